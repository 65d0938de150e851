// Bindings for gradient-bucket planning: arrays in, zero-copy NumPy arrays out, plus the Megatron
// drop-ins' direct walks over Python objects (the param list, the param_index_map dict), which cost
// less than building arrays from them in Python.
#include <algorithm>
#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include <pybind11/stl.h>

#include "bindings/common.h"
#include "buckets/layout.h"

namespace trainfast::bindings {
namespace {

std::span<const int64_t> span_2col(const CArray<int64_t>& array, const char* name) {
  if (array.ndim() != 2 || array.shape(1) != 2) {
    throw py::value_error(std::string(name) + " must have shape [num_buckets, 2]");
  }
  check_aligned(array, name);
  return {array.data(), static_cast<size_t>(array.shape(0) * 2)};
}

py::tuple plan_layout(const CArray<int64_t>& numels, const CArray<uint8_t>& shared_embedding,
                      std::optional<int64_t> bucket_size, int64_t data_parallel_world_size,
                      bool use_distributed_optimizer, bool pad_buckets_for_high_nccl_busbw) {
  const std::vector<int64_t> numels_copy = snapshot(span_1d(numels, "numels"));
  const std::vector<uint8_t> shared_copy = snapshot(span_1d(shared_embedding, "shared_embedding"));
  const std::span<const int64_t> numels_span(numels_copy);
  const std::span<const uint8_t> shared_span(shared_copy);
  buckets::Layout layout;
  Interrupt interrupt = python_interrupt();
  {
    py::gil_scoped_release release;
    layout = buckets::plan_layout(
        numels_span, shared_span,
        {bucket_size, data_parallel_world_size, use_distributed_optimizer, pad_buckets_for_high_nccl_busbw},
        &interrupt);
  }
  const auto num_buckets = static_cast<py::ssize_t>(layout.per_bucket_numel_unpadded.size());
  return py::make_tuple(to_numpy(std::move(layout.param_start)), to_numpy(std::move(layout.param_end)),
                        to_numpy(std::move(layout.bucket_id)),
                        to_numpy(std::move(layout.bucket_indices), {num_buckets, 2}),
                        to_numpy(std::move(layout.per_bucket_numel_unpadded)), layout.numel,
                        layout.numel_unpadded);
}

py::tuple shard_ranges(const CArray<int64_t>& param_start, const CArray<int64_t>& param_end,
                       const CArray<int64_t>& bucket_id, const CArray<int64_t>& bucket_indices,
                       int64_t data_parallel_world_size, int64_t rank_begin, int64_t rank_end,
                       bool reverse_order, int num_threads) {
  // The core counts each rank's rows in one pass and writes them in another.
  const std::vector<int64_t> start_copy = snapshot(span_1d(param_start, "param_start"));
  const std::vector<int64_t> end_copy = snapshot(span_1d(param_end, "param_end"));
  const std::vector<int64_t> id_copy = snapshot(span_1d(bucket_id, "bucket_id"));
  const std::vector<int64_t> bucket_copy = snapshot(span_2col(bucket_indices, "bucket_indices"));
  const std::span<const int64_t> starts(start_copy), ends(end_copy), ids(id_copy), buckets_span(bucket_copy);
  buckets::ShardRanges ranges;
  {
    Interrupt interrupt = python_interrupt();
    py::gil_scoped_release release;
    ranges = buckets::shard_ranges(starts, ends, ids, buckets_span, data_parallel_world_size, rank_begin,
                                   rank_end, reverse_order, num_threads, &interrupt);
  }
  const auto rows = static_cast<py::ssize_t>(ranges.rank.size());
  return py::make_tuple(to_numpy(std::move(ranges.rank), {rows}), to_numpy(std::move(ranges.bucket), {rows}),
                        to_numpy(std::move(ranges.param), {rows}),
                        to_numpy(std::move(ranges.gbuf_world), {rows, 2}),
                        to_numpy(std::move(ranges.gbuf_world_in_bucket), {rows, 2}),
                        to_numpy(std::move(ranges.gbuf_local), {rows, 2}),
                        to_numpy(std::move(ranges.param_range), {rows, 2}));
}

py::tuple partition(const CArray<uint8_t>& is_uint8, const CArray<int64_t>& num_buckets,
                    bool force_single_bucket_group, bool reduce_scatter_with_fp32_accumulation) {
  auto groups = buckets::partition_buckets(span_1d(is_uint8, "is_uint8"), span_1d(num_buckets, "num_buckets"),
                                           force_single_bucket_group, reduce_scatter_with_fp32_accumulation);
  const auto members = static_cast<py::ssize_t>(groups.members.size() / 2);
  return py::make_tuple(to_numpy(std::move(groups.group_offsets)),
                        to_numpy(std::move(groups.members), {members, 2}));
}

// Buffer offsets stay far below 2^62 (a real buffer holds fewer elements); refusing larger ones
// keeps the differences and sums of the range arithmetic below inside int64.
constexpr int64_t kOffsetLimit = int64_t{1} << 62;
bool offset_in_range(int64_t value) { return value > -kOffsetLimit && value < kOffsetLimit; }

int64_t as_int64(PyObject* value, const char* what) {
  int overflow = 0;
  const long long out = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (out == -1 && PyErr_Occurred()) {
    clear_input_error();
    throw py::type_error(std::string("param_world_index_map values must hold int ") + what);
  }
  if (overflow != 0 || !offset_in_range(out)) {
    throw py::value_error(std::string("param_world_index_map ") + what + " must be in (-2^62, 2^62)");
  }
  return out;
}

void check_world_range(int64_t world_start, int64_t world_end, int64_t bucket_offset) {
  if (!offset_in_range(world_start) || !offset_in_range(world_end) || !offset_in_range(bucket_offset)) {
    throw py::value_error("gbuf_world_range and bucket_offset must be in (-2^62, 2^62) (got " +
                          std::to_string(world_start) + ", " + std::to_string(world_end) + ", " +
                          std::to_string(bucket_offset) + ")");
  }
}

// Builds the range map: each owned param's four Range objects (upstream's keys and order).
class RangeMapBuilder {
 public:
  RangeMapBuilder(int64_t world_start, int64_t world_end, int64_t bucket_offset, const py::object& range_type)
      : world_start_(world_start), world_size_(world_end - world_start), bucket_offset_(bucket_offset),
        range_type_(range_type) {}

