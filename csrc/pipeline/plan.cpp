#include "pipeline/plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/check.h"

namespace trainfast::pipeline {
namespace {

// Python's // and % (upstream computes with them, negative operands included).
int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t pymod(int64_t a, int64_t b) { return a - b * floordiv(a, b); }

bool is_set(int64_t v) { return v != kNone; }

std::string chunk_name(int64_t chunk, int64_t pp) {
  return "(pp_rank=" + std::to_string(chunk % pp) + ", vp_stage=" + std::to_string(chunk / pp) + ")";
}

int64_t num_chunks_per_rank(const MegatronSpec& s) { return is_set(s.vpp) ? s.vpp : 1; }

// get_num_layers_to_build's arithmetic (no asserts); vp_stage kNone is upstream's None.
int64_t count_formula(const MegatronSpec& s, int64_t pp_rank, int64_t vp_stage) {
  const bool first_pp = pp_rank == 0, last_pp = pp_rank == s.pp - 1;
  int64_t per_rank;
  if (is_set(s.first) || is_set(s.last)) {
    const int64_t to_distribute = s.num_layers - (is_set(s.first) ? s.first : 0) - (is_set(s.last) ? s.last : 0);
    const int64_t stages_left = s.pp - is_set(s.first) - is_set(s.last);
    per_rank = stages_left > 0 ? floordiv(to_distribute, stages_left) : 0;
    if (first_pp && is_set(s.first)) per_rank = s.first;
    if (last_pp && is_set(s.last)) per_rank = s.last;
  } else {
    per_rank = floordiv(s.num_layers + s.account_for_embedding + s.account_for_loss, s.pp);
  }
  int64_t count = (is_set(s.vpp) && s.pp > 1) ? floordiv(per_rank, s.vpp) : per_rank;
  const bool single_vp = !is_set(s.vpp) || s.vpp <= 1;
  // upstream compares vp_stage (None included) with 0 / vpp - 1
  const bool vp_first = single_vp || (vp_stage != kNone && vp_stage == 0);
  const bool vp_last = single_vp || (vp_stage != kNone && vp_stage == s.vpp - 1);
  if (s.account_for_embedding && vp_first && first_pp) --count;
  if (s.account_for_loss && vp_last && last_pp) --count;
  return count;
}

// get_transformer_layer_offset's arithmetic (no asserts); vp_stage must be set when vpp is.
int64_t offset_formula(const MegatronSpec& s, int64_t pp_rank, int64_t vp_stage) {
  if (s.pp <= 1) return 0;
  const int64_t v = vp_stage == kNone ? 0 : vp_stage;
  if (is_set(s.first) || is_set(s.last)) {
    const int64_t middle_stages = s.pp - is_set(s.first) - is_set(s.last);
    const int64_t first = is_set(s.first) ? s.first : 0, last = is_set(s.last) ? s.last : 0;
    const int64_t middle_layers = s.num_layers - first - last;
    const int64_t middle_rank = is_set(s.first) ? pp_rank - 1 : pp_rank;
    if (is_set(s.vpp)) {
      const int64_t first_v = is_set(s.first) ? floordiv(s.first, s.vpp) : 0;
      const int64_t last_v = is_set(s.last) ? floordiv(s.last, s.vpp) : 0;
      const int64_t middle_v = floordiv(middle_layers, s.vpp);
      const int64_t total = first_v + middle_v + last_v;
      if (pp_rank == 0) return v * total;
      // upstream divides by middle_stages even when it is 0 (ZeroDivisionError); 0 layers then
      const int64_t per_middle = middle_stages > 0 ? floordiv(middle_v, middle_stages) : 0;
      return v * total + first_v + middle_rank * per_middle;
    }
    const int64_t per_rank = middle_stages > 0 ? floordiv(middle_layers, middle_stages) : 0;
    return pp_rank == 0 ? 0 : middle_rank * per_rank + first;
  }
  const int64_t total_layers = s.num_layers + s.account_for_embedding + s.account_for_loss;
  const int64_t per_rank = floordiv(total_layers, s.pp);
  int64_t offset = is_set(s.vpp) ? v * floordiv(total_layers, s.vpp) + pp_rank * floordiv(per_rank, s.vpp)
                                 : pp_rank * per_rank;
  const bool vp_first = !is_set(s.vpp) || s.vpp <= 1 || v == 0;
  if (s.account_for_embedding && !(vp_first && pp_rank == 0)) --offset;
  return offset;
}

ChunkPlan formula_plan(const MegatronSpec& s) {
  ChunkPlan plan;
  plan.pp = s.pp;
  plan.vpp = num_chunks_per_rank(s);
  const int64_t n = plan.pp * plan.vpp;
  plan.counts.resize(n);
  plan.offsets.resize(n);
  for (int64_t c = 0; c < n; ++c) {
    const int64_t p = c % s.pp, v = c / s.pp;
    const int64_t vp_stage = is_set(s.vpp) ? v : kNone;
    plan.counts[c] = count_formula(s, p, vp_stage);
    plan.offsets[c] = offset_formula(s, p, vp_stage);
  }
  return plan;
}

std::string sum_name(const MegatronSpec& s) {
  std::string out = "num_layers (" + std::to_string(s.num_layers) + ")";
  if (s.account_for_embedding) out += " + 1 (embedding)";
  if (s.account_for_loss) out += " + 1 (loss)";
  return out;
}

[[noreturn]] void fail(const MegatronSpec& s, const std::string& reason) {
  const ChunkPlan floor_plan = formula_plan(s);
  std::string effect = describe_coverage(floor_plan.counts, floor_plan.offsets, s.num_layers, s.pp);
  throw std::invalid_argument(reason + (effect.empty() ? "" : ": " + effect));
}

}  // namespace

void check_pp_vpp(int64_t pp, int64_t vpp, const char* pp_name, const char* vpp_name) {
  TF_CHECK_ARG(pp >= 1, pp_name, pp, "must be >= 1");
  TF_CHECK_ARG(vpp >= 1, vpp_name, vpp, "must be >= 1");
  TF_CHECK_ARG(pp <= kMaxChunks && vpp <= kMaxChunks && pp * vpp <= kMaxChunks, pp_name,
               std::to_string(pp) + " x " + std::to_string(vpp), "times the vpp size must be <= 2^22");
}

std::string format_layer_set(const std::vector<std::pair<int64_t, int64_t>>& runs) {
  int64_t total = 0;
  for (const auto& [a, b] : runs) total += b - a;
  std::string out = total == 1 ? "layer " : "layers ";
  constexpr size_t kShown = 6;
  for (size_t i = 0; i < runs.size() && i < kShown; ++i) {
    if (i) out += ", ";
    out += std::to_string(runs[i].first);
    if (runs[i].second - runs[i].first > 1) {
      out.push_back('-');
      out += std::to_string(runs[i].second - 1);
    }
  }
  if (runs.size() > kShown) {
    out += ", ... (";
    out += std::to_string(total);
    out += " in all)";
  }
  return out;
}

std::string describe_coverage(std::span<const int64_t> counts, std::span<const int64_t> offsets,
                              int64_t num_layers, int64_t pp) {
  const int64_t n = static_cast<int64_t>(counts.size());
  for (int64_t c = 0; c < n; ++c) {
    if (counts[c] < 0) {
      return "chunk " + chunk_name(c, pp) + " would build " + std::to_string(counts[c]) + " layers";
    }
  }
  int64_t next = 0;
  bool tiles = true;
  for (int64_t c = 0; c < n && tiles; ++c) {
    if (counts[c] == 0) continue;
    if (offsets[c] != next) tiles = false;
    next = offsets[c] + counts[c];
  }
  if (tiles && next == num_layers) return "";
  // Sweep the chunk intervals to find uncovered, doubly covered and nonexistent layers.
  std::vector<std::pair<int64_t, int64_t>> events;
  for (int64_t c = 0; c < n; ++c) {
    if (counts[c] == 0) continue;
    events.emplace_back(offsets[c], +1);
    events.emplace_back(offsets[c] + counts[c], -1);
  }
  events.emplace_back(0, 0);
  events.emplace_back(num_layers, 0);
  std::sort(events.begin(), events.end());
  std::vector<std::pair<int64_t, int64_t>> lost, twice, outside;
  auto add = [](std::vector<std::pair<int64_t, int64_t>>& runs, int64_t a, int64_t b) {
    if (a >= b) return;
    if (!runs.empty() && runs.back().second == a) runs.back().second = b;
    else runs.emplace_back(a, b);
  };
  int64_t depth = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    depth += events[i].second;
    const int64_t a = events[i].first, b = events[i + 1].first;
    if (a >= b) continue;
    const int64_t in_a = std::max<int64_t>(a, 0), in_b = std::min(b, num_layers);
    if (depth == 0) add(lost, in_a, in_b);
    if (depth >= 2) add(twice, in_a, in_b);
    if (depth >= 1) {
      add(outside, a, std::min<int64_t>(b, 0));
      add(outside, std::max(a, num_layers), b);
    }
  }
  std::vector<std::string> parts;
  if (!lost.empty()) parts.push_back(format_layer_set(lost) + " would be lost");
  if (!twice.empty()) parts.push_back(format_layer_set(twice) + " would be built more than once");
  if (!outside.empty()) {
    parts.push_back("nonexistent " + format_layer_set(outside) + " would be built (num_layers=" +
                    std::to_string(num_layers) + ")");
  }
  if (parts.empty()) return "chunks would hold their layers out of order";
  std::string out = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) out += "; " + parts[i];
  return out;
}

