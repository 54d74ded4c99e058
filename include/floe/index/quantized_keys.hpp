// 4-bit keys of one (layer, KV head) with a per-(token, block) offset and scale, and
// the scan that turns them into score estimates with deterministic error bounds.
// Tokens are stored in tiles of 16, so that the scan runs across the 16 tokens of a tile
// in vector lanes (layout and kernels: quantized_scan_kernels.hpp).
// docs/methods/retrieval-completion.md, "quantized_scan".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/error.hpp"
#include "floe/core/huge_page_allocator.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/index/directed_half.hpp"
#include "floe/index/quantized_scan_kernels.hpp"
#include "floe/index/widen.hpp"

namespace floe {

class quantized_keys {
 public:
  static constexpr index_t tile_tokens = quantized_tile::tokens;

  quantized_keys() = default;

  // `block_dims` elements of a key share one offset and scale: a multiple of 8 in [8, 512].
  // Larger blocks read fewer bytes and bound less tightly (docs/methods/retrieval-completion.md).
  template <KvView KV>
  static quantized_keys build(const KV& kv, index_t block = quantized_tile::default_block_dims) {
    require(block >= quantized_tile::group_dims && block <= 512 && block % quantized_tile::group_dims == 0,
            "block_dims", "must be a multiple of ", quantized_tile::group_dims, " in [", quantized_tile::group_dims,
            ", 512], got ", block);
    quantized_keys idx;
    idx.d_ = kv.d();
    idx.block_dims_ = block;
    idx.blocks_ = (kv.d() + block - 1) / block;
    idx.append(kv);
    return idx;
  }

  // Brings the index to the cache: quantises tokens [tokens(), kv.n()) of a cache that grew
  // by decoding, or drops tokens [kv.n(), tokens()) of one cut back (rejected speculative
  // tokens), so that it equals a build on the view either way.
  template <KvView KV>
  void append(const KV& kv) {
    require(kv.d() == d_, "kv", "index built for d = ", d_, ", the view has d = ", kv.d());
    if (kv.n() < n_) {  // cleared from the view's last tile on, which is quantised again below
      const index_t keep = kv.n() / tile_tokens;
      tiles_.resize(keep * tile_halves());
      n_ = keep * tile_tokens;
    }
    const index_t tiles = (kv.n() + tile_tokens - 1) / tile_tokens;
    tiles_.resize(tiles * tile_halves(), half{});
    std::vector<float> row(blocks_ * block_dims_, 0.f);
    for (index_t i = n_; i < kv.n(); ++i) {
      const auto* k = kv.key_row(i);
      for (index_t t = 0; t < d_; ++t) {
        row[t] = to_float(k[t]);
        require(std::isfinite(row[t]) && std::fabs(row[t]) <= 60000.f, "keys", "key ", i, " element ", t, " is ",
                row[t], ": the 4-bit index holds finite keys of magnitude <= 60000");
      }
      quantize_row(row.data(), i);
    }
    n_ = kv.n();
  }

  // Tiles the scan asks for ahead of itself into L2; 0 leaves it to the hardware prefetcher.
  // The default depends on the CPU (quantized_tile::default_prefetch_tiles).
  index_t prefetch_tiles() const { return prefetch_tiles_; }
  void set_prefetch_tiles(index_t tiles) {
    require(tiles <= quantized_tile::max_prefetch_tiles, "prefetch_tiles", tiles, " is not a tile count from 0 to ",
            quantized_tile::max_prefetch_tiles);
    prefetch_tiles_ = tiles;
  }

  index_t tokens() const { return n_; }
  index_t d() const { return d_; }
  index_t block_dims() const { return block_dims_; }
  // Bytes the scan reads per token: codes plus the offset and scale of every block.
  index_t bytes_per_token() const { return blocks_ * (block_dims_ / 2 + 2 * sizeof(half)); }
  std::uint64_t bytes() const { return static_cast<std::uint64_t>(n_) * bytes_per_token(); }

