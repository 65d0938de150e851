// Bindings for checkpoint write-item binning: reads WriteItem objects (or arrays), calls the core.
#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <utility>

#include "bindings/common.h"
#include "bindings/fast_attr.h"
#include "checkpoint/binning.h"
#include "common/checked_math.h"
#include "common/memory.h"

namespace trainfast::bindings {
namespace {

using checkpoint::Balance;

py::str interned(const char* name) {
  return py::reinterpret_steal<py::str>(PyUnicode_InternFromString(name));
}

std::string item_name(size_t idx) { return "items[" + std::to_string(idx) + "]"; }

// getattr through `reader` (fast for WriteItem dataclasses); a missing attribute names the item.
py::object get_attr(AttrReader& reader, py::handle obj, size_t idx) {
  PyObject* value = reader.get(obj.ptr());
  if (value == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();  // as getattr
    PyErr_Clear();
    throw py::type_error(item_name(idx) + " has no attribute '" +
                         std::string(py::str(reader.name())) +
                         "' (expected a torch.distributed.checkpoint WriteItem)");
  }
  return py::reinterpret_steal<py::object>(value);
}

// Product of a shape (torch.Size or any sequence of non-negative ints), overflow-checked.
int64_t numel_of(py::handle shape, size_t idx, const char* field) {
  // Built only on error: a string per item would cost as much as the rest of the read.
  auto where = [&] { return item_name(idx) + "." + field; };
  if (!PySequence_Check(shape.ptr())) throw py::type_error(where() + " must be a sequence of ints");
  // torch.Size is a tuple subclass: index it in place. Anything else is read from a tuple copy, as
  // a dimension's __index__ may run Python code that changes a list.
  py::object copy;
  PyObject* dims_tuple = shape.ptr();
  if (!PyTuple_Check(dims_tuple)) {
    copy = py::reinterpret_steal<py::object>(PySequence_Tuple(dims_tuple));
    if (!copy) throw py::error_already_set();
    dims_tuple = copy.ptr();
  }
  const Py_ssize_t ndim = PyTuple_GET_SIZE(dims_tuple);
  PyObject** dims = &PyTuple_GET_ITEM(dims_tuple, 0);
  int64_t numel = 1;
  // Upstream multiplies Python ints: a zero dimension anywhere makes 0 elements, however large the
  // others, so an overflow only counts once every dimension has been seen.
  bool overflowed = false, has_zero = false;
  for (Py_ssize_t d = 0; d < ndim; ++d) {
    py::handle dim(dims[d]);
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(dim.ptr(), &overflow);
    if (value == -1 && PyErr_Occurred()) {
      clear_input_error();
      throw py::type_error(where() + " must be a sequence of ints (got " +
                           std::string(py::repr(dim)) + ")");
    }
    if (overflow < 0 || (overflow == 0 && value < 0)) {
      throw py::value_error(where() + " has a negative dimension (got " + std::string(py::repr(dim)) + ")");
    }
    has_zero = has_zero || (overflow == 0 && value == 0);
    if (overflowed || overflow > 0) {
      overflowed = true;
      continue;
    }
    const auto product = checked_mul(numel, value);
    if (product) {
      numel = *product;
    } else {
      overflowed = true;
    }
  }
  if (has_zero) return 0;
  if (overflowed) throw py::value_error(where() + " has more than 2^63-1 elements");
  return numel;
}

// The attributes read from every item; each reader learns where its attribute lives.
struct ItemReaders {
  AttrReader type{"type"}, tensor_data{"tensor_data"}, chunk{"chunk"}, sizes{"sizes"},
      size{"size"}, properties{"properties"}, dtype{"dtype"}, bytes_io_data{"bytes_io_data"};
};

struct ItemArrays {
  std::vector<uint8_t> is_bytes;
  std::vector<int64_t> sizes;
};

// Element size by dtype identity: every key of the element-size dict, held (so no address is
// reused), plus dtypes that matched a key by equality. Lookups by identity are what the dict
// itself answers first, so this gives the same sizes.
class ElementSizeCache {
 public:
  explicit ElementSizeCache(const py::dict& element_sizes) : element_sizes_(element_sizes) {
    // Pairs held first: a size's __index__ may run Python code that empties the dict.
    std::vector<std::pair<py::object, py::object>> pairs;
    for (const auto& [dtype, size] : element_sizes) {
      pairs.emplace_back(py::reinterpret_borrow<py::object>(dtype), py::reinterpret_borrow<py::object>(size));
    }
    for (auto& [dtype, size] : pairs) entries_.emplace_back(std::move(dtype), checked_size(size));
  }