void validate_megatron(const MegatronSpec& s) {
  TF_CHECK_ARG(s.num_layers >= 0 && s.num_layers <= kMaxLayers, "num_layers", s.num_layers,
               "must be in [0, 2^40]");
  TF_CHECK_ARG(s.pp >= 1, "pipeline_model_parallel_size", s.pp, "must be >= 1");
  TF_CHECK_ARG(s.vpp == kNone || s.vpp >= 1, "virtual_pipeline_model_parallel_size", s.vpp,
               "must be None or >= 1");
  check_pp_vpp(s.pp, num_chunks_per_rank(s), "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size");
  TF_CHECK_ARG(s.first == kNone || s.first <= kMaxLayers, "num_layers_in_first_pipeline_stage",
               s.first, "must be <= 2^40");
  TF_CHECK_ARG(s.last == kNone || s.last <= kMaxLayers, "num_layers_in_last_pipeline_stage", s.last,
               "must be <= 2^40");
  const bool uneven = is_set(s.first) || is_set(s.last);
  const std::string vpp_str = std::to_string(s.vpp);
  if (uneven && (s.account_for_embedding || s.account_for_loss)) {
    fail(s, "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage cannot be set "
            "together with account_for_embedding_in_pipeline_split / "
            "account_for_loss_in_pipeline_split");
  }
  if (uneven) {
    // TransformerConfig.__post_init__'s uneven-PP checks, in its order.
    int64_t middle_stages = s.pp, middle_layers = s.num_layers;
    const std::pair<int64_t, const char*> ends[] = {{s.first, "first"}, {s.last, "last"}};
    for (const auto& [value, which] : ends) {
      if (!is_set(value)) continue;
      const std::string field = std::string("num_layers_in_") + which + "_pipeline_stage (" +
                                std::to_string(value) + ")";
      if (value <= 0) fail(s, field + " must be larger than 0");
      if (is_set(s.vpp) && pymod(value, s.vpp) != 0) {
        fail(s, field + " must be divisible by virtual_pipeline_model_parallel_size (" + vpp_str + ")");
      }
      middle_layers -= value;
      --middle_stages;
    }
    if ((middle_layers != 0) != (middle_stages != 0)) {
      fail(s, "mismatch: " + std::to_string(middle_layers) + " middle layers remaining but " +
                  std::to_string(middle_stages) + " middle pipeline stages available");
    }
    if (middle_stages != 0 && pymod(middle_layers, middle_stages) != 0) {
      fail(s, "the " + std::to_string(middle_layers) + " middle layers must be divisible by the " +
                  std::to_string(middle_stages) + " middle pipeline stages");
    }
    if (middle_stages != 0 && is_set(s.vpp) &&
        pymod(floordiv(middle_layers, middle_stages), s.vpp) != 0) {
      fail(s, "the " + std::to_string(floordiv(middle_layers, middle_stages)) +
                  " layers on each middle pipeline stage must be divisible by "
                  "virtual_pipeline_model_parallel_size (" + vpp_str + ")");
    }
  } else {
    const int64_t total_layers = s.num_layers + s.account_for_embedding + s.account_for_loss;
    if (pymod(total_layers, s.pp) != 0) {
      fail(s, sum_name(s) + " must be divisible by pipeline_model_parallel_size (" +
                  std::to_string(s.pp) + ")");
    }
    if (is_set(s.vpp) && (s.pp > 1 || s.account_for_embedding || s.account_for_loss) &&
        pymod(total_layers / s.pp, s.vpp) != 0) {
      fail(s, "the " + std::to_string(total_layers / s.pp) + " layers per pipeline stage (" +
                  sum_name(s) + " / " + std::to_string(s.pp) +
                  ") must be divisible by virtual_pipeline_model_parallel_size (" + vpp_str + ")");
    }
  }
  const ChunkPlan plan = formula_plan(s);
  for (int64_t c = 0; c < static_cast<int64_t>(plan.counts.size()); ++c) {
    if (plan.counts[c] < 0) {
      throw std::invalid_argument("not enough layers: chunk " + chunk_name(c, s.pp) + " would build " +
                                  std::to_string(plan.counts[c]) + " layers");
    }
  }
  const std::string effect = describe_coverage(plan.counts, plan.offsets, s.num_layers, s.pp);
  if (!effect.empty()) {
    std::string why = "this pipeline split does not build every layer exactly once";
    if (s.pp == 1 && num_chunks_per_rank(s) > 1) {
      why += " (Megatron ignores virtual_pipeline_model_parallel_size when "
             "pipeline_model_parallel_size is 1)";
    }
    throw std::invalid_argument(why + ": " + effect);
  }
}

