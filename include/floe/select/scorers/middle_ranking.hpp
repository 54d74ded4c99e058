// What every scorer of topk_anchors shares: how a budget becomes a token count for the
// middle region, the shared score of a GQA group, and picking the top k.
// docs/methods/retrieval-completion.md, "GQA" and "budgets".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FLOE_RANKING_X86 1  // keep_reaching's AVX-512 path and its CPU check
#endif

#include "floe/core/budget.hpp"
#include "floe/core/config.hpp"
#include "floe/exec/simd/arch.hpp"

namespace floe::select::ranking {

// Per-thread scratch of at least `count` floats that keeps its memory between calls: the
// scans allocate megabytes per step, and fresh pages cost more than the scan itself.
// One buffer per Tag; contents are unspecified on entry.
template <class Tag>
float* scratch(index_t count) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

// The head-wise maxima c_h of scores laid out [heads, ld] over `count` tokens.
inline std::vector<float> head_maxima(const float* scores, index_t heads, index_t count, index_t ld) {
  std::vector<float> c(heads);
  for (index_t h = 0; h < heads; ++h) {
    float lane[16];  // independent lanes, so the loop vectorises
    for (float& x : lane) x = -std::numeric_limits<float>::infinity();
    const float* z = scores + h * ld;
    index_t i = 0;
    for (; i + 16 <= count; i += 16)
      for (index_t l = 0; l < 16; ++l) lane[l] = z[i + l] > lane[l] ? z[i + l] : lane[l];
    for (; i < count; ++i) lane[0] = z[i] > lane[0] ? z[i] : lane[0];
    c[h] = *std::max_element(lane, lane + 16);
  }
  return c;
}

// The group's shared score of token i: max_h (z_h,i - c_h), the log-weight of the token
// relative to the head's largest, for the head that weighs it most. It is monotone in
// every z_h, so bounds on the z_h bound it.
inline void shared_scores(const float* scores, index_t heads, index_t count, index_t ld, const std::vector<float>& c,
                          float* out) {
  for (index_t i = 0; i < count; ++i) out[i] = scores[i] - c[0];
  for (index_t h = 1; h < heads; ++h)
    for (index_t i = 0; i < count; ++i) out[i] = std::max(out[i], scores[h * ld + i] - c[h]);
}

// Orders i before j when its key is larger, ties by position: every ranking is deterministic.
struct larger_first {
  const float* key;
  bool operator()(index_t i, index_t j) const { return key[i] > key[j] || (key[i] == key[j] && i < j); }
};

namespace detail {
// The order-preserving integer image of a float (a < b as floats => image(a) < image(b)) and back.
inline std::uint32_t order_image(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}
inline float from_order_image(std::uint32_t u) {
  u = u & 0x80000000u ? u & 0x7fffffffu : ~u;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

// The k-th largest key (k >= 1), or -inf when k exceeds count. Radix selection on the
// order-preserving integer images: a 1024-bucket histogram over the span [smallest,
// largest] finds the bucket that holds it, and only that bucket's keys go on, until few
// are left for nth_element. Every pass is branch-free: nth_element's mispredicted
// compares cost ~27 cycles a key (~0.1 ms for the ~10K keys a decode step ranks).
// No key may be NaN.
inline float kth_largest_radix(const float* key, index_t count, index_t k) {
  if (k == 0 || k > count) return -std::numeric_limits<float>::infinity();
  constexpr index_t few = 128;  // below this, nth_element is cheaper than a histogram
  if (count <= few) {
    thread_local std::vector<float> small;
    small.assign(key, key + count);
    std::nth_element(small.begin(), small.begin() + static_cast<std::ptrdiff_t>(k - 1), small.end(), std::greater<float>{});
    return small[k - 1];
  }
  thread_local std::vector<std::uint32_t> image, inside;
  image.resize(count + 1);
  inside.resize(count + 1);
  std::uint32_t lo = ~0u, hi = 0;
  for (index_t i = 0; i < count; ++i) {
    image[i] = detail::order_image(key[i]);
    lo = std::min(lo, image[i]);
    hi = std::max(hi, image[i]);
  }
  constexpr int bucket_bits = 10, copies = 4;  // four histograms: repeated buckets do not wait on each other
  thread_local std::vector<std::uint32_t> hist(copies << bucket_bits);
  for (index_t n = count; hi != lo && n > few;) {
    const std::uint32_t span = hi - lo;
    const int shift = std::max(0, 32 - __builtin_clz(span) - bucket_bits);
    std::fill(hist.begin(), hist.end(), 0u);
    index_t i = 0;
    for (; i + copies <= n; i += copies)
      for (int c = 0; c < copies; ++c) ++hist[(c << bucket_bits) + ((image[i + c] - lo) >> shift)];
    for (; i < n; ++i) ++hist[(image[i] - lo) >> shift];
    for (std::uint32_t b = 0; b < (1u << bucket_bits); ++b)
      for (int c = 1; c < copies; ++c) hist[b] += hist[(c << bucket_bits) + b];
    std::uint32_t b = (span >> shift) + 1;  // one past the top bucket
    index_t above = 0;
    while (above + hist[b - 1] < k) above += hist[--b];
    const std::uint32_t chosen = b - 1;
    index_t m = 0;
    for (index_t j = 0; j < n; ++j) {
      inside[m] = image[j];
      m += (image[j] - lo) >> shift == chosen ? 1 : 0;
    }
    std::swap(image, inside);
    k -= above;
    n = m;
    lo += chosen << shift;
    hi = lo + std::min(hi - lo, (std::uint32_t{1} << shift) - 1);
    if (n <= few) {
      std::nth_element(image.begin(), image.begin() + static_cast<std::ptrdiff_t>(k - 1), image.begin() + static_cast<std::ptrdiff_t>(n),
                       std::greater<std::uint32_t>{});
      return detail::from_order_image(image[k - 1]);
    }
  }
  return detail::from_order_image(lo);  // every key left is equal
}

// A threshold that at least k keys reach when k is a small part of count, from an evenly
// spaced sample (about 1.25 k keys reach it); -inf when sampling does not pay.
inline float sampled_bar(const float* key, index_t count, index_t k) {
  constexpr index_t sample_size = 2048;
  if (count < 8 * sample_size || k > count / 4) return -std::numeric_limits<float>::infinity();
  const index_t stride = count / sample_size;
  thread_local std::vector<float> sample;
  sample.resize(sample_size);
  for (index_t j = 0; j < sample_size; ++j) sample[j] = key[j * stride];
  const index_t rank = std::min<index_t>(sample_size - 1, (k + k / 4) / stride + 8);  // 0-based, from the top
  return kth_largest_radix(sample.data(), sample_size, rank + 1);
}

namespace detail {
// keep_reaching's loop, one key at a time, branch-free; at and kept hold count + 16.
inline index_t keep_reaching_portable(const float* key, index_t count, float bar, index_t* at, float* kept) {
  index_t m = 0;
  for (index_t i = 0; i < count; ++i) {
    at[m] = i;
    kept[m] = key[i];
    m += key[i] >= bar ? 1 : 0;
  }
  return m;
}

#ifdef FLOE_RANKING_X86
// The SIMD executor's test of this CPU and OS (AVX-512 F/CD/DQ/BW/VL), read once.
inline bool keep_reaching_avx512_available() {
  static const bool yes = cpu_supports(simd_arch::avx512);
  return yes;
}

// Stores the 64-bit positions (lanes 0-7 in low, 8-15 in high) that `reach` selects at
// out + m, in order, whole vectors; returns the new fill point.
__attribute__((target("avx512f"), always_inline)) inline index_t store_selected_positions(__mmask16 reach, __m512i low,
                                                                                         __m512i high, index_t* out,
                                                                                         index_t m) {
  const auto reach_low = static_cast<__mmask8>(reach & 0xff), reach_high = static_cast<__mmask8>(reach >> 8);
  _mm512_storeu_si512(out + m, _mm512_maskz_compress_epi64(reach_low, low));
  const auto m_low = static_cast<index_t>(__builtin_popcount(reach_low));
  _mm512_storeu_si512(out + m + m_low, _mm512_maskz_compress_epi64(reach_high, high));
  return m + m_low + static_cast<index_t>(__builtin_popcount(reach_high));
}

// The same, 16 keys a step with AVX-512 compress (whole vectors stored at the fill
// point, hence the 16 spare slots): 128K keys in ~0.02 ms instead of ~0.08 (2-core
// machine here), a third of a top k's time.
__attribute__((target("avx512f"))) inline index_t keep_reaching_avx512(const float* key, index_t count, float bar,
                                                                      index_t* at, float* kept) {
  static_assert(sizeof(index_t) == 8, "positions are stored as 64-bit lanes");
  const __m512 b = _mm512_set1_ps(bar);
  const __m512i step = _mm512_set1_epi64(16);
  __m512i low = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), high = _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15);
  index_t m = 0, i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512 x = _mm512_loadu_ps(key + i);
    const __mmask16 reach = _mm512_cmp_ps_mask(x, b, _CMP_GE_OQ);
    _mm512_storeu_ps(kept + m, _mm512_maskz_compress_ps(reach, x));
    m = store_selected_positions(reach, low, high, at, m);
    low = _mm512_add_epi64(low, step);
    high = _mm512_add_epi64(high, step);
  }
  const index_t tail = keep_reaching_portable(key + i, count - i, bar, at + m, kept + m);
  for (index_t j = m; j < m + tail; ++j) at[j] += i;  // the tail counted its positions from i
  return m + tail;
}

// The positions from[j] (j itself when from is null) of the keys[j] >= bar, ascending,
// 16 keys a step; out holds count + 16 (whole vectors are stored at the fill point).
__attribute__((target("avx512f"))) inline index_t positions_reaching_avx512(const float* keys, const index_t* from,
                                                                           index_t count, float bar, index_t* out) {
  const __m512 b = _mm512_set1_ps(bar);
  const __m512i step = _mm512_set1_epi64(16);
  __m512i low = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), high = _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15);
  index_t m = 0, j = 0;
  for (; j + 16 <= count; j += 16) {
    const __mmask16 reach = _mm512_cmp_ps_mask(_mm512_loadu_ps(keys + j), b, _CMP_GE_OQ);
    m = from ? store_selected_positions(reach, _mm512_loadu_si512(from + j), _mm512_loadu_si512(from + j + 8), out, m)
             : store_selected_positions(reach, low, high, out, m);
    low = _mm512_add_epi64(low, step);
    high = _mm512_add_epi64(high, step);
  }
  for (; j < count; ++j) {
    out[m] = from ? from[j] : j;
    m += keys[j] >= bar ? 1 : 0;
  }
  return m;
}
#endif
}  // namespace detail

