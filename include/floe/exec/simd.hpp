// floe::exec::simd — the CPU SIMD executor: fp32-accumulating online-softmax decode over
// fp32 / fp16 / bf16 KV, one pass over a KV head for all query heads of its GQA group,
// split-K over N with partial merges, threads through a parallel_for hook, and kernels
// chosen at run time among those compiled into floe::simd (link floe::simd).
// docs/simd-executor.md.
#pragma once

#include <algorithm>
#include <atomic>
#include <limits>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "floe/core/batch.hpp"
#include "floe/core/concepts.hpp"
#include "floe/exec/batch_decode.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/exec/simd/arch.hpp"
#include "floe/exec/simd/kernel_api.hpp"
#include "floe/exec/simd/pool_order.hpp"
#include "floe/exec/simd/staged_rows.hpp"
#include "floe/exec/simd/work_split.hpp"
#include "floe/exec/thread_pool.hpp"

namespace floe::exec {

struct simd_options {
  simd_arch arch = simd_arch::automatic;      // automatic: FLOE_SIMD_ARCH if set, else the best
  parallel_for_fn parallel_for = serial_for;  // the engine's threads, or thread_pool::hook()
  index_t concurrency = 1;                    // bodies parallel_for runs at once; 1 disables split-K
  index_t min_split_tokens = 2048;            // split-K never makes a piece shorter than this
  // Copy scattered rows together before attending (staged_rows.hpp): 1.2-2x faster from DRAM
  // on an AMD Zen 4, 1.4-1.9x slower on the device's Intel Xeon (docs/simd-executor.md).
  bool stage_short_runs = false;
};

class simd : public batch_decoder<simd> {
 public:
  using accumulator = float;
  static constexpr std::string_view name = "simd";
  // A call over a few hundred tokens costs little more than its reads (no launch, no
  // synchronize), so residuals may interleave their own reads with the exact part.
  static constexpr bool small_calls_cheap = true;

  simd() : simd(simd_options{}) {}
  explicit simd(simd_options options)
      : opt_(std::move(options)), kernels_(simd_detail::compiled_kernels(resolve_simd_arch(opt_.arch))) {
    require(static_cast<bool>(opt_.parallel_for), "parallel_for", "is an empty function");
    require(opt_.concurrency >= 1, "concurrency", "must be at least 1, got ", opt_.concurrency);
    require(opt_.min_split_tokens >= 1, "min_split_tokens", "must be at least 1");
  }
  // Runs on `pool` (which must outlive the executor), splitting work for pool.size() threads.
  explicit simd(thread_pool& pool, simd_arch arch = simd_arch::automatic)
      : simd(simd_options{arch, pool.hook(), pool.size()}) {}

  simd_arch arch() const { return kernels_->target; }
  const simd_options& options() const { return opt_; }
  // The caller's threads, lent to policies that split work of their own (LendsThreads).
  index_t concurrency() const { return opt_.concurrency; }
  void parallel_for(index_t n, const std::function<void(index_t)>& body) const { opt_.parallel_for(n, body); }

  // z[i - r.begin] = scale * q_head . k_i for i in r.
  template <KvView KV>
  void score(const KV& kv, const query_group& q, index_t head, token_range r, float* z) const {
    const auto check = [&] { require(head < q.heads, "head", "head ", head, " of ", q.heads, " query heads"); };
    score_rows(kv, q, r, z, check, [&](const auto& kernel, const auto& args, const auto* runs, index_t n, float* at) {
      kernel.score(args, head, runs, n, at);
    });
  }

  // z[h * ld + i - r.begin] = scale * q_h . k_i for every head h of the group and i in r,
  // each key read once for all heads (ranking by the group's weights: oracle_topk).
  template <KvView KV>
  void score_group(const KV& kv, const query_group& q, token_range r, float* z, index_t ld) const {
    const auto check = [&] {
      require(ld >= r.size(), "ld", "row stride ", ld, " is shorter than the range's ", r.size(), " tokens");
    };
    score_rows(kv, q, r, z, check, [&](const auto& kernel, const auto& args, const auto* runs, index_t n, float* at) {
      kernel.score_group(args, runs, n, at, ld);
    });
  }

