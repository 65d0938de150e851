// Bindings for the BPE pre-tokenizer: str in / list[str] out, and a streaming pre-token counter
// over files and in-memory documents returning dict[bytes, int].
#include <atomic>
#include <cerrno>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/common.h"
#include "bpe/pretokenize.h"
#include "common/utf8.h"

namespace trainfast::bindings {
namespace {

using bpe::Pattern;
using bpe::Utf8Errors;

Pattern to_pattern(int pattern) {
  if (pattern < 0 || pattern > 2) {
    throw py::value_error("pattern must be 0 (gpt2), 1 (cl100k) or 2 (o200k) (got " + std::to_string(pattern) + ")");
  }
  return static_cast<Pattern>(pattern);
}

Utf8Errors to_errors(int errors) {
  if (errors < 0 || errors > 2) {
    throw py::value_error("errors must be 0 (strict), 1 (replace) or 2 (ignore) (got " + std::to_string(errors) + ")");
  }
  return static_cast<Utf8Errors>(errors);
}

std::string lone_surrogate_message(const std::string& name, int64_t code_point_idx) {
  return name + " contains a lone surrogate (at index " + std::to_string(code_point_idx) +
         "), which has no UTF-8 encoding";
}

std::vector<std::string> special_token_bytes(const py::list& special_tokens) {
  StrsUtf8 utf8;
  for (size_t k = 0; k < special_tokens.size(); ++k) {
    py::handle token = special_tokens[k];
    if (!PyUnicode_Check(token.ptr())) {
      throw py::type_error("special_tokens[" + std::to_string(k) + "] must be a str (got " +
                           std::string(py::str(py::type::handle_of(token).attr("__name__"))) + ")");
    }
    utf8.add(token);
  }
  utf8.encode(1, nullptr);  // short: with the GIL held
  std::vector<std::string> out;
  out.reserve(utf8.size());
  for (size_t k = 0; k < utf8.size(); ++k) {
    if (utf8.first_surrogate_idx(k) >= 0) {
      throw py::value_error(lone_surrogate_message("special_tokens[" + std::to_string(k) + "]", utf8.first_surrogate_idx(k)));
    }
    out.emplace_back(utf8[k]);
  }
  return out;
}

py::list pretokenize(const py::str& text, int pattern, const py::list& special_tokens) {
  const bpe::SpecialTokenMatcher specials(special_token_bytes(special_tokens));
  StrsUtf8 text_utf8(text);
  std::string_view utf8;
  std::vector<bpe::Piece> pieces;
  Interrupt interrupt = python_interrupt();
  {
    py::gil_scoped_release release;
    text_utf8.encode(1, &interrupt);
    utf8 = text_utf8[0];
    pieces = bpe::split_and_pretokenize(utf8, to_pattern(pattern), specials, &interrupt);
  }
  py::list out(pieces.size());
  const bool ascii = text_utf8.is_ascii(0);
  Py_ssize_t char_pos = 0;  // code point index of pieces[k].begin
  for (size_t k = 0; k < pieces.size(); ++k) {
    check_signals_every_2_16(k);
    const auto& piece = pieces[k];
    Py_ssize_t char_end;
    if (ascii) {
      char_end = static_cast<Py_ssize_t>(piece.end);
    } else {
      char_end = char_pos;
      for (size_t b = piece.begin; b < piece.end; ++b) char_end += (static_cast<uint8_t>(utf8[b]) & 0xC0) != 0x80;
    }
    PyObject* sub = PyUnicode_Substring(text.ptr(), ascii ? static_cast<Py_ssize_t>(piece.begin) : char_pos, char_end);
    if (sub == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(k), sub);
    char_pos = char_end;
  }
  return out;
}

// End offsets (in code points) of the pre-tokens of text, special tokens not split off.
py::array_t<int64_t> pretokenize_ends(const py::str& text, int pattern) {
  StrsUtf8 text_utf8(text);
  const Pattern scanner = to_pattern(pattern);
  std::vector<int64_t> char_ends;
  Interrupt interrupt = python_interrupt();
  {
    py::gil_scoped_release release;
    text_utf8.encode(1, &interrupt);
    const std::string_view utf8 = text_utf8[0];
    std::vector<size_t> ends;
    bpe::pretokenize(utf8, scanner, ends, &interrupt);
    char_ends.reserve(ends.size());
    int64_t chars = 0;
    size_t b = 0;
    for (size_t k = 0; k < ends.size(); ++k) {
      if ((k & 0xFFFF) == 0) interrupt.check();
      for (; b < ends[k]; ++b) chars += (static_cast<uint8_t>(utf8[b]) & 0xC0) != 0x80;
      char_ends.push_back(chars);
    }
  }
  return to_numpy(std::move(char_ends));
}

// Reports progress (bytes counted so far) to a Python callable, if any; the GIL is held. Signal
// handlers run inside it too (Ctrl-C, an alarm): what it raises stops the count and is raised as
// itself (true). The display's own failures are handled in Python (_Progress).
bool report_progress(const py::object& progress, int64_t bytes_done) {
  if (progress.is_none()) return false;
  try {
    progress(bytes_done);
  } catch (py::error_already_set& error) {
    error.restore();
    hold_current_error();
    return true;
  }
  return false;
}

// Ctrl-C polling that also reports progress.
Interrupt progress_interrupt(const py::object& progress, const std::atomic<int64_t>& bytes_done) {
  clear_signal_error();
  return Interrupt([&progress, &bytes_done] {
    py::gil_scoped_acquire gil;
    if (poll_signal_handlers()) return true;
    return report_progress(progress, bytes_done.load(std::memory_order_relaxed));
  }, std::chrono::milliseconds(100));
}

// Every method of Counter releases the GIL; a second Python thread, or a progress callback, that
// calls the same counter meanwhile gets a RuntimeError instead of racing on its tables.
class InUse {
 public:
  explicit InUse(std::atomic<bool>& busy) : busy_(busy) {
    if (busy_.exchange(true)) throw std::runtime_error("this BpePretokenCounter is in use by another call");
  }
  ~InUse() { busy_.store(false); }
  InUse(const InUse&) = delete;
  InUse& operator=(const InUse&) = delete;

