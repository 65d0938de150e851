#include "pipeline/layout.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/check.h"

namespace trainfast::pipeline {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// Bytes of the character starting at s[i]: layouts come from Python str, so they are UTF-8, and
// upstream's regexes see characters, not bytes.
size_t char_length(std::string_view s, size_t i) {
  size_t end = i + 1;
  while (end < s.size() && is_continuation(s[end])) ++end;
  return end - i;
}

// Cut at a character boundary: a message with half a character is not UTF-8, and Python could not
// even decode it.
std::string quoted(std::string_view s) {
  constexpr size_t kMax = 80;
  std::string out = "'";
  if (s.size() > kMax) {
    size_t cut = kMax;
    while (cut > 0 && is_continuation(s[cut])) --cut;
    out += std::string(s.substr(0, cut)) + "...";
  } else {
    out += s;
  }
  return out + "'";
}

// Reads the digits at s[pos...] (upstream's greedy \d+) and returns the repeat count; pos moves past.
int64_t read_count(std::string_view s, size_t& pos, std::string_view layout) {
  int64_t value = 0;
  bool huge = false;
  while (pos < s.size() && is_digit(s[pos])) {
    value = value * 10 + (s[pos] - '0');
    if (value > kMaxLayoutChars) {
      huge = true;
      value = kMaxLayoutChars + 1;
    }
    ++pos;
  }
  if (huge) {
    throw std::invalid_argument("layout " + quoted(layout) + " has a repeat count larger than " +
                                std::to_string(kMaxLayoutChars));
  }
  return value;
}

void append_repeated(std::string& out, std::string_view piece, int64_t times, std::string_view layout) {
  if (static_cast<int64_t>(out.size()) + static_cast<int64_t>(piece.size()) * times > kMaxLayoutChars) {
    throw std::invalid_argument("layout " + quoted(layout) + " expands to more than " +
                                std::to_string(kMaxLayoutChars) + " characters");
  }
  for (int64_t k = 0; k < times; ++k) out.append(piece);
}

// re.sub(r'\(([^)]+)\)\*(\d+)', ...): '(' + non-empty text up to the first ')' + ")*" + digits.
std::string unroll_groups(std::string_view s, std::string_view layout) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '(') {
      const size_t close = s.find(')', i + 1);
      if (close != std::string_view::npos && close > i + 1 && close + 2 < s.size() + 0 &&
          s[close + 1] == '*' && is_digit(s[close + 2])) {
        size_t pos = close + 2;
        const int64_t times = read_count(s, pos, layout);
        append_repeated(out, s.substr(i + 1, close - i - 1), times, layout);
        i = pos;
        continue;
      }
    }
    out.push_back(s[i++]);
  }
  return out;
}

// re.sub(r'(.)\*(\d+)', ...): any character but a newline, then '*' and digits.
std::string unroll_chars(std::string_view s, std::string_view layout) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t len = char_length(s, i);
    if (s[i] != '\n' && i + len + 1 < s.size() && s[i + len] == '*' && is_digit(s[i + len + 1])) {
      size_t pos = i + len + 1;
      const int64_t times = read_count(s, pos, layout);
      append_repeated(out, s.substr(i, len), times, layout);
      i = pos;
      continue;
    }
    out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

bool known_char(char c) { return c == 'E' || c == 'L' || c == 't' || c == 'm'; }