  // The param at buffer offsets [start, end): an entry when it overlaps this rank's range.
  void add(py::handle key, int64_t start, int64_t end) {
    const auto part = buckets::param_shard_range(world_start_, world_start_ + world_size_, start, end);
    if (!part.owned()) return;
    const auto [local_start, local_end, sub_start] = part;
    py::dict ranges;
    ranges[gbuf_world_] = range_type_(local_start + world_start_, local_end + world_start_);
    ranges[in_bucket_] = range_type_(local_start + world_start_ - bucket_offset_, local_end + world_start_ - bucket_offset_);
    ranges[gbuf_local_] = range_type_(local_start, local_end);
    ranges[param_] = range_type_(sub_start, sub_start + (local_end - local_start));
    out_[key] = std::move(ranges);
  }

  py::dict& result() { return out_; }

 private:
  int64_t world_start_, world_size_, bucket_offset_;
  const py::object& range_type_;
  const py::str gbuf_world_{"gbuf_world"}, in_bucket_{"gbuf_world_in_bucket"}, gbuf_local_{"gbuf_local"},
      param_{"param"};
  py::dict out_;
};

// DistributedOptimizer._build_model_gbuf_param_range_map on the dict itself: one pass over its
// (start, end, bucket) values; only owned params get Range objects, in the dict's order.
py::dict param_range_map(const py::dict& param_world_index_map, int64_t world_start, int64_t world_end,
                         int64_t bucket_offset, const py::object& range_type) {
  check_world_range(world_start, world_end, bucket_offset);
  RangeMapBuilder out(world_start, world_end, bucket_offset, range_type);
  PyObject *borrowed_key = nullptr, *borrowed_value = nullptr;
  Py_ssize_t pos = 0;
  const Py_ssize_t size_before = PyDict_GET_SIZE(param_world_index_map.ptr());
  auto check_size = [&] {  // as iterating .items() does
    if (PyDict_GET_SIZE(param_world_index_map.ptr()) != size_before) {
      throw std::runtime_error("dictionary changed size during iteration");
    }
  };
  while (PyDict_Next(param_world_index_map.ptr(), &pos, &borrowed_key, &borrowed_value)) {
    check_size();
    // Owned: __index__, range_type or __hash__ below run Python code, which may change the dict.
    const auto key_ref = py::reinterpret_borrow<py::object>(borrowed_key);
    const auto value_ref = py::reinterpret_borrow<py::object>(borrowed_value);
    PyObject* key = key_ref.ptr();
    PyObject* value = value_ref.ptr();
    int64_t start, end;
    if (PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) == 3) {  // Megatron's own entries
      start = as_int64(PyTuple_GET_ITEM(value, 0), "starts");
      end = as_int64(PyTuple_GET_ITEM(value, 1), "ends");
    } else {
      if (!PySequence_Check(value) || PySequence_Size(value) != 3) {
        if (PyErr_Occurred()) clear_input_error();
        throw py::value_error("param_world_index_map values must be (start, end, bucket_id) triples");
      }
      py::object start_obj = py::reinterpret_steal<py::object>(PySequence_GetItem(value, 0));
      py::object end_obj = py::reinterpret_steal<py::object>(PySequence_GetItem(value, 1));
      if (!start_obj || !end_obj) throw py::error_already_set();
      start = as_int64(start_obj.ptr(), "starts");
      end = as_int64(end_obj.ptr(), "ends");
    }
    out.add(key, start, end);
  }
  check_size();
  return out.result();
}

// getattr(obj, name, default) without building the AttributeError: 1 found, 0 missing, -1 error.
int lookup_attr(PyObject* obj, PyObject* name, PyObject** out) {
#if PY_VERSION_HEX >= 0x030D0000
  return PyObject_GetOptionalAttr(obj, name, out);
#else
  return _PyObject_LookupAttr(obj, name, out);
#endif
}

// Thrown inside the readers below to hand the call back to the Python path, which reproduces
// upstream's result or error exactly (a param it cannot read, an assert, a raising predicate).
struct Irregular {};

py::object steal_or_irregular(PyObject* value) {
  if (value == nullptr) {
    clear_input_error();
    throw Irregular{};
  }
  return py::reinterpret_steal<py::object>(value);
}

bool truth_or_irregular(PyObject* value) {
  const int truth = PyObject_IsTrue(value);
  if (truth < 0) {
    clear_input_error();
    throw Irregular{};
  }
  return truth == 1;
}

py::object optional_attr(PyObject* obj, PyObject* name) {
  PyObject* value = nullptr;
  const int found = lookup_attr(obj, name, &value);
  if (found < 0) {
    clear_input_error();
    throw Irregular{};
  }
  return found == 1 ? py::reinterpret_steal<py::object>(value) : py::object();
}

// Dict key -> dense index, with a pointer-identity shortcut for the previous key (params of one
// buffer come in runs); identical elements make equal tuples, so the dict agrees with the shortcut.
struct KeyIndex {
  py::dict index;
  py::tuple last;  // holds its elements, so the pointer compares below never meet a reused address
  int64_t last_id = -1;

