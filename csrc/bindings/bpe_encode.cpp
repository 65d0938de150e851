// Bindings for BPE encoding/decoding: str in / list[int] out, batches encoded without the GIL.
#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/common.h"
#include "bpe/encode.h"
#include "common/memory.h"

namespace trainfast::bindings {
namespace {

std::string_view bytes_view(const py::handle& obj, const std::string& name) {
  if (!PyBytes_Check(obj.ptr())) {
    throw py::type_error(name + " must be bytes (got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) + ")");
  }
  return {PyBytes_AS_STRING(obj.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(obj.ptr()))};
}

const py::handle& checked_str(const py::handle& obj, const std::string& name) {
  if (!PyUnicode_Check(obj.ptr())) {
    throw py::type_error(name + " must be a str (got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) + ")");
  }
  return obj;
}

// Python's own UnicodeEncodeError for a str with a lone surrogate (the tokenizer catches it).
[[noreturn]] void raise_encode_error(const py::handle& text) {
  Py_ssize_t size = 0;
  if (PyUnicode_AsUTF8AndSize(text.ptr(), &size) == nullptr) throw py::error_already_set();
  throw std::logic_error("a str with a lone surrogate encoded as UTF-8");
}

// A list of the ids, sharing one int object per id (`id_objects`) instead of allocating one each.
py::list to_list(const uint32_t* ids, size_t n, const std::vector<py::object>& id_objects) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
  if (list == nullptr) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);
  for (size_t k = 0; k < n; ++k) {
    PyObject* value = ids[k] < id_objects.size() ? id_objects[ids[k]].ptr() : nullptr;
    if (value != nullptr) {
      Py_INCREF(value);
    } else {
      value = PyLong_FromUnsignedLong(ids[k]);
      if (value == nullptr) throw py::error_already_set();
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), value);
  }
  return out;
}

// Ints, or objects with __index__ (NumPy integers); not bool, which Python's indexing would take:
// a True among ids is a bug in the caller, not token 1.
int64_t read_id(PyObject* item, Py_ssize_t k) {
  const py::object as_int = as_index(item);
  PyObject* value = as_int.ptr();
  if (value == nullptr) {
    throw py::type_error("ids[" + std::to_string(k) + "] must be an int (got " +
                         std::string(py::str(py::type::handle_of(item).attr("__name__"))) + ")");
  }
  int overflow = 0;
  const long long id = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow != 0) {
    throw py::value_error("ids[" + std::to_string(k) + "] = " + std::string(py::str(value)) +
                          " is not a token id of this vocabulary");
  }
  return id;
}

std::vector<int64_t> read_ids(const py::handle& ids) {
  std::vector<int64_t> out;
  Py_ssize_t first = 0;  // of the items left for the snapshot
  if (PyList_CheckExact(ids.ptr())) {
    // A list's leading plain ints are read in place (they run no Python code that could change it;
    // the length is re-read after signal handlers, which may): a snapshot of tens of millions of
    // items, made and freed, took a third of a second that Ctrl-C could not cut short.
    out.reserve(static_cast<size_t>(PyList_GET_SIZE(ids.ptr())));
    for (;; ++first) {
      check_signals_every_2_16(static_cast<uint64_t>(first));  // tens of millions of ids: seconds
      if (first >= PyList_GET_SIZE(ids.ptr())) return out;
      PyObject* item = PyList_GET_ITEM(ids.ptr(), first);
      if (!PyLong_CheckExact(item)) break;
      out.push_back(read_id(item, first));
    }
  }
  // A tuple snapshot of the rest: an item's __index__ may run Python code that changes the caller's list.
  auto rest = py::reinterpret_steal<py::object>(
      first > 0 ? PyList_GetSlice(ids.ptr(), first, PyList_GET_SIZE(ids.ptr())) : py::handle(ids).inc_ref().ptr());
  PyObject* seq = rest ? PySequence_Tuple(rest.ptr()) : nullptr;
  if (seq == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();  // Ctrl-C, MemoryError
    PyErr_Clear();
    throw py::type_error("ids must be a sequence of int (got " +
                         std::string(py::str(py::type::handle_of(ids).attr("__name__"))) + ")");
  }
  const py::tuple owned = py::reinterpret_steal<py::tuple>(seq);
  const Py_ssize_t n = PyTuple_GET_SIZE(seq);
  out.reserve(out.size() + static_cast<size_t>(n));
  for (Py_ssize_t k = 0; k < n; ++k) {
    check_signals_every_2_16(static_cast<uint64_t>(k));
    out.push_back(read_id(PyTuple_GET_ITEM(seq, k), first + k));
  }
  return out;
}