// One character (its UTF-8 bytes) for a message: printable ASCII as itself, other single bytes as
// '\xNN', anything else as itself with its code point.
std::string describe_char(std::string_view ch) {
  const auto lead = static_cast<unsigned char>(ch[0]);
  std::string out = "'";
  // Not UTF-8 (a lone byte, or more continuation bytes than a character has): every byte escaped.
  if ((ch.size() == 1 && (lead < 0x20 || lead >= 0x7f)) || ch.size() > 4) {
    static const char* hex = "0123456789abcdef";
    for (const char c : ch) {
      const auto byte = static_cast<unsigned char>(c);
      out += "\\x";
      out += hex[byte >> 4];
      out += hex[byte & 15];
    }
    return out + "'";
  }
  out.append(ch);
  out += "'";
  if (ch.size() == 1) return out;
  uint32_t code = lead & (0x7F >> ch.size());
  for (size_t k = 1; k < ch.size(); ++k) code = (code << 6) | (static_cast<unsigned char>(ch[k]) & 0x3F);
  char digits[16];
  std::snprintf(digits, sizeof digits, " (U+%04X)", static_cast<unsigned>(code));
  return out + digits;
}

std::string describe_char(char c) { return describe_char(std::string_view(&c, 1)); }

void check_stage_chars(const std::vector<std::string>& stages, std::string_view layout) {
  for (size_t k = 0; k < stages.size(); ++k) {
    const std::string_view stage = stages[k];
    for (size_t j = 0; j < stage.size(); j += char_length(stage, j)) {
      const char c = stage[j];
      if (!known_char(c)) {
        std::string msg = "invalid layer character " + describe_char(stage.substr(j, char_length(stage, j))) +
                          " in stage " + std::to_string(k) + " (" + quoted(stages[k]) + ")";
        if (!layout.empty()) msg += " of layout " + quoted(layout);
        if (c == '(' || c == ')') msg += " (unbalanced or nested parentheses: use '(X)*n')";
        throw std::invalid_argument(msg + "; known layer characters: E (embedding), t (decoder), "
                                          "m (MTP), L (loss)");
      }
    }
  }
}

std::string stage_name(int64_t c, int64_t pp) {
  return "stage " + std::to_string(c) + " (pp_rank=" + std::to_string(c % pp) + ", vp_stage=" +
         std::to_string(c / pp) + ")";
}

// "t*3", "tt", "E" runs of one stage.
std::string compress_stage(const std::string& stage) {
  std::string out;
  size_t i = 0;
  while (i < stage.size()) {
    size_t j = i;
    while (j < stage.size() && stage[j] == stage[i]) ++j;
    const size_t run = j - i;
    if (run >= 3) out += std::string(1, stage[i]) + "*" + std::to_string(run);
    else out += std::string(run, stage[i]);
    i = j;
  }
  return out;
}

}  // namespace

Layout make_layout(std::vector<std::string> stages, int64_t pp) {
  TF_CHECK_ARG(pp >= 1, "pipeline_model_parallel_size", pp, "must be >= 1");
  check_stage_chars(stages, "");
  const auto num_stages = static_cast<int64_t>(stages.size());
  if (num_stages == 0 || num_stages % pp != 0) {
    throw std::invalid_argument("the layout has " + std::to_string(num_stages) +
                                " stages, which is not a multiple of pipeline_model_parallel_size (" +
                                std::to_string(pp) + ")");
  }
  check_pp_vpp(pp, num_stages / pp, "pipeline_model_parallel_size", "the layout's vpp size");
  Layout out;
  out.pp = pp;
  out.vpp = num_stages / pp;
  out.stages = std::move(stages);
  return out;
}

Layout parse_layout(std::string_view layout, int64_t pp) {
  TF_CHECK_ARG(pp >= 1, "pipeline_model_parallel_size", pp, "must be >= 1");
  if (static_cast<int64_t>(layout.size()) > kMaxLayoutChars) {
    throw std::invalid_argument("layout is longer than " + std::to_string(kMaxLayoutChars) + " characters");
  }
  std::string text;
  for (char c : layout) {
    if (c != ',') text.push_back(c);  // commas are cosmetic
  }
  text = unroll_chars(unroll_groups(text, layout), layout);
  // Counted before any stage string is built: "(|)*16777215" is 12 characters and 2^24 stages.
  const auto num_bars = static_cast<int64_t>(std::count(text.begin(), text.end(), '|'));
  if (num_bars + 1 > kMaxChunks) {
    throw std::invalid_argument("layout " + quoted(layout) + " expands to " + std::to_string(num_bars + 1) +
                                " stages, more than 2^22");
  }
  std::vector<std::string> stages(1);
  for (char c : text) {
    if (c == '|') stages.emplace_back();
    else stages.back().push_back(c);
  }
  check_stage_chars(stages, layout);
  const auto num_stages = static_cast<int64_t>(stages.size());
  if (num_stages % pp != 0) {
    throw std::invalid_argument("layout " + quoted(layout) + " has " + std::to_string(num_stages) +
                                " stages, which is not a multiple of pipeline_model_parallel_size (" +
                                std::to_string(pp) + ")");
  }
  return make_layout(std::move(stages), pp);
}

