// The tile kernels of the 4-bit key scan: score estimates and radii for the 16 tokens of
// one tile and up to 4 query heads. Three implementations of one formula, chosen at run
// time: AVX-512 VNNI (vpdpbusd: 64 code-times-query products per instruction), AVX2
// (vpmaddubsw + vpmaddwd), and a portable one (xsimd float lanes of the instruction set
// compiled for; about 5x slower than VNNI), so the library runs on any x86-64 CPU. All
// sum the same integers exactly; they differ only in float rounding, which the radius
// covers. VNNI also scans runs of whole tiles in one call (scan_vnni_run), storing in
// place. docs/methods/retrieval-completion.md, "quantized_scan".
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <system_error>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define FLOE_QUANTIZED_SCAN_X86 1  // the AVX2 and VNNI kernels and their CPU checks
#endif

#include <xsimd/xsimd.hpp>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"
#include "floe/core/numeric_types.hpp"
#include "floe/index/widen.hpp"

namespace floe {

// A query group prepared for the scan. Per head and block (of `groups` x 8 elements): the
// query's int8 codes (q ~ step * code), packed four to a word in the order the tile stores
// key codes, and the block's float terms of the estimate and of the radius.
struct quantized_query {
  index_t heads = 0, blocks = 0, groups = 0;
  std::vector<std::int8_t> codes;     // [heads, blocks * groups * 8]
  std::vector<std::int32_t> packed;   // [heads, blocks, groups, low/high]: codes 8G+0..3, 8G+4..7
  std::vector<float> step;            // [heads, blocks]
  std::vector<float> sums;            // [heads, blocks]: sum of s*q over the block (offset term)
  std::vector<float> reach_scale;     // [heads, blocks]: radius per unit of the token's scale
  std::vector<float> reach_offset;    // [heads, blocks]: radius per unit of |offset|
};

// Which tile kernel scans: the best one this CPU runs, or one forced (tests compare them).
enum class scan_kernel { automatic, portable, avx2, avx512_vnni };

namespace quantized_tile {

inline constexpr index_t tokens = 16;     // tokens of a tile
inline constexpr index_t group_dims = 8;  // elements of one 4-byte word per token
inline constexpr index_t heads_per_pass = 4;
// Elements sharing one offset and scale: a multiple of group_dims chosen at build
// (quantized_keys::build); 32 by default, 64 reads 72 bytes per token at d = 128 instead of 80.
inline constexpr index_t default_block_dims = 32;

// Bytes of one block of a tile: [group][token][4 bytes]. Byte b of a token's word holds
// element 8G + b in its low nibble and element 8G + 4 + b in its high nibble.
inline index_t block_code_bytes(index_t groups) { return groups * tokens * 4; }

// Where element t of token j of a block sits, and in which nibble.
inline index_t code_byte(index_t t, index_t j) { return (t / group_dims) * tokens * 4 + j * 4 + t % 4; }
inline bool code_high(index_t t) { return t % group_dims >= 4; }

// True when this CPU (and its OS) runs the AVX-512 VNNI kernel.
inline bool vnni_available() {
#ifdef FLOE_QUANTIZED_SCAN_X86
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;
#endif
}

// True when this CPU runs the AVX2 kernel (AVX2, FMA, F16C).
inline bool avx2_available() {
#ifdef FLOE_QUANTIZED_SCAN_X86
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && [] {
    unsigned a = 0, b = 0, c = 0, d = 0;  // F16C from CPUID leaf 1 (not every compiler's builtin knows it)
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return yes;
#else
  return false;
#endif
}

// Whether this CPU runs kernel k (automatic and portable always).
inline bool available(scan_kernel k) {
  return k == scan_kernel::avx512_vnni ? vnni_available() : k == scan_kernel::avx2 ? avx2_available() : true;
}

// Resolves `automatic` to the best kernel this CPU runs; FLOE_QUANTIZED_SCAN=portable or
// =avx2 in the environment caps the choice there.
inline scan_kernel resolve(scan_kernel k) {
  if (k != scan_kernel::automatic) return k;
  static const scan_kernel best = [] {
    const char* v = std::getenv("FLOE_QUANTIZED_SCAN");
    const std::string_view cap = v ? v : "";
    if (cap != "portable" && cap != "avx2" && vnni_available()) return scan_kernel::avx512_vnni;
    if (cap != "portable" && avx2_available()) return scan_kernel::avx2;
    return scan_kernel::portable;
  }();
  return best;
}

inline constexpr index_t max_prefetch_tiles = 4096;

// FLOE_SCAN_PREFETCH_TILES's value (or another setting's, named by `argument`): a whole
// number of tiles from 0 to max_prefetch_tiles, digits only.
inline index_t parse_prefetch_tiles(const char* text, const char* argument) {
  const std::string_view v = text ? text : "";
  index_t n = 0;
  const auto [end, error] = std::from_chars(v.data(), v.data() + v.size(), n);
  require(!v.empty() && v.front() != '-' && error == std::errc{} && end == v.data() + v.size() && n <= max_prefetch_tiles,
          argument, "'", v, "' is not a tile count from 0 to ", max_prefetch_tiles);
  return n;
}

// Tiles the scan asks for ahead of itself into L2 when nobody says: none on AMD CPUs and
// 16 on the others. Measured on the scan's own stream, cold: on Intel (Sapphire Rapids)
// the hardware prefetcher alone stalled on DRAM (by estimate 10.3-11.0 ms against 8.4-8.7), while
// on AMD (Zen 4) it alone was about a fifth faster than with the software prefetches (docs/methods/retrieval-completion.md,
// "Prefetching by CPU"). FLOE_SCAN_PREFETCH_TILES in the environment overrides both.
inline index_t default_prefetch_tiles() {
  static const index_t tiles = [] {
    const char* env = std::getenv("FLOE_SCAN_PREFETCH_TILES");
    if (env != nullptr && *env != '\0') return parse_prefetch_tiles(env, "FLOE_SCAN_PREFETCH_TILES");
#ifdef FLOE_QUANTIZED_SCAN_X86
    unsigned a = 0, vendor_b = 0, vendor_c = 0, vendor_d = 0;
    // "AuthenticAMD" comes back as EBX "Auth", EDX "enti", ECX "cAMD".
    if (__get_cpuid(0, &a, &vendor_b, &vendor_c, &vendor_d) && vendor_b == 0x68747541u && vendor_d == 0x69746e65u &&
        vendor_c == 0x444d4163u)
      return index_t{0};
#endif
    return index_t{16};
  }();
  return tiles;
}

// Centers and radii of heads [h0, h0 + H) for the tokens of one tile: out_c[h * 16 + j].
// The integer sums run in float lanes of the compiled instruction set (xsimd): they stay
// below 2^24 (|code * query code| <= 15 * 127 per element, at most 512 elements), so are exact.
template <index_t H, bool Radius>
void scan_portable(const quantized_query& p, index_t h0, const std::uint8_t* codes, const half* params,
                   float* out_c, float* out_r) {
  using lanes = xsimd::batch<float>;
  constexpr index_t L = lanes::size, V = tokens / L;
  static_assert(tokens % L == 0, "a tile must hold whole vectors");
  lanes center[H][V], radius[H][V];
  for (index_t h = 0; h < H; ++h)
    for (index_t v = 0; v < V; ++v) center[h][v] = radius[h][v] = lanes(0.f);
  alignas(64) float low[tokens], high[tokens], offset[tokens], scale[tokens], magnitude[tokens];
  const index_t block = p.groups * group_dims;
  for (index_t b = 0; b < p.blocks; ++b) {
    lanes dot[H][V];
    for (index_t h = 0; h < H; ++h)
      for (index_t v = 0; v < V; ++v) dot[h][v] = lanes(0.f);
    const std::uint8_t* cb = codes + b * block_code_bytes(p.groups);
    for (index_t G = 0; G < p.groups; ++G)
      for (index_t byte = 0; byte < 4; ++byte) {  // elements 8G + byte (low nibble) and 8G + 4 + byte (high)
        for (index_t j = 0; j < tokens; ++j) {
          const int c = cb[G * tokens * 4 + j * 4 + byte];
          low[j] = static_cast<float>(c & 15);
          high[j] = static_cast<float>(c >> 4);
        }
        for (index_t h = 0; h < H; ++h) {
          const std::int8_t* q = p.codes.data() + (h0 + h) * p.blocks * block + b * block + G * group_dims;
          const lanes ql(static_cast<float>(q[byte])), qh(static_cast<float>(q[4 + byte]));
          for (index_t v = 0; v < V; ++v)
            dot[h][v] = xsimd::fma(qh, lanes::load_aligned(high + v * L),
                                   xsimd::fma(ql, lanes::load_aligned(low + v * L), dot[h][v]));
        }
      }
    detail::widen_finite(params + b * 2 * tokens, offset, tokens);
    detail::widen_finite(params + b * 2 * tokens + tokens, scale, tokens);
    if constexpr (Radius)
      for (index_t j = 0; j < tokens; ++j) magnitude[j] = std::fabs(offset[j]);
    for (index_t h = 0; h < H; ++h) {
      const index_t at = (h0 + h) * p.blocks + b;
      const lanes step(p.step[at]), sum(p.sums[at]), rs(p.reach_scale[at]), ro(p.reach_offset[at]);
      for (index_t v = 0; v < V; ++v) {
        const lanes o = lanes::load_aligned(offset + v * L), s = lanes::load_aligned(scale + v * L);
        center[h][v] = xsimd::fma(o, sum, xsimd::fma(s, step * dot[h][v], center[h][v]));
        if constexpr (Radius)
          radius[h][v] = xsimd::fma(lanes::load_aligned(magnitude + v * L), ro, xsimd::fma(s, rs, radius[h][v]));
      }
    }
  }
  for (index_t h = 0; h < H; ++h)
    for (index_t v = 0; v < V; ++v) {
      center[h][v].store_unaligned(out_c + h * tokens + v * L);
      if constexpr (Radius) radius[h][v].store_unaligned(out_r + h * tokens + v * L);
    }
}

#ifdef FLOE_QUANTIZED_SCAN_X86
// The same for AVX-512 VNNI: the 16 tokens in the lanes, one int32 accumulator per head
// and nibble half; the results stay in registers for the caller to store.
template <index_t H, bool Radius>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline void vnni_tile(
    const quantized_query& p, index_t h0, const std::uint8_t* codes, const half* params, __m512 (&center)[H],
    __m512 (&radius)[H]) {
  for (index_t h = 0; h < H; ++h) center[h] = radius[h] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi8(0x0f), high_nibble = _mm512_set1_epi8(static_cast<char>(0xf0));
  const __mmask16 all = 0xffff;  // masked forms: GCC 12 warns on the unmasked ones' undefined source
  for (index_t b = 0; b < p.blocks; ++b) {
    // Two chains per head: the high nibbles in place (16x their code, |sum| <= 240 x 127
    // x 512, exact in int32), shifted once per block instead of once per load.
    __m512i low_dot[H], high_dot[H], dot[H];
    for (index_t h = 0; h < H; ++h) low_dot[h] = high_dot[h] = _mm512_setzero_si512();
    for (index_t G = 0; G < p.groups; ++G) {
      const __m512i v = _mm512_loadu_si512(codes + b * block_code_bytes(p.groups) + G * tokens * 4);
      const __m512i low = _mm512_and_si512(v, low_nibble), high = _mm512_and_si512(v, high_nibble);
      for (index_t h = 0; h < H; ++h) {
        const std::int32_t* w = p.packed.data() + (((h0 + h) * p.blocks + b) * p.groups + G) * 2;
        low_dot[h] = _mm512_dpbusd_epi32(low_dot[h], low, _mm512_set1_epi32(w[0]));
        high_dot[h] = _mm512_dpbusd_epi32(high_dot[h], high, _mm512_set1_epi32(w[1]));
      }
    }
    for (index_t h = 0; h < H; ++h) dot[h] = _mm512_add_epi32(low_dot[h], _mm512_maskz_srai_epi32(all, high_dot[h], 4));
    const __m512 offset = _mm512_maskz_cvtph_ps(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + b * 2 * tokens)));
    const __m512 scale =
        _mm512_maskz_cvtph_ps(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + b * 2 * tokens + tokens)));
    const __m512 magnitude = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(offset), _mm512_set1_epi32(0x7fffffff)));
    for (index_t h = 0; h < H; ++h) {
      const index_t at = (h0 + h) * p.blocks + b;
      const __m512 scaled_dot = _mm512_mul_ps(_mm512_set1_ps(p.step[at]), _mm512_maskz_cvtepi32_ps(all, dot[h]));
      center[h] = _mm512_fmadd_ps(offset, _mm512_set1_ps(p.sums[at]), _mm512_fmadd_ps(scale, scaled_dot, center[h]));
      if constexpr (Radius)
        radius[h] = _mm512_fmadd_ps(magnitude, _mm512_set1_ps(p.reach_offset[at]),
                                    _mm512_fmadd_ps(scale, _mm512_set1_ps(p.reach_scale[at]), radius[h]));
    }
  }
}