// The positions (ascending) of the keys >= bar, with their keys, in one pass.
inline index_t keep_reaching(const float* key, index_t count, float bar, std::vector<index_t>& at, std::vector<float>& kept) {
  if (at.size() < count + 16) at.resize(count + 16);
  if (kept.size() < count + 16) kept.resize(count + 16);
#ifdef FLOE_RANKING_X86
  if (detail::keep_reaching_avx512_available()) return detail::keep_reaching_avx512(key, count, bar, at.data(), kept.data());
#endif
  return detail::keep_reaching_portable(key, count, bar, at.data(), kept.data());
}

// The same value as kth_largest_radix, faster when k is a small part of count: only the
// keys that reach a sampled threshold are ranked (the radix path when fewer than k do).
inline float kth_largest(const float* key, index_t count, index_t k) {
  if (k == 0 || k > count) return -std::numeric_limits<float>::infinity();
  const float bar = sampled_bar(key, count, k);
  if (bar == -std::numeric_limits<float>::infinity()) return kth_largest_radix(key, count, k);
  thread_local std::vector<index_t> at;
  thread_local std::vector<float> kept;
  const index_t m = keep_reaching(key, count, bar, at, kept);
  return m < k ? kth_largest_radix(key, count, k) : kth_largest_radix(kept.data(), m, k);
}

