// floe::exec::cuda — the CUDA executor: the Executor concept (score, attend) and batch
// decode (decode, decode_gathered) on an NVIDIA GPU, fp32 accumulation and online softmax
// over fp32 / fp16 / bf16 KV, one read of each row for all query heads of a GQA group
// (up to 8 a pass), split over the N axis in chunks merged per group. Views must point to
// memory the device can read: cudaMalloc'd memory, or host memory registered with
// cudaHostRegister (the estimators' selectors also read keys on the host; registered or
// managed memory serves both). The kernels are compiled into floe::cuda (link it).
// docs/cuda-executor.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "floe/core/batch.hpp"
#include "floe/core/concepts.hpp"
#include "floe/exec/batch_decode.hpp"
#include "floe/exec/cuda/kernel_api.hpp"
#include "floe/exec/simd/work_split.hpp"

namespace floe::exec {

struct cuda_options {
  int device = 0;
  // Rows one thread block reads (a group of n rows runs as n / chunk_tokens blocks whose
  // partials are merged); 0: chosen per call from the work and the multiprocessor count.
  index_t chunk_tokens = 0;
  // The cudaStream_t every call runs on, after whatever the caller queued there before
  // it (an engine's stream); null: the calling thread's default stream
  // (cudaStreamPerThread). Each call still returns when its outputs are written.
  void* stream = nullptr;
};

// `count` token indices in device memory, strictly ascending (exec::cuda::decode_indexed).
struct device_tokens {
  const std::int32_t* indices = nullptr;
  index_t count = 0;
};

class cuda : public batch_decoder<cuda> {
 public:
  using accumulator = float;
  static constexpr std::string_view name = "cuda";

  // True when a CUDA device and driver are present.
  static bool available() { return cuda_detail::device_count() > 0; }

  cuda() : cuda(cuda_options{}) {}
  explicit cuda(cuda_options options) : opt_(options) {
    require(opt_.chunk_tokens <= (index_t{1} << 20), "chunk_tokens", "must be at most 2^20 (0: automatic), got ",
            opt_.chunk_tokens);
    const int devices = cuda_detail::device_count();
    if (devices == 0) throw cuda_error("no CUDA device is available");
    require(opt_.device >= 0 && opt_.device < devices, "device", "device ", opt_.device, " of ", devices);
    multiprocessors_ = cuda_detail::multiprocessors(opt_.device);
  }

  const cuda_options& options() const { return opt_; }

  // z[i - r.begin] = scale * q_head . k_i for i in r (z is host memory).
  template <KvView KV>
  void score(const KV& kv, const query_group& q, index_t head, token_range r, float* z) const {
    validate_query(q, kv.d());
    require_shape(kv);
    require(head < q.heads, "head", "head ", head, " of a group of ", q.heads, " query heads");
    require(r.begin <= r.end && r.end <= kv.n(), "range", "[", r.begin, ", ", r.end, ") is not inside [0, ",
            kv.n(), ")");
    if (r.begin == r.end) return;
    require(z != nullptr, "z", "null pointer");
    cuda_detail::select_device(opt_.device, opt_.stream);
    plan p(chunk_tokens_for(r.size()));
    const auto [desc, at] = host_query(p, q, head, 1);
    p.add_group(kv, std::span<const token_range>(&r, 1), desc, nullptr, 0, at);
    device_block mem(p.device_bytes(r.size()));
    p.upload(mem);
    cuda_detail::launch_score({.plan = p.on_device(mem, element_of<KV>(), row_of(kv), 1), .z = p.results_on(mem)});
    cuda_detail::to_host(z, p.results_on(mem), r.size() * sizeof(float));
    cuda_detail::synchronize();
  }

  // Adds to `out` the k (<= n) tokens of kv whose softmax weights, summed over the
  // group's heads, are largest (ties to the lower index): the ranking of oracle_topk and
  // of anchor_reuse's anchor layers (select::add_group_top_k calls it). Scores, weights
  // and the selection stay on the device; only the k indices come back.
  template <KvView KV>
  void group_top_k(const KV& kv, const query_group& q, index_t k, selection& out) const {
    check_top_k(kv, q, k);
    if (k == 0) return;
    if (k == kv.n()) return out.add(0, k);
    cuda_detail::select_device(opt_.device, opt_.stream);
    device_block chosen(sizeof(std::int32_t) * k);
    const std::span<const KV> views(&kv, 1);
    const unsigned long long* flags =
        rank_on_device(views, std::span<const query_group>(&q, 1), k, reinterpret_cast<std::int32_t*>(chosen.p));
    std::vector<std::int32_t> indices(k);
    cuda_detail::to_host(indices.data(), chosen.p, sizeof(std::int32_t) * k);
    cuda_detail::synchronize();
    refuse_bad_key(views, q.heads, flags[1], "kv", [](index_t) { return ""; });
    for (const std::int32_t i : indices) out.add(i, i + 1);
  }

  // The same top k as k ascending indices written to device memory (`indices`, k
  // entries), where decode_indexed can read them, this layer or a later one (Kascade's
  // reuse), without a trip through the host.
  template <KvView KV>
  void group_top_k(const KV& kv, const query_group& q, index_t k, std::int32_t* indices) const {
    group_top_k(std::span<const KV>(&kv, 1), std::span<const query_group>(&q, 1), k, indices);
  }