  // Merges the exact partial over `ranges` of every query head of the group into `out`.
  // Long inputs are split over N and run through the parallel_for hook.
  template <KvView KV>
  void attend(const KV& kv, const query_group& q, std::span<const token_range> ranges, partial_set<float>& out) const {
    validate_query(q, kv.d());
    require(out.heads() == q.heads, "partial.heads", out.heads(), " partials for ", q.heads, " query heads");
    require(out.dv() == kv.dv(), "partial.dv", "partial of dv ", out.dv(), " for values of dv ", kv.dv());
    const index_t tokens = floe::checked_token_count(ranges, kv.n());
    if (tokens == 0) return;
    const auto args = group_args_of(kv, q);
    const index_t parts = split_count(tokens, 1);
    if (parts == 1) {
      group_state st(q.heads, kv.d(), kv.dv());
      fold(kv, args, ranges, st);
      st.merge_into(out);
      return;
    }
    const auto pieces = split_for_attention(kv, ranges, tokens, parts);
    std::vector<group_state> states(parts, group_state(q.heads, kv.d(), kv.dv()));
    opt_.parallel_for(parts, [&](index_t p) { fold(kv, args, pieces[p], states[p]); });
    for (const auto& st : states) st.merge_into(out);
  }

  // The same over a sorted list of distinct token indices (a gathered selection); runs of
  // consecutive indices are read as ranges.
  template <KvView KV>
  void attend(const KV& kv, const query_group& q, std::span<const index_t> tokens, partial_set<float>& out) const {
    selection sel;
    for (index_t i = 0; i < tokens.size(); ++i) {
      require(tokens[i] < kv.n(), "tokens", "index ", tokens[i], " at position ", i, " is past n = ", kv.n());
      require(i == 0 || tokens[i] > tokens[i - 1], "tokens", "index ", tokens[i], " at position ", i,
              " does not follow ", tokens[i - 1], " (indices must be sorted and distinct)");
      sel.add(tokens[i], tokens[i] + 1);
    }
    attend(kv, q, std::span<const token_range>(sel.ranges), out);
  }

  // decode and decode_gathered (batch_decoder): work runs over (sequence, KV head, split).

 private:
  friend class batch_decoder<simd>;

  // Online-softmax state (m, l, a) of one group or split, plus the kernel's scratch.
  class group_state {
   public:
    group_state(index_t heads, index_t d, index_t dv)
        : heads_(heads), dv_(dv), data_(heads * (2 + dv + simd_detail::scratch_per_head + d), 0.f) {
      std::fill_n(data_.begin(), heads, -std::numeric_limits<float>::infinity());
    }
    simd_detail::online_state view() {
      float* p = data_.data();
      return {p, p + heads_, p + 2 * heads_, p + (2 + dv_) * heads_};
    }
    void merge_into(partial_set<float>& out) const {
      const float* p = data_.data();
      for (index_t h = 0; h < heads_; ++h) out.merge(h, p[h], p[heads_ + h], p + 2 * heads_ + h * dv_);
    }
    void finalize(const output_group<float>& out) const {
      const float* p = data_.data();
      for (index_t h = 0; h < heads_; ++h) write_normalized(p + 2 * heads_ + h * dv_, p[heads_ + h], dv_, out.row(h));
    }

   private:
    index_t heads_, dv_;
    std::vector<float> data_;
  };

  template <KvView KV>
  static simd_detail::group_args group_args_of(const KV& kv, const query_group& q) {
    return {q.data, q.row_stride(), q.heads, kv.d(), kv.dv(), q.scale, kv.key_stride(), kv.value_stride()};
  }

  // How many pieces to cut `tokens` of one group into, when `groups` groups run at once:
  // enough for about 8 tasks per thread, none shorter than min_split_tokens, except that
  // pieces shrink (to min_split_tokens / 4 at least) until the tasks divide evenly over
  // the threads (3 groups on 2 threads: 6 tasks, not 3).
  index_t split_count(index_t tokens, index_t groups) const {
    const index_t threads = opt_.concurrency;
    if (threads <= 1) return 1;
    const index_t wanted = (8 * threads + groups - 1) / groups;
    index_t parts = std::max<index_t>(1, std::min(wanted, tokens / opt_.min_split_tokens));
    while (groups * parts % threads != 0 && parts < wanted && tokens / (parts + 1) >= opt_.min_split_tokens / 4)
      ++parts;
    return parts;
  }

