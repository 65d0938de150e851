// Bindings for the BPE merge loop: trains over a native pre-token table (straight from the
// pre-token counter, no Python dict in between) or over a {bytes: int} dict, without the GIL.
#include <cstring>
#include <string>
#include <utility>

#include "bindings/common.h"
#include "bpe/pretokenize.h"
#include "bpe/train.h"

namespace trainfast::bindings {
namespace {

struct FlatWords {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> counts;
};

// Flattens {bytes: int}; the GIL is held. Words of one byte are dropped (they have no pair).
FlatWords read_word_counts(const py::dict& word_counts) {
  FlatWords table;
  table.counts.reserve(word_counts.size());
  table.offsets.reserve(word_counts.size() + 1);
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  for (uint64_t num_read = 0;; ++num_read) {
    // Millions of words take seconds. Checked before taking the next pair, which a signal
    // handler could otherwise free.
    check_signals_every_2_16(num_read);
    if (!PyDict_Next(word_counts.ptr(), &pos, &key, &value)) break;
    if (!PyBytes_Check(key)) {
      throw py::type_error("word_counts keys must be bytes (got " +
                           std::string(py::str(py::type::of(py::handle(key)).attr("__name__"))) +
                           " " + std::string(py::repr(key)) + ")");
    }
    // NumPy integers count too; their __index__ may run Python code, so hold the pair meanwhile.
    const py::object key_ref = py::reinterpret_borrow<py::object>(key);
    const py::object value_ref = py::reinterpret_borrow<py::object>(value);
    const Py_ssize_t size_before = PyDict_GET_SIZE(word_counts.ptr());
    const py::object as_int = as_index(value);
    if (PyDict_GET_SIZE(word_counts.ptr()) != size_before) {
      throw std::runtime_error("dictionary changed size during iteration");
    }
    if (!as_int) {
      throw py::type_error("word_counts values must be int (got " + std::string(py::repr(value)) +
                           " for " + std::string(py::repr(key)) + ")");
    }
    int overflow = 0;
    const long long count = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
    if (overflow != 0 || count < 1) {
      throw py::value_error("word_counts values must be in [1, 2^63-1] (got " +
                            std::string(py::repr(value)) + " for " + std::string(py::repr(key)) +
                            ")");
    }
    const char* data = PyBytes_AS_STRING(key);
    const Py_ssize_t size = PyBytes_GET_SIZE(key);
    if (size < 2) continue;
    table.bytes.insert(table.bytes.end(), data, data + size);
    table.offsets.push_back(static_cast<int64_t>(table.bytes.size()));
    table.counts.push_back(count);
  }
  return table;
}

// Runs `train(options)` without the GIL, with Ctrl-C polling and progress(num_done) calls.
template <class Train>
std::vector<bpe::Merge> run_training(int64_t num_merges, const py::object& progress,
                                     const Train& train) {
  Interrupt interrupt = python_interrupt();
  bpe::TrainOptions options;
  options.num_merges = num_merges;
  options.interrupt = &interrupt;
  if (!progress.is_none()) {
    options.on_progress = [&progress](int64_t num_done) {
      py::gil_scoped_acquire gil;
      progress(num_done);
    };
  }
  py::gil_scoped_release release;
  return train(options);
}

// [(left bytes, right bytes)] in creation order; ids are merge space (0..255 bytes, 256 + k merge k).
py::list merges_to_list(const std::vector<bpe::Merge>& merges) {
  std::vector<py::bytes> tokens;
  tokens.reserve(256 + merges.size());
  for (int b = 0; b < 256; ++b) tokens.emplace_back(std::string(1, static_cast<char>(b)));
  py::list out(merges.size());
  for (size_t k = 0; k < merges.size(); ++k) {
    const py::bytes& left = tokens.at(static_cast<size_t>(merges[k].left));
    const py::bytes& right = tokens.at(static_cast<size_t>(merges[k].right));
    PyObject* merged = PyBytes_FromStringAndSize(nullptr, PyBytes_GET_SIZE(left.ptr()) +
                                                              PyBytes_GET_SIZE(right.ptr()));
    if (merged == nullptr) throw py::error_already_set();
    char* data = PyBytes_AS_STRING(merged);
    std::memcpy(data, PyBytes_AS_STRING(left.ptr()), PyBytes_GET_SIZE(left.ptr()));
    std::memcpy(data + PyBytes_GET_SIZE(left.ptr()), PyBytes_AS_STRING(right.ptr()),
                PyBytes_GET_SIZE(right.ptr()));
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(k), py::make_tuple(left, right).release().ptr());
    tokens.push_back(py::reinterpret_steal<py::bytes>(merged));
  }
  return out;
}

py::list train_from_dict(const py::dict& word_counts, int64_t num_merges, const py::object& progress) {
  const FlatWords table = read_word_counts(word_counts);
  const std::vector<bpe::Merge> merges =
      run_training(num_merges, progress, [&table](const bpe::TrainOptions& options) {
        return bpe::train_merges(table.bytes, table.offsets, table.counts, options);
      });
  return merges_to_list(merges);
}

// Consumes the table: taken over while the GIL is held (another thread may look at the Python
// object), and its words are freed as soon as the merge loop has copied them.
py::list train_from_table(Self<bpe::PretokenCounts> table_arg, int64_t num_merges, const py::object& progress) {
  bpe::PretokenCounts& table = *table_arg;
  bpe::PretokenCounts words = std::move(table);
  table = bpe::PretokenCounts();
  const std::vector<bpe::Merge> merges =
      run_training(num_merges, progress, [&words](const bpe::TrainOptions& options) {
        return bpe::train_merges(words.pretokens, words.counts, options,
                                 [&words] { words = bpe::PretokenCounts(); });
      });
  return merges_to_list(merges);
}

}  // namespace

void register_bpe_train(py::module_& m) {
  py::class_<bpe::PretokenCounts>(m, "BpeWordTable",
                                  "Unique pre-tokens and their counts, kept native (from "
                                  "BpePretokenCounter.finish_table()).")
      .def("__len__", [](Self<bpe::PretokenCounts> self) { return self->pretokens.size(); });
  m.def("bpe_train_merges", &train_from_dict, py::arg("word_counts"), py::arg("num_merges"),
        py::arg("progress") = py::none(),
        "BPE merges over {pre-token bytes: count}: [(left, right)] bytes pairs in creation order. "
        "progress(num_done) is called about every 0.1 s.");
  m.def("bpe_train_merges_table", &train_from_table, py::arg("table"), py::arg("num_merges"),
        py::arg("progress") = py::none(),
        "bpe_train_merges over a BpeWordTable, which it empties (its memory is freed early).");
}

}  // namespace trainfast::bindings