  // Every KV head of a layer at once: kv_heads[h] (one sequence's views, of equal n and
  // d) ranked for queries[h] (host), the top k of each into indices + h * k (device). One
  // score launch and one chain of selection kernels serve all heads.
  template <KvView KV>
  void group_top_k(std::span<const KV> kv_heads, std::span<const query_group> queries, index_t k,
                   std::int32_t* indices) const {
    require(!kv_heads.empty(), "kv_heads", "no KV heads");
    require(queries.size() == kv_heads.size(), "queries", queries.size(), " query groups for ", kv_heads.size(),
            " KV heads");
    for (index_t h = 0; h < kv_heads.size(); ++h) {
      check_top_k(kv_heads[h], queries[h], k);
      require(kv_heads[h].n() == kv_heads[0].n() && kv_heads[h].d() == kv_heads[0].d(), "kv_heads", "KV head ", h,
              " has n = ", kv_heads[h].n(), ", d = ", kv_heads[h].d(), "; KV head 0 n = ", kv_heads[0].n(), ", d = ",
              kv_heads[0].d());
      require(queries[h].heads == queries[0].heads, "queries", "group ", h, " has ", queries[h].heads,
              " heads, group 0 ", queries[0].heads);
    }
    if (k == 0) return;
    require(indices != nullptr, "indices", "null pointer");
    cuda_detail::select_device(opt_.device, opt_.stream);
    if (k == kv_heads[0].n()) {
      std::vector<std::int32_t> all(k * kv_heads.size());
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::int32_t>(i % k);
      cuda_detail::to_device(indices, all.data(), sizeof(std::int32_t) * all.size());
      cuda_detail::synchronize();
    } else {
      const unsigned long long* flags = rank_on_device(kv_heads, queries, k, indices);
      cuda_detail::synchronize();
      refuse_bad_key(kv_heads, queries[0].heads, flags[1], "kv_heads",
                     [](index_t gi) { return floe::detail::concat("KV head ", gi, ", "); });
    }
  }

  // The engine's case, queries on the device: for every sequence s of the batch, KV head
  // h ranked for query heads [h g, (h + 1) g) of seq.queries (device, as for decode), its
  // top k into indices + (s Hkv + h) k, the order decode_indexed takes its lists in. k is
  // at most every sequence's n; a sequence's KV heads share n and d. One score launch and
  // one chain of selection kernels per run of sequences of equal n serve the batch, with
  // 4 Hq n bytes of device scratch per sequence for the scores. A NaN or Inf query is
  // found on the device, in the score launch, and refused ("sequence.queries") before any
  // index is written.
  template <KvView KV>
  void group_top_k(std::span<const sequence<KV>> batch, gqa_shape shape, float scale, index_t k,
                   std::int32_t* indices) const {
    shape.validate();
    require(std::isfinite(scale) && scale > 0.f, "scale", "must be finite and positive, got ", scale);
    const index_t g = shape.group();
    std::vector<cuda_detail::group_desc> checks;  // per (sequence, KV head): its device queries
    for (index_t s = 0; s < batch.size(); ++s) {
      const sequence<KV>& seq = batch[s];
      require(seq.kv_heads.size() == shape.kv_heads, "sequence.kv_heads", seq.kv_heads.size(),
              " KV heads, expected ", shape.kv_heads);
      require(seq.queries != nullptr, "sequence.queries", "null pointer");
      for (index_t h = 0; h < shape.kv_heads; ++h) {
        const KV& kv = seq.kv_heads[h];
        require_shape(kv);
        require(kv.n() == seq.kv_heads[0].n() && kv.d() == seq.kv_heads[0].d(), "sequence.kv_heads", "sequence ", s,
                ", KV head ", h, " has n = ", kv.n(), ", d = ", kv.d(), "; KV head 0 n = ", seq.kv_heads[0].n(),
                ", d = ", seq.kv_heads[0].d());
        require(k <= kv.n(), "k", "top ", k, " of sequence ", s, "'s cache of n = ", kv.n(), " tokens");
        const index_t qs = seq.query_stride ? seq.query_stride : kv.d();
        require(qs >= kv.d(), "sequence.query_stride", "stride ", qs, " is smaller than d = ", kv.d());
        cuda_detail::group_desc q{};
        q.q = seq.queries + h * g * qs;
        q.q_stride = static_cast<std::int64_t>(qs);
        q.heads = static_cast<std::int32_t>(g);
        q.d = static_cast<std::int32_t>(kv.d());
        q.scale = scale;
        checks.push_back(q);
      }
    }
    if (k == 0 || batch.empty()) return;
    require(indices != nullptr, "indices", "null pointer");
    cuda_detail::select_device(opt_.device, opt_.stream);
    std::vector<KV> heads;
    for (const sequence<KV>& seq : batch) heads.insert(heads.end(), seq.kv_heads.begin(), seq.kv_heads.end());
    const std::span<const KV> all(heads);
    const unsigned long long* flag = rank_on_device(
        all, g,
        [&](plan&, index_t gi, index_t h0, index_t count) {
          cuda_detail::group_desc desc = checks[gi];
          desc.q += h0 * desc.q_stride;
          desc.heads = static_cast<std::int32_t>(count);
          return std::pair{desc, plan::npos};
        },
        k, indices, true);
    cuda_detail::synchronize();
    const cuda_detail::nonfinite_query bad = cuda_detail::decode_nonfinite(flag[0]);
    if (bad.group >= 0) {  // plan group: head slice `bad.group % slices` of group gi
      const index_t pass = pass_of(all), slices = (g + pass - 1) / pass, gi = index_t(bad.group) / slices;
      const index_t head = gi % shape.kv_heads * g + index_t(bad.group) % slices * pass + index_t(bad.head);
      require(false, "sequence.queries", "sequence ", gi / shape.kv_heads, ", query head ", head, ", element ",
              bad.element, " is NaN or Inf");
    }
    refuse_bad_key(all, g, flag[1], "sequence.kv_heads", [&](index_t gi) {
      return floe::detail::concat("sequence ", gi / shape.kv_heads, ", KV head ", gi % shape.kv_heads, ", ");
    });
    // Caches of exactly k tokens: every token, written once the queries passed.
    std::vector<std::int32_t> every;
    for (index_t gi = 0; gi < heads.size(); ++gi)
      if (heads[gi].n() == k) {
        for (index_t i = every.size(); i < k; ++i) every.push_back(static_cast<std::int32_t>(i));
        cuda_detail::to_device(indices + gi * k, every.data(), sizeof(std::int32_t) * k);
      }
    if (!every.empty()) cuda_detail::synchronize();
  }