  // Calls flush(runs, run_count, tokens) for batches of up to 1024 evenly strided runs or
  // 4096 tokens covering `ranges` in order (per row when the view has no for_each_run).
  // Within a batch the kernel asks for each next tile while it works on one; across
  // batches, the first rows of the next batch's runs are asked for before a batch is
  // flushed, so that scattered rows from DRAM are on their way when the kernel gets there
  // (docs/benchmarks.md "Gathered rows").
  // Checks a score call (the query and range first, then the caller's `check`) and feeds its
  // rows to `call(kernel, args, runs, count, z)` in batches.
  template <KvView KV, class Check, class Call>
  void score_rows(const KV& kv, const query_group& q, token_range r, float* z, Check&& check, Call&& call) const {
    using T = typename KV::element_type;
    validate_query(q, kv.d());
    require(r.begin <= r.end && r.end <= kv.n(), "range", "[", r.begin, ", ", r.end, ") is not inside [0, ",
            kv.n(), ")");
    check();
    if (r.begin == r.end) return;
    require(z != nullptr, "z", "null pointer");
    const auto args = group_args_of(kv, q);
    const auto& kernel = kernels_->template of<T>();
    for_run_batches(kv, std::span<const token_range>(&r, 1),
                    [&](const simd_detail::row_run<T>* runs, index_t count, index_t tokens) {
                      call(kernel, args, runs, count, z);
                      z += tokens;
                    });
  }

  // AnyOrder: the rows may come in another order (attention); a paged view's whole blocks
  // then come in pool order (pool_order.hpp).
  template <bool AnyOrder = false, KvView KV, class Flush>
  static void for_run_batches(const KV& kv, std::span<const token_range> ranges, Flush&& flush) {
    using T = typename KV::element_type;
    constexpr index_t capacity = 1024, batch_tokens = 4096, rows_ahead = 4;
    thread_local std::vector<simd_detail::row_run<T>> storage;  // two batches; off the stack (48 KiB)
    storage.resize(2 * capacity);
    simd_detail::row_run<T>* runs[2] = {storage.data(), storage.data() + capacity};
    index_t used = 0, tokens = 0, ready = 0, ready_tokens = 0, cur = 0;
    const index_t key_bytes = kv.d() * index_t{sizeof(T)}, value_bytes = kv.dv() * index_t{sizeof(T)};
    auto hand_over = [&] {  // prefetch the start of the batch just filled, flush the one before it
      // Up to 4 rows of each run, at most 256 rows; one tile when the runs are single rows
      // (a longer burst of scattered rows stalls the batch before it).
      const index_t rows_asked = tokens == used ? simd_detail::tile_tokens : 256;
      index_t asked = 0;
      for (index_t r = 0; r < used && asked < rows_asked; ++r)
        for (index_t t = 0; t < std::min(runs[cur][r].count, rows_ahead) && asked < rows_asked; ++t, ++asked) {
          simd_detail::prefetch_row<2>(runs[cur][r].keys + t * kv.key_stride(), key_bytes);
          simd_detail::prefetch_row<2>(runs[cur][r].values + t * kv.value_stride(), value_bytes);
        }
      if (ready) flush(runs[cur ^ 1], ready, ready_tokens);
      ready = used;
      ready_tokens = tokens;
      cur ^= 1;
      used = tokens = 0;
    };
    auto push = [&](const T* keys, const T* values, index_t count) {
      runs[cur][used++] = {keys, values, count};
      tokens += count;
      if (used == capacity || tokens >= batch_tokens) hand_over();
    };
    if constexpr (AnyOrder && requires { kv.block_table(); })
      simd_detail::for_blocks_in_pool_order(kv, ranges,
                                            [&](token_range r) { push(kv.key_row(r.begin), kv.value_row(r.begin), r.size()); });
    else
      for (const token_range& r : ranges) {
        if constexpr (requires { kv.for_each_run(r.begin, r.end, [](index_t, index_t, const T*, const T*) {}); })
          kv.for_each_run(r.begin, r.end, [&](index_t, index_t count, const T* k, const T* v) { push(k, v, count); });
        else
          for (index_t i = r.begin; i < r.end; ++i) push(kv.key_row(i), kv.value_row(i), 1);
      }
    if (used) hand_over();
    if (ready) flush(runs[cur ^ 1], ready, ready_tokens);
  }