bool validate_layout(const Layout& layout, int64_t num_layers, int64_t mtp_num_layers, bool check_mtp_count) {
  const int64_t pp = layout.pp, vpp = layout.vpp, n = pp * vpp;
  int64_t first_stage = -1, last_stage = -1;
  int64_t num_e = 0, num_l = 0, num_t = 0, num_m = 0;
  for (int64_t c = 0; c < n; ++c) {
    const std::string& stage = layout.stages[c];
    if (!stage.empty()) {
      if (first_stage < 0) first_stage = c;
      last_stage = c;
    }
    for (char ch : stage) {
      num_e += ch == 'E';
      num_l += ch == 'L';
      num_t += ch == 't';
      num_m += ch == 'm';
    }
  }
  if (first_stage < 0) {
    throw std::invalid_argument("the layout has no layers: it must start with the embedding 'E' and end "
                                "with the loss 'L'");
  }
  const char first = layout.stages[first_stage].front(), last = layout.stages[last_stage].back();
  if (first != 'E') {
    throw std::invalid_argument("the first layer must be the embedding 'E', but got " + describe_char(first) +
                                " in " + stage_name(first_stage, pp));
  }
  if (last != 'L') {
    throw std::invalid_argument("the last layer must be the loss 'L', but got " + describe_char(last) +
                                " in " + stage_name(last_stage, pp));
  }
  if (num_e != 1) {
    throw std::invalid_argument("the embedding 'E' must appear exactly once (got " + std::to_string(num_e) + ")");
  }
  if (num_l != 1) {
    throw std::invalid_argument("the loss 'L' must appear exactly once (got " + std::to_string(num_l) + ")");
  }
  if (num_layers != kNone && num_t != num_layers) {
    std::string effect;
    if (num_t < num_layers) {
      effect = num_layers - num_t == 1 ? ": layer " + std::to_string(num_t) + " would be lost"
                                       : ": layers " + std::to_string(num_t) + "-" +
                                             std::to_string(num_layers - 1) + " would be lost";
    } else {
      effect = ": it would build " + std::to_string(num_t - num_layers) + " nonexistent layers";
    }
    throw std::invalid_argument("the layout has " + std::to_string(num_t) +
                                " decoder layers 't' but num_layers is " + std::to_string(num_layers) + effect);
  }
  if (check_mtp_count && !(num_m == mtp_num_layers || (mtp_num_layers == kNone && num_m == 0))) {
    throw std::invalid_argument("the layout has " + std::to_string(num_m) +
                                " MTP layers 'm' but mtp_num_layers is " +
                                (mtp_num_layers == kNone ? std::string("None") : std::to_string(mtp_num_layers)));
  }
  bool seen_mtp = false;
  for (int64_t c = 0; c < n; ++c) {
    for (char ch : layout.stages[c]) {
      if (ch == 'm') seen_mtp = true;
      if (ch == 't' && seen_mtp) {
        throw std::invalid_argument("decoder layers must be placed before MTP layers (a 't' follows an 'm' in " +
                                    stage_name(c, pp) + ")");
      }
    }
  }
  const int64_t mtp_expected = check_mtp_count ? mtp_num_layers : num_m;
  for (int64_t p = 0; p < pp; ++p) {
    for (int64_t v = 0; v + 1 < vpp; ++v) {
      if (layout.stages[v * pp + p].find('m') != std::string::npos) {
        throw std::invalid_argument("MTP layers must be in the last virtual stage of their pipeline rank, but " +
                                    stage_name(v * pp + p, pp) + " has one");
      }
    }
  }
  bool mtp_standalone = false;
  for (int64_t p = 0; p < pp; ++p) {
    const std::string& stage = layout.stages[(vpp - 1) * pp + p];
    int64_t count = 0;
    for (char ch : stage) count += ch == 'm';
    if (count == 0) continue;
    if (count != mtp_expected) {
      throw std::invalid_argument("all MTP layers must be in the same virtual stage, but " +
                                  stage_name((vpp - 1) * pp + p, pp) + " has " + std::to_string(count) +
                                  " of " + std::to_string(mtp_expected));
    }
    if (p != pp - 1) mtp_standalone = true;
  }
  return mtp_standalone;
}

