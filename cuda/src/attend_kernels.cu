// Decode-attention kernels of floe::exec::cuda: one thread block per chunk of a group's
// rows, 16 (or 8) lanes per token with 16 bytes of the row each per slot, the g query
// heads of the group served by one read of each row; chunk partials are merged per
// group. docs/cuda-executor.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "floe/exec/cuda/kernel_api.hpp"
#include "stream.cuh"

namespace floe::cuda_detail {
namespace {

// L lanes take one token (16 by default; 8 for 64-element rows of 16-bit types, which
// fill only 8 lanes with 16 bytes each); a block of 128 threads holds 128 / L subgroups.
constexpr int block_threads = 128;
template <int L>
constexpr int subgroups_of = block_threads / L;

// 16-byte loads: 4 floats or 8 16-bit elements, widened to float.
template <class T>
constexpr int vec_of = 16 / sizeof(T);
template <class T>
struct vec16;
template <>
struct vec16<float> {
  __device__ static void load(const float* p, float* out) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
  __device__ static float one(const float* p) { return *p; }
};
template <>
struct vec16<__half> {
  __device__ static void load(const __half* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
  __device__ static float one(const __half* p) { return __half2float(*p); }
};
template <>
struct vec16<__nv_bfloat16> {
  __device__ static void load(const __nv_bfloat16* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) out[2 * i] = __uint_as_float(w[i] << 16), out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
  __device__ static float one(const __nv_bfloat16* p) { return __bfloat162float(*p); }
};

// Element e of this lane's slice of a row: slot s holds elements (s*16 + lane)*V + 0..V-1.
template <class T, int L>
__device__ int element_of(int s, int lane, int t) {
  return (s * L + lane) * vec_of<T> + t;
}

// This lane's elements of a row of length n (zeros past n).
template <class T, int SLOTS, int L = 16>
__device__ void load_row(const T* row, int n, int lane, bool aligned, float (&out)[SLOTS * vec_of<T>]) {
  constexpr int V = vec_of<T>;
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int e = element_of<T, L>(s, lane, 0);
    if (aligned && e < n) {
      vec16<T>::load(row + e, out + s * V);
    } else {
#pragma unroll
      for (int t = 0; t < V; ++t) out[s * V + t] = e + t < n ? vec16<T>::one(row + e + t) : 0.f;
    }
  }
}

template <int L = 16>
__device__ float sum_lanes(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Each of a 16-lane subgroup's HP partial dot products (HP <= 16, a power of two) summed
// over its lanes by halving: after the step of offset O a lane keeps half the heads, so
// HP/2 + HP/4 + ... shuffles instead of 4 HP. Returns the sum of head `head` (updated),
// which the lanes of one residue class mod 16 / HP share.
template <int HP, int O = 8>
__device__ float sum_heads(float* dot, int lane, int& head) {
  if constexpr (O == 0) {
    return dot[0];
  } else if constexpr (HP == 1) {
    dot[0] += __shfl_xor_sync(0xffffffffu, dot[0], O);
    return sum_heads<1, O / 2>(dot, lane, head);
  } else {
    constexpr int half = HP / 2;
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? dot[i] : dot[i + half];
      const float keep = upper ? dot[i + half] : dot[i];
      dot[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    if (upper) head += half;
    return sum_heads<half, O / 2>(dot, lane, head);
  }
}

// Where token j of a chunk lives: walks the chunk's runs forward (j only grows).
struct run_cursor {
  const run* r;
  int start = 0;
  __device__ void seek(int j) {
    while (j >= start + r->count) start += (r++)->count;
  }
  // The row of token j (after seek(j)) counted from the run's keys / values.
  __device__ std::int64_t row(int j) const {
    const int i = j - start;
    if (r->table == nullptr) return i;
    const int t = r->first + i;
    return std::int64_t(r->table[t / r->block_size]) * r->block_size + t % r->block_size;
  }
};

constexpr float log2e = 1.4426950408889634f, ln2 = 0.6931471805599453f;

// The query check of group `group`, run by one whole block: the lowest (group, head,
// element) whose query is NaN or Inf goes into `first`, packed in one 64-bit key.
__device__ void find_nonfinite(const group_desc* groups, int group, unsigned long long* first) {
  const group_desc g = groups[group];
  for (int idx = threadIdx.x; idx < g.heads * g.d; idx += block_threads) {
    const int h = idx / g.d, e = idx % g.d;
    if (!isfinite(g.q[h * g.q_stride + e]))
      atomicMin(first, (static_cast<unsigned long long>(group) << 40) | (static_cast<unsigned long long>(h) << 20) |
                           static_cast<unsigned long long>(e));
  }
}

// A block's `parts` partial states merged into the chunk's partial at `out` (m in natural
// units): part p's maximum (base 2) and sum of head h at m[p * HP + h] and l[...], its
// output element j at a[(p * HP + h) * a_row + j], scaled by a_scale.
template <int HP>
__device__ void merge_states(int heads, int dv, int parts, const float* m, const float* l, const float* a, int a_row,
                             float a_scale, int dv_max, float* out) {
  for (int idx = threadIdx.x; idx < heads * dv; idx += block_threads) {
    const int h = idx / dv, j = idx % dv;
    float mm = -INFINITY;
    for (int p = 0; p < parts; ++p) mm = fmaxf(mm, m[p * HP + h]);
    float ll = 0.f, aa = 0.f;
    for (int p = 0; p < parts; ++p) {
      if (m[p * HP + h] == -INFINITY) continue;  // a part that saw no token
      const float r = exp2f(m[p * HP + h] - mm);
      ll += r * l[p * HP + h];
      aa += r * a[(p * HP + h) * a_row + j];
    }
    if (j == 0) out[h] = mm * ln2, out[HP + h] = ll;
    out[2 * HP + h * dv_max + j] = aa * a_scale;
  }
}

// The online-softmax state of one subgroup over the group's heads (base 2), with this
// lane's slice of the scaled queries and of the value accumulators.
template <class T, int SLOTS, int HP, int L>
struct subgroup_state {
  static constexpr int subgroups = subgroups_of<L>;
  static constexpr int V = vec_of<T>, W = SLOTS * V;
  float q[HP][W], acc[HP][W], m[HP], l[HP];

  __device__ void init(const group_desc& g, int lane) {
#pragma unroll
    for (int h = 0; h < HP; ++h) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s)
#pragma unroll
        for (int t = 0; t < V; ++t) {
          const int e = element_of<T, L>(s, lane, t);
          q[h][s * V + t] = h < g.heads && e < g.d ? g.q[h * g.q_stride + e] * (g.scale * log2e) : 0.f;
          acc[h][s * V + t] = 0.f;
        }
      m[h] = -INFINITY;
      l[h] = 0.f;
    }
  }

  // Folds U tokens in, rows fetched one at a time by key(u, out) / value(u, out) (keys
  // first: all scores, one rescale per head, then the values), so no row is held longer
  // than its use. valid(u) is false past the chunk.
  template <int U, class Key, class Value, class Valid>
  __device__ void fold_rows(Key&& key, Value&& value, Valid&& valid) {
    float z[U][HP];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[W];
      key(u, k);
#pragma unroll
      for (int h = 0; h < HP; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < W; ++e) dot = fmaf(q[h][e], k[e], dot);
        z[u][h] = sum_lanes<L>(dot);  // every lane of the warp shuffles, valid or not
      }
    }
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      float top = -INFINITY;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (valid(u)) top = fmaxf(top, z[u][h]);
      if (top > m[h]) {  // rescale what we have to the new maximum
        const float r = exp2f(m[h] - top);
        l[h] *= r;
#pragma unroll
        for (int e = 0; e < W; ++e) acc[h][e] *= r;
        m[h] = top;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float v[W];
      value(u, v);
#pragma unroll
      for (int h = 0; h < HP; ++h) {
        const float w = valid(u) ? exp2f(z[u][h] - m[h]) : 0.f;
        l[h] += w;
#pragma unroll
        for (int e = 0; e < W; ++e) acc[h][e] = fmaf(w, v[e], acc[h][e]);
      }
    }
  }