ChunkPlan megatron_plan(const MegatronSpec& spec) {
  validate_megatron(spec);
  return formula_plan(spec);
}

RankValues megatron_rank(const MegatronSpec& spec, int64_t pp_rank, int64_t vp_stage) {
  validate_megatron(spec);
  TF_CHECK_ARG(pp_rank >= 0 && pp_rank < spec.pp, "pp_rank", pp_rank,
               ("must be in [0, pipeline_model_parallel_size=" + std::to_string(spec.pp) + ")").c_str());
  const int64_t nv = num_chunks_per_rank(spec);
  TF_CHECK_ARG(vp_stage == kNone || (vp_stage >= 0 && vp_stage < nv), "vp_stage", vp_stage,
               ("must be None or in [0, " + std::to_string(nv) + ")").c_str());
  if (vp_stage == kNone && is_set(spec.vpp) && spec.pp > 1) {
    return {count_formula(spec, pp_rank, vp_stage), kNone};  // upstream's offset asserts here
  }
  return {count_formula(spec, pp_rank, vp_stage), offset_formula(spec, pp_rank, vp_stage)};
}

ChunkPlan plan_from_counts(std::vector<int64_t> counts, int64_t pp, int64_t vpp) {
  ChunkPlan plan;
  plan.pp = pp;
  plan.vpp = vpp;
  plan.offsets.resize(counts.size());
  int64_t next = 0;
  for (size_t c = 0; c < counts.size(); ++c) {
    plan.offsets[c] = next;
    next += counts[c];
  }
  plan.counts = std::move(counts);
  return plan;
}

