// Bindings for gradient-bucket planning: arrays in, zero-copy NumPy arrays out, plus a direct
// reader of Megatron's param_index_map dict for the range-map drop-in.
#include <optional>
#include <string>
#include <utility>

#include <pybind11/stl.h>

#include "bindings/common.h"
#include "buckets/layout.h"

namespace trainfast::bindings {
namespace {

// Zero-copy NumPy array owning a vector with any allocator.
template <typename T, typename A>
py::array_t<T> owned_array(std::vector<T, A>&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T, A>(std::move(values));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T, A>*>(p); });
  return py::array_t<T>(shape, owned->data(), free_when_done);
}

std::span<const int64_t> span_2col(const CArray<int64_t>& array, const char* name) {
  if (array.ndim() != 2 || array.shape(1) != 2) {
    throw py::value_error(std::string(name) + " must have shape [num_buckets, 2]");
  }
  return {array.data(), static_cast<size_t>(array.shape(0) * 2)};
}

py::tuple plan_layout(const CArray<int64_t>& numels, const CArray<uint8_t>& shared_embedding,
                      std::optional<int64_t> bucket_size, int64_t data_parallel_world_size,
                      bool use_distributed_optimizer, bool pad_buckets_for_high_nccl_busbw) {
  const auto numels_span = span_1d(numels, "numels");
  const auto shared_span = span_1d(shared_embedding, "shared_embedding");
  buckets::Layout layout;
  {
    py::gil_scoped_release release;
    layout = buckets::plan_layout(
        numels_span, shared_span,
        {bucket_size, data_parallel_world_size, use_distributed_optimizer, pad_buckets_for_high_nccl_busbw});
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
  const auto starts = span_1d(param_start, "param_start");
  const auto ends = span_1d(param_end, "param_end");
  const auto ids = span_1d(bucket_id, "bucket_id");
  const auto buckets_span = span_2col(bucket_indices, "bucket_indices");
  buckets::ShardRanges ranges;
  {
    py::gil_scoped_release release;
    Interrupt interrupt = python_interrupt();
    ranges = buckets::shard_ranges(starts, ends, ids, buckets_span, data_parallel_world_size, rank_begin,
                                   rank_end, reverse_order, num_threads, &interrupt);
  }
  const auto rows = static_cast<py::ssize_t>(ranges.rank.size());
  return py::make_tuple(owned_array(std::move(ranges.rank), {rows}), owned_array(std::move(ranges.bucket), {rows}),
                        owned_array(std::move(ranges.param), {rows}),
                        owned_array(std::move(ranges.gbuf_world), {rows, 2}),
                        owned_array(std::move(ranges.gbuf_world_in_bucket), {rows, 2}),
                        owned_array(std::move(ranges.gbuf_local), {rows, 2}),
                        owned_array(std::move(ranges.param_range), {rows, 2}));
}

py::tuple partition(const CArray<uint8_t>& is_uint8, const CArray<int64_t>& num_buckets,
                    bool force_single_bucket_group, bool reduce_scatter_with_fp32_accumulation) {
  auto groups = buckets::partition_buckets(span_1d(is_uint8, "is_uint8"), span_1d(num_buckets, "num_buckets"),
                                           force_single_bucket_group, reduce_scatter_with_fp32_accumulation);
  const auto members = static_cast<py::ssize_t>(groups.members.size() / 2);
  return py::make_tuple(to_numpy(std::move(groups.group_offsets)),
                        to_numpy(std::move(groups.members), {members, 2}));
}

int64_t as_int64(PyObject* value, const char* what) {
  int overflow = 0;
  const long long out = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string("param_world_index_map values must hold int ") + what);
  }
  if (overflow != 0) throw py::value_error(std::string("param_world_index_map ") + what + " exceeds int64");
  return out;
}

// DistributedOptimizer._build_model_gbuf_param_range_map on the dict itself: one pass over its
// (start, end, bucket) values; only owned params get Range objects, in the dict's order.
py::dict param_range_map(const py::dict& param_world_index_map, int64_t world_start, int64_t world_end,
                         int64_t bucket_offset, const py::object& range_type) {
  const int64_t world_size = world_end - world_start;
  const py::str gbuf_world("gbuf_world"), in_bucket("gbuf_world_in_bucket"), gbuf_local("gbuf_local"),
      param_key("param");
  py::dict out;
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(param_world_index_map.ptr(), &pos, &key, &value)) {
    int64_t start, end;
    if (PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) == 3) {  // Megatron's own entries
      start = as_int64(PyTuple_GET_ITEM(value, 0), "starts");
      end = as_int64(PyTuple_GET_ITEM(value, 1), "ends");
    } else {
      if (!PySequence_Check(value) || PySequence_Size(value) != 3) {
        if (PyErr_Occurred()) PyErr_Clear();
        throw py::value_error("param_world_index_map values must be (start, end, bucket_id) triples");
      }
      py::object start_obj = py::reinterpret_steal<py::object>(PySequence_GetItem(value, 0));
      py::object end_obj = py::reinterpret_steal<py::object>(PySequence_GetItem(value, 1));
      if (!start_obj || !end_obj) throw py::error_already_set();
      start = as_int64(start_obj.ptr(), "starts");
      end = as_int64(end_obj.ptr(), "ends");
    }
    const int64_t local_start = std::max<int64_t>(0, start - world_start);
    const int64_t local_end = std::min(world_size, end - world_start);
    if (local_end <= local_start) continue;
    const int64_t size = local_end - local_start;
    const int64_t sub_start = std::max<int64_t>(0, world_start - start);
    py::dict ranges;
    ranges[gbuf_world] = range_type(local_start + world_start, local_end + world_start);
    ranges[in_bucket] = range_type(local_start + world_start - bucket_offset, local_end + world_start - bucket_offset);
    ranges[gbuf_local] = range_type(local_start, local_end);
    ranges[param_key] = range_type(sub_start, sub_start + size);
    out[py::handle(key)] = std::move(ranges);
  }
  return out;
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
}

}  // namespace trainfast::bindings