  // Merges the block's subgroup states into the chunk's partial at `out` (m in natural
  // units), through shared memory: sm_a holds block_threads * HP * W floats.
  __device__ void store(const group_desc& g, int dv_max, int lane, int sub, float* sm_a, float* out) const {
    __shared__ float sm_m[subgroups][HP], sm_l[subgroups][HP];
    constexpr int row = L * W;
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      if (lane == 0) sm_m[sub][h] = m[h], sm_l[sub][h] = l[h];
#pragma unroll
      for (int s = 0; s < SLOTS; ++s)
#pragma unroll
        for (int t = 0; t < V; ++t) sm_a[(sub * HP + h) * row + element_of<T, L>(s, lane, t)] = acc[h][s * V + t];
    }
    __syncthreads();
    merge_states<HP>(g.heads, g.dv, subgroups, &sm_m[0][0], &sm_l[0][0], sm_a, row, 1.f, dv_max, out);
  }
};

// One chunk's exact partial, rows read straight into registers (any alignment):
// subgroups of L lanes, each taking two tokens a step, both rows loaded before use.
template <class T, int SLOTS, int HP, int L>
__global__ void __launch_bounds__(block_threads) attend_chunks(const run* runs, const chunk* chunks, int chunk_count, unsigned long long* check,
                                                               const group_desc* groups, int dv_max, float* work) {
  using state_t = subgroup_state<T, SLOTS, HP, L>;
  constexpr int W = state_t::W, subgroups = subgroups_of<L>, tile_tokens = 2 * subgroups;
  if (int(blockIdx.x) >= chunk_count) return find_nonfinite(groups, blockIdx.x - chunk_count, check);
  const chunk c = chunks[blockIdx.x];
  const group_desc g = groups[c.group];
  const int lane = threadIdx.x % L, sub = threadIdx.x / L;
  const bool aligned = g.aligned != 0;
  state_t st;
  st.init(g, lane);
  run_cursor cur{runs + c.first_run};
  for (int base = 0; base < c.tokens; base += tile_tokens) {
    float k[2][W], v[2][W];
    bool valid[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = base + u * subgroups + sub;
      valid[u] = j < c.tokens;
      if (valid[u]) {
        cur.seek(j);
        const std::int64_t i = cur.row(j);
        load_row<T, SLOTS, L>(static_cast<const T*>(cur.r->keys) + i * g.key_stride, g.d, lane, aligned, k[u]);
        load_row<T, SLOTS, L>(static_cast<const T*>(cur.r->values) + i * g.value_stride, g.dv, lane, aligned, v[u]);
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) k[u][e] = v[u][e] = 0.f;
      }
    }
    st.template fold_rows<2>([&](int u, float* out) { for (int e = 0; e < W; ++e) out[e] = k[u][e]; },
                             [&](int u, float* out) { for (int e = 0; e < W; ++e) out[e] = v[u][e]; },
                             [&](int u) { return valid[u]; });
  }
  __shared__ float sm_a[block_threads * HP * W];
  st.store(g, dv_max, lane, sub, sm_a, work + static_cast<std::int64_t>(blockIdx.x) * HP * (2 + dv_max));
}