template <index_t H, bool Radius>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void scan_vnni(const quantized_query& p, index_t h0,
                                                                       const std::uint8_t* codes,
                                                                       const half* params, float* out_c,
                                                                       float* out_r) {
  __m512 center[H], radius[H];
  vnni_tile<H, Radius>(p, h0, codes, params, center, radius);
  for (index_t h = 0; h < H; ++h) {
    _mm512_storeu_ps(out_c + h * tokens, center[h]);
    if constexpr (Radius) _mm512_storeu_ps(out_r + h * tokens, radius[h]);
  }
}

// Whole tiles [0, count) of a run, `stride` bytes apart (codes, then params at
// `code_bytes`), stored straight to center/radius[(h0 + h) * ld + 16 * tile], with
// maxima[h0 + h] (when given) raised to each head's largest center: one call per run of tiles, not
// per tile, so that the tiles overlap in the core. Prefetches `ahead` tiles ahead into L2
// while they are below `prefetch_count` (spreading the prefetches among the loads gained nothing).
template <index_t H, bool Radius>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void scan_vnni_run(
    const quantized_query& p, index_t h0, const std::uint8_t* tiles, index_t stride, index_t code_bytes,
    index_t count, index_t ahead, index_t prefetch_count, float* center_out, float* radius_out, index_t ld,
    float* maxima) {
  const bool track = maxima != nullptr;
  __m512 best[H];
  for (index_t h = 0; h < H; ++h) best[h] = _mm512_set1_ps(-__builtin_huge_valf());
  for (index_t t = 0; t < count; ++t) {
    const std::uint8_t* tile = tiles + t * stride;
    if (ahead > 0 && t + ahead < prefetch_count)
      for (index_t b = 0; b < stride; b += 64) _mm_prefetch(reinterpret_cast<const char*>(tile + ahead * stride + b), _MM_HINT_T1);
    __m512 center[H], radius[H];
    vnni_tile<H, Radius>(p, h0, tile, reinterpret_cast<const half*>(tile + code_bytes), center, radius);
    for (index_t h = 0; h < H; ++h) {
      _mm512_storeu_ps(center_out + (h0 + h) * ld + t * tokens, center[h]);
      if constexpr (Radius) _mm512_storeu_ps(radius_out + (h0 + h) * ld + t * tokens, radius[h]);
      // The masked form: GCC 12's _mm512_max_ps trips -Wmaybe-uninitialized.
      if (track) best[h] = _mm512_maskz_max_ps(0xffff, best[h], center[h]);
    }
  }
  if (track)
    for (index_t h = 0; h < H; ++h) {
      alignas(64) float lanes[tokens];
      _mm512_store_ps(lanes, best[h]);
      maxima[h0 + h] = std::max(maxima[h0 + h], *std::max_element(lanes, lanes + tokens));
    }
}

