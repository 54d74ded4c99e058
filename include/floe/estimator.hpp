// floe::estimator<Selector, Residual>: the compile-time composition of a selector and a
// residual estimator. o ~= (exact partial over E) merged with (residual estimate over R).
#pragma once

#include <string>
#include <utility>

#include "floe/core/concepts.hpp"

namespace floe {

template <class S, class R>
class estimator {
  static_assert(Selector<S>,
                "floe::estimator<S, R>: S does not satisfy floe::Selector. A selector needs: "
                "static name; a type `index` with bytes(); a type `selection` derived from floe::selection; "
                "index build(const KV&) const; void select(const index&, const KV&, const query_group&, "
                "const Exec&, selection&, stats&) const.");
  static_assert(ResidualFor<R, S>,
                "floe::estimator<S, R>: R does not satisfy floe::ResidualFor<R, S>. A residual needs: "
                "static name; a type `index` with bytes(); index build(const KV&, const S&, const S::index&) const; "
                "void estimate(const index&, const KV&, const query_group&, const S::selection&, const Exec&, "
                "partial_set<Acc>&, stats&) const.");

 public:
  using selector_type = S;
  using residual_type = R;

  // Per (layer, KV head) state built once after prefill.
  struct state {
    typename S::index selector_index;
    typename R::index residual_index;
    std::uint64_t bytes() const { return selector_index.bytes() + residual_index.bytes(); }
  };

  estimator() = default;
  estimator(S s, R r) : selector_(std::move(s)), residual_(std::move(r)) {}

  const S& selector() const { return selector_; }
  const R& residual() const { return residual_; }
  static std::string name() { return std::string(S::name) + "+" + std::string(R::name); }

  template <KvView KV>
  state build(const KV& kv) const {
    state st{selector_.build(kv), {}};
    st.residual_index = residual_.build(kv, selector_, st.selector_index);
    return st;
  }

  // Brings the state up to the cache (kv is the whole cache, its first tokens unchanged):
  // each index with append() takes in the tokens it grew by, or drops the tokens it was
  // cut back by (rejected speculative tokens). A summary refuses ("kv") a cut below the
  // tokens it summed; the tail window is never summed, so a cut within it always works.
  template <KvView KV>
  void append(state& st, const KV& kv) const {
    if constexpr (requires { st.selector_index.append(kv); }) st.selector_index.append(kv);
    if constexpr (requires { st.residual_index.append(kv); }) st.residual_index.append(kv);
  }

  // One decode step for one GQA group: g query heads against one KV head. Every argument
  // is checked before the output is written; reads are added to `io`.
  template <KvView KV, Executor E, class Out>
  void decode(const state& st, const KV& kv, const query_group& q, const E& exec, const output_group<Out>& out,
              stats& io) const {
    validate_query(q, kv.d());
    validate_output(out, q.heads, kv.dv());
    // One selection per thread, reused: its vectors keep their memory between steps (a
    // fresh 4-bit scan's estimates would be megabytes of new pages each step). Selectors
    // clear what they fill; a nested decode on the same thread gets a fresh selection.
    thread_local typename S::selection reused;
    thread_local bool reused_busy = false;
    typename S::selection fresh;
    const bool nested = reused_busy;
    typename S::selection& sel = nested ? fresh : reused;
    struct release {
      bool& busy;
      bool own;
      ~release() {
        if (own) busy = false;
      }
    } guard{reused_busy, !nested};
    reused_busy = true;
    stats call;
    selector_.select(st.selector_index, kv, q, exec, sel, call);
    validate_ranges(sel.ranges, kv.n());

    using T = typename KV::element_type;
    const index_t exact = sel.count();
    partial_set<typename E::accumulator> parts(q.heads, kv.dv());
    // A residual that reads the exact part itself (interleaved with its own reads) does so.
    if constexpr (requires { residual_.attend_and_estimate(st.residual_index, kv, q, sel, exec, parts, call); }) {
      residual_.attend_and_estimate(st.residual_index, kv, q, sel, exec, parts, call);
    } else {
      exec.attend(kv, q, sel.ranges, parts);
      residual_.estimate(st.residual_index, kv, q, sel, exec, parts, call);
    }
    call.tokens_total += kv.n();
    call.tokens_read += exact;
    if (!sel.keys_counted) call.key_bytes += exact * kv.d() * sizeof(T);
    call.value_bytes += exact * kv.dv() * sizeof(T);
    call.index_bytes += st.bytes();

    parts.finalize(out);
    io += call;
  }

 private:
  S selector_{};
  R residual_{};
};

}  // namespace floe
