// Pipeline / virtual-pipeline layer splits: Megatron's formulas, the "uneven VPP" remainder rule,
// Paddle's per-stage round-robin, and the coverage check every plan must pass.
//
// A plan has pp * vpp chunks in global layer order: chunk c runs on pipeline rank c % pp as its
// virtual stage c / pp and holds decoder layers [offsets[c], offsets[c] + counts[c]).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace trainfast::pipeline {

inline constexpr int64_t kNone = std::numeric_limits<int64_t>::min();  // "not set" (None)
inline constexpr int64_t kMaxLayers = int64_t{1} << 40;
inline constexpr int64_t kMaxChunks = int64_t{1} << 22;

struct ChunkPlan {
  int64_t pp = 1;
  int64_t vpp = 1;
  std::vector<int64_t> counts;   // [pp * vpp]
  std::vector<int64_t> offsets;  // [pp * vpp]
};

// Megatron's pipeline fields of a TransformerConfig (kNone where the field is None).
struct MegatronSpec {
  int64_t num_layers = 0;
  int64_t pp = 1;
  int64_t vpp = kNone;
  int64_t first = kNone;  // num_layers_in_first_pipeline_stage
  int64_t last = kNone;   // num_layers_in_last_pipeline_stage
  bool account_for_embedding = false;
  bool account_for_loss = false;
};

// Checks everything TransformerConfig.__post_init__ and the two upstream functions assert, then that
// the split covers every layer exactly once in order; throws std::invalid_argument saying which rule
// failed and which layers would be lost or built twice.
void validate_megatron(const MegatronSpec& spec);

// The validated plan (chunk values as get_num_layers_to_build / get_transformer_layer_offset give).
ChunkPlan megatron_plan(const MegatronSpec& spec);

// Upstream's per-rank values for a validated spec; vp_stage may be kNone (upstream's quirks apply:
// a missing vp_stage with vpp > 1 is neither the first nor the last virtual stage; the offset is
// kNone where upstream's get_transformer_layer_offset asserts that vp_stage is given).
struct RankValues {
  int64_t num_layers_to_build;
  int64_t offset;
};
RankValues megatron_rank(const MegatronSpec& spec, int64_t pp_rank, int64_t vp_stage);

// Seed rule: chunk j gets one layer per layer index == j (mod pp * vpp); every chunk needs one layer.
ChunkPlan uneven_plan(int64_t num_layers, int64_t pp, int64_t vpp);

// Paddle complete_chunk_id: stage_ids[i] is the pp stage the user put layer i on; each stage's
// layers are dealt round-robin over its vpp chunks, then chunks are cut in global layer order.
ChunkPlan paddle_plan(std::span<const int64_t> stage_ids, int64_t pp, int64_t vpp);

// Chunks of `counts` laid end to end (the plan every valid split must equal).
ChunkPlan plan_from_counts(std::vector<int64_t> counts, int64_t pp, int64_t vpp);

// "" when chunks tile [0, num_layers) in order; else e.g. "layers 6-7 would be lost".
std::string describe_coverage(std::span<const int64_t> counts, std::span<const int64_t> offsets,
                              int64_t num_layers, int64_t pp);

// "layer 3", "layers 0-2, 5" (at most a few runs, then "...").
std::string format_layer_set(const std::vector<std::pair<int64_t, int64_t>>& runs);

void check_pp_vpp(int64_t pp, int64_t vpp, const char* pp_name, const char* vpp_name);

}  // namespace trainfast::pipeline
