// Bindings for checkpoint write-item binning: reads WriteItem objects (or arrays), calls the core.
#include <string>
#include <utility>

#include "bindings/common.h"
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

py::object get_attr(py::handle obj, const py::str& attr, size_t idx) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), attr.ptr());
  if (value == nullptr) {
    PyErr_Clear();
    throw py::type_error(item_name(idx) + " has no attribute '" + std::string(attr) +
                         "' (expected a torch.distributed.checkpoint WriteItem)");
  }
  return py::reinterpret_steal<py::object>(value);
}

// Product of a shape (torch.Size or any sequence of non-negative ints), overflow-checked.
int64_t numel_of(py::handle shape, size_t idx, const char* field) {
  // Built only on error: a string per item would cost as much as the rest of the read.
  auto where = [&] { return item_name(idx) + "." + field; };
  if (!PySequence_Check(shape.ptr())) throw py::type_error(where() + " must be a sequence of ints");
  // torch.Size is a tuple subclass: index it in place (PySequence_Fast would copy it to a list).
  py::object fast;
  PyObject** dims;
  Py_ssize_t ndim;
  if (PyTuple_Check(shape.ptr())) {
    ndim = PyTuple_GET_SIZE(shape.ptr());
    dims = &PyTuple_GET_ITEM(shape.ptr(), 0);
  } else {
    fast = py::reinterpret_steal<py::object>(PySequence_Fast(shape.ptr(), "shape"));
    if (!fast) throw py::error_already_set();
    ndim = PySequence_Fast_GET_SIZE(fast.ptr());
    dims = PySequence_Fast_ITEMS(fast.ptr());
  }
  int64_t numel = 1;
  for (Py_ssize_t d = 0; d < ndim; ++d) {
    py::handle dim(dims[d]);
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(dim.ptr(), &overflow);
    if (value == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::type_error(where() + " must be a sequence of ints (got " +
                           std::string(py::repr(dim)) + ")");
    }
    if (overflow != 0 || value < 0) {
      throw py::value_error(where() + " has a negative or oversized dimension (got " +
                            std::string(py::repr(dim)) + ")");
    }
    const auto product = checked_mul(numel, value);
    if (!product) throw py::value_error(where() + " has more than 2^63-1 elements");
    numel = *product;
  }
  return numel;
}

struct ItemArrays {
  std::vector<uint8_t> is_bytes;
  std::vector<int64_t> sizes;
};