 private:
  std::atomic<bool>& busy_;
};

class Counter {
 public:
  Counter(int pattern, const py::list& special_tokens, int errors, int num_threads, size_t chunk_bytes,
          size_t block_bytes) {
    bpe::CountOptions options;
    options.pattern = to_pattern(pattern);
    options.special_tokens = special_token_bytes(special_tokens);
    options.errors = to_errors(errors);
    options.num_threads = num_threads;
    if (chunk_bytes > 0) options.chunk_bytes = chunk_bytes;
    if (block_bytes > 0) options.block_bytes = block_bytes;
    counter_ = std::make_unique<bpe::PretokenCounter>(std::move(options));
    num_threads_ = num_threads;
  }

  void add_file(const std::string& path, const py::object& progress) {
    const InUse in_use(busy_);
    std::atomic<int64_t> bytes_done{0};
    Interrupt interrupt = progress_interrupt(progress, bytes_done);
    {
      py::gil_scoped_release release;
      counter_->add_file(path, &interrupt, &bytes_done);
    }
    report_done(progress, bytes_done.load());
  }

  // Returns the bytes of text counted, as UTF-8 after decoding (what progress reports; a str's
  // len() is in code points).
  int64_t add_documents(const py::list& documents, int64_t first_index, const py::object& progress) {
    const InUse in_use(busy_);
    if (first_index < 0 || first_index > (int64_t{1} << 62)) {  // names inputs[first_index + k]
      throw py::value_error("first_index must be in [0, 2^62] (got " + std::to_string(first_index) + ")");
    }
    const size_t num_docs = documents.size();
    std::vector<std::string_view> views(num_docs);
    std::vector<uint8_t> is_text(num_docs);
    std::vector<py::object> owners;  // keeps the bytes documents alive while the GIL is released
    StrsUtf8 texts;  // and the str ones
    std::vector<size_t> text_docs;  // document index of each of texts
    for (size_t k = 0; k < num_docs; ++k) {
      py::handle doc = documents[k];
      if (PyUnicode_Check(doc.ptr())) {
        texts.add(doc);
        text_docs.push_back(k);
        is_text[k] = 1;
      } else if (PyBytes_Check(doc.ptr())) {
        owners.push_back(py::reinterpret_borrow<py::object>(doc));
        views[k] = {PyBytes_AS_STRING(doc.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(doc.ptr()))};
      } else {
        throw py::type_error(document_name(first_index, k) + " must be str or bytes (got " +
                             std::string(py::str(py::type::handle_of(doc).attr("__name__"))) + ")");
      }
    }
    std::atomic<int64_t> bytes_done{0};
    Interrupt interrupt = progress_interrupt(progress, bytes_done);
    {
      py::gil_scoped_release release;
      // Every str is encoded before anything is counted: a lone surrogate fails the call cleanly.
      texts.encode(num_threads_, &interrupt);
      for (size_t j = 0; j < texts.size(); ++j) {
        if (texts.first_surrogate_idx(j) >= 0) {
          throw std::invalid_argument(lone_surrogate_message(document_name(first_index, text_docs[j]), texts.first_surrogate_idx(j)));
        }
        views[text_docs[j]] = texts[j];
      }
      // Consecutive documents of one kind go together, keeping first-occurrence order.
      for (size_t begin = 0; begin < num_docs;) {
        size_t end = begin + 1;
        while (end < num_docs && is_text[end] == is_text[begin]) ++end;
        std::vector<std::string> names;
        if (!is_text[begin]) {
          for (size_t k = begin; k < end; ++k) names.push_back(document_name(first_index, k));
        }
        try {
          counter_->add_documents(std::span<const std::string_view>(views.data() + begin, end - begin),
                                  is_text[begin] != 0, names, &interrupt, &bytes_done);
        } catch (...) {
          // The earlier runs are counted: the call fails part-way, as a failing run does alone.
          if (begin > 0) counter_->mark_broken();
          throw;
        }
        begin = end;
      }
    }
    report_done(progress, bytes_done.load());
    return bytes_done.load();
  }