  // Gathered decode over device token lists: group s * Hkv + h (KV head h of sequence s)
  // attends to lists[s * Hkv + h], `count` strictly ascending indices below its view's n
  // in device memory (group_top_k's device output, say). Contiguous caches (kv_view)
  // only. The lists are checked on the device before any row is read through them; a bad
  // one throws invalid_argument("tokens", "sequence s, KV head h, position p ...") and
  // nothing is written. Queries, outputs and KV on the device, as for decode.
  template <KvElement T>
  void decode_indexed(std::span<const sequence<kv_view<T>>> batch, gqa_shape shape, float scale,
                      std::span<const device_tokens> lists) const {
    shape.validate();
    require(lists.size() == batch.size() * shape.kv_heads, "tokens", lists.size(), " token lists for ", batch.size(),
            " sequences of ", shape.kv_heads, " KV heads");
    for (index_t i = 0; i < lists.size(); ++i)
      require(lists[i].count == 0 || lists[i].indices != nullptr, "tokens", "list ", i, " is a null pointer");
    run_batch(batch, shape, scale, [&](index_t group, const kv_view<T>&) { return lists[group]; });
  }

  // Merges the exact partial over `ranges` of every query head of the group into `out`.
  template <KvView KV>
  void attend(const KV& kv, const query_group& q, std::span<const token_range> ranges, partial_set<float>& out) const {
    validate_query(q, kv.d());
    require_shape(kv);
    require(out.heads() == q.heads, "partial.heads", out.heads(), " partials for ", q.heads, " query heads");
    require(out.dv() == kv.dv(), "partial.dv", "partial of dv ", out.dv(), " for values of dv ", kv.dv());
    const index_t tokens = floe::checked_token_count(ranges, kv.n());
    if (tokens == 0) return;
    const int pass = cuda_detail::heads_per_pass(row_of(kv));
    cuda_detail::select_device(opt_.device, opt_.stream);
    plan p(chunk_tokens_for(tokens * ((q.heads + pass - 1) / pass), tensor_core_rows<KV>(row_of(kv))));
    for (index_t h0 = 0; h0 < q.heads; h0 += index_t(pass)) {
      const auto [desc, at] = host_query(p, q, h0, std::min<index_t>(pass, q.heads - h0));
      p.add_group(kv, ranges, desc, nullptr, 0, at);
    }
    const int hp = pass_template(p.max_heads);
    const std::size_t per_group = std::size_t(hp) * (2 + kv.dv());
    device_block mem(p.device_bytes(p.groups.size() * per_group, hp * (2 + kv.dv())));
    p.upload(mem);
    launch<KV>(p, mem, row_of(kv), hp, true);
    std::vector<float> res(p.groups.size() * per_group);
    cuda_detail::to_host(res.data(), p.results_on(mem), res.size() * sizeof(float));
    cuda_detail::synchronize();
    for (std::size_t gi = 0; gi < p.groups.size(); ++gi) {
      const float* r = res.data() + gi * per_group;
      for (int h = 0; h < p.groups[gi].heads; ++h)
        out.merge(gi * pass + h, r[h], r[hp + h], r + 2 * hp + std::size_t(h) * kv.dv());
    }
  }

  // decode and decode_gathered (batch_decoder): queries, outputs and KV on the device;
  // each call returns when the outputs are written.

 private:
  friend class batch_decoder<cuda>;

  // One device allocation (stream-ordered), freed when the call returns or throws.
  struct device_block {
    explicit device_block(std::size_t bytes) : p(static_cast<char*>(cuda_detail::device_alloc(bytes))) {}
    ~device_block() { cuda_detail::device_free(p); }
    device_block(const device_block&) = delete;
    device_block& operator=(const device_block&) = delete;
    char* p;
  };

  // The runs, chunks and groups of one launch, built on the host and uploaded at once,
  // with the host queries they need; laid out in one device block followed by the
  // chunk partials and the results.
  struct plan {
    explicit plan(std::int32_t chunk_tokens) : cap(chunk_tokens) {}
    std::int32_t cap;
    std::vector<cuda_detail::run> runs;
    std::vector<cuda_detail::chunk> chunks;
    std::vector<cuda_detail::group_desc> groups;
    std::vector<float> queries;           // host queries, copied up with the plan
    std::vector<std::size_t> query_of;    // per group: offset into `queries`, or npos
    std::vector<std::int32_t> tables;     // block tables of paged views, copied up with the plan
    std::vector<std::pair<const std::int32_t*, std::size_t>> table_sources;  // [host table, entries] per table
    std::vector<std::size_t> table_at;    // per table_sources entry: offset into `tables`
    std::vector<std::pair<std::size_t, std::size_t>> paged_runs;  // [run, offset into `tables`]
    int max_heads = 1, max_dv = 1, min_row = cuda_detail::max_row;  // min_row: the narrowest d or dv
    unsigned long long* readback = nullptr;  // page-locked slots for the flags, set by upload
    bool all_aligned = true;
    std::size_t work_floats = 0, result_floats = 0;