// The same for AVX2: 8 tokens per register, two halves per tile. vpmaddubsw sums two code
// x query products into int16 (|.| <= 2 x 15 x 127, and the low and high nibbles' sums
// together <= 7620: no saturation), vpmaddwd the pairs of a token into int32.
template <index_t H, bool Radius>
__attribute__((target("avx2,fma,f16c"))) void scan_avx2(const quantized_query& p, index_t h0,
                                                        const std::uint8_t* codes, const half* params,
                                                        float* out_c, float* out_r) {
  __m256 center[H][2], radius[H][2];
  for (index_t h = 0; h < H; ++h)
    for (int s = 0; s < 2; ++s) center[h][s] = radius[h][s] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (index_t b = 0; b < p.blocks; ++b) {
    __m256i dot[H][2];
    for (index_t h = 0; h < H; ++h) dot[h][0] = dot[h][1] = _mm256_setzero_si256();
    for (index_t G = 0; G < p.groups; ++G)
      for (int s = 0; s < 2; ++s) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(codes + b * block_code_bytes(p.groups) + G * tokens * 4 + s * 32));
        const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (index_t h = 0; h < H; ++h) {
          const std::int32_t* w = p.packed.data() + (((h0 + h) * p.blocks + b) * p.groups + G) * 2;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(w[0])),
                                                 _mm256_maddubs_epi16(high, _mm256_set1_epi32(w[1])));
          dot[h][s] = _mm256_add_epi32(dot[h][s], _mm256_madd_epi16(pairs, ones));
        }
      }
    for (int s = 0; s < 2; ++s) {
      const half* prm = params + b * 2 * tokens + s * 8;
      const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(prm)));
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(prm + tokens)));
      const __m256 magnitude = _mm256_and_ps(offset, sign_off);
      for (index_t h = 0; h < H; ++h) {
        const index_t at = (h0 + h) * p.blocks + b;
        const __m256 scaled_dot = _mm256_mul_ps(_mm256_set1_ps(p.step[at]), _mm256_cvtepi32_ps(dot[h][s]));
        center[h][s] =
            _mm256_fmadd_ps(offset, _mm256_set1_ps(p.sums[at]), _mm256_fmadd_ps(scale, scaled_dot, center[h][s]));
        if constexpr (Radius)
          radius[h][s] = _mm256_fmadd_ps(magnitude, _mm256_set1_ps(p.reach_offset[at]),
                                         _mm256_fmadd_ps(scale, _mm256_set1_ps(p.reach_scale[at]), radius[h][s]));
      }
    }
  }
  for (index_t h = 0; h < H; ++h)
    for (int s = 0; s < 2; ++s) {
      _mm256_storeu_ps(out_c + h * tokens + s * 8, center[h][s]);
      if constexpr (Radius) _mm256_storeu_ps(out_r + h * tokens + s * 8, radius[h][s]);
    }
}
#endif