// The positions (ascending) of the k largest keys among candidates (all of [0, count) when
// `candidates` is null), ties broken towards the lower position: every key above the k-th
// largest, then those equal to it in order. Over all of [0, count) with a small k, only
// the keys reaching a sampled threshold are looked at after one pass.
inline std::vector<index_t> top_k(const float* key, index_t count, index_t k, const std::vector<index_t>* candidates = nullptr) {
  std::vector<float> gathered;
  if (candidates) {
    gathered.resize(candidates->size());
    for (index_t j = 0; j < gathered.size(); ++j) gathered[j] = key[(*candidates)[j]];
  }
  const float* keys = candidates ? gathered.data() : key;
  const index_t n = candidates ? candidates->size() : count;
  k = std::min(k, n);
  std::vector<index_t> chosen;
  if (k == 0) return chosen;
  // The keys that can be chosen, ascending by position: those reaching a sampled
  // threshold when at least k do, else all.
  thread_local std::vector<index_t> at;
  thread_local std::vector<float> kept;
  const float bar = sampled_bar(keys, n, k);
  const index_t m = bar == -std::numeric_limits<float>::infinity() ? 0 : keep_reaching(keys, n, bar, at, kept);
  const bool narrowed = m >= k;
  const index_t pool = narrowed ? m : n;
  const float* pool_keys = narrowed ? kept.data() : keys;
  const float kth = kth_largest_radix(pool_keys, pool, k);
  index_t above = 0, equal = 0;
  for (index_t j = 0; j < pool; ++j) {
    above += pool_keys[j] > kth ? 1 : 0;
    equal += pool_keys[j] == kth ? 1 : 0;
  }
  index_t ties = k - above;
#ifdef FLOE_RANKING_X86
  // Every key equal to the k-th is taken (the usual case: the k-th alone): the choice is
  // the keys >= kth, 16 at a time (2.1-2.3 us for 8K keys instead of 12-13, 2-core machine).
  if (!candidates && ties == equal && detail::keep_reaching_avx512_available()) {
    chosen.resize(k + 16);
    const index_t filled = detail::positions_reaching_avx512(pool_keys, narrowed ? at.data() : nullptr, pool, kth,
                                                             chosen.data());
    chosen.resize(filled);
    return chosen;
  }
#endif
  chosen.resize(k + 1);  // branch-free: every key is written at the fill point, one spare slot
  index_t filled = 0;
  for (index_t j = 0; j < pool; ++j) {
    const float x = pool_keys[j];
    const bool take = x > kth || (x == kth && ties > 0);
    ties -= take && x == kth ? 1 : 0;
    const index_t p = narrowed ? at[j] : j;
    chosen[filled] = candidates ? (*candidates)[p] : p;
    filled += take ? 1 : 0;
  }
  chosen.resize(k);
  if (candidates) std::sort(chosen.begin(), chosen.end());
  return chosen;
}