__device__ void copy16_async(void* smem, const void* global) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
}
__device__ void commit_async() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ void wait_async() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

constexpr int stages = 3;             // tiles in flight per block
template <int L>
constexpr int async_tile = 4 * subgroups_of<L>;  // tokens per tile: four per subgroup

// Shared memory of the pipelined kernel: `stages` tiles of rows, reused afterwards for
// the merge of the subgroup states.
template <class T, int SLOTS, int HP, int L>
std::size_t async_smem_bytes(int d, int dv) {
  const std::size_t tiles = std::size_t(stages) * async_tile<L> * (d + dv) * sizeof(T);
  const std::size_t merge = std::size_t(block_threads) * HP * SLOTS * vec_of<T> * sizeof(float);
  return tiles > merge ? tiles : merge;
}

// The same partial for 16-byte aligned rows, with the rows of the next tiles copied into
// shared memory asynchronously (cp.async) while this tile is folded in: many bytes in
// flight per block without holding them in registers.
template <class T, int SLOTS, int HP, int L>
__global__ void __launch_bounds__(block_threads) attend_chunks_async(const run* runs, const chunk* chunks, int chunk_count, unsigned long long* check,
                                                                     const group_desc* groups, int dv_max, float* work) {
  using state_t = subgroup_state<T, SLOTS, HP, L>;
  constexpr int V = vec_of<T>, subgroups = subgroups_of<L>, tile = async_tile<L>;
  extern __shared__ __align__(16) unsigned char smem[];
  if (int(blockIdx.x) >= chunk_count) return find_nonfinite(groups, blockIdx.x - chunk_count, check);
  const chunk c = chunks[blockIdx.x];
  const group_desc g = groups[c.group];
  const int lane = threadIdx.x % L, sub = threadIdx.x / L;
  const int key_pieces = g.d * int(sizeof(T)) / 16, pieces = key_pieces + g.dv * int(sizeof(T)) / 16;
  const int token_bytes = pieces * 16, stage_bytes = tile * token_bytes;
  const int tiles = (c.tokens + tile - 1) / tile;
  // Copying: 4 threads per token of a tile, each taking every 4th 16-byte piece of its
  // token's key and value rows (no division per piece; one run lookup per tile).
  constexpr int copiers = block_threads / tile;
  const int my_token = threadIdx.x / copiers, my_piece = threadIdx.x % copiers;
  run_cursor copier{runs + c.first_run};
  auto issue = [&](int t) {
    const int j = t * tile + my_token;
    if (j >= c.tokens) return;
    copier.seek(j);
    const std::int64_t i = copier.row(j);
    const auto* key = reinterpret_cast<const unsigned char*>(static_cast<const T*>(copier.r->keys) + i * g.key_stride);
    const auto* value = reinterpret_cast<const unsigned char*>(static_cast<const T*>(copier.r->values) + i * g.value_stride);
    unsigned char* dst = smem + (t % stages) * stage_bytes + my_token * token_bytes;
    for (int piece = my_piece; piece < pieces; piece += copiers)
      copy16_async(dst + piece * 16, piece < key_pieces ? key + piece * 16 : value + (piece - key_pieces) * 16);
  };
  state_t st;
  st.init(g, lane);
#pragma unroll
  for (int t = 0; t < stages - 1; ++t) {
    if (t < tiles) issue(t);
    commit_async();
  }
  for (int t = 0; t < tiles; ++t) {
    wait_async<stages - 2>();
    __syncthreads();
    const unsigned char* stage = smem + (t % stages) * stage_bytes;
    // Subgroup `sub` takes tokens sub, sub + 8, sub + 16, sub + 24 of the tile.
    auto row_of = [&](int u) { return stage + (u * subgroups + sub) * token_bytes; };
    auto valid = [&](int u) { return t * tile + u * subgroups + sub < c.tokens; };
    auto fetch = [&](const T* row, int n, int u, float* out) {
#pragma unroll
      for (int s2 = 0; s2 < SLOTS; ++s2) {
        const int e = element_of<T, L>(s2, lane, 0);
        if (valid(u) && e < n) {
          vec16<T>::load(row + e, out + s2 * V);
        } else {
#pragma unroll
          for (int x = 0; x < V; ++x) out[s2 * V + x] = 0.f;
        }
      }
    };
    st.template fold_rows<4>([&](int u, float* k) { fetch(reinterpret_cast<const T*>(row_of(u)), g.d, u, k); },
                             [&](int u, float* v) { fetch(reinterpret_cast<const T*>(row_of(u) + key_pieces * 16), g.dv, u, v); },
                             valid);
    if (t + stages - 1 < tiles) issue(t + stages - 1);  // into the stage folded one step ago
    commit_async();
  }
  wait_async<0>();
  __syncthreads();  // every fold is done before the tiles' memory holds the merge
  st.store(g, dv_max, lane, sub, reinterpret_cast<float*>(smem),
           work + static_cast<std::int64_t>(blockIdx.x) * HP * (2 + dv_max));
}