class Encoder {
 public:
  Encoder(const py::list& tokens, const CArray<int64_t>& ids, const CArray<int64_t>& merge_left,
          const CArray<int64_t>& merge_right, const CArray<int64_t>& merge_result, const py::list& special_tokens,
          const CArray<int64_t>& special_ids, int pattern) {
    std::vector<std::string_view> token_views, special_views;
    token_views.reserve(tokens.size());
    for (size_t k = 0; k < tokens.size(); ++k) token_views.push_back(bytes_view(tokens[k], "tokens[" + std::to_string(k) + "]"));
    for (size_t k = 0; k < special_tokens.size(); ++k) {
      special_views.push_back(bytes_view(special_tokens[k], "special_tokens[" + std::to_string(k) + "]"));
    }
    if (pattern < 0 || pattern > 2) {
      throw py::value_error("pattern must be 0 (gpt2), 1 (cl100k) or 2 (o200k) (got " + std::to_string(pattern) + ")");
    }
    // Tables are indexed by id up to the largest: refuse a sparse vocab whose tables cannot fit.
    const auto id_span = span_1d(ids, "ids");
    const int64_t max_id = id_span.empty() ? -1 : *std::max_element(id_span.begin(), id_span.end());
    if (max_id >= (int64_t{1} << 31)) {  // before max_id + 1 below, which could overflow
      throw py::value_error("vocab id " + std::to_string(max_id) + " must be in [0, 2^31)");
    }
    // Per id: token offset (8) and length (4) in the core, a list slot (8) and an int object (32) here.
    if (bpe::BpeEncoder::ids_are_dense(max_id, id_span.size())) {
      check_output_fits("Tokenizer: the tables indexed by token id up to the largest vocab id", max_id + 1, 52);
    }
    encoder_ = std::make_unique<bpe::BpeEncoder>(
        token_views, span_1d(ids, "ids"), span_1d(merge_left, "merge_left"), span_1d(merge_right, "merge_right"),
        span_1d(merge_result, "merge_result"), special_views, span_1d(special_ids, "special_ids"),
        static_cast<bpe::Pattern>(pattern));
    // Int objects for the ids in use only, below the bound of a dense vocab (a sparse one, with a
    // stray id of 10^8, keeps its small ids here). Gaps and larger ids: to_list makes those on demand.
    const size_t limit = static_cast<size_t>(std::min(max_id + 1, bpe::BpeEncoder::dense_id_bound(id_span.size())));
    id_objects_.resize(limit);
    uint64_t step = 0;
    // Copies: the signal check below runs Python code, which could resize the arrays meanwhile.
    for (const auto& used : {snapshot(span_1d(ids, "ids")), snapshot(span_1d(special_ids, "special_ids"))}) {
      for (const int64_t id : used) {
        check_signals_every_2_16(step++);
        if (id >= 0 && static_cast<uint64_t>(id) < limit && !id_objects_[static_cast<size_t>(id)]) {
          id_objects_[static_cast<size_t>(id)] = py::int_(id);
        }
      }
    }
  }

  py::list encode(const py::handle& text) {
    StrsUtf8 utf8(checked_str(text, "text"));
    std::vector<uint32_t> ids;
    Interrupt interrupt = python_interrupt();
    {
      py::gil_scoped_release release;
      utf8.encode(1, &interrupt);
      if (utf8.first_surrogate_idx(0) < 0) encoder_->encode(utf8[0], ids, &interrupt);
    }
    if (utf8.first_surrogate_idx(0) >= 0) raise_encode_error(text);
    return to_list(ids.data(), ids.size(), id_objects_);
  }

  py::list encode_batch(const py::list& texts, int num_threads) {
    // Our own references: another thread may empty the caller's list while the GIL is released.
    const py::tuple owned(texts);
    StrsUtf8 utf8;
    for (size_t k = 0; k < owned.size(); ++k) utf8.add(checked_str(owned[k], "texts[" + std::to_string(k) + "]"));
    std::vector<std::vector<uint32_t>> results;
    Interrupt interrupt = python_interrupt();
    size_t num_clean = 0;  // texts before the first with a lone surrogate
    {
      py::gil_scoped_release release;
      utf8.encode(std::max(1, num_threads), &interrupt);
      std::vector<std::string_view> views;
      views.reserve(utf8.size());
      for (; num_clean < utf8.size() && utf8.first_surrogate_idx(num_clean) < 0; ++num_clean) views.push_back(utf8[num_clean]);
      if (num_clean == utf8.size()) results = encoder_->encode_batch(views, num_threads, &interrupt);
    }
    if (num_clean < utf8.size()) raise_encode_error(owned[num_clean]);
    py::list out(results.size());
    for (size_t k = 0; k < results.size(); ++k) {
      out[k] = to_list(results[k].data(), results[k].size(), id_objects_);
      std::vector<uint32_t>().swap(results[k]);
    }
    return out;
  }