  // The size of `dtype` when it is a known object, else -1; reads only (no Python code, so worker
  // threads may call it while the caller holds the GIL).
  int64_t find(PyObject* dtype) const {
    for (const auto& [held, size] : entries_) {
      if (held.ptr() == dtype) return size;
    }
    return -1;
  }

  // Any dtype: a dict lookup for unknown objects (may run their __hash__/__eq__).
  int64_t lookup(const py::object& dtype, size_t idx) {
    if (const int64_t size = find(dtype.ptr()); size >= 0) return size;
    PyObject* size = PyDict_GetItemWithError(element_sizes_.ptr(), dtype.ptr());
    if (size == nullptr) {
      if (PyErr_Occurred()) clear_input_error();
      // Upstream's element size raises TypeError for a sub-byte dtype too (torch.iinfo).
      throw py::type_error(item_name(idx) + " has an unknown dtype (got " +
                            std::string(py::repr(dtype)) + ")");
    }
    const int64_t value = checked_size(size);
    if (entries_.size() < kMaxEntries) entries_.emplace_back(dtype, value);
    return value;
  }

 private:
  static constexpr size_t kMaxEntries = 256;  // bounds the scan when many odd dtypes match keys
  static int64_t checked_size(py::handle size) {
    const auto value = py::cast<int64_t>(size);
    if (value < 0) throw py::value_error("element sizes must be non-negative");
    return value;
  }

  const py::dict& element_sizes_;
  std::vector<std::pair<py::object, int64_t>> entries_;
};

// The last dtype found (one per thread): plans list long runs of one dtype.
struct LastDtype {
  PyObject* dtype = nullptr;  // held by the ElementSizeCache
  int64_t size = 0;
};

// prod(shape) when `shape` is a tuple (torch.Size) of exact ints that fit, else -1 (overflow,
// negative dims and everything else are left to numel_of and its errors). Reads only.
int64_t numel_of_plain_tuple(PyObject* shape) {
  if (shape == nullptr || !PyTuple_Check(shape)) return -1;
  int64_t numel = 1;
  for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); ++d) {
    PyObject* dim = PyTuple_GET_ITEM(shape, d);
    if (!PyLong_CheckExact(dim)) return -1;
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(dim, &overflow);  // exact int: no code runs
    if (overflow != 0 || value < 0) return -1;
    const auto product = checked_mul(numel, value);
    if (!product) return -1;
    numel = *product;
  }
  return numel;
}

// Parallel reading: after this many items in a row read fast; chunks between Ctrl-C checks; blocks
// claimed by a thread; below this many items threads are not worth starting.
constexpr size_t kFastRunBeforeParallel = 64;
constexpr size_t kParallelReadChunk = size_t{1} << 19;
constexpr int64_t kParallelReadBlock = 4096;
constexpr size_t kMinParallelRead = 32768;

int64_t g_fast_items = 0;  // items read by read_item_fast since the last checkpoint_read_counts()

struct ItemReadContext {
  ItemReaders readers;
  PyObject* byte_io_type;
  ElementSizeCache element_sizes;
  bool global_sizing;
  bool count_bytes;
};

// The common case without a single reference count change (each one dirties a cache line of a
// different object): every attribute comes from inline values, the shape is plain ints, the dtype
// is cached. Nothing here can run Python code or write to any object, so the borrowed pointers stay
// valid, and worker threads may run it while the calling thread holds the GIL (no Python code can
// run anywhere then). Returns false, with nothing written, when the item needs read_item_generic.
bool read_item_fast(const ItemReadContext& ctx, LastDtype& last, PyObject* item, uint8_t& is_bytes,
                    int64_t& size) {
  const ItemReaders& r = ctx.readers;
  PyObject* type = r.type.peek(item);
  if (type == nullptr) return false;
  // Another class than the enum's may define __eq__: that comparison is left to the generic path.
  const bool bytes = type == ctx.byte_io_type;
  if (!bytes && Py_TYPE(type) != Py_TYPE(ctx.byte_io_type)) return false;
  if (bytes) {
    if (ctx.count_bytes) return false;
    is_bytes = 1;
    size = 0;
    return true;
  }
  PyObject* tensor_data = r.tensor_data.peek(item);
  if (tensor_data == nullptr) return false;
  PyObject* shape = ctx.global_sizing ? r.size.peek(tensor_data)
                                      : r.sizes.peek(r.chunk.peek(tensor_data));
  const int64_t numel = numel_of_plain_tuple(shape);
  if (numel < 0) return false;
  PyObject* dtype = r.dtype.peek(r.properties.peek(tensor_data));
  if (dtype == nullptr) return false;
  if (dtype != last.dtype) {
    const int64_t found = ctx.element_sizes.find(dtype);
    if (found < 0) return false;
    last = {dtype, found};
  }
  const int64_t element_size = last.size;
  const auto bytes_total = checked_mul(numel, element_size);
  if (!bytes_total) return false;
  is_bytes = 0;
  size = *bytes_total;
  return true;
}

