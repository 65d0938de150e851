#include "buckets/layout.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <numeric>
#include <string>

#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common/check.h"
#include "common/checked_math.h"
#include "common/memory.h"

namespace trainfast::buckets {
namespace {

constexpr int64_t kParamAlign = 64;  // params start 128-byte aligned (>= 16-bit values)
constexpr int64_t kTwoPow53 = int64_t{1} << 53;

int64_t checked_sum(int64_t a, int64_t b, const char* what) {
  const auto sum = checked_add(a, b);
  TF_CHECK_ARG(sum.has_value(), what, "overflow", "must keep buffer offsets below 2**63");
  return *sum;
}

int64_t lcm_checked(int64_t a, int64_t b) {
  const int64_t g = std::gcd(a, b);
  const auto product = checked_mul(a / g, b);
  TF_CHECK_ARG(product.has_value(), "data_parallel_world_size", a,
               "is too large: the bucket padding divisor overflows int64");
  return *product;
}

// value / divisor (value >= 0, divisor >= 1) rounded to the nearest double, ties to even: Python's
// int / int, which rounds the exact quotient once.
double divide_as_python(int64_t value, int64_t divisor) {
  if (value == 0 || (value <= kTwoPow53 && divisor <= kTwoPow53)) {
    return static_cast<double>(value) / static_cast<double>(divisor);  // exact operands: one rounding
  }
  // The quotient scaled by 2^shift has at least 64 significant bits; round those to 53 by hand, a
  // nonzero remainder breaking what would otherwise be a tie.
  __extension__ typedef unsigned __int128 u128;
  const int shift = 127 - static_cast<int>(std::bit_width(static_cast<uint64_t>(value)));
  const u128 scaled = static_cast<u128>(value) << shift;
  const u128 quotient = scaled / static_cast<u128>(divisor);
  const bool inexact = scaled % static_cast<u128>(divisor) != 0;
  const auto high = static_cast<uint64_t>(quotient >> 64);
  const int num_bits = high != 0 ? 64 + std::bit_width(high) : std::bit_width(static_cast<uint64_t>(quotient));
  const int drop = num_bits - 53;
  uint64_t mantissa = static_cast<uint64_t>(quotient >> drop);
  const u128 rest = quotient & ((u128{1} << drop) - 1);
  const u128 half = u128{1} << (drop - 1);
  if (rest > half || (rest == half && (inexact || (mantissa & 1) != 0))) ++mantissa;
  return std::ldexp(static_cast<double>(mantissa), drop - shift);
}

}  // namespace


int64_t pad_to_divisor(int64_t value, int64_t divisor) {
  // Upstream computes int(math.ceil(value / divisor) * divisor): a float quotient, then exact ints.
  const double quotient = std::ceil(divide_as_python(value, divisor));
  const auto padded = quotient < 0x1p63 ? checked_mul(static_cast<int64_t>(quotient), divisor) : std::nullopt;
  TF_CHECK_ARG(padded.has_value(), "numels", value, "sum too large: padded buffer overflows int64");
  // Past 2^53 the float quotient can round down: upstream then places the next param or bucket
  // over the end of this one. Refused rather than returned as a layout whose views overlap.
  TF_CHECK_ARG(*padded >= value, "numels", value,
               "sum too large: an offset past 2^53 rounds below itself in Megatron's float padding "
               "(the layout would overlap)");
  return *padded;
}

int64_t bucket_end_divisor(int64_t data_parallel_world_size, bool pad_for_high_nccl_busbw) {
  TF_CHECK_ARG(data_parallel_world_size > 0, "data_parallel_world_size", data_parallel_world_size,
               "must be positive");
  int64_t divisor = lcm_checked(data_parallel_world_size, 128);
  if (pad_for_high_nccl_busbw) divisor = lcm_checked(divisor, int64_t{1} << 16);
  return divisor;
}

Layout plan_layout(std::span<const int64_t> numels, std::span<const uint8_t> shared_embedding,
                   const LayoutOptions& options, Interrupt* interrupt) {
  const int64_t dp = options.data_parallel_world_size;
  TF_CHECK_ARG(dp > 0, "data_parallel_world_size", dp, "must be positive");
  if (options.bucket_size) {
    // 0 closes a bucket after every param, as Megatron does with any size <= 0.
    TF_CHECK_ARG(*options.bucket_size >= 0, "bucket_size", *options.bucket_size,
                 "must be non-negative or None");
  }
  const size_t n = numels.size();
  TF_CHECK_ARG(shared_embedding.empty() || shared_embedding.size() == n, "shared_embedding",
               shared_embedding.size(), "must have one flag per param (length of numels)");
  for (size_t i = 0; i < n; ++i) {
    TF_CHECK_ARG(numels[i] >= 0, "numels", numels[i], "must be non-negative");
  }
  const bool distopt = options.use_distributed_optimizer;
  const int64_t end_divisor = distopt ? bucket_end_divisor(dp, options.pad_buckets_for_high_nccl_busbw) : 1;

  Layout out;
  out.param_start.resize(n);
  out.param_end.resize(n);
  out.bucket_id.resize(n);

  int64_t param_start = 0, bucket_start = 0, bucket_id = 0, params_in_bucket = 0, last_end = 0;
  // Records the open bucket as ending at `end` (unpadded) and returns its padded end.
  auto close_bucket = [&](int64_t end) {
    out.per_bucket_numel_unpadded.push_back(end - bucket_start);
    const int64_t padded_end = distopt ? pad_to_divisor(end, end_divisor) : end;
    out.bucket_indices.push_back(bucket_start);
    out.bucket_indices.push_back(padded_end);
    bucket_start = padded_end;
    params_in_bucket = 0;
    ++bucket_id;
    return padded_end;
  };
  for (size_t k = 0; k < n; ++k) {
    const size_t i = n - 1 - k;  // reverse model order roughly follows backprop
    if (interrupt != nullptr && (k & 0xFFFF) == 0) interrupt->check();  // tens of millions of params: seconds
    if (distopt) param_start = pad_to_divisor(param_start, kParamAlign);
    const bool alone = distopt && !shared_embedding.empty() && shared_embedding[i] != 0;
    if (alone && params_in_bucket > 0) param_start = close_bucket(param_start);
    const int64_t param_end = checked_sum(param_start, numels[i], "numels");
    out.param_start[i] = param_start;
    out.param_end[i] = param_end;
    out.bucket_id[i] = bucket_id;
    ++params_in_bucket;
    last_end = param_end;
    if ((options.bucket_size && param_end - bucket_start >= *options.bucket_size) || alone) {
      param_start = close_bucket(param_end);
    } else {
      param_start = param_end;
    }
  }
  if (params_in_bucket > 0) close_bucket(last_end);
  out.numel = out.bucket_indices.empty() ? 0 : out.bucket_indices.back();
  for (int64_t unpadded : out.per_bucket_numel_unpadded) out.numel_unpadded += unpadded;
  return out;
}

ShardRanges shard_ranges(std::span<const int64_t> param_start_in, std::span<const int64_t> param_end_in,
                         std::span<const int64_t> bucket_id_in, std::span<const int64_t> bucket_indices,
                         int64_t data_parallel_world_size, int64_t rank_begin, int64_t rank_end,
                         bool reverse_order, int num_threads, Interrupt* interrupt) {
  const int64_t dp = data_parallel_world_size;
  TF_CHECK_ARG(dp > 0, "data_parallel_world_size", dp, "must be positive");
  TF_CHECK_ARG(rank_begin >= 0 && rank_begin <= rank_end, "rank", rank_begin, "must be non-negative");
  TF_CHECK_ARG(rank_end <= dp, "rank", rank_end - 1, "must be < data_parallel_world_size");
  const int64_t n = static_cast<int64_t>(param_start_in.size());
  TF_CHECK_ARG(static_cast<int64_t>(param_end_in.size()) == n && static_cast<int64_t>(bucket_id_in.size()) == n,
               "layout", "param_start/param_end/bucket_id lengths", "must match");
  TF_CHECK_ARG(bucket_indices.size() % 2 == 0, "bucket_indices", bucket_indices.size(),
               "must have shape [num_buckets, 2]");
  const int64_t num_buckets = static_cast<int64_t>(bucket_indices.size() / 2);
  for (int64_t b = 0; b < num_buckets; ++b) {
    const int64_t start = bucket_indices[2 * b], end = bucket_indices[2 * b + 1];
    TF_CHECK_ARG(start >= 0 && end >= start, "bucket_indices", b, "must hold 0 <= start <= end rows");
    TF_CHECK_ARG((end - start) % dp == 0, "data_parallel_world_size", dp,
                 "must divide every bucket's padded size (Megatron asserts this)");
  }
  // Layout position k reads input index at(k).
  auto at = [&](int64_t k) { return reverse_order ? n - 1 - k : k; };
  auto start_of = [&](int64_t k) { return param_start_in[at(k)]; };
  auto end_of = [&](int64_t k) { return param_end_in[at(k)]; };
  auto bucket_of = [&](int64_t k) { return bucket_id_in[at(k)]; };
  // In layout order: bucket ids non-decreasing, params inside their bucket, disjoint and ascending.
  for (int64_t k = 0; k < n; ++k) {
    const int64_t b = bucket_of(k), s = start_of(k), e = end_of(k);
    TF_CHECK_ARG(b >= 0 && b < num_buckets, "bucket_id", b, "must index bucket_indices");
    TF_CHECK_ARG(k == 0 || b >= bucket_of(k - 1), "bucket_id", b, "must be non-decreasing in layout order");
    TF_CHECK_ARG(s >= bucket_indices[2 * b] && s <= bucket_indices[2 * b + 1], "param_start", s,
                 "must lie inside the param's bucket");
    TF_CHECK_ARG(e >= s && e <= bucket_indices[2 * b + 1], "param_end", e,
                 "must lie inside the param's bucket, at or after its param_start");
    TF_CHECK_ARG(k == 0 || bucket_of(k - 1) != b || s >= end_of(k - 1), "param_start", s,
                 "must not overlap the previous param of its bucket");
  }
  const int64_t num_ranks = rank_end - rank_begin;
  // num_ranks itself (up to 2^63 - 1) is checked: num_ranks + 1 could overflow.
  check_output_fits("shard_ranges: the row offsets (one per rank of data_parallel_world_size)", num_ranks,
                    sizeof(int64_t));
  // A non-empty param [s, e) of a bucket at `offset` with shards of `shard` elements overlaps
  // exactly the ranks (s - offset) / shard .. (e - 1 - offset) / shard.
  auto rank_span = [&](int64_t k, int64_t* first, int64_t* last) {
    const int64_t s = start_of(k), e = end_of(k), b = bucket_of(k);
    const int64_t offset = bucket_indices[2 * b];
    const int64_t shard = (bucket_indices[2 * b + 1] - offset) / dp;
    if (e <= s || shard == 0) return false;
    *first = std::max((s - offset) / shard, rank_begin);
    *last = std::min((e - 1 - offset) / shard, rank_end - 1);
    return *first <= *last;
  };
  std::vector<int64_t> rank_rows(num_ranks + 1, 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t first, last;
    if (!rank_span(k, &first, &last)) continue;
    rank_rows[first - rank_begin + 1] += 1;  // difference array over ranks
    if (last + 1 < rank_end) rank_rows[last - rank_begin + 2] -= 1;
  }
  for (int64_t r = 1; r <= num_ranks; ++r) rank_rows[r] += rank_rows[r - 1];  // rows per rank
  for (int64_t r = 0; r < num_ranks; ++r) rank_rows[r + 1] += rank_rows[r];  // row offsets

  const int64_t num_rows = rank_rows.back();
  // 3 columns + 4 ranges of 2: 11 int64 per row.
  check_output_fits("shard_ranges: the table of (rank, bucket, param) rows", num_rows, 11 * sizeof(int64_t));
  ShardRanges out;
  out.rank.resize(num_rows);
  out.bucket.resize(num_rows);
  out.param.resize(num_rows);
  out.gbuf_world.resize(2 * num_rows);
  out.gbuf_world_in_bucket.resize(2 * num_rows);
  out.gbuf_local.resize(2 * num_rows);
  out.param_range.resize(2 * num_rows);
  // bucket_first[b]: first layout position whose bucket id is >= b.
  std::vector<int64_t> bucket_first(num_buckets + 1, n);
  for (int64_t k = n - 1; k >= 0; --k) bucket_first[bucket_of(k)] = k;
  for (int64_t b = num_buckets - 1; b >= 0; --b) bucket_first[b] = std::min(bucket_first[b], bucket_first[b + 1]);
  // Each rank writes its own rows contiguously: per bucket, binary-search the run of positions
  // overlapping its shard (ends and starts ascend inside a bucket), then emit the non-empty ones.
  parallel_for(num_ranks, 4, num_threads, [&](int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      int64_t row = rank_rows[r];
      const int64_t rank = r + rank_begin;
      for (int64_t b = 0; b < num_buckets; ++b) {
        const int64_t offset = bucket_indices[2 * b];
        const int64_t shard = (bucket_indices[2 * b + 1] - offset) / dp;
        const int64_t world_start = offset + rank * shard, world_end = world_start + shard;
        int64_t lo = bucket_first[b], hi = bucket_first[b + 1];
        while (lo < hi) {  // first position whose end > world_start
          const int64_t mid = lo + (hi - lo) / 2;
          if (end_of(mid) <= world_start) lo = mid + 1; else hi = mid;
        }
        for (int64_t k = lo, stop = bucket_first[b + 1]; k < stop; ++k) {
          const int64_t s = start_of(k), e = end_of(k);
          if (s >= world_end) break;
          if (e <= s) continue;
          const auto [local_start, local_end, param_offset] = param_shard_range(world_start, world_end, s, e);
          out.rank[row] = rank;
          out.bucket[row] = b;
          out.param[row] = at(k);
          out.gbuf_local[2 * row] = local_start;
          out.gbuf_local[2 * row + 1] = local_end;
          out.gbuf_world[2 * row] = local_start + world_start;
          out.gbuf_world[2 * row + 1] = local_end + world_start;
          out.gbuf_world_in_bucket[2 * row] = local_start + world_start - offset;
          out.gbuf_world_in_bucket[2 * row + 1] = local_end + world_start - offset;
          out.param_range[2 * row] = param_offset;
          out.param_range[2 * row + 1] = param_offset + (local_end - local_start);
          ++row;
        }
      }
    }
  }, interrupt);
  return out;
}