  // Split-K pieces of `ranges` for attention: a paged view's blocks are cut in pool order,
  // so that each part streams through its own stretch of the pool.
  template <KvView KV>
  static std::vector<std::vector<token_range>> split_for_attention(const KV& kv, std::span<const token_range> ranges,
                                                                   index_t tokens, index_t parts) {
    if constexpr (requires { kv.block_table(); })
      return simd_detail::split_ranges(simd_detail::ranges_in_pool_order(kv, ranges), tokens, parts);
    else
      return simd_detail::split_ranges(ranges, tokens, parts);
  }

  // Rows of the first tile that fold(kv, ranges) reads: what the task before it prefetches
  // as it ends.
  template <class T>
  struct first_tile {
    const T* keys[simd_detail::tile_tokens];
    const T* values[simd_detail::tile_tokens];
    index_t count = 0;
    simd_detail::row_run<const T*> rows() const { return {keys, values, count}; }
  };
  template <KvView KV>
  static void first_tile_of(const KV& kv, std::span<const token_range> ranges,
                            first_tile<typename KV::element_type>& rows) {
    rows.count = 0;
    auto take = [&](token_range r) {
      for (index_t i = r.begin; i < r.end && rows.count < simd_detail::tile_tokens; ++i, ++rows.count) {
        rows.keys[rows.count] = kv.key_row(i);
        rows.values[rows.count] = kv.value_row(i);
      }
    };
    if constexpr (requires { kv.block_table(); })
      simd_detail::for_blocks_in_pool_order(kv, ranges, take);  // the order fold reads them in
    else
      for (const token_range& r : ranges) take(r);
  }

  // Folds `ranges` into st; the last tile prefetches `after` (the caller's next rows).
  template <KvView KV>
  void fold(const KV& kv, const simd_detail::group_args& args, std::span<const token_range> ranges, group_state& st,
            const simd_detail::row_run<const typename KV::element_type*>& after = {}) const {
    using T = typename KV::element_type;
    const auto& kernel = kernels_->template of<T>();
    const auto state = st.view();
    index_t left = 0;
    for (const token_range& r : ranges) left += r.size();
    const simd_detail::row_run<const T*> none{nullptr, nullptr, 0};
    for_run_batches<true>(kv, ranges, [&](const simd_detail::row_run<T>* runs, index_t count, index_t tokens) {
      left -= tokens;
      if (opt_.stage_short_runs && simd_detail::worth_staging(count, tokens))
        simd_detail::attend_staged(kernel, args, runs, count, tokens, state, left == 0 ? after : none);
      else
        kernel.attend(args, runs, count, state, left == 0 ? after : none);
    });
  }