#include "attend_mma.cuh"

// Per (group, head): merges the group's chunk partials (a block-wide max, then each of 16
// warps sums every 16th chunk's rescaled partial, a lane per 32nd element, and the warps'
// sums are added); writes a / l to the group's output rows, or (m, l, a) to `results`.
// Chunks spread over the warps of 512 threads: with 128 threads and every chunk passing
// through each thread the kernel took 15 us at d 64, 128K, batch 1 (128 chunks a group,
// 12 blocks; ncu: one warp a scheduler issuing every 10.5 cycles).
constexpr int merge_threads = 512;
template <int HP>
__global__ void __launch_bounds__(merge_threads) merge_groups(const group_desc* groups, int dv_max,
                                                              const float* work, float* results,
                                                              const unsigned long long* refused) {
  if (refused && *refused != ~0ull) return;  // a bad query: write nothing
  const group_desc g = groups[blockIdx.x];
  const int h = blockIdx.y, tid = threadIdx.x;
  if (h >= g.heads) return;
  constexpr int warps = merge_threads / 32, per_lane = max_row / 32;
  const int warp = tid / 32, lane = tid % 32;
  const std::int64_t stride = HP * (2 + dv_max);
  const float* base = work + g.first_chunk * stride;
  __shared__ float red[merge_threads];
  __shared__ float warp_l[warps], warp_a[warps][max_row];
  float mm = -INFINITY;
  for (int c = tid; c < g.chunks; c += merge_threads) mm = fmaxf(mm, base[c * stride + h]);
  red[tid] = mm;
  __syncthreads();
  for (int o = merge_threads / 2; o > 0; o /= 2) {
    if (tid < o) red[tid] = fmaxf(red[tid], red[tid + o]);
    __syncthreads();
  }
  const float top = red[0];
  float ll = 0.f, aa[per_lane] = {};
  if (top != -INFINITY) {
#pragma unroll 4
    for (int c = warp; c < g.chunks; c += warps) {
      const float* part = base + c * stride;
      const float r = expf(part[h] - top);  // 0 for a chunk that saw no token of this head
      ll = fmaf(r, part[HP + h], ll);
#pragma unroll
      for (int x = 0; x < per_lane; ++x)
        if (lane + 32 * x < g.dv) aa[x] = fmaf(r, part[2 * HP + h * dv_max + lane + 32 * x], aa[x]);
    }
  }
  if (lane == 0) warp_l[warp] = ll;
#pragma unroll
  for (int x = 0; x < per_lane; ++x) warp_a[warp][lane + 32 * x] = aa[x];
  __syncthreads();
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < warps; ++w) sum += warp_l[w];
  for (int j = tid; j < g.dv; j += merge_threads) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < warps; ++w) a += warp_a[w][j];
    if (g.out) {
      g.out[h * g.out_stride + j] = sum > 0.f ? a / sum : 0.f;
    } else {
      float* r = results + blockIdx.x * stride;
      if (j == 0) r[h] = top, r[HP + h] = sum;
      r[2 * HP + h * dv_max + j] = a;
    }
  }
}