    static constexpr std::size_t npos = ~std::size_t{0};
    static std::size_t up(std::size_t b) { return (b + 255) / 256 * 256; }
    std::size_t runs_at() const { return 0; }
    std::size_t chunks_at() const { return up(runs_at() + runs.size() * sizeof(cuda_detail::run)); }
    std::size_t groups_at() const { return up(chunks_at() + chunks.size() * sizeof(cuda_detail::chunk)); }
    std::size_t queries_at() const { return up(groups_at() + groups.size() * sizeof(cuda_detail::group_desc)); }
    std::size_t tables_at() const { return up(queries_at() + queries.size() * sizeof(float)); }
    std::size_t flag_at() const { return up(tables_at() + tables.size() * sizeof(std::int32_t)); }
    // Two flags: the query check's and the score check's (rank_on_device's bad key).
    std::size_t work_at() const { return up(flag_at() + 2 * sizeof(unsigned long long)); }
    std::size_t results_at() const { return up(work_at() + work_floats * sizeof(float)); }
    std::size_t device_bytes(std::size_t results, std::size_t work_per_chunk = 0) {
      work_floats = chunks.size() * work_per_chunk;
      result_floats = results;
      return results_at() + result_floats * sizeof(float);
    }
    const cuda_detail::run* runs_on(const device_block& m) const { return reinterpret_cast<const cuda_detail::run*>(m.p + runs_at()); }
    const cuda_detail::chunk* chunks_on(const device_block& m) const { return reinterpret_cast<const cuda_detail::chunk*>(m.p + chunks_at()); }
    const cuda_detail::group_desc* groups_on(const device_block& m) const { return reinterpret_cast<const cuda_detail::group_desc*>(m.p + groups_at()); }
    float* work_on(const device_block& m) const { return reinterpret_cast<float*>(m.p + work_at()); }
    float* results_on(const device_block& m) const { return reinterpret_cast<float*>(m.p + results_at()); }
    unsigned long long* flag_on(const device_block& m) const { return reinterpret_cast<unsigned long long*>(m.p + flag_at()); }
    // The uploaded plan as a launch takes it: rows of `row` elements, heads_pass heads a block.
    cuda_detail::chunk_plan on_device(const device_block& m, cuda_detail::element type, int row, int heads_pass) const {
      return {type, row, heads_pass, runs_on(m), chunks_on(m), static_cast<int>(chunks.size()),
              groups_on(m), static_cast<int>(groups.size()), all_aligned, min_row};
    }

