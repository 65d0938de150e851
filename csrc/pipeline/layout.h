// Megatron's pipeline_model_parallel_layout strings ("Et*3|(tt|)*29,m|L"): parse, validate, print.
//
// Characters: E embedding, t decoder ("transformer"), m MTP, L loss. Stages are separated by '|' and
// listed in global order: stage c runs on pipeline rank c % pp as its virtual stage c / pp.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pipeline/plan.h"

namespace trainfast::pipeline {

inline constexpr int64_t kMaxLayoutChars = int64_t{1} << 24;

struct Layout {
  int64_t pp = 1;
  int64_t vpp = 1;
  std::vector<std::string> stages;  // [pp * vpp] expanded, e.g. "Ettt"
};

// Megatron's parse_str_to_list then the pp check of PipelineParallelLayerLayout: commas dropped,
// "(X)*n" then "c*n" unrolled left to right as upstream's regexes do, split on '|'.
Layout parse_layout(std::string_view layout, int64_t pp);

// Builds a Layout from expanded stages (checks characters and the pp multiple).
Layout make_layout(std::vector<std::string> stages, int64_t pp);

// validate_layer_layout: E first and once, L last and once, decoder count == num_layers (skipped
// when kNone), MTP count == mtp_num_layers (kNone: None; with check_mtp_count false any count, all in
// one stage), decoders before MTP, MTP only in a rank's last virtual stage. Returns mtp_standalone.
bool validate_layout(const Layout& layout, int64_t num_layers, int64_t mtp_num_layers, bool check_mtp_count);

// Counts / offsets of one layer character per stage (upstream get_num_layers_to_build / offset).
ChunkPlan layout_plan(const Layout& layout, char layer_char);

// Short string that parses back to the same stages: runs "t*3", repeated stages "(tt|)*29".
std::string layout_to_string(const Layout& layout);

// A decoder plan as a layout string: E before chunk 0's layers, L after the last chunk's.
std::string plan_to_layout_string(std::span<const int64_t> counts, int64_t pp, int64_t vpp);

}  // namespace trainfast::pipeline