  template <KvView KV, class RangesOf>
  void run_batch(std::span<const sequence<KV>> batch, gqa_shape shape, float scale, RangesOf&& ranges_of) const {
    shape.validate();
    const index_t g = shape.group(), groups = batch.size() * shape.kv_heads;
    struct group_plan {
      const KV* kv;
      query_group q;
      output_group<float> out;
      std::vector<token_range> ranges;
      index_t tokens;
    };
    std::vector<group_plan> plans;
    plans.reserve(groups);
    for (index_t s = 0; s < batch.size(); ++s) {
      const sequence<KV>& seq = batch[s];
      require(seq.kv_heads.size() == shape.kv_heads, "sequence.kv_heads", seq.kv_heads.size(),
              " KV heads, expected ", shape.kv_heads);
      require(seq.queries != nullptr, "sequence.queries", "null pointer");
      require(seq.out != nullptr, "sequence.out", "null pointer");
      for (index_t h = 0; h < shape.kv_heads; ++h) {
        const KV& kv = seq.kv_heads[h];
        const index_t qs = seq.query_stride ? seq.query_stride : kv.d();
        const index_t os = seq.out_stride ? seq.out_stride : kv.dv();
        query_group q{seq.queries + h * g * qs, g, kv.d(), qs, scale};
        output_group<float> o{seq.out + h * g * os, g, kv.dv(), os};
        validate_query(q, kv.d());
        validate_output(o, g, kv.dv());
        std::vector<token_range> ranges = ranges_of(s * shape.kv_heads + h, kv);
        const index_t tokens = floe::checked_token_count(ranges, kv.n());
        plans.push_back({&kv, q, o, std::move(ranges), tokens});
      }
    }
    struct task {
      index_t group;
      std::span<const token_range> ranges;  // the plan's own, or a piece in `pieces`
    };
    std::vector<task> tasks;
    std::vector<std::vector<token_range>> pieces;  // moving it keeps each piece's storage
    std::vector<index_t> first_task(groups + 1, 0);
    for (index_t gi = 0; gi < groups; ++gi) {
      first_task[gi] = tasks.size();
      const group_plan& p = plans[gi];
      const index_t parts = split_count(p.tokens, groups);
      if (p.tokens == 0) continue;
      if (parts == 1) tasks.push_back({gi, p.ranges});
      else
        for (auto& piece : split_for_attention(*p.kv, p.ranges, p.tokens, parts)) {
          pieces.push_back(std::move(piece));
          tasks.push_back({gi, pieces.back()});
        }
    }
    first_task[groups] = tasks.size();
    std::vector<group_state> states;
    states.reserve(tasks.size());
    for (const task& t : tasks) states.emplace_back(g, plans[t.group].kv->d(), plans[t.group].kv->dv());
    // The last task of a group to finish merges its pieces in order and writes the rows
    // (a group of one task writes them from its state).
    auto finish = [&](index_t gi) {
      if (first_task[gi + 1] - first_task[gi] == 1) {
        states[first_task[gi]].finalize(plans[gi].out);
        return;
      }
      partial_set<float> merged(g, plans[gi].kv->dv());
      for (index_t i = first_task[gi]; i < first_task[gi + 1]; ++i) states[i].merge_into(merged);
      merged.finalize(plans[gi].out);
    };
    std::vector<std::atomic<index_t>> pending(groups);
    for (index_t gi = 0; gi < groups; ++gi) {
      pending[gi].store(first_task[gi + 1] - first_task[gi], std::memory_order_relaxed);
      if (first_task[gi + 1] == first_task[gi]) finish(gi);  // nothing to read: zeros
    }
    // Each body claims its next task before it folds the current one, so that the current
    // one's last tile can prefetch the next one's first (a short gathered task otherwise
    // starts with its first tile's misses). A body holds at most one task ahead.
    std::atomic<index_t> claimed{0};
    const index_t bodies = std::min<index_t>(opt_.concurrency, tasks.size());
    if (bodies > 0)
      opt_.parallel_for(bodies, [&](index_t) {
        first_tile<typename KV::element_type> next;
        for (index_t i = claimed.fetch_add(1, std::memory_order_relaxed); i < tasks.size();) {
          const index_t j = claimed.fetch_add(1, std::memory_order_relaxed);
          next.count = 0;
          if (j < tasks.size()) first_tile_of(*plans[tasks[j].group].kv, tasks[j].ranges, next);
          const index_t gi = tasks[i].group;
          const group_plan& p = plans[gi];
          fold(*p.kv, group_args_of(*p.kv, p.q), tasks[i].ranges, states[i], next.rows());
          if (pending[gi].fetch_sub(1, std::memory_order_acq_rel) == 1) finish(gi);
          i = j;
        }
      });
  }

  simd_options opt_;
  const simd_detail::kernel_set* kernels_;
};

static_assert(Executor<simd>);

}  // namespace floe::exec