// Top-p: the fewest tokens whose estimated share of the middle's attention reaches p,
// averaged over the group's heads (each head's estimated softmax over the middle), then
// clamped to [floor, cap] and to the middle.
inline index_t top_p_count(const float* scores, index_t heads, index_t count, index_t ld, const budget& b) {
  const std::vector<float> c = head_maxima(scores, heads, count, ld);
  std::vector<double> share(count, 0.0);
  for (index_t h = 0; h < heads; ++h) {
    double total = 0.0;
    for (index_t i = 0; i < count; ++i) total += std::exp(static_cast<double>(scores[h * ld + i]) - c[h]);
    for (index_t i = 0; i < count; ++i)
      share[i] += std::exp(static_cast<double>(scores[h * ld + i]) - c[h]) / (total * static_cast<double>(heads));
  }
  std::sort(share.begin(), share.end(), std::greater<double>{});
  index_t k = 0;
  double reached = 0.0;
  while (k < count && reached < b.value * (1.0 - 1e-12)) reached += share[k++];
  return std::min({std::max(k, b.floor), b.cap, count});
}

// The token count a budget grants the middle region of `count` tokens: counts and
// fractions resolve against the middle (a count larger than the middle is an error);
// mass budgets need the scores (top_p_count) and return 0 here.
inline index_t fixed_count(const budget& b, index_t count) {
  if (b.kind == budget::unit::mass) {
    b.resolve(count);  // checks p, floor and cap
    return 0;
  }
  return b.resolve(count);
}

}  // namespace floe::select::ranking