// Scores of every head of each chunk's group: z[h * out_stride + first_token + j] into the
// group's `out` when it has one (a whole group's scores, one read of each key), else into
// z (one head; out_stride 0). Blocks past the chunks check one group's device queries
// each into `check`; a NaN or +Inf score puts group << 40 | token into `bad_key`. At
// least 8 blocks a multiprocessor (64 registers), for rows in flight: 128K, d 128,
// batch 1 went 191 -> 172 us on the H200 (ncu).
template <class T, int SLOTS, int HP>
__global__ void __launch_bounds__(block_threads, 8) score_chunks(const run* runs, const chunk* chunks, int chunk_count,
                                                              unsigned long long* check, const group_desc* groups,
                                                              float* z, unsigned long long* bad_key) {
  if (int(blockIdx.x) >= chunk_count) {
    if (blockIdx.y == 0) find_nonfinite(groups, blockIdx.x - chunk_count, check);
    return;
  }
  constexpr int V = vec_of<T>, W = SLOTS * V;
  const chunk c = chunks[blockIdx.x];
  const group_desc g = groups[c.group];
  constexpr int subgroups = subgroups_of<16>;
  const int lane = threadIdx.x % 16, sub = threadIdx.x / 16;
  float q[HP][W];
#pragma unroll
  for (int h = 0; h < HP; ++h)
#pragma unroll
    for (int s = 0; s < SLOTS; ++s)
#pragma unroll
      for (int t = 0; t < V; ++t) {
        const int e = element_of<T, 16>(s, lane, t);
        q[h][s * V + t] = h < g.heads && e < g.d ? g.q[h * g.q_stride + e] : 0.f;
      }
  float* base = g.out ? g.out : z;
  run_cursor cur{runs + c.first_run};
  // Block y of gridDim.y takes a slice of the chunk (scores need no merge, so a chunk can
  // be split for more blocks in flight), U rows per subgroup a step, loaded before use.
  constexpr int U = W <= 8 ? 2 : 1;
  constexpr int step = subgroups * U;
  const int slice = (c.tokens + step * int(gridDim.y) - 1) / (step * int(gridDim.y)) * step;
  const int begin = int(blockIdx.y) * slice, end = min(c.tokens, begin + slice);
  for (int b = begin; b < end; b += step) {
    float k[U][W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = b + u * subgroups + sub;
      if (j < end) {
        cur.seek(j);
        load_row<T, SLOTS>(static_cast<const T*>(cur.r->keys) + cur.row(j) * g.key_stride, g.d, lane,
                           g.aligned != 0, k[u]);
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) k[u][e] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = b + u * subgroups + sub;
      float dot[HP];
#pragma unroll
      for (int h = 0; h < HP; ++h) {
        dot[h] = 0.f;
#pragma unroll
        for (int e = 0; e < W; ++e) dot[h] = fmaf(q[h][e], k[u][e], dot[h]);
      }
      int h = 0;
      const float sum = sum_heads<HP>(dot, lane, h);
      if (j < end && lane % (16 / HP) == 0 && h < g.heads) {
        const float score = g.scale * sum;
        base[h * g.out_stride + c.first_token + j] = score;
        if (!(score < INFINITY) && bad_key)  // NaN or +Inf: no order to rank by
          atomicMin(bad_key, static_cast<unsigned long long>(c.group) << 40 | static_cast<unsigned long long>(c.first_token + j));
      }
    }
  }
}