  int64_t find(PyObject* a, PyObject* b, PyObject* c, PyObject* d, bool* created) {
    *created = false;
    if (last_id >= 0) {
      PyObject* const* held = &PyTuple_GET_ITEM(last.ptr(), 0);
      if (held[0] == a && held[1] == b && held[2] == c && held[3] == d) return last_id;
    }
    py::tuple key = py::make_tuple(py::handle(a), py::handle(b), py::handle(c), py::handle(d));
    PyObject* found = PyDict_GetItemWithError(index.ptr(), key.ptr());
    int64_t id;
    if (found != nullptr) {
      id = PyLong_AsLongLong(found);
    } else {
      if (PyErr_Occurred()) {
        clear_input_error();
        throw Irregular{};
      }
      id = static_cast<int64_t>(PyDict_GET_SIZE(index.ptr()));
      if (PyDict_SetItem(index.ptr(), key.ptr(), py::int_(id).ptr()) != 0) {
        clear_input_error();
        throw Irregular{};
      }
      *created = true;
    }
    last = std::move(key);
    last_id = id;
    return id;
  }
};

// group_params_for_buffers in one native pass: per param requires_grad, dtype, the quantized-storage
// predicate (None: known false for every param), allreduce, the layer-wise flag and, for layouts,
// numel and shared_embedding. Returns [(key, params, param_indices, numels, shared)] in first-seen
// key order, or None where the Python path must run.
py::object group_params(const py::list& params, bool grad_reduce_in_fp32, const py::object& fp32,
                        const py::object& uint8, const py::object& quantized, const py::object& parameter_type,
                        const py::object& tensor_nelement, bool layout_inputs) {
  static PyObject* s_requires_grad = PyUnicode_InternFromString("requires_grad");
  static PyObject* s_dtype = PyUnicode_InternFromString("dtype");
  static PyObject* s_allreduce = PyUnicode_InternFromString("allreduce");
  static PyObject* s_layer_wise = PyUnicode_InternFromString("is_managed_by_layer_wise_optimizer");
  static PyObject* s_shared = PyUnicode_InternFromString("shared_embedding");
  static PyObject* s_data = PyUnicode_InternFromString("data");
  static PyObject* s_nelement = PyUnicode_InternFromString("nelement");
  struct Group {
    py::object key;
    py::list members;
    std::vector<int64_t> indices, numels;
    std::vector<uint8_t> shared;
  };
  // A snapshot: predicates run Python code that could edit the list.
  py::tuple items = py::reinterpret_steal<py::tuple>(PySequence_Tuple(params.ptr()));
  if (!items) throw py::error_already_set();
  std::vector<Group> groups;
  std::vector<int64_t> fake_counts;
  KeyIndex keys, fake_keys;
  PyObject* exact_parameter = parameter_type.ptr();
  try {
    const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* param = PyTuple_GET_ITEM(items.ptr(), i);
      if (!truth_or_irregular(steal_or_irregular(PyObject_GetAttr(param, s_requires_grad)).ptr())) throw Irregular{};
      py::object dtype = steal_or_irregular(PyObject_GetAttr(param, s_dtype));
      PyObject* storage = dtype.ptr();
      if (!quantized.is_none() &&
          truth_or_irregular(steal_or_irregular(PyObject_CallOneArg(quantized.ptr(), param)).ptr())) {
        storage = uint8.ptr();
      }
      PyObject* grad = grad_reduce_in_fp32 ? fp32.ptr() : dtype.ptr();
      py::object allreduce = optional_attr(param, s_allreduce);
      bool is_expert = false;
      if (allreduce) is_expert = !truth_or_irregular(allreduce.ptr());
      PyObject* expert_flag = is_expert ? Py_True : Py_False;
      py::object layer_wise = optional_attr(param, s_layer_wise);
      PyObject* layer_wise_flag = layer_wise ? layer_wise.ptr() : Py_False;
      bool created = false;
      const int64_t g = keys.find(storage, grad, expert_flag, layer_wise_flag, &created);
      if (created) groups.push_back({py::make_tuple(py::handle(storage), py::handle(grad), py::handle(expert_flag),
                                                    py::handle(layer_wise_flag)),
                                     py::list(), {}, {}, {}});
      // param_indices count under the fake (high-precision) dtype
      const int64_t f = fake_keys.find(dtype.ptr(), grad, expert_flag, layer_wise_flag, &created);
      if (created) fake_counts.push_back(0);
      Group& group = groups[static_cast<size_t>(g)];
      if (PyList_Append(group.members.ptr(), param) != 0) throw py::error_already_set();
      group.indices.push_back(fake_counts[static_cast<size_t>(f)]++);
      if (layout_inputs) {
        // upstream reads param.data.nelement(): for a plain Parameter that is torch.Tensor's nelement
        // (the caller's tensor_nelement) applied to the same sizes, so apply it to the param itself
        py::object numel;
        if (Py_TYPE(param) == reinterpret_cast<PyTypeObject*>(exact_parameter) && !tensor_nelement.is_none()) {
          numel = steal_or_irregular(PyObject_CallOneArg(tensor_nelement.ptr(), param));
        } else {
          py::object data = steal_or_irregular(PyObject_GetAttr(param, s_data));
          numel = steal_or_irregular(PyObject_CallMethodNoArgs(data.ptr(), s_nelement));
        }
        const long long value = PyLong_AsLongLong(numel.ptr());
        if (value == -1 && PyErr_Occurred()) {
          clear_input_error();
          throw Irregular{};
        }
        group.numels.push_back(value);
        py::object shared = optional_attr(param, s_shared);
        group.shared.push_back(shared && truth_or_irregular(shared.ptr()) ? 1 : 0);
      }
    }
  } catch (const Irregular&) {
    return py::none();
  }
  py::list out;
  for (auto& group : groups) {
    py::list indices(group.indices.size());
    for (size_t k = 0; k < group.indices.size(); ++k) {
      PyObject* index = PyLong_FromLongLong(group.indices[k]);
      if (index == nullptr) throw py::error_already_set();  // the list's unset slots are NULL, which it frees fine
      PyList_SET_ITEM(indices.ptr(), static_cast<Py_ssize_t>(k), index);
    }
    py::object numels = py::none(), shared = py::none();
    if (layout_inputs) {
      numels = to_numpy(std::move(group.numels));
      shared = to_numpy(std::move(group.shared));
    }
    out.append(py::make_tuple(group.key, group.members, indices, numels, shared));
  }
  return out;
}