  // Ids of the longest prefix of text that is safe to encode on its own, and its length in
  // characters (0 when no safe cut is known yet).
  py::tuple encode_prefix(const py::handle& text) {
    StrsUtf8 text_utf8(checked_str(text, "text"));
    std::string_view utf8;
    std::vector<uint32_t> ids;
    Interrupt interrupt = python_interrupt();
    size_t cut = 0;
    {
      py::gil_scoped_release release;
      text_utf8.encode(1, &interrupt);
      utf8 = text_utf8[0];
      if (text_utf8.first_surrogate_idx(0) < 0) {
        cut = encoder_->safe_cut(utf8, &interrupt);  // all of a text without one: long
        encoder_->encode(utf8.substr(0, cut), ids, &interrupt);
      }
    }
    if (text_utf8.first_surrogate_idx(0) >= 0) raise_encode_error(text);
    size_t num_chars = cut;
    if (!text_utf8.is_ascii(0)) {
      num_chars = 0;
      for (size_t b = 0; b < cut; ++b) num_chars += (static_cast<uint8_t>(utf8[b]) & 0xC0) != 0x80;
    }
    return py::make_tuple(to_list(ids.data(), ids.size(), id_objects_), num_chars);
  }

  // Ids of pre-tokens cut by the caller (custom patterns); each piece is merged on its own.
  py::list encode_pieces(const py::list& pieces) {
    const py::tuple owned(pieces);  // as in encode_batch
    std::vector<std::string_view> views;
    views.reserve(owned.size());
    for (size_t k = 0; k < owned.size(); ++k) views.push_back(bytes_view(owned[k], "pieces[" + std::to_string(k) + "]"));
    std::vector<uint32_t> ids;
    Interrupt interrupt = python_interrupt();
    {
      py::gil_scoped_release release;
      for (size_t k = 0; k < views.size(); ++k) {
        if (k % 1024 == 0) interrupt.check();
        encoder_->encode_piece(views[k], ids, &interrupt);
      }
    }
    return to_list(ids.data(), ids.size(), id_objects_);
  }

  py::bytes decode_bytes(const py::handle& ids) {
    const std::string out = decoded(read_ids(ids));
    return py::bytes(out.data(), out.size());
  }

  py::str decode(const py::handle& ids) {
    const std::string out = decoded(read_ids(ids));
    PyObject* text = PyUnicode_DecodeUTF8(out.data(), static_cast<Py_ssize_t>(out.size()), "replace");
    if (text == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(text);
  }

 private:
  std::string decoded(const std::vector<int64_t>& ids) const {
    // Streaming decode (a token at a time) should not pay for a GIL release.
    if (ids.size() < (size_t{1} << 16)) return encoder_->decode(ids);
    Interrupt interrupt = python_interrupt();
    py::gil_scoped_release release;
    return encoder_->decode(ids, &interrupt);
  }

  std::unique_ptr<bpe::BpeEncoder> encoder_;
  std::vector<py::object> id_objects_;  // int object of each id in use, by id (null in the gaps)
};

}  // namespace

void register_bpe_encode(py::module_& m) {
  py::class_<Encoder>(m, "BpeEncoder", "BPE encoder/decoder over a fixed vocabulary and merge list.")
      .def(py::init<const py::list&, const CArray<int64_t>&, const CArray<int64_t>&, const CArray<int64_t>&,
                    const CArray<int64_t>&, const py::list&, const CArray<int64_t>&, int>(),
           py::arg("tokens"), py::arg("ids").noconvert(), py::arg("merge_left").noconvert(),
           py::arg("merge_right").noconvert(), py::arg("merge_result").noconvert(), py::arg("special_tokens"),
           py::arg("special_ids").noconvert(), py::arg("pattern"))
      .def("encode", method(&Encoder::encode), py::arg("text"), "Token ids of text (list[int]).")
      .def("encode_batch", method(&Encoder::encode_batch), py::arg("texts"), py::arg("num_threads"),
           "Token ids of each text, on up to num_threads threads.")
      .def("encode_prefix", method(&Encoder::encode_prefix), py::arg("text"),
           "(ids, num_chars): ids of the longest safely encodable prefix of text and its length.")
      .def("encode_pieces", method(&Encoder::encode_pieces), py::arg("pieces"),
           "Ids of pre-tokens given as bytes, each merged on its own.")
      .def("decode_bytes", method(&Encoder::decode_bytes), py::arg("ids"), "Concatenated token bytes of ids.")
      .def("decode", method(&Encoder::decode), py::arg("ids"), "Text of ids; invalid UTF-8 becomes U+FFFD.");
}

}  // namespace trainfast::bindings