// Lets `kernel` take `smem` bytes of dynamic shared memory on `device` (past 48 KiB a
// kernel must opt in, on each device; the kernels' static arrays count too).
void allow_smem(const void* kernel, std::size_t smem, int device) {
  struct allowed {
    const void* kernel;
    int device;
    std::size_t smem;
  };
  static thread_local std::vector<allowed> done;
  for (const allowed& a : done)
    if (a.kernel == kernel && a.device == device && a.smem >= smem) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "shared memory size");
  done.push_back({kernel, device, smem});
}

// One launch of a chunk kernel (blocks past the chunks check one group's device queries
// each, when a.check is set), then the merge of its partials.
template <int HP, class Kernel>
void launch_chunks(Kernel* kernel, std::size_t smem, const launch_args& a) {
  const int blocks = a.plan.chunk_count + (a.check ? a.plan.group_count : 0);
  if (blocks > 0) {
    if (smem > 0) allow_smem(reinterpret_cast<const void*>(kernel), smem, current_device);
    kernel<<<blocks, block_threads, smem, current_stream>>>(a.plan.runs, a.plan.chunks, a.plan.chunk_count, a.check, a.plan.groups,
                                                            a.dv_max, a.work);
  }
  check(cudaGetLastError(), "attend kernel launch");
  merge_groups<HP><<<dim3(a.plan.group_count, HP), merge_threads, 0, current_stream>>>(a.plan.groups, a.dv_max, a.work,
                                                                                      a.results, a.check);
  check(cudaGetLastError(), "merge kernel launch");
}

template <class T, int SLOTS, int HP, int L>
void attend_as(const launch_args& a) {
  if (a.plan.all_aligned)
    launch_chunks<HP>(attend_chunks_async<T, SLOTS, HP, L>, async_smem_bytes<T, SLOTS, HP, L>(a.plan.row, a.plan.row), a);
  else
    launch_chunks<HP>(attend_chunks<T, SLOTS, HP, L>, 0, a);
}