// Megatron's param_index_map {param: (start, end, bucket_id)} in layout (reverse model) order.
// Params of id_hash_type hash as id(param) (torch.Tensor.__hash__, checked by the caller): the
// dict takes that hash directly instead of calling the Python-level __hash__ per param.
py::dict index_map(const py::list& params, const CArray<int64_t>& param_start, const CArray<int64_t>& param_end,
                   const CArray<int64_t>& bucket_id, const py::object& id_hash_type) {
  // Copies: a param's __hash__ runs Python code, which could resize these arrays meanwhile.
  const std::vector<int64_t> starts = snapshot(span_1d(param_start, "param_start"));
  const std::vector<int64_t> ends = snapshot(span_1d(param_end, "param_end"));
  const std::vector<int64_t> ids = snapshot(span_1d(bucket_id, "bucket_id"));
  // A snapshot, as upstream iterates a copy: a param's __hash__ may change the caller's list.
  const py::tuple owned_params(params);
  const auto n = static_cast<size_t>(PyTuple_GET_SIZE(owned_params.ptr()));
  if (starts.size() != n || ends.size() != n || ids.size() != n) {
    throw py::value_error("param_start, param_end and bucket_id must have one entry per param");
  }
#if PY_VERSION_HEX < 0x030D0000
  // sized once: no rehash while it grows to n entries
  py::dict out = py::reinterpret_steal<py::dict>(_PyDict_NewPresized(static_cast<Py_ssize_t>(n)));
  if (!out) throw py::error_already_set();
#else
  py::dict out;
#endif
  PyTypeObject* fast_type =
      id_hash_type.is_none() ? nullptr : reinterpret_cast<PyTypeObject*>(id_hash_type.ptr());
  py::object last_end, last_bucket;
  int64_t last_end_value = 0, last_bucket_value = 0;
  for (size_t k = n; k-- > 0;) {
    PyObject* param = PyTuple_GET_ITEM(owned_params.ptr(), static_cast<Py_ssize_t>(k));
    py::object value = py::reinterpret_steal<py::object>(PyTuple_New(3));
    if (!value) throw py::error_already_set();
    // A param usually starts where the previous one ended, in the previous one's bucket: share those ints.
    PyObject* start = starts[k] == last_end_value && last_end ? last_end.inc_ref().ptr() : PyLong_FromLongLong(starts[k]);
    PyObject* end = PyLong_FromLongLong(ends[k]);
    PyObject* bucket = ids[k] == last_bucket_value && last_bucket ? last_bucket.inc_ref().ptr() : PyLong_FromLongLong(ids[k]);
    PyTuple_SET_ITEM(value.ptr(), 0, start);
    PyTuple_SET_ITEM(value.ptr(), 1, end);
    PyTuple_SET_ITEM(value.ptr(), 2, bucket);
    if (start == nullptr || end == nullptr || bucket == nullptr) throw py::error_already_set();
    // A tuple of ints holds no references the cycle collector must follow; CPython untracks such
    // tuples itself at their first collection, doing it now spares the collections 45k entries.
    PyObject_GC_UnTrack(value.ptr());
    last_end = py::reinterpret_borrow<py::object>(end);
    last_end_value = ends[k];
    last_bucket = py::reinterpret_borrow<py::object>(bucket);
    last_bucket_value = ids[k];
    int rc;
#if PY_VERSION_HEX < 0x030D0000
    if (fast_type != nullptr && Py_TYPE(param) == fast_type) {
      // what slot_tp_hash makes of id(param): the address as a Py_ssize_t (-1 is reserved)
      Py_hash_t hash = static_cast<Py_hash_t>(reinterpret_cast<intptr_t>(param));
      if (hash == -1) hash = -2;
      rc = _PyDict_SetItem_KnownHash(out.ptr(), param, value.ptr(), hash);
    } else {
      rc = PyDict_SetItem(out.ptr(), param, value.ptr());
    }
#else
    (void)fast_type;
    rc = PyDict_SetItem(out.ptr(), param, value.ptr());
#endif
    if (rc != 0) throw py::error_already_set();
  }
  return out;
}