// Reads type and size of every item; the GIL is held. Sizes follow upstream's `_item_size`:
// prod(shape) * element size, with shape = tensor_data.chunk.sizes (Megatron) or tensor_data.size
// (torch DCP). With `count_bytes`, a BYTE_IO item's size is bytes_io_data.nbytes when present.
ItemArrays read_items(const py::list& items, const py::object& byte_io_type,
                      const py::dict& element_sizes, bool global_sizing, bool count_bytes) {
  // Interned names make each attribute lookup a pointer comparison in the instance dict.
  const py::str type_attr = interned("type"), tensor_data_attr = interned("tensor_data"),
                chunk_attr = interned("chunk"), sizes_attr = interned("sizes"),
                size_attr = interned("size"), properties_attr = interned("properties"),
                dtype_attr = interned("dtype"), bytes_io_attr = interned("bytes_io_data"),
                nbytes_attr = interned("nbytes");
  const size_t num_items = items.size();
  ItemArrays out;
  out.is_bytes.resize(num_items);
  out.sizes.resize(num_items);
  PyObject* last_dtype = nullptr;  // dtypes repeat: skip the dict lookup for a run of equal ones
  int64_t last_element_size = 0;
  for (size_t i = 0; i < num_items; ++i) {
    // The GIL is held here, so Python's Ctrl-C handler runs only when asked.
    if ((i & 0xffff) == 0xffff && PyErr_CheckSignals() != 0) throw py::error_already_set();
    py::handle item = items[i];
    const py::object type = get_attr(item, type_attr, i);
    bool is_bytes = type.ptr() == byte_io_type.ptr();
    if (!is_bytes && Py_TYPE(type.ptr()) != Py_TYPE(byte_io_type.ptr())) {
      const int equal = PyObject_RichCompareBool(type.ptr(), byte_io_type.ptr(), Py_EQ);
      if (equal < 0) throw py::error_already_set();
      is_bytes = equal == 1;
    }
    out.is_bytes[i] = is_bytes;
    if (is_bytes) {
      if (count_bytes) {
        PyObject* data = PyObject_GetAttr(item.ptr(), bytes_io_attr.ptr());
        if (data == nullptr) PyErr_Clear();
        auto data_obj = py::reinterpret_steal<py::object>(data);
        if (data != nullptr && !data_obj.is_none() && py::hasattr(data_obj, nbytes_attr)) {
          const auto nbytes = data_obj.attr(nbytes_attr).cast<long long>();
          if (nbytes < 0) {
            throw py::value_error(item_name(i) + ".bytes_io_data.nbytes must be non-negative (got " +
                                  std::to_string(nbytes) + ")");
          }
          out.sizes[i] = nbytes;
        }
      }
      continue;
    }
    const py::object tensor_data = get_attr(item, tensor_data_attr, i);
    if (tensor_data.is_none()) {
      throw py::value_error(item_name(i) + " is a tensor item but its tensor_data is None");
    }
    const int64_t numel =
        global_sizing ? numel_of(get_attr(tensor_data, size_attr, i), i, "tensor_data.size")
                      : numel_of(get_attr(get_attr(tensor_data, chunk_attr, i), sizes_attr, i), i,
                                 "tensor_data.chunk.sizes");
    const py::object dtype = get_attr(get_attr(tensor_data, properties_attr, i), dtype_attr, i);
    if (dtype.ptr() != last_dtype) {
      PyObject* size = PyDict_GetItemWithError(element_sizes.ptr(), dtype.ptr());
      if (size == nullptr) {
        if (PyErr_Occurred()) PyErr_Clear();
        throw py::value_error(item_name(i) + " has an unknown dtype (got " +
                              std::string(py::repr(dtype)) + ")");
      }
      last_dtype = dtype.ptr();  // dtypes are interned singletons kept alive by the dict
      last_element_size = py::reinterpret_borrow<py::int_>(size).cast<int64_t>();
    }
    const auto bytes = checked_mul(numel, last_element_size);
    if (!bytes) throw py::value_error(item_name(i) + " has more than 2^63-1 bytes");
    out.sizes[i] = *bytes;
  }
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
                           const py::dict& element_sizes, bool global_sizing, bool refined) {
  // Per bin: an empty list object with its GC header (72), its slot in `out` (8), core tables (16).
  check_output_fits("split_by_size_and_type: the list of bins", bins, 96);
  ItemArrays arrays = read_items(items, byte_io_type, element_sizes, global_sizing, refined);
  const checkpoint::BinPlan plan = plan_without_gil(arrays.is_bytes, arrays.sizes, bins, refined);
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
                           const py::dict& element_sizes, bool global_sizing, bool count_bytes) {
  ItemArrays arrays = read_items(items, byte_io_type, element_sizes, global_sizing, count_bytes);
  return py::make_tuple(to_numpy(std::move(arrays.is_bytes)), to_numpy(std::move(arrays.sizes)));
}

py::tuple assign_bins(const CArray<uint8_t>& is_bytes, const CArray<int64_t>& sizes, int64_t bins,
                      bool refined) {
  const auto is_bytes_span = span_1d(is_bytes, "is_bytes");
  const auto sizes_span = span_1d(sizes, "sizes");
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
        py::arg("refined"),
        "Bins WriteItem objects; returns a list of `bins` lists of the same objects.");
  m.def("checkpoint_write_item_sizes", &write_item_sizes, py::arg("items"),
        py::arg("byte_io_type"), py::arg("element_sizes"), py::arg("global_sizing"),
        py::arg("count_bytes"), "Returns (is_bytes uint8[n], sizes int64[n]) of WriteItem objects.");
  m.def("checkpoint_assign_bins", &assign_bins, py::arg("is_bytes").noconvert(),
        py::arg("sizes").noconvert(), py::arg("bins"), py::arg("refined"),
        "Returns (bin_idx, order, bin_offsets, bin_bytes) int64 arrays.");
}

}  // namespace trainfast::bindings