template <class T, int SLOTS, int L>
void attend_slots(const launch_args& a) {
  if (a.plan.heads_pass == 1) attend_as<T, SLOTS, 1, L>(a);
  else if (a.plan.heads_pass == 4) attend_as<T, SLOTS, 4, L>(a);
  else if constexpr (SLOTS * vec_of<T> <= 8)  // 8 heads a pass only while the registers hold them
    attend_as<T, SLOTS, 8, L>(a);
  else
    throw cuda_error("no kernel for 8 heads a pass at rows over 128");
}

// Slots of L lanes x 16 bytes a row of `row` elements needs: 1, 2 or 4.
template <class T, int L = 16>
int slots_for(int row) {
  const int per = L * vec_of<T>, s = (row + per - 1) / per;
  return s <= 1 ? 1 : s == 2 ? 2 : 4;
}

// The tensor-core kernel takes 16-bit rows of d = dv = 64 or 128 in every group, 16-byte
// aligned, on compute capability 8.0 or newer, unless FLOE_CUDA_ATTEND=simt (so do the
// tensor-core scores).
bool mma_fits(bool all_aligned, int row, int min_row, int heads_pass) {
  static const bool simt = [] {
    const char* v = std::getenv("FLOE_CUDA_ATTEND");
    return v != nullptr && std::strcmp(v, "simt") == 0;
  }();
  static thread_local int device = -1, major = 0;
  if (current_device != device) {
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, current_device), "compute capability");
    device = current_device;
  }
  return !simt && major >= 8 && all_aligned && row == min_row && (row == 64 || row == 128) && heads_pass <= 8;
}

template <class T, int D, int HP>
void attend_mma_as(const launch_args& a) {
  launch_chunks<HP>(attend_chunks_mma<T, D, HP>, tile_copier<T, D, true>::smem_bytes, a);
}

template <class T, int D>
void attend_mma_rows(const launch_args& a) {
  if (a.plan.heads_pass == 1) attend_mma_as<T, D, 1>(a);
  else if (a.plan.heads_pass == 4) attend_mma_as<T, D, 4>(a);
  else attend_mma_as<T, D, 8>(a);
}

template <class T>
void attend_type(const launch_args& a) {
  if constexpr (vec_of<T> == 8) {
    if (mma_fits(a.plan.all_aligned, a.plan.row, a.plan.min_row, a.plan.heads_pass)) return a.plan.row == 64 ? attend_mma_rows<T, 64>(a) : attend_mma_rows<T, 128>(a);
  }
  if constexpr (vec_of<T> == 8) {
    if (a.plan.row <= 64) return attend_slots<T, 1, 8>(a);  // 8 lanes of 16 bytes hold the row
  }
  const int slots = slots_for<T>(a.plan.row);
  if (slots == 1) attend_slots<T, 1, 16>(a);
  else if (slots == 2) attend_slots<T, 2, 16>(a);
  else if constexpr (vec_of<T> == 4) attend_slots<T, 4, 16>(a);
}

// Blocks of a score launch along x: the chunks, and one per group to check.
int score_blocks(const score_launch_args& a) { return a.plan.chunk_count + (a.check ? a.plan.group_count : 0); }

// SIMT scores: about 4096 blocks in all (31 per multiprocessor of an H200), a chunk split
// in up to 8.
template <class T, int SLOTS>
void score_slots(const score_launch_args& a) {
  const int slices = std::clamp((4096 + a.plan.chunk_count - 1) / std::max(a.plan.chunk_count, 1), 1, 8);
  auto launch = [&](auto kernel) {
    kernel<<<dim3(score_blocks(a), slices), block_threads, 0, current_stream>>>(a.plan.runs, a.plan.chunks,
                                                                               a.plan.chunk_count, a.check,
                                                                               a.plan.groups, a.z, a.bad_key);
  };
  if (a.plan.heads_pass == 1) launch(score_chunks<T, SLOTS, 1>);
  else if (a.plan.heads_pass == 4) launch(score_chunks<T, SLOTS, 4>);
  else if constexpr (SLOTS * vec_of<T> <= 8) launch(score_chunks<T, SLOTS, 8>);
  else throw cuda_error("no score kernel for 8 heads a pass at rows over 128");
}