// The dict's modification tag (PEP 509: changes on every insert, delete or value store; unique
// across dicts); 0 where this Python has none.
unsigned long long dict_version(PyObject* dict) {
#if PY_VERSION_HEX < 0x030C0000
  return static_cast<unsigned long long>(reinterpret_cast<PyDictObject*>(dict)->ma_version_tag);
#else
  (void)dict;
  return 0;
#endif
}

// A snapshot of a param_index_map for repeated range-map calls: (keys, values, starts, ends,
// running max of ends, starts_sorted, version), or None unless every value is an exact (int, int, int).
py::object index_snapshot(const py::dict& param_world_index_map) {
  const Py_ssize_t n = PyDict_GET_SIZE(param_world_index_map.ptr());
  py::tuple keys(n), values(n);
  std::vector<int64_t> starts, ends, max_end;
  starts.reserve(static_cast<size_t>(n));
  ends.reserve(static_cast<size_t>(n));
  max_end.reserve(static_cast<size_t>(n));
  bool sorted = true;
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0, i = 0;
  while (PyDict_Next(param_world_index_map.ptr(), &pos, &key, &value)) {
    if (i >= n || !PyTuple_CheckExact(value) || PyTuple_GET_SIZE(value) != 3) return py::none();
    int64_t triple[3];
    for (int j = 0; j < 3; ++j) {
      PyObject* item = PyTuple_GET_ITEM(value, j);
      if (!PyLong_CheckExact(item)) return py::none();
      int overflow = 0;
      triple[j] = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow != 0 || (triple[j] == -1 && PyErr_Occurred()) || !offset_in_range(triple[j])) {
        if (PyErr_Occurred()) clear_input_error();
        return py::none();  // the plain path says what is wrong
      }
    }
    if (!starts.empty() && triple[0] < starts.back()) sorted = false;
    starts.push_back(triple[0]);
    ends.push_back(triple[1]);
    max_end.push_back(max_end.empty() ? triple[1] : std::max(max_end.back(), triple[1]));
    Py_INCREF(key);
    PyTuple_SET_ITEM(keys.ptr(), i, key);
    Py_INCREF(value);
    PyTuple_SET_ITEM(values.ptr(), i, value);
    ++i;
  }
  if (i != n) return py::none();
  return py::make_tuple(keys, values, to_numpy(std::move(starts)), to_numpy(std::move(ends)),
                        to_numpy(std::move(max_end)), sorted, dict_version(param_world_index_map.ptr()));
}