  // Scaled query rows s*q_h as int8 codes per block, with the terms of the estimate and
  // of its radius. Rounding the query costs |sum_t e_t k_t| <= 15 scale * sum_t |e_t| on
  // top of the keys' own rounding (the key code lies in 0..15, e_t = s q_t - step code_t).
  quantized_query prepare(const query_group& q) const {
    constexpr index_t D = quantized_tile::group_dims;
    const index_t G = block_dims_ / D, pd = blocks_ * block_dims_;
    quantized_query p;
    p.heads = q.heads;
    p.blocks = blocks_;
    p.groups = G;
    std::vector<std::uint8_t> bytes(G * 2 * 4);  // one block's packed codes: [group][low/high][4]
    p.codes.assign(q.heads * pd, 0);
    p.packed.assign(q.heads * blocks_ * G * 2, 0);
    for (auto* v : {&p.step, &p.sums, &p.reach_scale, &p.reach_offset}) v->assign(q.heads * blocks_, 0.f);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t b = 0; b < blocks_; ++b) {
        const index_t first = b * block_dims_, last = std::min(d_, first + block_dims_);
        float top = 0.f;
        for (index_t t = first; t < last; ++t) {
          const float x = q.scale * q.row(h)[t];
          require(std::isfinite(x), "query", "head ", h, " element ", t, " is ", x);
          top = std::max(top, std::fabs(x));
        }
        const float step = top / 127.f;
        double sum = 0, l1 = 0, lost = 0;  // lost: sum of |e_t|
        for (index_t t = first; t < last; ++t) {
          const float x = q.scale * q.row(h)[t];
          const float c = step > 0.f ? std::clamp(std::nearbyint(x / step), -127.f, 127.f) : 0.f;
          p.codes[h * pd + t] = static_cast<std::int8_t>(c);
          sum += x;
          l1 += std::fabs(x);
          lost += std::fabs(static_cast<double>(x) - static_cast<double>(step) * c);
        }
        for (index_t t = 0; t < block_dims_; ++t)
          bytes[(t / D) * 8 + (t % D >= 4 ? 4 : 0) + t % 4] = static_cast<std::uint8_t>(p.codes[h * pd + first + t]);
        std::memcpy(p.packed.data() + (h * blocks_ + b) * G * 2, bytes.data(), bytes.size());
        const index_t at = h * blocks_ + b;
        p.step[at] = step;
        p.sums[at] = static_cast<float>(sum);
        // Half a key step per element, the query's rounding, and float rounding of the dot
        // products here and in any executor's exact score (relative 4e-5 of sum |s q_t k_t|).
        p.reach_scale[at] = static_cast<float>(l1 * (0.5 + 1e-4 + 16 * 4e-5) + 15.0 * lost * (1 + 1e-5) + 1e-30);
        p.reach_offset[at] = static_cast<float>(l1 * 4e-5 * (1 + 1e-5));
      }
    return p;
  }

  // For tokens [begin, end) and every head h: center[h * ld + i - begin] estimates the
  // score z = s q_h . k_i, and |z - center| <= radius (same layout), however z is rounded.
  // A null `radius` leaves the radii out. A non-null `maxima` gets max_i center[h][i] per
  // head (the pass over the estimates a ranking would make next, done while they are hot).
  void scan(const quantized_query& p, index_t begin, index_t end, float* center, float* radius, index_t ld,
            scan_kernel kernel = scan_kernel::automatic, float* maxima = nullptr) const {
    require(p.blocks == blocks_ && p.groups * quantized_tile::group_dims == block_dims_, "query", "prepared for ",
            p.blocks, " blocks of ", p.groups * quantized_tile::group_dims, " elements, the index has ", blocks_,
            " of ", block_dims_);
    require(begin <= end && end <= n_, "range", "[", begin, ", ", end, ") is not within the ", n_, " indexed tokens");
    require(quantized_tile::available(kernel), "kernel", "scan kernel ", static_cast<int>(kernel),
            " asked for on a CPU that does not run it");
    kernel = quantized_tile::resolve(kernel);
    constexpr index_t T = tile_tokens, P = quantized_tile::heads_per_pass;
    alignas(64) float out_c[P * T], out_r[P * T];
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size;
    static_assert(T % L == 0, "a tile is whole vectors");
    thread_local std::vector<float> lane_max;  // [heads][L], reduced at the end
    if (maxima) lane_max.assign(p.heads * L, -std::numeric_limits<float>::infinity());
    const index_t last_tile = (end + T - 1) / T;
    auto one_tile = [&](index_t tile) {  // any kernel, a whole or cut tile, through out_c / out_r
      const index_t first = std::max(begin, tile * T), last = std::min(end, (tile + 1) * T);
      if (prefetch_tiles_ > 0 && tile + prefetch_tiles_ < last_tile) prefetch_tile(tile + prefetch_tiles_);
      for (index_t h0 = 0; h0 < p.heads; h0 += P) {
        const index_t hn = std::min(P, p.heads - h0);
        quantized_tile::scan_tile(kernel, p, h0, hn, tile_codes(tile), tile_params_at(tile), out_c, out_r,
                                  radius != nullptr);
        for (index_t h = 0; h < hn; ++h) {
          const float* c = out_c + h * T + (first - tile * T);
          std::copy(c, c + (last - first), center + (h0 + h) * ld + first - begin);
          if (!maxima) continue;
          float* m = lane_max.data() + (h0 + h) * L;
          if (last - first == T) {
            lanes run = lanes::load_unaligned(m);
            for (index_t j = 0; j < T; j += L) run = xsimd::max(run, lanes::load_unaligned(c + j));
            run.store_unaligned(m);
          } else {
            for (index_t j = 0; j < last - first; ++j) m[0] = std::max(m[0], c[j]);
          }
        }
        if (radius)
          for (index_t h = 0; h < hn; ++h)
            for (index_t i = first; i < last; ++i) radius[(h0 + h) * ld + i - begin] = out_r[h * T + i - tile * T];
      }
    };
    index_t tile = begin / T;
#ifdef FLOE_QUANTIZED_SCAN_X86
    // VNNI: the whole tiles in runs of one call per head pass, stored in place.
    const index_t whole_end = end / T;
    if (kernel == scan_kernel::avx512_vnni && (begin + T - 1) / T < whole_end) {
      if (begin % T != 0) one_tile(tile++);
      thread_local std::vector<float> run_max;  // per head, folded into lane_max below
      if (maxima) run_max.assign(p.heads, -std::numeric_limits<float>::infinity());
      constexpr index_t run_tiles = 64;  // 80 KiB at d = 128: the run stays in L2 across head passes
      const index_t stride = tile_halves() * index_t{sizeof(half)};
      while (tile < whole_end) {
        const index_t count = std::min(run_tiles, whole_end - tile);
        for (index_t h0 = 0; h0 < p.heads; h0 += P)
          quantized_tile::scan_run_vnni(p, h0, std::min(P, p.heads - h0), tile_codes(tile), stride, tile_code_bytes(),
                                        count, h0 == 0 ? prefetch_tiles_ : 0, last_tile - tile,
                                        center + tile * T - begin, radius ? radius + tile * T - begin : nullptr, ld,
                                        maxima ? run_max.data() : nullptr);
        tile += count;
      }
      if (maxima)
        for (index_t h = 0; h < p.heads; ++h) lane_max[h * L] = std::max(lane_max[h * L], run_max[h]);
    }
#endif
    for (; tile < last_tile; ++tile) one_tile(tile);
    if (maxima)
      for (index_t h = 0; h < p.heads; ++h)
        maxima[h] = *std::max_element(lane_max.begin() + h * L, lane_max.begin() + (h + 1) * L);
  }