// Tensor-core scores: about 1024 blocks in all (two waves of four a multiprocessor on an
// H200), a chunk split in up to 8, each block pipelining its slice through the stages.
template <class T, int D>
void score_mma(const score_launch_args& a) {
  auto* kernel = score_chunks_mma<T, D>;
  const std::size_t smem = tile_copier<T, D, false>::smem_bytes;
  allow_smem(reinterpret_cast<const void*>(kernel), smem, current_device);
  const int slices = std::clamp((1024 + a.plan.chunk_count - 1) / std::max(a.plan.chunk_count, 1), 1, 8);
  kernel<<<dim3(score_blocks(a), slices), block_threads, smem, current_stream>>>(
      a.plan.runs, a.plan.chunks, a.plan.chunk_count, a.check, a.plan.groups, a.z, a.bad_key);
}

template <class T>
void score_type(const score_launch_args& a) {
  if (score_blocks(a) == 0) return;
  const int row = a.plan.row;
  if constexpr (vec_of<T> == 8) {
    if (mma_fits(a.plan.all_aligned, row, a.plan.min_row, a.plan.heads_pass)) {
      row == 64 ? score_mma<T, 64>(a) : score_mma<T, 128>(a);
      return check(cudaGetLastError(), "score kernel launch");
    }
  }
  const int slots = slots_for<T>(row);
  if (slots == 1) score_slots<T, 1>(a);
  else if (slots == 2) score_slots<T, 2>(a);
  else if constexpr (vec_of<T> == 4) score_slots<T, 4>(a);
  check(cudaGetLastError(), "score kernel launch");
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}
void select_device(int device, void* stream) {
  check(cudaSetDevice(device), "cudaSetDevice");
  current_device = device;
  current_stream = stream ? static_cast<cudaStream_t>(stream) : cudaStreamPerThread;
  // Keep freed stream-ordered memory in the pool: each call allocates its plan and work
  // there, and returning it to the driver at every synchronize costs a real allocation.
  static thread_local int tuned = -1;
  if (tuned != device) {
    cudaMemPool_t pool;
    check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep = ~std::uint64_t{0};
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
    tuned = device;
  }
}
void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMallocAsync(&p, bytes ? bytes : 1, current_stream), "cudaMallocAsync");
  return p;
}
void device_free(void* p) { (void)cudaFreeAsync(p, current_stream); }
void to_device(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, current_stream), "copy to device");
}
void to_host(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, current_stream), "copy to host");
}
void synchronize() { check(cudaStreamSynchronize(current_stream), "kernel execution"); }


void* host_staging(std::size_t bytes) {
  struct pinned {
    void* p = nullptr;
    std::size_t size = 0;
    ~pinned() {
      if (p) (void)cudaFreeHost(p);
    }
  };
  static thread_local pinned buffer;
  if (buffer.size < bytes) {
    // Grows at least twofold, so that a slowly growing plan pays few page-locked allocations.
    const std::size_t want = std::max<std::size_t>({bytes, 2 * buffer.size, std::size_t{1} << 16});
    if (buffer.p) check(cudaFreeHost(buffer.p), "cudaFreeHost");
    buffer.p = nullptr;
    buffer.size = 0;
    check(cudaMallocHost(&buffer.p, want), "cudaMallocHost");
    buffer.size = want;
  }
  return buffer.p;
}

nonfinite_query decode_nonfinite(unsigned long long first) {
  if (first == ~0ull) return {-1, 0, 0};
  return {static_cast<std::int32_t>(first >> 40), static_cast<std::int32_t>((first >> 20) & 0xfffff),
          static_cast<std::int32_t>(first & 0xfffff)};
}

void launch_attend(const launch_args& a) {
  // Kernels launch on the call's stream, the one the copies above use.
  switch (a.plan.type) {
    case element::f32: return attend_type<float>(a);
    case element::f16: return attend_type<__half>(a);
    case element::bf16: return attend_type<__nv_bfloat16>(a);
  }
}

int multiprocessors(int device) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  return n;
}

void launch_score(const score_launch_args& a) {
  switch (a.plan.type) {
    case element::f32: return score_type<float>(a);
    case element::f16: return score_type<__half>(a);
    case element::bf16: return score_type<__nv_bfloat16>(a);
  }
}

}  // namespace floe::cuda_detail