ChunkPlan uneven_plan(int64_t num_layers, int64_t pp, int64_t vpp) {
  check_pp_vpp(pp, vpp, "pp", "vpp");
  TF_CHECK_ARG(num_layers >= 0 && num_layers <= kMaxLayers, "num_layers", num_layers, "must be in [0, 2^40]");
  const int64_t n = pp * vpp;
  if (num_layers < n) {
    throw std::invalid_argument(
        "num_layers (" + std::to_string(num_layers) + ") must be at least pp * vpp = " +
        std::to_string(n) + ": every chunk needs a layer, but chunk " + chunk_name(num_layers, pp) +
        (n - num_layers > 1 ? " and " + std::to_string(n - num_layers - 1) + " more" : "") +
        " would get none");
  }
  std::vector<int64_t> counts(n, num_layers / n);
  for (int64_t c = 0; c < num_layers % n; ++c) ++counts[c];
  return plan_from_counts(std::move(counts), pp, vpp);
}

ChunkPlan paddle_plan(std::span<const int64_t> stage_ids, int64_t pp, int64_t vpp) {
  check_pp_vpp(pp, vpp, "pp", "vpp");
  if (pp < 2 && vpp > 1) {
    throw std::invalid_argument("VPP schedule mode only can be set in pipeline mode (got pp=" +
                                std::to_string(pp) + ", vpp=" + std::to_string(vpp) + ")");
  }
  std::vector<int64_t> per_stage(pp, 0);
  for (size_t i = 0; i < stage_ids.size(); ++i) {
    const int64_t stage = stage_ids[i];
    if (stage < 0 || stage >= pp) {
      throw std::invalid_argument("stage_ids[" + std::to_string(i) + "] must be a pipeline stage in [0, " +
                                  std::to_string(pp) + ") (got " + std::to_string(stage) + ")");
    }
    ++per_stage[stage];
  }
  for (int64_t stage = 0; stage < pp; ++stage) {
    if (per_stage[stage] >= vpp) continue;
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (size_t i = 0; i < stage_ids.size(); ++i) {
      if (stage_ids[i] != stage) continue;
      const auto idx = static_cast<int64_t>(i);
      if (!runs.empty() && runs.back().second == idx) runs.back().second = idx + 1;
      else runs.emplace_back(idx, idx + 1);
    }
    throw std::invalid_argument(
        "pipeline stage " + std::to_string(stage) + " has " + std::to_string(per_stage[stage]) +
        " layers" + (runs.empty() ? "" : " (" + format_layer_set(runs) + ")") + ", fewer than vpp=" +
        std::to_string(vpp) + ": every chunk needs at least one layer");
  }
  // Stage s's i-th layer goes to its virtual chunk i % vpp (round robin).
  std::vector<int64_t> counts(pp * vpp, 0);
  for (int64_t stage = 0; stage < pp; ++stage) {
    for (int64_t v = 0; v < vpp; ++v) {
      counts[v * pp + stage] = per_stage[stage] / vpp + (v < per_stage[stage] % vpp ? 1 : 0);
    }
  }
  return plan_from_counts(std::move(counts), pp, vpp);
}

}  // namespace trainfast::pipeline
