// Bindings for EPLB: the two stages of the hierarchical policy and upstream's two helpers.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "bindings/common.h"
#include "common/checked_math.h"
#include "common/memory.h"
#include "eplb/eplb.h"

namespace trainfast::bindings {
namespace {

template <typename T>
std::span<const T> flat(const CArray<T>& array, const char* name) {
  check_aligned(array, name);
  return {array.data(), static_cast<size_t>(array.size())};
}

void check_2d(const py::array& array, const char* name) {
  if (array.ndim() != 2) {
    throw py::value_error(std::string(name) + " must be 2-D (got " + std::to_string(array.ndim()) + "-D)");
  }
}

std::shared_ptr<eplb::Replication> replicate(const CArray<float>& weight, int64_t num_replicas,
                                             int64_t num_groups, int64_t num_nodes, int64_t num_gpus,
                                             const CArray<float>& group_loads,
                                             const CArray<int64_t>& group_order, int num_threads) {
  check_2d(weight, "weight");
  eplb::Shape shape{weight.shape(0), weight.shape(1), num_replicas, num_groups, num_nodes, num_gpus};
  auto out = std::make_shared<eplb::Replication>();
  auto interrupt = python_interrupt();
  // Copies, read once each: the core reads weights in several passes without the GIL.
  const std::vector<float> weight_copy = snapshot(flat(weight, "weight"));
  const std::vector<float> loads_copy = snapshot(flat(group_loads, "group_loads"));
  const std::vector<int64_t> order_copy = snapshot(flat(group_order, "group_order"));
  const std::span<const float> weight_span(weight_copy), loads_span(loads_copy);
  const std::span<const int64_t> order_span(order_copy);
  {
    py::gil_scoped_release release;
    *out = eplb::replicate(weight_span, shape, loads_span, order_span, num_threads, &interrupt);
  }
  return out;
}

// The caller's reference keeps `replication` alive while the GIL is released.
py::tuple place(Self<eplb::Replication> replication_arg, const CArray<int64_t>& replica_order, bool refine,
                bool avoid_gpu_duplicates, int num_threads) {
  const eplb::Replication& replication = *replication_arg;
  const std::vector<int64_t> order_copy = snapshot(flat(replica_order, "replica_order"));
  const std::span<const int64_t> order_span(order_copy);
  eplb::PlaceOptions options{refine, avoid_gpu_duplicates};
  auto interrupt = python_interrupt();
  eplb::Placement placement;
  {
    py::gil_scoped_release release;
    placement = eplb::place(replication, order_span, options, num_threads, &interrupt);
  }
  const auto& s = replication.shape;
  return py::make_tuple(
      to_numpy(std::move(placement.phy2log), {s.num_layers, s.num_physical}),
      to_numpy(std::move(placement.log2phy), {s.num_layers, s.num_logical, placement.max_count}),
      to_numpy(std::move(placement.logcnt), {s.num_layers, s.num_logical}),
      to_numpy(std::move(placement.phy_rank), {s.num_layers, s.num_physical}));
}

template <typename Int>
py::tuple int_loads_typed(const py::array& weight_any, int64_t num_groups) {
  const auto weight = CArray<Int>::ensure(weight_any);
  const int64_t rows = weight.shape(0), cols = weight.shape(1);
  // More groups than experts has no group sums here (None: the caller asks torch); and it would
  // size group_loads by an unchecked number.
  if (num_groups < 0 || num_groups > cols) num_groups = 0;
  eplb::Buffer<float> out(rows * cols), group_loads(num_groups > 0 ? rows * num_groups : 0);
  bool exact = false;
  const std::vector<Int> weight_copy = snapshot(flat(weight, "weight"));
  {
    py::gil_scoped_release release;
    exact = eplb::int_loads<Int>(weight_copy, rows, cols, num_groups, out, group_loads);
  }
  py::object sums = py::none();
  if (exact) sums = to_numpy(std::move(group_loads), {rows, num_groups});
  return py::make_tuple(to_numpy(std::move(out), {rows, cols}), sums);
}

py::tuple int_loads(const py::array& weight, int64_t num_groups) {
  check_2d(weight, "weight");
  if (!(weight.flags() & py::array::c_style)) throw py::value_error("weight must be C-contiguous");
  if (weight.dtype().is(py::dtype::of<int64_t>())) return int_loads_typed<int64_t>(weight, num_groups);
  if (weight.dtype().is(py::dtype::of<int32_t>())) return int_loads_typed<int32_t>(weight, num_groups);
  throw py::type_error("weight must be int64 or int32 (got " + std::string(py::str(weight.dtype())) + ")");
}

template <typename T>
py::tuple balanced_packing_typed(const py::array& weight_any, const CArray<int64_t>& order, int64_t num_packs,
                                 int num_threads) {
  const auto weight = CArray<T>::ensure(weight_any);
  const int64_t rows = weight.shape(0), items = weight.shape(1);
  if (order.ndim() != 2 || order.shape(0) != rows || order.shape(1) != items) {
    throw py::value_error("order must have the shape of weight");
  }
  // Uninitialized (the core writes every entry): zeroing gigabytes up front held the GIL and Ctrl-C.
  eplb::Buffer<int64_t> pack_index(rows * items), rank_in_pack(rows * items);
  const std::vector<T> weight_copy = snapshot(flat(weight, "weight"));
  const std::vector<int64_t> order_copy = snapshot(flat(order, "order"));
  Interrupt interrupt = python_interrupt();
  {
    py::gil_scoped_release release;
    eplb::balanced_packing<T>(weight_copy, rows, items, order_copy, num_packs, pack_index, rank_in_pack,
                              num_threads, &interrupt);
  }
  return py::make_tuple(to_numpy(std::move(pack_index), {rows, items}),
                        to_numpy(std::move(rank_in_pack), {rows, items}));
}

py::tuple balanced_packing(const py::array& weight, const CArray<int64_t>& order, int64_t num_packs,
                           int num_threads) {
  check_2d(weight, "weight");
  if (!(weight.flags() & py::array::c_style)) throw py::value_error("weight must be C-contiguous");
  if (weight.dtype().is(py::dtype::of<float>())) return balanced_packing_typed<float>(weight, order, num_packs, num_threads);
  if (weight.dtype().is(py::dtype::of<double>())) return balanced_packing_typed<double>(weight, order, num_packs, num_threads);
  if (weight.dtype().is(py::dtype::of<int64_t>())) return balanced_packing_typed<int64_t>(weight, order, num_packs, num_threads);
  throw py::type_error("weight must be float32, float64 or int64 (got " + std::string(py::str(weight.dtype())) + ")");
}

template <typename T>
py::tuple replicate_experts_typed(const py::array& weight_any, int64_t num_phy, int num_threads) {
  const auto weight = CArray<T>::ensure(weight_any);
  const int64_t rows = weight.shape(0), num_log = weight.shape(1);
  if (num_phy < num_log) throw py::value_error("num_phy must be >= the number of logical experts");
  check_output_fits("replicate_experts: phy2log and rank of rows x num_phy slots",
                    checked_mul(rows, num_phy).value_or(INT64_MAX), 2 * sizeof(int64_t));
  eplb::Buffer<int64_t> phy2log(rows * num_phy), rank(rows * num_phy), logcnt(rows * num_log);  // all written
  const std::vector<T> weight_copy = snapshot(flat(weight, "weight"));
  Interrupt interrupt = python_interrupt();
  {
    py::gil_scoped_release release;
    eplb::replicate_experts<T>(weight_copy, rows, num_log, num_phy, phy2log, rank, logcnt, num_threads,
                               &interrupt);
  }
  return py::make_tuple(to_numpy(std::move(phy2log), {rows, num_phy}),
                        to_numpy(std::move(rank), {rows, num_phy}),
                        to_numpy(std::move(logcnt), {rows, num_log}));
}

py::tuple replicate_experts(const py::array& weight, int64_t num_phy, int num_threads) {
  check_2d(weight, "weight");
  if (!(weight.flags() & py::array::c_style)) throw py::value_error("weight must be C-contiguous");
  if (weight.dtype().is(py::dtype::of<float>())) return replicate_experts_typed<float>(weight, num_phy, num_threads);
  if (weight.dtype().is(py::dtype::of<double>())) return replicate_experts_typed<double>(weight, num_phy, num_threads);
  if (weight.dtype().is(py::dtype::of<int64_t>())) return replicate_experts_typed<int64_t>(weight, num_phy, num_threads);
  throw py::type_error("weight must be float32, float64 or int64 (got " + std::string(py::str(weight.dtype())) + ")");
}

py::array_t<int64_t> max_weight_assignment(const CArray<int64_t>& weight, int num_threads) {
  if (weight.ndim() != 3 || weight.shape(1) != weight.shape(2)) {
    throw py::value_error("weight must have shape [num_matrices, n, n] (got shape " +
                          std::string(py::str(py::tuple(weight.attr("shape")))) + ")");
  }
  const int64_t num_matrices = weight.shape(0), n = weight.shape(1);
  eplb::Buffer<int64_t> assignment(num_matrices * n);  // all written
  const std::vector<int64_t> weight_copy = snapshot(flat(weight, "weight"));
  Interrupt interrupt = python_interrupt();
  {
    py::gil_scoped_release release;
    eplb::max_weight_assignment(weight_copy, num_matrices, n, assignment, num_threads, &interrupt);
  }
  return to_numpy(std::move(assignment), {num_matrices, n});
}

}  // namespace

void register_eplb(py::module_& m) {
  py::class_<eplb::Replication, std::shared_ptr<eplb::Replication>>(
      m, "EplbReplication", "Stage 1 of the hierarchical policy (groups on nodes, replicas chosen).")
      .def_property_readonly(
          "replica_loads",
          [](py::object self) {
            eplb::Replication* rep = bound_value<eplb::Replication>(self);
            if (rep == nullptr) throw py::type_error("replica_loads is read from an EplbReplication");
            const auto& s = rep->shape;
            // A copy, not a view: eplb_place reads these loads without the GIL, and a write through
            // a view from another thread would race with it.
            py::array_t<float> loads({s.num_layers * s.num_nodes, s.physical_per_node()});
            std::copy_n(rep->replica_loads.data(), rep->replica_loads.size(), loads.mutable_data());
            return loads;
          },
          "float32 [num_layers * num_nodes, num_replicas / num_nodes]: load / count of each replica (a copy).");
  m.def("eplb_replicate", &replicate, py::arg("weight").noconvert(), py::arg("num_replicas"), py::arg("num_groups"),
        py::arg("num_nodes"), py::arg("num_gpus"), py::arg("group_loads").noconvert(),
        py::arg("group_order").noconvert(), py::arg("num_threads"),
        "Stage 1: pack groups onto nodes and replicate within nodes. Empty group_loads/group_order: "
        "native float32 sums and order (ties by lowest index).");
  m.def("eplb_place", &place, py::arg("replication"), py::arg("replica_order").noconvert(), py::arg("refine"),
        py::arg("avoid_gpu_duplicates"), py::arg("num_threads"),
        "Stage 2: pack each node's replicas onto its GPUs. Returns (phy2log, log2phy, logcnt, phyrank).");
  m.def("eplb_int_loads", &int_loads, py::arg("weight"), py::arg("num_groups"),
        "Integer loads as float32 (checked), plus the group sums when float32 adds them exactly in any "
        "order (else None). Returns (weight_f32, group_loads | None).");
  m.def("eplb_balanced_packing", &balanced_packing, py::arg("weight"), py::arg("order").noconvert(),
        py::arg("num_packs"), py::arg("num_threads"),
        "Upstream's balanced_packing with the given descending order. Returns (pack_index, rank_in_pack).");
  m.def("eplb_max_weight_assignment", &max_weight_assignment, py::arg("weight").noconvert(),
        py::arg("num_threads"),
        "For each [n, n] matrix of weight [num_matrices, n, n] (int64, entries in [0, 2^40)), the column "
        "given to each row that maximises the sum. Returns int64 [num_matrices, n].");
  m.def("eplb_replicate_experts", &replicate_experts, py::arg("weight"), py::arg("num_phy"), py::arg("num_threads"),
        "Upstream's replicate_experts. Returns (phy2log, rank, logcnt).");
}

}  // namespace trainfast::bindings