// _build_model_gbuf_param_range_map from a snapshot: checks the dict still holds the very same key
// and value objects in the same order (pointer compares; the snapshot keeps them alive, so an
// address cannot be reused), then visits only entries that can overlap the range. None when stale.
py::object param_range_map_indexed(const py::dict& param_world_index_map, const py::tuple& keys,
                                   const py::tuple& values, const CArray<int64_t>& param_start,
                                   const CArray<int64_t>& param_end, const CArray<int64_t>& max_end,
                                   bool starts_sorted, unsigned long long version, int64_t world_start,
                                   int64_t world_end,
                                   int64_t bucket_offset, const py::object& range_type) {
  check_world_range(world_start, world_end, bucket_offset);
  const Py_ssize_t n = PyTuple_GET_SIZE(keys.ptr());
  const auto starts = span_1d(param_start, "param_start");
  const auto ends = span_1d(param_end, "param_end");
  const auto running_max = span_1d(max_end, "max_end");
  if (PyTuple_GET_SIZE(values.ptr()) != n || starts.size() != static_cast<size_t>(n) ||
      ends.size() != static_cast<size_t>(n) || running_max.size() != static_cast<size_t>(n)) {
    throw py::value_error("snapshot arrays must have one entry per key");
  }
  // As index_snapshot checked them: no overflow in the differences below.
  auto check_offsets = [](int64_t start, int64_t end) {
    if (!offset_in_range(start) || !offset_in_range(end)) {
      throw py::value_error("param_world_index_map offsets must be in (-2^62, 2^62)");
    }
  };
  for (Py_ssize_t i = 0; i < n; ++i) check_offsets(starts[i], ends[i]);
  if (PyDict_GET_SIZE(param_world_index_map.ptr()) != n) return py::none();
  if (version == 0 || dict_version(param_world_index_map.ptr()) != version) {
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(param_world_index_map.ptr(), &pos, &key, &value)) {
      if (i >= n || key != PyTuple_GET_ITEM(keys.ptr(), i) || value != PyTuple_GET_ITEM(values.ptr(), i)) {
        return py::none();
      }
      ++i;
    }
    if (i != n) return py::none();
  }
  // Entries before lo end at or before world_start; entries from hi on (sorted starts) start at or
  // after world_end: neither can overlap.
  const auto lo = static_cast<size_t>(
      std::upper_bound(running_max.begin(), running_max.end(), world_start) - running_max.begin());
  const auto hi = starts_sorted ? static_cast<size_t>(std::lower_bound(starts.begin(), starts.end(), world_end) -
                                                      starts.begin())
                                : static_cast<size_t>(n);
  RangeMapBuilder out(world_start, world_end, bucket_offset, range_type);
  for (size_t i = lo; i < hi; ++i) {
    // Read once and checked again: range_type is Python code, which may rewrite the arrays.
    const int64_t start = starts[i], end = ends[i];
    check_offsets(start, end);
    out.add(PyTuple_GET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i)), start, end);
  }
  return out.result();
}

}  // namespace