// Any item: attributes through getattr where needed (properties, __getattr__, other classes),
// holding references since that may run Python code. Throws on bad items.
void read_item_generic(ItemReadContext& ctx, const py::object& item, size_t i, uint8_t& is_bytes_out,
                       int64_t& size_out) {
  ItemReaders& r = ctx.readers;
  const py::object type = get_attr(r.type, item, i);
  bool is_bytes = type.ptr() == ctx.byte_io_type;
  if (!is_bytes && Py_TYPE(type.ptr()) != Py_TYPE(ctx.byte_io_type)) {
    const int equal = PyObject_RichCompareBool(type.ptr(), ctx.byte_io_type, Py_EQ);
    if (equal < 0) throw py::error_already_set();
    is_bytes = equal == 1;
  }
  is_bytes_out = is_bytes;
  size_out = 0;
  if (is_bytes) {
    if (ctx.count_bytes) {
      PyObject* data = r.bytes_io_data.get(item.ptr());
      if (data == nullptr) clear_input_error();
      auto data_obj = py::reinterpret_steal<py::object>(data);
      const py::str nbytes_attr = interned("nbytes");
      if (data != nullptr && !data_obj.is_none() && py::hasattr(data_obj, nbytes_attr)) {
        const py::object nbytes_obj = data_obj.attr(nbytes_attr);
        const py::object as_int = as_index(nbytes_obj.ptr());  // NumPy integers too, as in shapes
        if (!as_int) {
          throw py::type_error(item_name(i) + ".bytes_io_data.nbytes must be an int (got " +
                               std::string(py::repr(nbytes_obj)) + ")");
        }
        int overflow = 0;
        const long long nbytes = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
        if (overflow != 0 || nbytes < 0) {
          throw py::value_error(item_name(i) + ".bytes_io_data.nbytes must be in [0, 2^63) (got " +
                                std::string(py::repr(nbytes_obj)) + ")");
        }
        size_out = nbytes;
      }
    }
    return;
  }
  const py::object tensor_data = get_attr(r.tensor_data, item, i);
  if (tensor_data.is_none()) {
    raise_upstream_assertion(item_name(i) + " is a tensor item but its tensor_data is None");
  }
  const int64_t numel =
      ctx.global_sizing
          ? numel_of(get_attr(r.size, tensor_data, i), i, "tensor_data.size")
          : numel_of(get_attr(r.sizes, get_attr(r.chunk, tensor_data, i), i), i,
                     "tensor_data.chunk.sizes");
  const py::object dtype = get_attr(r.dtype, get_attr(r.properties, tensor_data, i), i);
  const auto bytes = checked_mul(numel, ctx.element_sizes.lookup(dtype, i));
  if (!bytes) throw py::value_error(item_name(i) + " has more than 2^63-1 bytes");
  size_out = *bytes;
}

// read_item_fast over items [begin, end) on `num_threads` threads while this thread holds the GIL;
// returns the first item it could not read (or `end`): everything before it is read.
size_t read_fast_in_parallel(const ItemReadContext& ctx, PyObject* list, size_t begin, size_t end,
                             int num_threads, ItemArrays& out) {
  std::atomic<size_t> first_failure{end};
  parallel_for(
      static_cast<int64_t>(end - begin), kParallelReadBlock, num_threads,
      [&](int64_t block_begin, int64_t block_end) {
        const size_t lo = begin + static_cast<size_t>(block_begin);
        const size_t hi = begin + static_cast<size_t>(block_end);
        if (first_failure.load(std::memory_order_relaxed) < lo) return;  // read serially anyway
        LastDtype last;
        for (size_t i = lo; i < hi; ++i) {
          if (!read_item_fast(ctx, last, PyList_GET_ITEM(list, i), out.is_bytes[i], out.sizes[i])) {
            size_t seen = first_failure.load();
            while (i < seen && !first_failure.compare_exchange_weak(seen, i)) {
            }
            return;
          }
        }
      },
      nullptr);  // no Ctrl-C polling inside: it would run Python code while workers read objects
  return first_failure.load();
}