 private:
  // Into L2, not L1 (Intel, phase_scan, 4 heads, g = 1, cold: 2.7-3.5 ms into L1, 2.1-2.3 into L2).
  void prefetch_tile(index_t tile) const { detail::prefetch_row(tiles_.data() + tile * tile_halves(), tile_halves()); }

  // Codes of a tile: [block][quantized_tile::block_code_bytes]. Params of a tile:
  // [block][offset x16, scale x16].
  index_t block_code_bytes() const { return quantized_tile::block_code_bytes(block_dims_ / quantized_tile::group_dims); }
  index_t tile_code_bytes() const { return blocks_ * block_code_bytes(); }
  index_t tile_params() const { return blocks_ * 2 * tile_tokens; }
  index_t tile_halves() const { return tile_code_bytes() / index_t{sizeof(half)} + tile_params(); }
  std::uint8_t* tile_codes(index_t tile) { return reinterpret_cast<std::uint8_t*>(tiles_.data() + tile * tile_halves()); }
  const std::uint8_t* tile_codes(index_t tile) const {
    return reinterpret_cast<const std::uint8_t*>(tiles_.data() + tile * tile_halves());
  }
  half* tile_params_at(index_t tile) { return tiles_.data() + tile * tile_halves() + tile_code_bytes() / index_t{sizeof(half)}; }
  const half* tile_params_at(index_t tile) const {
    return tiles_.data() + tile * tile_halves() + tile_code_bytes() / index_t{sizeof(half)};
  }

  // Offset rounded down and scale rounded up, so every element lies in [offset, offset + 15 scale].
  void quantize_row(const float* row, index_t i) {
    const index_t tile = i / tile_tokens, j = i % tile_tokens;
    std::uint8_t* c = tile_codes(tile);
    half* prm = tile_params_at(tile);
    for (index_t b = 0; b < blocks_; ++b) {
      const float* x = row + b * block_dims_;
      const index_t len = std::min(block_dims_, d_ - b * block_dims_);
      const auto [lo, hi] = std::minmax_element(x, x + len);
      const half offset = detail::half_not_above(*lo);
      const float off = offset.to_float();
      const half scale = detail::half_not_below((*hi - off) / 15.f * (1.f + 1e-6f));
      const float sc = scale.to_float();
      prm[b * 2 * tile_tokens + j] = offset;
      prm[b * 2 * tile_tokens + tile_tokens + j] = scale;
      for (index_t t = 0; t < len; ++t) {
        std::uint8_t& byte = c[b * block_code_bytes() + quantized_tile::code_byte(t, j)];
        const std::uint8_t q = code(x[t], off, sc);
        byte = quantized_tile::code_high(t) ? static_cast<std::uint8_t>((byte & 0x0fu) | (q << 4))
                                            : static_cast<std::uint8_t>((byte & 0xf0u) | q);
      }
    }
  }

  static std::uint8_t code(float x, float offset, float scale) {
    if (!(scale > 0.f)) return 0;
    const float c = std::nearbyint((x - offset) / scale);
    return static_cast<std::uint8_t>(std::clamp(c, 0.f, 15.f));
  }

  index_t n_ = 0, d_ = 0, blocks_ = 0, block_dims_ = quantized_tile::default_block_dims;
  index_t prefetch_tiles_ = quantized_tile::default_prefetch_tiles();
  // [tiles][codes, then params]: the scan reads one stream. On huge pages: with 4 KiB
  // pages the scan ran at half the dense kernel's DRAM rate (docs/methods/retrieval-completion.md).
  std::vector<half, huge_page_allocator<half>> tiles_;
};

}  // namespace floe