  // The last progress report: a Ctrl-C that lands in it fails the call as a pending one does.
  void report_done(const py::object& progress, int64_t bytes_done) {
    if (report_progress(progress, bytes_done)) {
      counter_->mark_broken();
      restore_held_error();
      throw py::error_already_set();
    }
    fail_on_pending_signal();
  }

  // (bytes, offsets uint64[n + 1], counts int64[n]): pre-token k is bytes[offsets[k]:offsets[k + 1]].
  py::tuple finish_arrays() {
    const InUse in_use(busy_);
    bpe::FlatPretokenCounts counts = finish_flat();
    py::tuple out;
    try {
      out = py::make_tuple(to_numpy(std::move(counts.bytes)), to_numpy(std::move(counts.offsets)),
                           to_numpy(std::move(counts.counts)));
    } catch (...) {
      counter_->mark_broken();  // MemoryError: the counter is empty, the counts lost
      throw;
    }
    fail_on_pending_signal();
    return out;
  }

  py::dict finish() {
    const InUse in_use(busy_);
    const bpe::FlatPretokenCounts counts = finish_flat();
    // Presized: no rehash up to CPython's cap (2^17 slots, ~87K keys); past it the dict still grows a few times.
    const auto num_entries = static_cast<Py_ssize_t>(counts.counts.size());
#if PY_VERSION_HEX < 0x030D0000
    py::dict out = py::reinterpret_steal<py::dict>(_PyDict_NewPresized(num_entries));
#else
    py::dict out = py::reinterpret_steal<py::dict>(PyDict_New());  // 3.13 hid the presized constructor
#endif
    // The counter is empty now: a dict left unfinished loses the counts for good.
    auto fail = [this] {
      counter_->mark_broken();
      throw py::error_already_set();
    };
    if (!out) fail();
    for (Py_ssize_t k = 0; k < num_entries; ++k) {
      // Millions of keys take a second or more: Ctrl-C must not wait for the whole dict.
      if ((k & 0xFFFF) == 0) fail_on_pending_signal();
      const uint64_t begin = counts.offsets[k];
      PyObject* key = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(counts.bytes.data()) + begin,
                                                static_cast<Py_ssize_t>(counts.offsets[k + 1] - begin));
      PyObject* value = key != nullptr ? PyLong_FromLongLong(counts.counts[k]) : nullptr;
      const int failed = value == nullptr || PyDict_SetItem(out.ptr(), key, value) != 0;
      Py_XDECREF(key);
      Py_XDECREF(value);
      if (failed) fail();
    }
    fail_on_pending_signal();
    return out;
  }