// Calls f.operator()<H>() with H = hn, 1 <= hn <= heads_per_pass: the kernels unroll over heads.
template <class F>
inline void with_head_count(index_t hn, F&& f) {
  switch (hn) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    default: f.template operator()<4>(); break;
  }
}

// One tile, heads [h0, h0 + hn), hn <= heads_per_pass, with the resolved kernel. Without
// `with_radius` out_r is left alone (choosing by estimate needs no bounds).
inline void scan_tile(scan_kernel kernel, const quantized_query& p, index_t h0, index_t hn, const std::uint8_t* codes,
                      const half* params, float* out_c, float* out_r, bool with_radius = true) {
  auto run = [&]<index_t H, bool R>() {
#ifdef FLOE_QUANTIZED_SCAN_X86
    if (kernel == scan_kernel::avx512_vnni) return scan_vnni<H, R>(p, h0, codes, params, out_c, out_r);
    if (kernel == scan_kernel::avx2) return scan_avx2<H, R>(p, h0, codes, params, out_c, out_r);
#endif
    scan_portable<H, R>(p, h0, codes, params, out_c, out_r);
  };
  with_head_count(hn, [&]<index_t H>() {
    if (with_radius)
      run.template operator()<H, true>();
    else
      run.template operator()<H, false>();
  });
}

#ifdef FLOE_QUANTIZED_SCAN_X86
// scan_vnni_run for heads [h0, h0 + hn), hn <= heads_per_pass.
inline void scan_run_vnni(const quantized_query& p, index_t h0, index_t hn, const std::uint8_t* tiles, index_t stride,
                          index_t code_bytes, index_t count, index_t ahead, index_t prefetch_count, float* center,
                          float* radius, index_t ld, float* maxima) {
  with_head_count(hn, [&]<index_t H>() {
    if (radius)
      scan_vnni_run<H, true>(p, h0, tiles, stride, code_bytes, count, ahead, prefetch_count, center, radius, ld, maxima);
    else
      scan_vnni_run<H, false>(p, h0, tiles, stride, code_bytes, count, ahead, prefetch_count, center, radius, ld, maxima);
  });
}
#endif

}  // namespace quantized_tile
}  // namespace floe
