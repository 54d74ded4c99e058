// The exact top k of a GQA group's summed softmax weights on the device (the ranking of
// oracle_topk and anchor_reuse's anchor layers): per-head softmax statistics, the
// weights, a three-level radix select on their bits (non-negative floats order as their
// bits), then one ordered compaction. Only the k indices leave the device.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "floe/exec/cuda/kernel_api.hpp"
#include "stream.cuh"

namespace floe::cuda_detail {
namespace {

constexpr int threads = 256;
constexpr int per_thread = 4;                       // tokens a thread takes in the compaction
constexpr int tile = threads * per_thread;          // tokens a block takes in the compaction
constexpr int stat_blocks = 64;                     // at most this many blocks per head share its softmax statistics
constexpr int bins = 4096;                          // radix levels: bits 31-20, 19-8, 7-0
__host__ __device__ constexpr int level_shift(int level) { return level == 0 ? 20 : level == 1 ? 8 : 0; }
__host__ __device__ constexpr unsigned level_bins(int level) { return level == 2 ? 256u : 4096u; }

// The k-th largest weight's bits, found digit by digit; rank: its rank (0 = largest)
// among the weights that match the digits found so far.
struct select_state {
  unsigned prefix;
  long long rank;
};

// Per group: each array below holds one part per group, one after the other.
struct scratch_layout {
  float2* partials;      // [heads, stat_blocks]: max score, sum of exponentials
  float* weight;         // [n]
  unsigned* histogram;   // [bins]
  select_state* state;
  unsigned long long* tile_counts;  // per tile: above + (ties << 32), then their exclusive scan; [tiles + 1]
};

// Folds the softmax partial (m2, l2) (a max and a sum of exp(x - max)) into (m, l).
__device__ void merge_partial(float& m, float& l, float m2, float l2) {
  const float top = fmaxf(m, m2);
  if (top != -INFINITY) l = l * expf(m - top) + l2 * expf(m2 - top);
  m = top;
}

std::int64_t tiles_of(std::int64_t n) { return (n + tile - 1) / tile; }
std::size_t up(std::size_t b) { return (b + 255) / 256 * 256; }

scratch_layout layout(void* scratch, int heads, std::int64_t n, int groups) {
  char* p = static_cast<char*>(scratch);
  scratch_layout s;
  s.partials = reinterpret_cast<float2*>(p);
  p += up(sizeof(float2) * heads * stat_blocks * groups);
  s.weight = reinterpret_cast<float*>(p);
  p += up(sizeof(float) * n * groups);
  s.histogram = reinterpret_cast<unsigned*>(p);
  p += up(sizeof(unsigned) * bins * groups);
  s.state = reinterpret_cast<select_state*>(p);
  p += up(sizeof(select_state) * groups);
  s.tile_counts = reinterpret_cast<unsigned long long*>(p);
  return s;
}

// Block (p, g * heads + h): the max and the sum of exp(z - max) over its share of head h
// of group g. Block (0, g * heads) also resets group g's selection state and histogram.
__global__ void __launch_bounds__(threads) head_partials(const float* z, int heads, std::int64_t n, std::int64_t k,
                                                         float2* partials, unsigned* histogram, select_state* state) {
  const float* zh = z + blockIdx.y * n;
  float m = -INFINITY, l = 0.f;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    const float x = zh[i];  // one exponential per score, not merge_partial's two
    if (x > m) {
      l = l * expf(m - x) + 1.f;
      m = x;
    } else {
      l += expf(x - m);
    }
  }
  __shared__ float sm[threads], sl[threads];
  sm[threadIdx.x] = m;
  sl[threadIdx.x] = l;
  __syncthreads();
  for (int half = threads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) merge_partial(sm[threadIdx.x], sl[threadIdx.x], sm[threadIdx.x + half], sl[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.y * stat_blocks + blockIdx.x] = make_float2(sm[0], sl[0]);
  if (blockIdx.x == 0 && blockIdx.y % heads == 0) {
    const int group = blockIdx.y / heads;
    for (int b = threadIdx.x; b < bins; b += blockDim.x) histogram[group * bins + b] = 0;
    if (threadIdx.x == 0) state[group] = {0u, k - 1};
  }
}

// w_i = sum_h exp(z_hi - m_h) / l_h of group blockIdx.y; each block first merges the
// heads' partials.
__global__ void __launch_bounds__(threads) group_weights(const float* z, int heads, std::int64_t n,
                                                         const float2* partials, int stat_used, float* weight) {
  extern __shared__ float2 stats[];  // per head: max, 1 / sum
  z += std::int64_t(blockIdx.y) * heads * n;
  partials += blockIdx.y * heads * stat_blocks;
  weight += blockIdx.y * n;
  for (int h = threadIdx.x; h < heads; h += blockDim.x) {
    float m = -INFINITY, l = 0.f;
    for (int p = 0; p < stat_used; ++p) merge_partial(m, l, partials[h * stat_blocks + p].x, partials[h * stat_blocks + p].y);
    stats[h] = make_float2(m, 1.f / l);
  }
  __syncthreads();
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    float w = 0.f;
    for (int h = 0; h < heads; ++h) w = fmaf(expf(z[h * n + i] - stats[h].x), stats[h].y, w);
    weight[i] = w;
  }
}

// Counts the level's digit of every weight whose higher digits match the state's prefix.
__global__ void __launch_bounds__(threads) digit_histogram(const float* weight, std::int64_t n, int level,
                                                           const select_state* state, unsigned* histogram) {
  __shared__ unsigned local[bins];
  weight += blockIdx.y * n;  // group blockIdx.y
  state += blockIdx.y;
  histogram += blockIdx.y * bins;
  for (int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const int shift = level_shift(level);
  const unsigned high = level == 0 ? 32 : level_shift(level - 1);  // bits at or above `high` must match
  const unsigned prefix = state->prefix;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    const unsigned bits = __float_as_uint(weight[i]);
    if (high < 32 && (bits >> high) != (prefix >> high)) continue;
    atomicAdd(&local[(bits >> shift) & (level_bins(level) - 1)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x)
    if (local[b]) atomicAdd(&histogram[b], local[b]);
}

// One block: the digit whose bin holds the state's rank (bins taken from the top), then
// the rank inside it; clears the histogram for the next level.
__global__ void __launch_bounds__(1024) choose_digit(int level, unsigned* histogram, select_state* state) {
  using scan = cub::BlockScan<unsigned long long, 1024>;
  __shared__ typename scan::TempStorage temp;
  histogram += blockIdx.x * bins;  // group blockIdx.x
  state += blockIdx.x;
  const long long rank = state->rank;  // read by every thread before the scan's barrier; written after it
  const int count = static_cast<int>(level_bins(level)), per = (count + 1023) / 1024;
  // Thread t takes bins [lo, hi), counted down from the top.
  const int hi = count - static_cast<int>(threadIdx.x) * per, lo = hi - per > 0 ? hi - per : 0;
  unsigned long long sum = 0;
  for (int b = lo; b < hi; ++b) sum += histogram[b];
  unsigned long long before;
  scan(temp).ExclusiveSum(sum, before);
  if (rank >= static_cast<long long>(before) && rank < static_cast<long long>(before + sum)) {
    unsigned long long above = before;
    for (int b = hi; b-- > lo;) {
      if (rank < static_cast<long long>(above + histogram[b])) {
        state->prefix |= static_cast<unsigned>(b) << level_shift(level);
        state->rank = rank - static_cast<long long>(above);
        break;
      }
      above += histogram[b];
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) histogram[b] = 0;
}

// This thread's tokens of the tile: how many weigh more than the k-th (low half) and
// how many equal it (high half).
__device__ unsigned long long thread_counts(const float* weight, std::int64_t n, unsigned kth, std::int64_t first) {
  unsigned long long c = 0;
  for (int t = 0; t < per_thread; ++t) {
    const std::int64_t i = first + t;
    if (i >= n) break;
    const unsigned bits = __float_as_uint(weight[i]);
    c += bits > kth ? 1ull : bits == kth ? (1ull << 32) : 0ull;
  }
  return c;
}

__global__ void __launch_bounds__(threads) count_tiles(const float* weight, std::int64_t n,
                                                       const select_state* state, unsigned long long* tile_counts) {
  using reduce = cub::BlockReduce<unsigned long long, threads>;
  __shared__ typename reduce::TempStorage temp;
  weight += blockIdx.y * n;  // group blockIdx.y
  state += blockIdx.y;
  tile_counts += blockIdx.y * (gridDim.x + 1);
  const std::int64_t first = blockIdx.x * std::int64_t(tile) + threadIdx.x * per_thread;
  const unsigned long long total = reduce(temp).Sum(thread_counts(weight, n, state->prefix, first));
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

// Exclusive scan of the tile counts in place; the grand total lands at [tiles].
__global__ void __launch_bounds__(1024) scan_tiles(unsigned long long* tile_counts, std::int64_t tiles) {
  using scan = cub::BlockScan<unsigned long long, 1024>;
  __shared__ typename scan::TempStorage temp;
  __shared__ unsigned long long carry;
  tile_counts += blockIdx.x * (tiles + 1);  // group blockIdx.x
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (std::int64_t base = 0; base < tiles; base += 1024) {
    const std::int64_t i = base + threadIdx.x;
    const unsigned long long x = i < tiles ? tile_counts[i] : 0ull;
    unsigned long long before, sum;
    scan(temp).ExclusiveSum(x, before, sum);
    if (i < tiles) tile_counts[i] = carry + before;
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_counts[tiles] = carry;
}

// Token i is chosen if it weighs more than the k-th, or equals it and fewer than `need`
// equal ones precede it; its place is (heavier before it) + min(equal before it, need).
__global__ void __launch_bounds__(threads) write_chosen(const float* weight, std::int64_t n, std::int64_t k,
                                                        const select_state* state,
                                                        const unsigned long long* tile_before,
                                                        std::int64_t tiles, std::int32_t* chosen,
                                                        const unsigned long long* proceed) {
  using scan = cub::BlockScan<unsigned long long, threads>;
  __shared__ typename scan::TempStorage temp;
  if (proceed != nullptr && (proceed[0] & proceed[1]) != ~0ull) return;  // a query or key failed its check: write nothing
  weight += blockIdx.y * n;  // group blockIdx.y
  state += blockIdx.y;
  tile_before += blockIdx.y * (tiles + 1);
  chosen += blockIdx.y * k;
  const unsigned kth = state->prefix;
  const std::int64_t first = blockIdx.x * std::int64_t(tile) + threadIdx.x * per_thread;
  unsigned long long before;
  scan(temp).ExclusiveSum(thread_counts(weight, n, kth, first), before);
  before += tile_before[blockIdx.x];
  const long long need = k - static_cast<long long>(tile_before[tiles] & 0xffffffffull);
  long long above = static_cast<long long>(before & 0xffffffffull), ties = static_cast<long long>(before >> 32);
  for (int t = 0; t < per_thread; ++t) {
    const std::int64_t i = first + t;
    if (i >= n) break;
    const unsigned bits = __float_as_uint(weight[i]);
    if (bits > kth) {
      chosen[above + (ties < need ? ties : need)] = static_cast<std::int32_t>(i);
      ++above;
    } else if (bits == kth) {
      if (ties < need) chosen[above + ties] = static_cast<std::int32_t>(i);
      ++ties;
    }
  }
}

}  // namespace

std::size_t top_k_scratch_bytes(int heads, std::int64_t n, int groups) {
  return up(sizeof(float2) * heads * stat_blocks * groups) + up(sizeof(float) * n * groups) +
         up(sizeof(unsigned) * bins * groups) + up(sizeof(select_state) * groups) +
         sizeof(unsigned long long) * (tiles_of(n) + 1) * groups;
}

void launch_group_top_k(const float* z, int heads, std::int64_t n, std::int64_t k, void* scratch,
                        std::int32_t* chosen, int groups, const unsigned long long* proceed) {
  const scratch_layout s = layout(scratch, heads, n, groups);
  const std::int64_t tiles = tiles_of(n);
  const auto g = static_cast<unsigned>(groups);
  // Grid-stride blocks per group: one per 2048 tokens, but about 1024 in all at most. Each
  // block merges the heads' statistics and clears a histogram first, so more blocks cost
  // more: at 128K, d 128 one per 512 tokens made the weights 15 -> 20 us at batch 1 (512
  // blocks -> 2048) and one per 8192 made them 82 -> 60 us at batch 8 (4096 -> 1024; ncu).
  const std::int64_t per_group = std::max<std::int64_t>(1, 1024 / groups);
  const auto spread = static_cast<unsigned>(std::min<std::int64_t>({(n + 2047) / 2048, per_group, 1024}));
  // Statistics blocks per head: 64, but about 2048 in all at most (as above, more blocks
  // cost more: at 128K, d 128, batch 8, 16384 of them took 70 us, 2048 took 50; ncu).
  const auto stat_used = static_cast<int>(std::clamp<std::int64_t>(2048 / (std::int64_t(heads) * groups), 1, stat_blocks));
  head_partials<<<dim3(static_cast<unsigned>(stat_used), heads * g), threads, 0, current_stream>>>(z, heads, n, k, s.partials,
                                                                                                  s.histogram, s.state);
  group_weights<<<dim3(spread, g), threads, sizeof(float2) * heads, current_stream>>>(z, heads, n, s.partials, stat_used,
                                                                                      s.weight);
  for (int level = 0; level < 3; ++level) {
    digit_histogram<<<dim3(spread, g), threads, 0, current_stream>>>(s.weight, n, level, s.state, s.histogram);
    choose_digit<<<g, 1024, 0, current_stream>>>(level, s.histogram, s.state);
  }
  count_tiles<<<dim3(static_cast<unsigned>(tiles), g), threads, 0, current_stream>>>(s.weight, n, s.state, s.tile_counts);
  scan_tiles<<<g, 1024, 0, current_stream>>>(s.tile_counts, tiles);
  write_chosen<<<dim3(static_cast<unsigned>(tiles), g), threads, 0, current_stream>>>(s.weight, n, k, s.state,
                                                                                     s.tile_counts, tiles, chosen, proceed);
  check(cudaGetLastError(), "top-k kernel launch");
}

}  // namespace floe::cuda_detail