  // finish() without the dict: the table stays native for the BPE trainer (bpe_train.cpp).
  bpe::PretokenCounts finish_table() {
    const InUse in_use(busy_);
    bpe::PretokenCounts counts;
    Interrupt interrupt = python_interrupt();
    {
      py::gil_scoped_release release;
      counts = counter_->finish(&interrupt);
    }
    fail_on_pending_signal();
    return counts;
  }

 private:
  // The counts, merged without the GIL (the caller holds busy_).
  bpe::FlatPretokenCounts finish_flat() {
    Interrupt interrupt = python_interrupt();
    py::gil_scoped_release release;
    return counter_->finish_flat(&interrupt);
  }

  // A Ctrl-C in the last poll interval of a call (the whole of a short one) would otherwise surface
  // just after it returns, its work done (a finish's counts dropped, a batch counted): the call
  // fails instead, as its last step, and leaves the counter broken (as a call that fails once
  // counting has begun does; a caller cannot tell how far it got).
  void fail_on_pending_signal() {
    if (PyErr_CheckSignals() == 0) return;
    counter_->mark_broken();
    throw py::error_already_set();
  }

  static std::string document_name(int64_t first_index, size_t k) {
    return "inputs[" + std::to_string(first_index + static_cast<int64_t>(k)) + "]";
  }

  std::unique_ptr<bpe::PretokenCounter> counter_;
  int num_threads_ = 1;
  std::atomic<bool> busy_{false};
};

}  // namespace

void register_bpe_pretokenize(py::module_& m) {
  m.def("bpe_pretokenize", &pretokenize, py::arg("text"), py::arg("pattern"), py::arg("special_tokens"),
        "Pre-tokens and special tokens of text, in order (pattern: 0 gpt2, 1 cl100k, 2 o200k).");
  m.def("bpe_pretokenize_ends", &pretokenize_ends, py::arg("text"), py::arg("pattern"),
        "int64 end offsets (code points) of the pre-tokens of text (no special tokens).");
  // Internal, for tests: the file reader's UTF-8 check on either path.
  m.def(
      "_scan_utf8",
      [](const py::bytes& data, bool simd) {
        const std::string_view view(data);
        const auto* s = reinterpret_cast<const uint8_t*>(view.data());
        uint64_t num_cr = 0, num_crlf = 0;
        const bool valid = simd ? scan_utf8_simd(s, view.size(), &num_cr, &num_crlf)
                                : scan_utf8_scalar(s, view.size(), &num_cr, &num_crlf);
        return py::make_tuple(valid, num_cr, num_crlf);
      },
      py::arg("data"), py::arg("simd"), "(valid UTF-8, count of \\r, count of \\r\\n) of data.");
  m.def("_has_simd_utf8", &has_simd_utf8, "Whether the UTF-8 check runs on AVX2 here.");
  m.def("_special_token_walk_slack", &bpe::special_token_walk_slack,
        "Bytes special-token walks may compare beyond 4 per byte of text before the automaton takes over.");
  m.def("_set_special_token_walk_slack", &bpe::set_special_token_walk_slack, py::arg("bytes"),
        "For tests: 0 sends small texts with long special tokens to the automaton too.");
  py::class_<Counter>(m, "BpePretokenCounter", "Counts pre-tokens over files and documents.")
      .def(py::init<int, const py::list&, int, int, size_t, size_t>(), py::arg("pattern"),
           py::arg("special_tokens"), py::arg("errors"), py::arg("num_threads"), py::arg("chunk_bytes") = 0,
           py::arg("block_bytes") = 0)
      .def("add_file", method(&Counter::add_file), py::arg("path"), py::arg("progress") = py::none())
      .def("add_documents", method(&Counter::add_documents), py::arg("documents"), py::arg("first_index") = 0,
           py::arg("progress") = py::none())
      .def("finish", method(&Counter::finish), "dict[bytes, int] in first-occurrence order; empties the counter.")
      .def("finish_table", method(&Counter::finish_table), "finish() as a native BpeWordTable (no dict); empties the counter.")
      .def("finish_arrays", method(&Counter::finish_arrays),
           "(uint8 key bytes, uint64 offsets[n + 1], int64 counts[n]) in first-occurrence order; empties the counter.");
}

}  // namespace trainfast::bindings
