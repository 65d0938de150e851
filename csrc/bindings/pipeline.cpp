// Bindings for pipeline layer splits: plain ints / strings / NumPy arrays to the pure C++ core.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "pipeline/balance.h"
#include "pipeline/layout.h"
#include "pipeline/plan.h"

namespace trainfast::bindings {
namespace {

namespace pl = trainfast::pipeline;

// No real layer count or rank comes near 2^60. Refusing larger ones keeps the core's None (INT64_MIN)
// apart from every value, and its sums and differences of a few of them from overflowing.
int64_t bounded(int64_t value, const char* name) {
  constexpr int64_t kLimit = int64_t{1} << 60;
  if (value <= -kLimit || value >= kLimit) {
    throw py::value_error(std::string(name) + " must be in (-2^60, 2^60) (got " + std::to_string(value) + ")");
  }
  return value;
}

int64_t or_none(const std::optional<int64_t>& value, const char* name) {
  return value ? bounded(*value, name) : pl::kNone;
}

pl::MegatronSpec make_spec(int64_t num_layers, int64_t pp, std::optional<int64_t> vpp,
                           std::optional<int64_t> first, std::optional<int64_t> last, bool account_for_embedding,
                           bool account_for_loss) {
  return pl::MegatronSpec{bounded(num_layers, "num_layers"), bounded(pp, "pipeline_model_parallel_size"),
                          or_none(vpp, "virtual_pipeline_model_parallel_size"),
                          or_none(first, "num_layers_in_first_pipeline_stage"),
                          or_none(last, "num_layers_in_last_pipeline_stage"), account_for_embedding,
                          account_for_loss};
}

py::tuple plan_tuple(pl::ChunkPlan&& plan) {
  return py::make_tuple(to_numpy(std::move(plan.counts)), to_numpy(std::move(plan.offsets)));
}

py::tuple megatron_plan(int64_t num_layers, int64_t pp, std::optional<int64_t> vpp, std::optional<int64_t> first,
                        std::optional<int64_t> last, bool account_for_embedding, bool account_for_loss) {
  return plan_tuple(pl::megatron_plan(make_spec(num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss)));
}

py::tuple megatron_rank(int64_t num_layers, int64_t pp, std::optional<int64_t> vpp, std::optional<int64_t> first,
                        std::optional<int64_t> last, bool account_for_embedding, bool account_for_loss,
                        int64_t pp_rank, std::optional<int64_t> vp_stage) {
  const auto values = pl::megatron_rank(
      make_spec(num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss), bounded(pp_rank, "pp_rank"),
      or_none(vp_stage, "vp_stage"));
  py::object offset = values.offset == pl::kNone ? py::object(py::none()) : py::object(py::int_(values.offset));
  return py::make_tuple(values.num_layers_to_build, offset);
}

py::tuple paddle_plan(const CArray<int64_t>& stage_ids, int64_t pp, int64_t vpp) {
  return plan_tuple(pl::paddle_plan(span_1d(stage_ids, "stage_ids"), pp, vpp));
}

py::tuple layout_counts(std::vector<std::string> stages, int64_t pp, const std::string& layer_char) {
  if (layer_char.size() != 1) throw py::value_error("layer_char must be one character (got '" + layer_char + "')");
  return plan_tuple(pl::layout_plan(pl::make_layout(std::move(stages), pp), layer_char[0]));
}

py::tuple balanced_split(const CArray<double>& layer_costs, int64_t pp, int64_t vpp, double embedding_cost,
                         double loss_cost) {
  const std::vector<double> costs = snapshot(span_1d(layer_costs, "layer_costs"));  // read in several passes
  pl::BalancedSplit split;
  {
    Interrupt interrupt = python_interrupt();
    py::gil_scoped_release release;
    split = pl::balanced_split(costs, pp, vpp, embedding_cost, loss_cost, &interrupt);
  }
  return py::make_tuple(to_numpy(std::move(split.boundaries)), to_numpy(std::move(split.chunk_costs)),
                        to_numpy(std::move(split.stage_costs)), split.max_chunk_cost, split.max_stage_cost);
}

}  // namespace

void register_pipeline(py::module_& m) {
  m.def("pipeline_megatron_plan", &megatron_plan, py::arg("num_layers"), py::arg("pp"), py::arg("vpp"),
        py::arg("first"), py::arg("last"), py::arg("account_for_embedding"), py::arg("account_for_loss"),
        "Validated Megatron split: (counts int64[pp*vpp], offsets int64[pp*vpp]) in global chunk order.");
  m.def("pipeline_megatron_rank", &megatron_rank, py::arg("num_layers"), py::arg("pp"), py::arg("vpp"),
        py::arg("first"), py::arg("last"), py::arg("account_for_embedding"), py::arg("account_for_loss"),
        py::arg("pp_rank"), py::arg("vp_stage"),
        "(get_num_layers_to_build, get_transformer_layer_offset or None) of one rank of a validated spec.");
  m.def("pipeline_uneven_plan", [](int64_t num_layers, int64_t pp, int64_t vpp) {
          return plan_tuple(pl::uneven_plan(num_layers, pp, vpp));
        }, py::arg("num_layers"), py::arg("pp"), py::arg("vpp"),
        "Remainder rule: the first num_layers % (pp*vpp) chunks get one more layer.");
  m.def("pipeline_paddle_plan", &paddle_plan, py::arg("stage_ids").noconvert(), py::arg("pp"), py::arg("vpp"),
        "Paddle complete_chunk_id segmentation from each layer's pipeline stage.");
  m.def("pipeline_parse_layout", [](const std::string& layout, int64_t pp) {
          return pl::parse_layout(layout, pp).stages;
        }, py::arg("layout"), py::arg("pp"), "Expanded stages of a Megatron layout string.");
  m.def("pipeline_validate_layout", [](std::vector<std::string> stages, int64_t pp, std::optional<int64_t> num_layers,
                                       std::optional<int64_t> mtp_num_layers, bool check_mtp_count) {
          return pl::validate_layout(pl::make_layout(std::move(stages), pp), or_none(num_layers, "num_layers"),
                                     or_none(mtp_num_layers, "mtp_num_layers"), check_mtp_count);
        }, py::arg("stages"), py::arg("pp"), py::arg("num_layers"), py::arg("mtp_num_layers"),
        py::arg("check_mtp_count"), "Megatron's validate_layer_layout; returns mtp_standalone.");
  m.def("pipeline_layout_counts", &layout_counts, py::arg("stages"), py::arg("pp"), py::arg("layer_char"),
        "(counts, offsets) of one layer character over the stages.");
  m.def("pipeline_layout_to_str", [](std::vector<std::string> stages, int64_t pp) {
          return pl::layout_to_string(pl::make_layout(std::move(stages), pp));
        }, py::arg("stages"), py::arg("pp"), "Short layout string for expanded stages.");
  m.def("pipeline_plan_to_layout_str", [](const CArray<int64_t>& counts, int64_t pp, int64_t vpp) {
          return pl::plan_to_layout_string(span_1d(counts, "counts"), pp, vpp);
        }, py::arg("counts").noconvert(), py::arg("pp"), py::arg("vpp"),
        "Layout string (E first, L last) of per-chunk decoder counts.");
  m.def("pipeline_balanced_split", &balanced_split, py::arg("layer_costs").noconvert(), py::arg("pp"),
        py::arg("vpp"), py::arg("embedding_cost"), py::arg("loss_cost"),
        "(boundaries int64[K+1], chunk_costs f64[K], stage_costs f64[pp], max_chunk_cost, max_stage_cost).");
}

}  // namespace trainfast::bindings