BucketGroups partition_buckets(std::span<const uint8_t> is_uint8, std::span<const int64_t> num_buckets,
                               bool force_single_bucket_group,
                               bool reduce_scatter_with_fp32_accumulation) {
  TF_CHECK_ARG(is_uint8.size() == num_buckets.size(), "num_buckets", num_buckets.size(),
               "must have one entry per buffer (length of is_uint8)");
  const int64_t num_buffers = static_cast<int64_t>(num_buckets.size());
  int64_t uint8_buffer = -1;
  for (int64_t b = 0; b < num_buffers; ++b) {
    TF_CHECK_ARG(num_buckets[b] >= 0, "num_buckets", num_buckets[b], "must be non-negative");
    if (is_uint8[b]) {
      TF_CHECK_ARG(uint8_buffer < 0, "is_uint8", "two uint8 buffers",
                   "must mark at most one buffer (Megatron asserts a single uint8 buffer)");
      uint8_buffer = b;
    }
  }
  int64_t num_members = 0;
  for (int64_t b = 0; b < num_buffers; ++b) {
    const auto sum = checked_add(num_members, num_buckets[b]);
    TF_CHECK_ARG(sum.has_value(), "num_buckets", "sum > 2^63-1", "must sum to a value that fits in int64");
    num_members = *sum;
  }
  // Two member columns and at most one group offset per member.
  check_output_fits("partition_bucket_indices: the (buffer, bucket) pairs", num_members, 3 * sizeof(int64_t));
  BucketGroups out;
  out.group_offsets.push_back(0);
  auto add = [&](int64_t buffer, int64_t bucket) {
    out.members.push_back(buffer);
    out.members.push_back(bucket);
  };
  auto close_group = [&] { out.group_offsets.push_back(static_cast<int64_t>(out.members.size() / 2)); };
  if (num_buffers == 0) return out;
  if (force_single_bucket_group) {
    for (int64_t b = 0; b < num_buffers; ++b)
      for (int64_t j = 0; j < num_buckets[b]; ++j) add(b, j);
    close_group();
  } else if (uint8_buffer < 0) {
    for (int64_t b = 0; b < num_buffers; ++b)
      for (int64_t j = 0; j < num_buckets[b]; ++j) {
        add(b, j);
        close_group();
      }
  } else if (reduce_scatter_with_fp32_accumulation) {
    // Every bucket alone, but in upstream's fp8-first order: the fp8 buckets, then (after the last
    // fp8 one; never without one) every non-fp8 bucket in buffer order.
    const int64_t count = num_buckets[uint8_buffer];
    for (int64_t j = 0; j < count; ++j) {
      add(uint8_buffer, j);
      close_group();
    }
    if (count > 0) {
      for (int64_t b = 0; b < num_buffers; ++b) {
        if (b == uint8_buffer) continue;
        for (int64_t k = 0; k < num_buckets[b]; ++k) {
          add(b, k);
          close_group();
        }
      }
    }
  } else {
    // fp8 buckets each alone; the last one also takes every non-fp8 bucket (they fill late).
    const int64_t count = num_buckets[uint8_buffer];
    for (int64_t j = 0; j < count; ++j) {
      add(uint8_buffer, j);
      if (j == count - 1) {
        for (int64_t b = 0; b < num_buffers; ++b) {
          if (b == uint8_buffer) continue;
          for (int64_t k = 0; k < num_buckets[b]; ++k) add(b, k);
        }
      }
      close_group();
    }
  }
  return out;
}

}  // namespace trainfast::buckets