ChunkPlan layout_plan(const Layout& layout, char layer_char) {
  std::vector<int64_t> counts(layout.stages.size());
  for (size_t c = 0; c < counts.size(); ++c) {
    int64_t count = 0;
    for (char ch : layout.stages[c]) count += ch == layer_char;
    counts[c] = count;
  }
  return plan_from_counts(std::move(counts), layout.pp, layout.vpp);
}

std::string layout_to_string(const Layout& layout) {
  std::vector<std::string> parts;  // one per group of equal consecutive stages
  const auto& stages = layout.stages;
  size_t i = 0;
  while (i < stages.size()) {
    size_t j = i;
    while (j < stages.size() && stages[j] == stages[i]) ++j;
    const size_t run = j - i;
    const std::string one = compress_stage(stages[i]);
    const bool at_end = j == stages.size();
    // "(S|)*r" leaves a trailing '|', so a group at the very end repeats one stage fewer.
    const size_t grouped = at_end ? run - 1 : run;
    std::string text;
    if (grouped >= 3) {
      text = "(" + one + "|)*" + std::to_string(grouped);
      if (at_end) text += "," + one;
    } else {
      for (size_t k = 0; k < run; ++k) text += (k ? "|" : "") + one;
      if (!at_end) text += "|";
    }
    parts.push_back(std::move(text));
    i = j;
  }
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) {
    // a comma keeps "(..)*29" visually apart from the next stage (upstream ignores commas)
    if (k && out.back() != '|') out += ",";
    out += parts[k];
  }
  return out;
}

std::string plan_to_layout_string(std::span<const int64_t> counts, int64_t pp, int64_t vpp) {
  check_pp_vpp(pp, vpp, "pp", "vpp");
  if (static_cast<int64_t>(counts.size()) != pp * vpp) {
    throw std::invalid_argument("the plan has " + std::to_string(counts.size()) + " chunks but pp * vpp is " +
                                std::to_string(pp * vpp));
  }
  int64_t total = 0;
  for (size_t c = 0; c < counts.size(); ++c) {
    if (counts[c] < 0) throw std::invalid_argument("chunk " + std::to_string(c) + " has a negative layer count");
    if (counts[c] > kMaxLayoutChars - total) {  // before adding, so a huge count cannot wrap
      throw std::invalid_argument("the plan has more than " + std::to_string(kMaxLayoutChars) + " layers");
    }
    total += counts[c];
  }
  Layout layout;
  layout.pp = pp;
  layout.vpp = vpp;
  layout.stages.resize(counts.size());
  for (size_t c = 0; c < counts.size(); ++c) {
    std::string& stage = layout.stages[c];
    if (c == 0) stage.push_back('E');
    stage.append(static_cast<size_t>(counts[c]), 't');
    if (c + 1 == counts.size()) stage.push_back('L');
  }
  return layout_to_string(layout);
}

}  // namespace trainfast::pipeline