    // Cuts `ranges` of kv into runs and chunks of at most `cap` tokens for a new group.
    // `sel`: ranges (a contiguous range of token_range), or a device token list.
    template <KvView KV, class Sel>
    void add_group(const KV& kv, const Sel& sel, cuda_detail::group_desc desc,
                   float* out, index_t out_stride, std::size_t query_offset = npos) {
      using T = typename KV::element_type;
      const auto group = static_cast<std::int32_t>(groups.size());
      desc.out = out;
      desc.out_stride = static_cast<std::int64_t>(out_stride);
      desc.key_stride = static_cast<std::int64_t>(kv.key_stride());
      desc.value_stride = static_cast<std::int64_t>(kv.value_stride());
      desc.d = static_cast<std::int32_t>(kv.d());
      desc.dv = static_cast<std::int32_t>(kv.dv());
      desc.first_chunk = static_cast<std::int32_t>(chunks.size());
      constexpr index_t vec = 16 / sizeof(T);  // elements of one 16-byte load
      bool aligned = kv.d() % vec == 0 && kv.dv() % vec == 0 && kv.key_stride() % vec == 0 && kv.value_stride() % vec == 0;
      std::int32_t token = 0;
      // Appends `count` tokens as runs cut at chunk boundaries; run_of(offset, take) is the
      // run of the piece's tokens [offset, offset + take).
      auto push = [&](index_t count, auto&& run_of) {
        for (index_t done = 0; done < count;) {
          if (chunks.empty() || chunks.back().group != group || chunks.back().tokens == cap)
            chunks.push_back({group, static_cast<std::int32_t>(runs.size()), 0, 0, token});
          auto& c = chunks.back();
          const auto take = static_cast<std::int32_t>(std::min<index_t>(count - done, index_t(cap - c.tokens)));
          runs.push_back(run_of(done, take));
          c.runs += 1;
          c.tokens += take;
          token += take;
          done += index_t(take);
        }
      };
      auto push_rows = [&](const T* k, const T* v, index_t count) {
        aligned = aligned && reinterpret_cast<std::uintptr_t>(k) % 16 == 0 && reinterpret_cast<std::uintptr_t>(v) % 16 == 0;
        push(count, [&](index_t offset, std::int32_t take) {
          return cuda_detail::run{k + offset * kv.key_stride(), v + offset * kv.value_stride(), nullptr, take, 0, 0};
        });
      };
      if constexpr (std::is_same_v<Sel, device_tokens>) {
        // A device token list (decode_indexed) is itself the block table of 1-token blocks.
        const T* k = kv.key_row(0);
        const T* v = kv.value_row(0);
        aligned = aligned && reinterpret_cast<std::uintptr_t>(k) % 16 == 0 && reinterpret_cast<std::uintptr_t>(v) % 16 == 0;
        push(sel.count, [&](index_t offset, std::int32_t take) {
          return cuda_detail::run{k, v, sel.indices, take, static_cast<std::int32_t>(offset), 1};
        });
      } else if constexpr (requires { kv.block_table(); kv.key_pool(); kv.value_pool(); }) {
        const std::span<const token_range> ranges(sel);
        // Paged: one run per range, its rows found through the block table on the device.
        const T* k = kv.key_pool();
        const T* v = kv.value_pool();
        aligned = aligned && reinterpret_cast<std::uintptr_t>(k) % 16 == 0 && reinterpret_cast<std::uintptr_t>(v) % 16 == 0;
        const std::size_t table = stage_table(kv.block_table().data(), (kv.n() + kv.block_size() - 1) / kv.block_size());
        const auto block_size = static_cast<std::int32_t>(kv.block_size());
        for (const token_range& r : ranges)
          push(r.size(), [&](index_t offset, std::int32_t take) {
            paged_runs.emplace_back(runs.size(), table);
            return cuda_detail::run{k, v, nullptr, take, static_cast<std::int32_t>(r.begin + offset), block_size};
          });
      } else if (const std::span<const token_range> ranges(sel); const index_t count = listed_tokens(kv, ranges)) {
        // Short ranges of a strided cache (a top-k selection: thousands of single tokens):
        // their token list goes up once and the kernels read it as a block table of
        // 1-token blocks, instead of a run planned and uploaded per range.
        const T* k = kv.key_row(0);
        const T* v = kv.value_row(0);
        aligned = aligned && reinterpret_cast<std::uintptr_t>(k) % 16 == 0 && reinterpret_cast<std::uintptr_t>(v) % 16 == 0;
        const std::size_t list = tables.size();
        tables.resize(list + std::size_t(count));
        std::int32_t* at = tables.data() + list;
        for (const token_range& r : ranges)
          for (index_t i = r.begin; i < r.end; ++i) *at++ = static_cast<std::int32_t>(i);
        push(count, [&](index_t offset, std::int32_t take) {
          paged_runs.emplace_back(runs.size(), list);
          return cuda_detail::run{k, v, nullptr, take, static_cast<std::int32_t>(offset), 1};
        });
      } else {
        for (const token_range& r : ranges) {
          if constexpr (requires { kv.for_each_run(r.begin, r.end, [](index_t, index_t, const T*, const T*) {}); })
            kv.for_each_run(r.begin, r.end, [&](index_t, index_t count, const T* k, const T* v) { push_rows(k, v, count); });
          else
            for (index_t i = r.begin; i < r.end; ++i) push_rows(kv.key_row(i), kv.value_row(i), 1);
        }
      }
      desc.chunks = static_cast<std::int32_t>(chunks.size()) - desc.first_chunk;
      desc.aligned = aligned ? 1 : 0;
      all_aligned = all_aligned && aligned;
      max_heads = std::max(max_heads, int(desc.heads));
      max_dv = std::max(max_dv, int(desc.dv));
      min_row = std::min({min_row, int(desc.d), int(desc.dv)});
      groups.push_back(desc);
      query_of.push_back(query_offset);
    }

    // The tokens of `ranges` when they are read through a token list (a strided cache,
    // rows at key_row(0) + i * stride, whose ranges average under 16 tokens), else 0.
    template <KvView KV>
    static index_t listed_tokens(const KV&, std::span<const token_range> ranges) {
      if constexpr (std::is_same_v<KV, kv_view<typename KV::element_type>>) {
        index_t tokens = 0;
        for (const token_range& r : ranges) tokens += r.size();
        return tokens < 16 * index_t(ranges.size()) ? tokens : 0;
      } else {
        return 0;
      }
    }

    // Offset into `tables` of the first `entries` entries of a host block table, staged
    // once per call however many views share it.
    std::size_t stage_table(const std::int32_t* table, index_t entries) {
      const std::pair<const std::int32_t*, std::size_t> source{table, std::size_t(entries)};
      for (std::size_t i = 0; i < table_sources.size(); ++i)
        if (table_sources[i] == source) return table_at[i];
      table_sources.push_back(source);
      table_at.push_back(tables.size());
      tables.insert(tables.end(), table, table + entries);
      return table_at.back();
    }

    // Copies the plan (with device query and block-table pointers patched in) into the
    // device block.
    void upload(const device_block& m) {
      std::vector<cuda_detail::group_desc> patched = groups;
      for (std::size_t gi = 0; gi < groups.size(); ++gi)
        if (query_of[gi] != npos) patched[gi].q = reinterpret_cast<const float*>(m.p + queries_at()) + query_of[gi];
      // Built in page-locked staging (the flag's read-back slot just past it), so that
      // the upload is one direct copy.
      char* host = static_cast<char*>(cuda_detail::host_staging(work_at() + 2 * sizeof(unsigned long long)));
      readback = reinterpret_cast<unsigned long long*>(host + work_at());
      std::copy_n(reinterpret_cast<const char*>(runs.data()), runs.size() * sizeof(cuda_detail::run), host + runs_at());
      for (const auto& [r, offset] : paged_runs) {
        const auto* table = reinterpret_cast<const std::int32_t*>(m.p + tables_at()) + offset;
        std::memcpy(host + runs_at() + r * sizeof(cuda_detail::run) + offsetof(cuda_detail::run, table), &table,
                    sizeof table);
      }
      std::copy_n(reinterpret_cast<const char*>(tables.data()), tables.size() * sizeof(std::int32_t), host + tables_at());
      std::copy_n(reinterpret_cast<const char*>(chunks.data()), chunks.size() * sizeof(cuda_detail::chunk), host + chunks_at());
      std::copy_n(reinterpret_cast<const char*>(patched.data()), patched.size() * sizeof(cuda_detail::group_desc), host + groups_at());
      std::copy_n(reinterpret_cast<const char*>(queries.data()), queries.size() * sizeof(float), host + queries_at());
      const unsigned long long none[2] = {~0ull, ~0ull};  // both checks' "all finite"
      std::copy_n(reinterpret_cast<const char*>(none), sizeof none, host + flag_at());
      cuda_detail::to_device(m.p, host, work_at());
    }
  };