void register_buckets(py::module_& m) {
  m.def("buckets_plan_layout", &plan_layout, py::arg("numels").noconvert(),
        py::arg("shared_embedding").noconvert(), py::arg("bucket_size"), py::arg("data_parallel_world_size"),
        py::arg("use_distributed_optimizer"), py::arg("pad_buckets_for_high_nccl_busbw"),
        "Returns (param_start, param_end, bucket_id, bucket_indices[B,2], per_bucket_numel_unpadded, "
        "numel, numel_unpadded).");
  m.def("buckets_shard_ranges", &shard_ranges, py::arg("param_start").noconvert(),
        py::arg("param_end").noconvert(), py::arg("bucket_id").noconvert(),
        py::arg("bucket_indices").noconvert(), py::arg("data_parallel_world_size"), py::arg("rank_begin"),
        py::arg("rank_end"), py::arg("reverse_order"), py::arg("num_threads"),
        "Returns (rank, bucket, param index, gbuf_world, gbuf_world_in_bucket, gbuf_local, param_range); "
        "layout order is the arrays' order, reversed when reverse_order.");
  m.def("buckets_partition", &partition, py::arg("is_uint8").noconvert(), py::arg("num_buckets").noconvert(),
        py::arg("force_single_bucket_group"), py::arg("reduce_scatter_with_fp32_accumulation"),
        "Returns (group_offsets[G+1], members[M,2] of (buffer, bucket)).");
  m.def("buckets_param_range_map", &param_range_map, py::arg("param_world_index_map"), py::arg("world_start"),
        py::arg("world_end"), py::arg("bucket_offset"), py::arg("range_type"),
        "Megatron's _build_model_gbuf_param_range_map: {param: {name: Range}} for owned params.");
  m.def("buckets_group_params", &group_params, py::arg("params"), py::arg("grad_reduce_in_fp32"), py::arg("fp32"),
        py::arg("uint8"), py::arg("quantized"), py::arg("parameter_type"), py::arg("tensor_nelement"),
        py::arg("layout_inputs"),
        "group_params_for_buffers in one pass: [(key, params, param_indices, numels, shared)], or None where "
        "the Python path must run.");
  m.def("buckets_index_map", &index_map, py::arg("params"), py::arg("param_start").noconvert(),
        py::arg("param_end").noconvert(), py::arg("bucket_id").noconvert(), py::arg("id_hash_type"),
        "Megatron's param_index_map {param: (start, end, bucket_id)} in reverse (layout) order.");
  m.def("buckets_index_snapshot", &index_snapshot, py::arg("param_world_index_map"),
        "(keys, values, starts, ends, max_end, starts_sorted, version) of a param_index_map, or None.");
  m.def("buckets_param_range_map_indexed", &param_range_map_indexed, py::arg("param_world_index_map"),
        py::arg("keys"), py::arg("values"), py::arg("param_start").noconvert(), py::arg("param_end").noconvert(),
        py::arg("max_end").noconvert(), py::arg("starts_sorted"), py::arg("version"), py::arg("world_start"),
        py::arg("world_end"),
        py::arg("bucket_offset"), py::arg("range_type"),
        "_build_model_gbuf_param_range_map from a snapshot; None when the dict changed since.");
}

}  // namespace trainfast::bindings