// Reads type and size of every item; the GIL is held. Sizes follow upstream's `_item_size`:
// prod(shape) * element size, with shape = tensor_data.chunk.sizes (Megatron) or tensor_data.size
// (torch DCP). With `count_bytes`, a BYTE_IO item's size is bytes_io_data.nbytes when present.
// Items are read in order; runs of plain items go to worker threads, which only read memory.
ItemArrays read_items(const py::list& items, const py::object& byte_io_type,
                      const py::dict& element_sizes, bool global_sizing, bool count_bytes,
                      int num_threads) {
  ItemReadContext ctx{{}, byte_io_type.ptr(), ElementSizeCache(element_sizes), global_sizing,
                      count_bytes};
  const size_t num_items = items.size();
  ItemArrays out;
  out.is_bytes.resize(num_items);
  out.sizes.resize(num_items);
  int64_t num_fast = 0;
  size_t fast_run = 0;  // consecutive items read fast: the readers know the classes by now
  LastDtype last;
  size_t i = 0;
  while (i < num_items) {
    const bool parallel = num_threads > 1 && fast_run >= kFastRunBeforeParallel && num_items - i >= kMinParallelRead;
    // The GIL is held here, so Python's signal handlers run only when asked.
    if (parallel) {
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    } else {
      check_signals_every_2_16(i);
    }
    // A signal handler or a duck-typed item's property may have run code that changed the list.
    const auto list_size = static_cast<size_t>(PyList_GET_SIZE(items.ptr()));
    if (i >= list_size) throw py::value_error("items changed length while being read");
    if (parallel) {
      const size_t end = std::min({num_items, list_size, i + kParallelReadChunk});
      const size_t stop = read_fast_in_parallel(ctx, items.ptr(), i, end, num_threads, out);
      num_fast += static_cast<int64_t>(stop - i);
      i = stop;
      if (stop < end) fast_run = 0;  // item `stop` needs the serial path
      continue;
    }
    PyObject* item = PyList_GET_ITEM(items.ptr(), i);
    if (read_item_fast(ctx, last, item, out.is_bytes[i], out.sizes[i])) {
      ++num_fast;
      ++fast_run;
    } else {
      fast_run = 0;
      read_item_generic(ctx, py::reinterpret_borrow<py::object>(item), i, out.is_bytes[i],
                        out.sizes[i]);
    }
    ++i;
  }
  g_fast_items += num_fast;
  return out;
}

checkpoint::BinPlan plan_without_gil(const std::vector<uint8_t>& is_bytes,
                                     const std::vector<int64_t>& sizes, int64_t bins, bool refined) {
  Interrupt interrupt = python_interrupt();
  py::gil_scoped_release release;
  return checkpoint::assign_bins(is_bytes, sizes, bins,
                                 refined ? Balance::kRefined : Balance::kUpstream, &interrupt);
}