  template <KvView KV>
  static void check_top_k(const KV& kv, const query_group& q, index_t k) {
    validate_query(q, kv.d());
    require_shape(kv);
    require(k <= kv.n(), "k", "top ", k, " of a cache of n = ", kv.n(), " tokens");
  }

  // Queues on the call's stream, for every group gi of kv_heads (`heads` queries each,
  // from query_of), the scores of its heads and the selection of its k heaviest tokens
  // into chosen + gi * k (device); consecutive groups of equal n share one chain of
  // selection kernels, and groups with k = n get none (their queries are only checked).
  // query_of(plan, gi, h0, count): the desc of heads [h0, h0 + count) of group gi and
  // their offset in the plan's staged queries (npos: on the device). check_queries: the
  // score launch checks every group's device queries. Nothing is selected unless every
  // query passes and every score is finite; the two flags (the query check's, and the
  // lowest plan group << 40 | token of a NaN or +Inf score; plan groups: ceil(heads /
  // pass_of(kv_heads)) per group) are read back into the returned host slots, valid after
  // a synchronize.
  template <KvView KV, class QueryOf>
  const unsigned long long* rank_on_device(std::span<const KV> kv_heads, index_t heads, QueryOf&& query_of,
                                           index_t k, std::int32_t* chosen, bool check_queries = false) const {
    const index_t groups = kv_heads.size(), pass = pass_of(kv_heads);
    std::vector<std::size_t> z_at(groups + 1, 0);         // group gi's scores [heads, n] at z + z_at[gi]
    std::vector<std::pair<index_t, index_t>> chains;      // [first, end) groups of equal n, each k < n
    index_t ranked_tokens = 0;
    for (index_t gi = 0; gi < groups; ++gi) {
      const index_t n = kv_heads[gi].n();
      const bool ranked = k < n;
      z_at[gi + 1] = z_at[gi] + (ranked ? std::size_t(heads * n) : 0);
      if (!ranked) continue;
      ranked_tokens += n;
      if (!chains.empty() && chains.back().second == gi && kv_heads[chains.back().first].n() == n)
        chains.back().second = gi + 1;
      else
        chains.emplace_back(gi, gi + 1);
    }
    std::size_t scratch = 0;
    for (const auto& [a, b] : chains)
      scratch = std::max(scratch, cuda_detail::top_k_scratch_bytes(static_cast<int>(heads), std::int64_t(kv_heads[a].n()),
                                                                   static_cast<int>(b - a)));
    const std::size_t z_bytes = plan::up(sizeof(float) * z_at[groups]);
    device_block work(z_bytes + scratch);
    float* z = reinterpret_cast<float*>(work.p);
    plan p(chunk_tokens_for(ranked_tokens * ((heads + pass - 1) / pass)));
    for (index_t gi = 0; gi < groups; ++gi) {
      const token_range all{0, kv_heads[gi].n()};
      const bool ranked = k < all.end;
      for (index_t h0 = 0; h0 < heads; h0 += pass) {
        const auto [desc, at] = query_of(p, gi, h0, std::min(pass, heads - h0));
        p.add_group(kv_heads[gi], std::span<const token_range>(&all, ranked ? 1 : 0), desc,
                    ranked ? z + z_at[gi] + h0 * all.end : nullptr, all.end, at);
      }
    }
    device_block mem(p.device_bytes(0));
    p.upload(mem);
    unsigned long long* flag = p.flag_on(mem);
    cuda_detail::launch_score({.plan = p.on_device(mem, element_of<KV>(), widest_row(kv_heads), pass_template(p.max_heads)),
                               .check = check_queries ? flag : nullptr,
                               .bad_key = flag + 1});
    for (const auto& [a, b] : chains)
      cuda_detail::launch_group_top_k(z + z_at[a], static_cast<int>(heads), std::int64_t(kv_heads[a].n()),
                                      std::int64_t(k), work.p + z_bytes, chosen + a * k, static_cast<int>(b - a), flag);
    cuda_detail::to_host(p.readback, flag, 2 * sizeof *p.readback);
    return p.readback;
  }

