// Bindings for the BPE merge loop: reads a {bytes: int} pre-token table, trains without the GIL.
#include <string>
#include <utility>

#include "bindings/common.h"
#include "bpe/train.h"

namespace trainfast::bindings {
namespace {

struct WordTable {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> counts;
};

// Flattens {bytes: int}; the GIL is held. Words of one byte are dropped (they have no pair).
WordTable read_word_counts(const py::dict& word_counts) {
  WordTable table;
  table.counts.reserve(word_counts.size());
  table.offsets.reserve(word_counts.size() + 1);
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(word_counts.ptr(), &pos, &key, &value)) {
    if (!PyBytes_Check(key)) {
      throw py::type_error("word_counts keys must be bytes (got " +
                           std::string(py::str(py::type::of(py::handle(key)).attr("__name__"))) +
                           " " + std::string(py::repr(key)) + ")");
    }
    if (!PyLong_Check(value) || PyBool_Check(value)) {
      throw py::type_error("word_counts values must be int (got " + std::string(py::repr(value)) +
                           " for " + std::string(py::repr(key)) + ")");
    }
    int overflow = 0;
    const long long count = PyLong_AsLongLongAndOverflow(value, &overflow);
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

// Returns (left, right) int32 arrays of merge-space ids (0..255 bytes, 256 + k merge k).
py::tuple train_merges(const py::dict& word_counts, int64_t num_merges,
                       const py::object& progress) {
  const WordTable table = read_word_counts(word_counts);
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
  std::vector<bpe::Merge> merges;
  {
    py::gil_scoped_release release;
    merges = bpe::train_merges(table.bytes, table.offsets, table.counts, options);
  }
  std::vector<int32_t> left(merges.size()), right(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    left[i] = merges[i].left;
    right[i] = merges[i].right;
  }
  return py::make_tuple(to_numpy(std::move(left)), to_numpy(std::move(right)));
}

}  // namespace

void register_bpe_train(py::module_& m) {
  m.def("bpe_train_merges", &train_merges, py::arg("word_counts"), py::arg("num_merges"),
        py::arg("progress") = py::none(),
        "BPE merges over {pre-token bytes: count}; returns (left, right) int32 arrays of "
        "merge-space ids (0..255 bytes, 256 + k the token of merge k). progress(num_done) is "
        "called about every 0.1 s.");
}

}  // namespace trainfast::bindings