py::list split_write_items(const py::list& items, int64_t bins, const py::object& byte_io_type,
                           const py::dict& element_sizes, bool global_sizing, bool refined,
                           int num_threads) {
  // Per bin: an empty list object with its GC header (72), its slot in `out` (8), core tables (16).
  check_output_fits("split_by_size_and_type: the list of bins", bins, 96);
  ItemArrays arrays =
      read_items(items, byte_io_type, element_sizes, global_sizing, refined, num_threads);
  // The core keeps bin loads in int64; upstream adds Python ints. Said here in terms of `items`.
  int64_t total = 0;
  for (size_t i = 0; i < arrays.sizes.size(); ++i) {
    if (arrays.is_bytes[i] && !refined) continue;
    const auto sum = checked_add(total, arrays.sizes[i]);
    if (!sum) {
      throw py::value_error("items: sizes summing past 2^63-1 bytes are not supported (the sizes up to "
                            "items[" + std::to_string(i) + "] do)");
    }
    total = *sum;
  }
  const checkpoint::BinPlan plan = plan_without_gil(arrays.is_bytes, arrays.sizes, bins, refined);
  // The last item's properties, or another thread while planning ran without the GIL, may have
  // resized the list (read_items catches it shrinking while it reads).
  if (static_cast<size_t>(PyList_GET_SIZE(items.ptr())) != arrays.sizes.size()) {
    throw py::value_error("items changed length while being read");
  }
  py::list out(bins);
  std::vector<PyObject*> bin_lists(bins);
  for (int64_t b = 0; b < bins; ++b) {
    py::list bin(plan.bin_offsets[b + 1] - plan.bin_offsets[b]);
    bin_lists[b] = bin.ptr();
    out[b] = std::move(bin);
  }
  // Every item lands in exactly one bin. Taking the references in input order walks the objects
  // in allocation order; taking them while filling (size order) costs a cache miss per item.
  const Py_ssize_t num_items = PyList_GET_SIZE(items.ptr());
  if (plan.bin_offsets[bins] != num_items) throw std::logic_error("bin plan does not cover every item");
  for (Py_ssize_t i = 0; i < num_items; ++i) Py_INCREF(PyList_GET_ITEM(items.ptr(), i));
  for (int64_t b = 0; b < bins; ++b) {
    const int64_t begin = plan.bin_offsets[b];
    for (int64_t k = begin; k < plan.bin_offsets[b + 1]; ++k) {
      PyList_SET_ITEM(bin_lists[b], k - begin, PyList_GET_ITEM(items.ptr(), plan.order[k]));
    }
  }
  return out;
}

py::tuple write_item_sizes(const py::list& items, const py::object& byte_io_type,
                           const py::dict& element_sizes, bool global_sizing, bool count_bytes,
                           int num_threads) {
  ItemArrays arrays =
      read_items(items, byte_io_type, element_sizes, global_sizing, count_bytes, num_threads);
  return py::make_tuple(to_numpy(std::move(arrays.is_bytes)), to_numpy(std::move(arrays.sizes)));
}

py::tuple assign_bins(const CArray<uint8_t>& is_bytes, const CArray<int64_t>& sizes, int64_t bins,
                      bool refined) {
  // An item that changed kind between the core's passes would overrun `order`.
  const std::vector<uint8_t> is_bytes_copy = snapshot(span_1d(is_bytes, "is_bytes"));
  const std::vector<int64_t> sizes_copy = snapshot(span_1d(sizes, "sizes"));
  const std::span<const uint8_t> is_bytes_span(is_bytes_copy);
  const std::span<const int64_t> sizes_span(sizes_copy);
  checkpoint::BinPlan plan;
  {
    Interrupt interrupt = python_interrupt();
    py::gil_scoped_release release;
    plan = checkpoint::assign_bins(is_bytes_span, sizes_span, bins,
                                   refined ? Balance::kRefined : Balance::kUpstream, &interrupt);
  }
  return py::make_tuple(to_numpy(std::move(plan.bin_idx)), to_numpy(std::move(plan.order)),
                        to_numpy(std::move(plan.bin_offsets)), to_numpy(std::move(plan.bin_bytes)));
}

}  // namespace

void register_checkpoint(py::module_& m) {
  m.def("checkpoint_split_write_items", &split_write_items, py::arg("items"), py::arg("bins"),
        py::arg("byte_io_type"), py::arg("element_sizes"), py::arg("global_sizing"),
        py::arg("refined"), py::arg("num_threads"),
        "Bins WriteItem objects; returns a list of `bins` lists of the same objects.");
  m.def("checkpoint_write_item_sizes", &write_item_sizes, py::arg("items"),
        py::arg("byte_io_type"), py::arg("element_sizes"), py::arg("global_sizing"),
        py::arg("count_bytes"), py::arg("num_threads"), "Returns (is_bytes uint8[n], sizes int64[n]) of WriteItem objects.");
  m.def("checkpoint_assign_bins", &assign_bins, py::arg("is_bytes").noconvert(),
        py::arg("sizes").noconvert(), py::arg("bins"), py::arg("refined"),
        "Returns (bin_idx, order, bin_offsets, bin_bytes) int64 arrays.");
  m.def(
      "checkpoint_read_counts",
      [] {
        const AttrReadCounts counts = take_attr_read_counts();
        const int64_t fast_items = std::exchange(g_fast_items, 0);
        return py::make_tuple(fast_items, counts.fast, counts.generic);
      },
      "Returns and resets (fast_items, fast_attrs, generic_attrs): items read without getattr, and "
      "attributes of the other items read from inline values / by getattr.");
}

}  // namespace trainfast::bindings