  // Refuses a ranking whose scores were not all finite (rank_on_device's second flag,
  // after a synchronize): names the key's token and its first NaN or Inf element, read
  // back from the cache, or says that its scores overflow. where(gi) names the view.
  template <KvView KV, class Where>
  static void refuse_bad_key(std::span<const KV> kv_heads, index_t heads, unsigned long long flag,
                             const char* argument, Where&& where) {
    const cuda_detail::bad_score bad = cuda_detail::decode_bad_key(flag);
    if (bad.group < 0) return;
    const index_t pass = pass_of(kv_heads), gi = index_t(bad.group) / ((heads + pass - 1) / pass);
    const KV& kv = kv_heads[gi];
    std::vector<typename KV::element_type> row(kv.d());
    cuda_detail::to_host(row.data(), kv.key_row(index_t(bad.token)), sizeof(row[0]) * row.size());
    cuda_detail::synchronize();
    for (index_t t = 0; t < kv.d(); ++t)
      require(std::isfinite(to_float(row[t])), argument, where(gi), "key ", bad.token, " element ", t,
              " is NaN or Inf");
    require(false, argument, where(gi), "the scores of key ", bad.token, " overflow float");
  }
  // The widest row (d or dv) of the views, and the query heads per slice of a group in
  // rank_on_device's plan, which it sets.
  template <KvView KV>
  static int widest_row(std::span<const KV> kv_heads) {
    int row = 1;
    for (const KV& kv : kv_heads) row = std::max(row, row_of(kv));
    return row;
  }
  template <KvView KV>
  static index_t pass_of(std::span<const KV> kv_heads) { return index_t(cuda_detail::heads_per_pass(widest_row(kv_heads))); }
  // rank_on_device for host query groups, staged with the plan.
  template <KvView KV>
  const unsigned long long* rank_on_device(std::span<const KV> kv_heads, std::span<const query_group> queries,
                                           index_t k, std::int32_t* chosen) const {
    return rank_on_device(kv_heads, queries[0].heads,
                   [&](plan& p, index_t gi, index_t h0, index_t count) { return host_query(p, queries[gi], h0, count); },
                   k, chosen);
  }

  // Heads [h0, h0 + count) of a host query group, staged for upload: their group desc
  // and where the rows sit in the staged queries.
  static std::pair<cuda_detail::group_desc, std::size_t> host_query(plan& p, const query_group& q, index_t h0,
                                                                    index_t count) {
    cuda_detail::group_desc g{};
    g.q_stride = static_cast<std::int64_t>(q.d);
    g.heads = static_cast<std::int32_t>(count);
    g.scale = q.scale;
    const std::size_t at = p.queries.size();
    for (index_t h = h0; h < h0 + count; ++h) p.queries.insert(p.queries.end(), q.row(h), q.row(h) + q.d);
    return {g, at};
  }

  template <KvView KV>
  static cuda_detail::element element_of() {
    using T = typename KV::element_type;
    if constexpr (std::is_same_v<T, float>) return cuda_detail::element::f32;
    else if constexpr (std::is_same_v<T, half>) return cuda_detail::element::f16;
    else return cuda_detail::element::bf16;
  }
  template <KvView KV>
  static int row_of(const KV& kv) { return static_cast<int>(std::max(kv.d(), kv.dv())); }
  template <KvView KV>
  static void require_shape(const KV& kv) {
    require(kv.d() <= cuda_detail::max_row, "d", "the CUDA executor takes d up to ", cuda_detail::max_row, ", got ", kv.d());
    require(kv.dv() <= cuda_detail::max_row, "dv", "the CUDA executor takes dv up to ", cuda_detail::max_row, ", got ", kv.dv());
    // Token positions travel to the kernels as 32-bit integers.
    require(kv.n() < (index_t{1} << 31), "n", "the CUDA executor takes caches of fewer than 2^31 tokens, got ", kv.n());
  }
  // The compiled head count (1, 4 or 8) that serves `heads` heads a pass.
  static int pass_template(int heads) { return heads <= 1 ? 1 : heads <= 4 ? 4 : 8; }

  // The exact part of every group of the plan; results on the device when `to_results`.
  template <KvView KV>
  static void launch(const plan& p, const device_block& mem, int row, int hp, bool to_results) {
    cuda_detail::launch_attend({p.on_device(mem, element_of<KV>(), row, hp), p.max_dv, p.work_on(mem),
                                to_results ? p.results_on(mem) : nullptr, to_results ? nullptr : p.flag_on(mem)});
  }

