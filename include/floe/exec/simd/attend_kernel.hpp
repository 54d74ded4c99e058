// Decode-attention kernels, templated on a lane type L (an xsimd batch or a plain float):
// per tile of rows, score every query head of the GQA group (each key row is read from
// memory once), rescale the online softmax once per tile, then fold in the values (each
// value row read once). Included only by the per-architecture units of floe::simd, so
// nothing here may be a non-template inline function (docs/simd-executor.md, "ODR").
#pragma once

#include <cstdint>

#include "floe/exec/simd/kernel_api.hpp"

namespace floe::simd_detail {

// Walks runs of evenly strided rows, handing out row pointers a tile at a time. (Templated
// on L too, so that each architecture's unit gets its own copy.)
template <class L, class T>
class row_cursor {
 public:
  row_cursor(const row_run<T>* runs, index_t count, index_t key_stride, index_t value_stride)
      : runs_(runs), count_(count), key_stride_(key_stride), value_stride_(value_stride) {}

  // Fills up to tile_tokens key and value row pointers; returns how many (0 at the end).
  index_t next(const T** keys, const T** values) {
    index_t n = 0;
    while (n < tile_tokens && run_ < count_) {
      const row_run<T>& run = runs_[run_];
      for (; n < tile_tokens && offset_ < run.count; ++n, ++offset_) {
        keys[n] = run.keys + offset_ * key_stride_;
        values[n] = run.values + offset_ * value_stride_;
      }
      if (offset_ >= run.count) {
        ++run_;
        offset_ = 0;
      }
    }
    return n;
  }