  template <KvView KV, class RangesOf>
  void run_batch(std::span<const sequence<KV>> batch, gqa_shape shape, float scale, RangesOf&& ranges_of) const {
    shape.validate();
    require(std::isfinite(scale) && scale > 0.f, "scale", "must be finite and positive, got ", scale);
    const index_t g = shape.group();
    cuda_detail::select_device(opt_.device, opt_.stream);
    using selection_of = std::remove_cvref_t<std::invoke_result_t<RangesOf&, index_t, const KV&>>;
    constexpr bool device_lists = std::is_same_v<selection_of, device_tokens>;
    struct head_plan {
      const KV* kv;
      selection_of ranges;  // token ranges, or a device token list (decode_indexed)
      index_t seq, head, query_stride, out_stride;
    };
    std::vector<head_plan> heads;  // validated first: nothing runs unless all is well
    index_t tokens = 0;
    int row = 1;
    for (index_t s = 0; s < batch.size(); ++s) {
      const sequence<KV>& seq = batch[s];
      require(seq.kv_heads.size() == shape.kv_heads, "sequence.kv_heads", seq.kv_heads.size(),
              " KV heads, expected ", shape.kv_heads);
      require(seq.queries != nullptr, "sequence.queries", "null pointer");
      require(seq.out != nullptr, "sequence.out", "null pointer");
      for (index_t h = 0; h < shape.kv_heads; ++h) {
        const KV& kv = seq.kv_heads[h];
        require_shape(kv);
        const index_t qs = seq.query_stride ? seq.query_stride : kv.d();
        const index_t os = seq.out_stride ? seq.out_stride : kv.dv();
        require(qs >= kv.d(), "sequence.query_stride", "stride ", qs, " is smaller than d = ", kv.d());
        require(os >= kv.dv(), "sequence.out_stride", "stride ", os, " is smaller than dv = ", kv.dv());
        selection_of ranges = ranges_of(s * shape.kv_heads + h, kv);
        if constexpr (device_lists) {
          require(ranges.count <= kv.n(), "tokens", "sequence ", s, ", KV head ", h, ": ", ranges.count,
                  " tokens listed, more than n = ", kv.n());
          tokens += ranges.count;
        } else {
          tokens += floe::checked_token_count(ranges, kv.n());
        }
        row = std::max(row, row_of(kv));
        heads.push_back({&kv, std::move(ranges), s, h, qs, os});
      }
    }
    const index_t pass = index_t(cuda_detail::heads_per_pass(row));
    plan p(chunk_tokens_for(tokens * ((g + pass - 1) / pass), tensor_core_rows<KV>(row)));
    std::vector<std::pair<index_t, index_t>> origin;  // per group: sequence, first query head
    for (const head_plan& hp : heads) {
      const sequence<KV>& seq = batch[hp.seq];
      for (index_t h0 = 0; h0 < g; h0 += pass) {
        cuda_detail::group_desc desc{};
        desc.q = seq.queries + (hp.head * g + h0) * hp.query_stride;
        desc.q_stride = static_cast<std::int64_t>(hp.query_stride);
        desc.heads = static_cast<std::int32_t>(std::min(pass, g - h0));
        desc.scale = scale;
        p.add_group(*hp.kv, hp.ranges, desc, seq.out + (hp.head * g + h0) * hp.out_stride, hp.out_stride);
        origin.emplace_back(hp.seq, hp.head * g + h0);
      }
    }
    if (p.groups.empty()) return;
    const int hp = pass_template(p.max_heads);
    device_block mem(p.device_bytes(0, std::size_t(hp) * (2 + p.max_dv)));
    p.upload(mem);
    if constexpr (device_lists) check_lists(heads);
    // Device queries are checked on the device, in the attend launch; the merge writes
    // nothing if one is bad.
    launch<KV>(p, mem, row, hp, false);
    cuda_detail::to_host(p.readback, p.flag_on(mem), sizeof *p.readback);
    cuda_detail::synchronize();
    const cuda_detail::nonfinite_query bad = cuda_detail::decode_nonfinite(*p.readback);
    if (bad.group >= 0)
      require(false, "sequence.queries", "sequence ", origin[bad.group].first, ", query head ",
              origin[bad.group].second + index_t(bad.head), ", element ", bad.element, " is NaN or Inf");
  }

  // Checks decode_indexed's device token lists on the device (and waits for the answer)
  // before any row is read through them: a bad index is refused by its position.
  template <class HeadPlans>
  static void check_lists(const HeadPlans& heads) {
    std::vector<cuda_detail::token_list> lists;
    for (const auto& hp : heads)
      lists.push_back({hp.ranges.indices, static_cast<std::int32_t>(hp.ranges.count), static_cast<std::int32_t>(hp.kv->n())});
    const std::size_t flag_at = plan::up(sizeof(cuda_detail::token_list) * lists.size());
    device_block mem(flag_at + sizeof(unsigned long long));
    unsigned long long first = ~0ull;
    cuda_detail::to_device(mem.p, lists.data(), sizeof(cuda_detail::token_list) * lists.size());
    cuda_detail::to_device(mem.p + flag_at, &first, sizeof first);
    auto* flag = reinterpret_cast<unsigned long long*>(mem.p + flag_at);
    cuda_detail::launch_check_tokens(reinterpret_cast<const cuda_detail::token_list*>(mem.p), static_cast<int>(lists.size()), flag);
    cuda_detail::to_host(&first, flag, sizeof first);
    cuda_detail::synchronize();
    if (first == ~0ull) return;
    const auto& bad = heads[first >> 32];
    require(false, "tokens", "sequence ", bad.seq, ", KV head ", bad.head, ": position ", first & 0xffffffffull,
            " holds an index outside [0, ", bad.kv->n(), ") or not above the one before it");
  }

  // Tokens per chunk for `work` (tokens times head passes) of one launch, unless set. The
  // SIMT kernel: about three chunks per multiprocessor (256-4096; on the H200 2048 beat 512
  // and 1024 at 128K, batch 1). The tensor-core kernel (16-bit rows
  // of 64 or 128, `tensor_cores`) holds two blocks per multiprocessor: the largest power of
  // two (256-8192) that still gives 0.9 blocks a slot (0.7 for 512), since a second,
  // partial wave cost up to 30 % and half-empty slots as much (H200 sweeps of
  // FLOE_CUDA_CHUNK, docs/cuda-executor.md).
  std::int32_t chunk_tokens_for(index_t work, bool tensor_cores = false) const {
    if (opt_.chunk_tokens) return static_cast<std::int32_t>(opt_.chunk_tokens);
    index_t cap = 256;
    if (tensor_cores) {
      const index_t slots = 2 * index_t(multiprocessors_);
      cap = 8192;
      // 0.7 at 512: 256-token chunks cost more than a partly empty wave (…-chunk-rule.txt).
      while (cap > 256 && 10 * work < (cap > 512 ? 9 : 7) * slots * cap) cap /= 2;
    } else {
      const index_t want = work / (index_t(multiprocessors_) * 3);
      while (cap < 4096 && cap * 2 <= want) cap *= 2;
    }
    return static_cast<std::int32_t>(cap);
  }
  // Whether the exact part of rows of `row` elements of KV runs on tensor cores (when
  // they are also 16-byte aligned with d = dv; the kernels decide).
  template <KvView KV>
  static bool tensor_core_rows(int row) {
    return sizeof(typename KV::element_type) == 2 && (row == 64 || row == 128);
  }

  cuda_options opt_;
  int multiprocessors_ = 1;
};

static_assert(Executor<cuda>);

}  // namespace floe::exec