 private:
  const row_run<T>* runs_;
  index_t count_, key_stride_, value_stride_;
  index_t run_ = 0, offset_ = 0;
};

// Asks for the cache lines of bytes [begin, end) of `row` into L2. The kernels prefetch
// the next tile as they go: its keys threaded through the scoring FMAs (prefetch_line),
// each value pass's columns while folding values, so that requests are spread over the
// whole tile instead of bunched (docs/benchmarks.md: from DRAM 20-55% over the hardware
// prefetcher alone, and ~15% more from spreading them). It also covers page and range
// boundaries, where a hardware prefetcher stops.
template <class L, class T>
inline __attribute__((always_inline)) void prefetch_bytes(const T* row, index_t begin, index_t end) {
  const auto base = reinterpret_cast<std::uintptr_t>(row);
  for (std::uintptr_t line = (base + begin) & ~std::uintptr_t{63}; line < base + end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

// Asks for the line holding element e of rows[0, m).
template <class L, class T>
inline __attribute__((always_inline)) void prefetch_line(const T* const* rows, index_t m, index_t e) {
  for (index_t i = 0; i < m; ++i) __builtin_prefetch(rows[i] + e, 0, 2);
}

// Largest power of two <= limit, at least 1.
consteval index_t pow2_at_most(index_t limit) {
  index_t p = 1;
  while (p * 2 <= limit) p *= 2;
  return p;
}

// z[j * z_stride + t] = scale * q_{h0+j} . k_t for t < n and the G heads from h0. U tokens
// go together so that U * G independent FMA chains hide the FMA latency and each query
// chunk is loaded once for U tokens; each key chunk is loaded once for all G heads. The W
// per-token dot vectors of a step are then summed lane-wise at once. With z_padded, each
// z row has room up to the next multiple of W, and the lanes past n are garbage.
// Paired (bf16, d a multiple of 2W): keys are read 2W at a time as even and odd elements
// (L::load_pair), and g.q holds each 2W-block of the query in that order too.
template <class L, class T, index_t G, bool Paired = false>
void score_block(const group_args& g, index_t h0, const T* const* keys, index_t n, float* z, index_t z_stride,
                 bool z_padded, const row_run<const T*>& prefetch) {
  using vec = typename L::vec;
  constexpr index_t W = L::width;
  constexpr index_t U = pow2_at_most(L::accumulators / G < 4 ? L::accumulators / G : 4) < W
                            ? pow2_at_most(L::accumulators / G < 4 ? L::accumulators / G : 4)
                            : W;
  static_assert(W % U == 0);
  const index_t full = g.d / W * W;
  const bool has_tail = full < g.d;
  const float* q[G];
  for (index_t j = 0; j < G; ++j) q[j] = g.q + (h0 + j) * g.q_stride;
  // When the U * G accumulators of a step fill more than half a vector, they are summed in
  // registers right away (lane j * U + i: head j, token i) and each head's U-token piece
  // copied to its row of z; otherwise the dot vectors wait, spilled, for W tokens and are
  // summed per head (the spills cost ~10 % of the scoring from L2 at g = 4, d = 128).
  constexpr bool sum_per_step = U * G <= W && 2 * U * G > W;
  vec dots[G][W];
  alignas(64) float blocks[W / U][W];
  alignas(64) float tails[G][W];
  alignas(64) float out[W];
  // The next tile's key rows, asked for as this tile's are scored: while token t's bytes
  // [b, b + 64) are read, the same bytes of the next tile's row t are asked for, so the
  // requests spread over the FMA blocks with no bookkeeping (a walker over the lines cost
  // ~10 % of the scoring from L2; docs/benchmarks.md, "Prefetching keys row by row").
  const index_t row_bytes = g.d * index_t{sizeof(T)};
  const index_t ahead = prefetch.count < n ? prefetch.count : n;
  const index_t tail_from = full < g.d ? full * index_t{sizeof(T)} : row_bytes - 1;
  for (index_t t0 = 0; t0 < n; t0 += W) {
    const index_t count = n - t0 < W ? n - t0 : W;
    for (index_t u = 0; u < W; u += U) {
      const T* k[U];  // rows past the end repeat the last one; their lanes are dropped
      for (index_t i = 0; i < U; ++i) k[i] = keys[t0 + (u + i < count ? u + i : count - 1)];
      // The next tile's rows of the same tokens: next[0, m).
      const T* const* next = ahead ? prefetch.keys + t0 + u : nullptr;
      const index_t m = t0 + u + U <= ahead ? U : (t0 + u < ahead ? ahead - t0 - u : 0);
      vec acc[U][G];
      for (index_t i = 0; i < U; ++i)
        for (index_t j = 0; j < G; ++j) acc[i][j] = L::zero();
      if constexpr (Paired) {
        for (index_t e = 0; e < full; e += 2 * W) {
          if (e * index_t{sizeof(T)} % 64 == 0) prefetch_line<L>(next, m, e);
          vec even[U], odd[U];
          for (index_t i = 0; i < U; ++i) L::load_pair(k[i] + e, even[i], odd[i]);
          for (index_t j = 0; j < G; ++j) {
            const vec qv = L::load(q[j] + e);
            for (index_t i = 0; i < U; ++i) acc[i][j] = L::fma(qv, even[i], acc[i][j]);
          }
          for (index_t j = 0; j < G; ++j) {
            const vec qv = L::load(q[j] + e + W);
            for (index_t i = 0; i < U; ++i) acc[i][j] = L::fma(qv, odd[i], acc[i][j]);
          }
        }
      } else {
        for (index_t e = 0; e < full; e += W) {
          if (e * index_t{sizeof(T)} % 64 == 0) prefetch_line<L>(next, m, e);
          vec kv[U];
          for (index_t i = 0; i < U; ++i) kv[i] = L::load(k[i] + e);
          for (index_t j = 0; j < G; ++j) {
            const vec qv = L::load(q[j] + e);
            for (index_t i = 0; i < U; ++i) acc[i][j] = L::fma(qv, kv[i], acc[i][j]);
          }
        }
      }
      // The lines the loop above did not ask for: the row's tail, and its last line when
      // the row does not start on a line.
      for (index_t i = 0; i < m; ++i)
        if (has_tail || (reinterpret_cast<std::uintptr_t>(next[i]) & 63) != 0)
          prefetch_bytes<L>(next[i], tail_from, row_bytes);
      if constexpr (sum_per_step) {
        if (!has_tail) {
          vec rows[W];
          for (index_t r = U * G; r < W; ++r) rows[r] = L::zero();
          for (index_t i = 0; i < U; ++i)
            for (index_t j = 0; j < G; ++j) rows[j * U + i] = acc[i][j];
          L::store(blocks[u / U], L::sum_rows(rows) * L::splat(g.scale));
          continue;
        }
      }
      for (index_t i = 0; i < U; ++i)
        for (index_t j = 0; j < G; ++j) dots[j][u + i] = acc[i][j];
      if (has_tail) {
        for (index_t i = 0; i < U; ++i)
          for (index_t j = 0; j < G; ++j) {
            float s = 0.f;
            for (index_t e = full; e < g.d; ++e) s += q[j][e] * L::scalar(k[i][e]);
            tails[j][u + i] = s;
          }
      }
    }
    if constexpr (sum_per_step) {
      if (!has_tail) {
        for (index_t j = 0; j < G; ++j)
          for (index_t b = 0; b * U < count; ++b) {
            float* dst = z + j * z_stride + t0 + b * U;
            if (count == W || z_padded)
              __builtin_memcpy(dst, &blocks[b][j * U], U * sizeof(float));
            else
              for (index_t i = 0; i < U && b * U + i < count; ++i) dst[i] = blocks[b][j * U + i];
          }
        continue;
      }
    }
    for (index_t j = 0; j < G; ++j) {
      vec dot = L::sum_rows(dots[j]);
      if (has_tail) dot = dot + L::load(tails[j]);
      dot = dot * L::splat(g.scale);
      if (count == W || z_padded) {
        L::store(z + j * z_stride + t0, dot);
      } else {
        L::store(out, dot);
        for (index_t u = 0; u < count; ++u) z[j * z_stride + t0 + u] = out[u];
      }
    }
  }
  for (index_t t = ahead; t < prefetch.count; ++t) prefetch_bytes<L>(prefetch.keys[t], 0, row_bytes);
}

// Turns each head's scores z[h * tile_tokens + t] into weights exp(z - m_new) in place,
// updates m and l, and leaves the rescale factor exp(m_old - m_new) in alpha[h].
template <class L>
void softmax_step(index_t heads, index_t n, float* z, float* alpha, float* m, float* l) {
  using vec = typename L::vec;
  constexpr index_t W = L::width;
  const index_t padded = (n + W - 1) / W * W;
  const float neg_inf = -__builtin_inff();
  for (index_t h = 0; h < heads; ++h) {
    float* zh = z + h * tile_tokens;
    for (index_t t = n; t < padded; ++t) zh[t] = neg_inf;  // padding weighs exp(-inf) = 0
    vec top = L::splat(neg_inf);
    for (index_t t = 0; t < padded; t += W) top = L::max(top, L::load(zh + t));
    const float tile_max = L::hmax(top);
    const bool grows = tile_max > m[h];
    const float m_new = grows ? tile_max : m[h];
    alpha[h] = grows ? __builtin_expf(m[h] - m_new) : 1.f;  // m[h] = -inf (nothing yet) gives 0
    vec sum = L::zero();
    const vec shift = L::splat(m_new);
    for (index_t t = 0; t < padded; t += W) {
      const vec w = L::exp(L::load(zh + t) - shift);
      L::store(zh + t, w);
      sum = sum + w;
    }
    l[h] = l[h] * alpha[h] + L::hadd(sum);
    m[h] = m_new;
  }
}

// One pass of value_block over C chunks of W elements from e: C * G accumulators, each a
// chain of n FMAs, and each value chunk loaded once for all G heads.
// Meanwhile it prefetches bytes [pf_begin, pf_end) of the next tile's value rows. Paired
// (and C even, e a multiple of 2W): chunk pairs are read as even and odd elements and the
// sums put back in order once at the end.
template <class L, class T, index_t G, index_t C, bool Paired>
void value_pass(const T* const* values, index_t n, const float* const* w, const float* alpha, float* const* a,
                index_t e, const row_run<const T*>& prefetch, index_t pf_begin, index_t pf_end) {
  using vec = typename L::vec;
  constexpr index_t W = L::width;
  vec acc[C][G];
  for (index_t c = 0; c < C; ++c)
    for (index_t j = 0; j < G; ++j) acc[c][j] = L::zero();
  for (index_t t = 0; t < n; ++t) {
    if (t < prefetch.count) prefetch_bytes<L>(prefetch.values[t], pf_begin, pf_end);
    vec v[C];
    if constexpr (Paired && C % 2 == 0)
      for (index_t c = 0; c < C; c += 2) L::load_pair(values[t] + e + c * W, v[c], v[c + 1]);
    else
      for (index_t c = 0; c < C; ++c) v[c] = L::load(values[t] + e + c * W);
    for (index_t j = 0; j < G; ++j) {
      const vec wj = L::splat(w[j][t]);
      for (index_t c = 0; c < C; ++c) acc[c][j] = L::fma(wj, v[c], acc[c][j]);
    }
  }
  if constexpr (Paired && C % 2 == 0)
    for (index_t c = 0; c < C; c += 2)
      for (index_t j = 0; j < G; ++j) L::unpair(acc[c][j], acc[c + 1][j]);
  for (index_t j = 0; j < G; ++j) {
    const vec scale = L::splat(alpha[j]);
    for (index_t c = 0; c < C; ++c) {
      float* dst = a[j] + e + c * W;
      L::store(dst, L::fma(L::load(dst), scale, acc[c][j]));
    }
  }
}

// Passes of C chunks while they fit, then halves C. The pass that ends at `full` also
// prefetches the rest of the row (to dv).
template <class L, class T, index_t G, index_t C, bool Paired>
void value_passes(const T* const* values, index_t n, const float* const* w, const float* alpha, float* const* a,
                  index_t full, index_t dv, index_t& e, const row_run<const T*>& prefetch) {
  for (; e + C * L::width <= full; e += C * L::width) {
    const index_t end = e + C * L::width == full ? dv : e + C * L::width;
    value_pass<L, T, G, C, Paired>(values, n, w, alpha, a, e, prefetch, e * index_t{sizeof(T)},
                                   end * index_t{sizeof(T)});
  }
  if constexpr (C > 1) value_passes<L, T, G, C / 2, Paired>(values, n, w, alpha, a, full, dv, e, prefetch);
}

// a_h = a_h * alpha_h + sum_t w_{h,t} v_t for the G heads from h0. The tile's sum starts
// from zero (short sums keep fp32 accumulation accurate over long contexts).
template <class L, class T, index_t G, bool Paired>
void value_block(const group_args& g, index_t h0, const T* const* values, index_t n, const float* weights,
                 const float* alpha, float* a, const row_run<const T*>& prefetch) {
  constexpr index_t C = pow2_at_most(L::accumulators / G < L::max_chunks ? L::accumulators / G : L::max_chunks);
  const index_t full = g.dv / L::width * L::width;
  const float* w[G];
  float* out[G];
  for (index_t j = 0; j < G; ++j) {
    w[j] = weights + (h0 + j) * tile_tokens;
    out[j] = a + (h0 + j) * g.dv;
  }
  index_t e = 0;
  if (full == 0)  // dv < one vector: no pass runs, so prefetch the rows here
    for (index_t t = 0; t < prefetch.count; ++t) prefetch_bytes<L>(prefetch.values[t], 0, g.dv * index_t{sizeof(T)});
  value_passes<L, T, G, C, Paired>(values, n, w, alpha + h0, out, full, g.dv, e, prefetch);
  if (full != 0)  // rows to prefetch past this tile's n (a short last tile before `after`)
    for (index_t t = n; t < prefetch.count; ++t) prefetch_bytes<L>(prefetch.values[t], 0, g.dv * index_t{sizeof(T)});
  for (; e < g.dv; ++e) {
    for (index_t j = 0; j < G; ++j) {
      float s = 0.f;
      for (index_t t = 0; t < n; ++t) s += w[j][t] * L::scalar(values[t][e]);
      out[j][e] = out[j][e] * alpha[h0 + j] + s;
    }
  }
}

// Calls f.template operator()<G>(h0) over blocks of at most 8 heads, so that the block's
// accumulators live in registers.
template <class F>
void for_head_blocks(index_t heads, F&& f) {
  for (index_t h0 = 0; h0 < heads;) {
    const index_t left = heads - h0;
    switch (left < 8 ? left : 8) {
      case 1: f.template operator()<1>(h0); h0 += 1; break;
      case 2: f.template operator()<2>(h0); h0 += 2; break;
      case 3: f.template operator()<3>(h0); h0 += 3; break;
      case 4: f.template operator()<4>(h0); h0 += 4; break;
      case 5: f.template operator()<5>(h0); h0 += 5; break;
      case 6: f.template operator()<6>(h0); h0 += 6; break;
      case 7: f.template operator()<7>(h0); h0 += 7; break;
      default: f.template operator()<8>(h0); h0 += 8; break;
    }
  }
}

// Calls f(keys, values, n, next) for each tile of the runs in order, with `next` the rows of
// the tile after it (`after` at the end), which f's kernels prefetch while this one runs.
// The first tile has no tile before it to ask for its rows, so they are asked for at once
// (its values too when f reads them): a short step of a few tiles, as a sparse selection
// gives, would otherwise wait for its first rows a miss at a time.
template <class L, class T, class F>
void for_each_tile(const group_args& g, const row_run<T>* runs, index_t run_count, bool reads_values,
                   const row_run<const T*>& after, F&& f) {
  const T* keys[2][tile_tokens];
  const T* values[2][tile_tokens];
  row_cursor<L, T> cursor(runs, run_count, g.key_stride, g.value_stride);
  index_t cur = 0, n = cursor.next(keys[0], values[0]);
  for (index_t t = 0; t < n; ++t) prefetch_bytes<L>(keys[0][t], 0, g.d * index_t{sizeof(T)});
  if (reads_values)
    for (index_t t = 0; t < n; ++t) prefetch_bytes<L>(values[0][t], 0, g.dv * index_t{sizeof(T)});
  while (n) {
    const index_t next_n = cursor.next(keys[cur ^ 1], values[cur ^ 1]);
    f(keys[cur], values[cur], n, next_n ? row_run<const T*>{keys[cur ^ 1], values[cur ^ 1], next_n} : after);
    cur ^= 1;
    n = next_n;
  }
}

template <class L, class T, bool Paired>
void attend_tiles(const group_args& g, const row_run<T>* runs, index_t run_count, const online_state& st,
                  const row_run<const T*>& after) {
  float* z = st.scratch;                              // [heads][tile_tokens]
  float* alpha = st.scratch + g.heads * tile_tokens;  // [heads]
  const row_run<const T*> none{nullptr, nullptr, 0};
  for_each_tile<L, T>(g, runs, run_count, true, after, [&](const T* const* keys, const T* const* values, index_t n,
                                              const row_run<const T*>& next) {
    for_head_blocks(g.heads, [&]<index_t G>(index_t h0) {
      score_block<L, T, G, Paired>(g, h0, keys, n, z + h0 * tile_tokens, tile_tokens, true, h0 == 0 ? next : none);
    });
    softmax_step<L>(g.heads, n, z, alpha, st.m, st.l);
    for_head_blocks(g.heads, [&]<index_t G>(index_t h0) {
      value_block<L, T, G, Paired>(g, h0, values, n, z, alpha, st.a, h0 == 0 ? next : none);
    });
  });
}

// bf16 with d and dv multiples of 2W runs paired: each 2W-block of the query is copied to
// scratch as its even then its odd elements, the order in which L::load_pair reads keys.
template <class L, class T>
void attend_runs(const group_args& g, const row_run<T>* runs, index_t run_count, const online_state& st,
                 const row_run<const T*>& after) {
  if constexpr (L::pairs && std::is_same_v<T, bfloat16>) {
    constexpr index_t W = L::width;
    if (g.d % (2 * W) == 0 && g.dv % (2 * W) == 0) {
      float* paired_q = st.scratch + g.heads * scratch_per_head;  // [heads][d]
      for (index_t h = 0; h < g.heads; ++h)
        for (index_t b = 0; b < g.d; b += 2 * W)
          for (index_t i = 0; i < W; ++i) {
            paired_q[h * g.d + b + i] = g.q[h * g.q_stride + b + 2 * i];
            paired_q[h * g.d + b + W + i] = g.q[h * g.q_stride + b + 2 * i + 1];
          }
      group_args paired = g;
      paired.q = paired_q;
      paired.q_stride = g.d;
      attend_tiles<L, T, true>(paired, runs, run_count, st, after);
      return;
    }
  }
  attend_tiles<L, T, false>(g, runs, run_count, st, after);
}

template <class L, class T>
void score_runs(const group_args& g, index_t head, const row_run<T>* runs, index_t run_count, float* z) {
  const T* keys[tile_tokens];
  const T* values[tile_tokens];
  row_cursor<L, T> cursor(runs, run_count, g.key_stride, g.value_stride);
  while (const index_t n = cursor.next(keys, values)) {
    score_block<L, T, 1>(g, head, keys, n, z, 0, false, row_run<const T*>{nullptr, nullptr, 0});
    z += n;
  }
}

// z[h * ld + i] = scale * q_h . k_i for every head h of the group and the rows of `runs` in
// order: each key row is read once for all heads (the next tile's rows prefetched).
template <class L, class T>
void score_group_runs(const group_args& g, const row_run<T>* runs, index_t run_count, float* z, index_t ld) {
  const row_run<const T*> none{nullptr, nullptr, 0};
  for_each_tile<L, T>(g, runs, run_count, false, none, [&](const T* const* keys, const T* const*, index_t n,
                                              const row_run<const T*>& next) {
    for_head_blocks(g.heads, [&]<index_t G>(index_t h0) {
      score_block<L, T, G>(g, h0, keys, n, z + h0 * ld, ld, false, h0 == 0 ? next : none);
    });
    z += n;
  });
}

template <class L>
constexpr kernel_set make_kernel_set(simd_arch target) {
  kernel_set set;
  set.target = target;
  set.f32 = {&attend_runs<L, float>, &score_runs<L, float>, &score_group_runs<L, float>};
  set.f16 = {&attend_runs<L, half>, &score_runs<L, half>, &score_group_runs<L, half>};
  set.bf16 = {&attend_runs<L, bfloat16>, &score_runs<L, bfloat16>, &score_group_runs<L, bfloat16>};
  return set;
}

}  // namespace floe::simd_detail
