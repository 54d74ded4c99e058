// The seams of floe as C++20 concepts: Executor, Selector, ResidualFor<R, S>.
// Each is checked against archetypes (the simplest KV view and executor), so a policy
// must be generic over element type and layout to pass.
#pragma once

#include <concepts>
#include <span>
#include <string_view>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"

namespace floe {

namespace archetype {
using kv = kv_view<float>;
using paged_kv = paged_kv_view<half>;

// The least an executor offers: scoring and exact partials over ranges.
struct executor {
  using accumulator = double;
  template <KvView KV>
  void score(const KV&, const query_group&, index_t, token_range, float*) const;
  template <KvView KV>
  void attend(const KV&, const query_group&, std::span<const token_range>, partial_set<double>&) const;
};
}  // namespace archetype

// Memory movement and parallelism: scores and exact softmax partials over token ranges.
template <class E>
concept Executor =
    std::floating_point<typename E::accumulator> &&
    requires(const E& e, const archetype::kv& kv, const archetype::paged_kv& paged, const query_group& q,
             std::span<const token_range> ranges, partial_set<typename E::accumulator>& out, float* z) {
      { E::name } -> std::convertible_to<std::string_view>;
      e.score(kv, q, index_t{0}, token_range{}, z);
      e.attend(kv, q, ranges, out);
      e.attend(paged, q, ranges, out);
    };

// A prefill-time index reports its memory.
template <class I>
concept Index = requires(const I& i) {
  { i.bytes() } -> std::convertible_to<std::uint64_t>;
};

// Chooses the exact set of one decode step for one GQA group.
template <class S>
concept Selector =
    Index<typename S::index> && std::derived_from<typename S::selection, floe::selection> &&
    requires(const S& s, const archetype::kv& kv, const typename S::index& idx, const query_group& q,
             const archetype::executor& ex, typename S::selection& out, stats& st) {
      { S::name } -> std::convertible_to<std::string_view>;
      { s.build(kv) } -> std::same_as<typename S::index>;
      s.select(idx, kv, q, ex, out, st);
    };

// Estimates the residual (tokens outside the exact set) for the selections of S and
// merges the estimate into the exact partials.
template <class R, class S>
concept ResidualFor =
    Selector<S> && Index<typename R::index> &&
    requires(const R& r, const S& s, const archetype::kv& kv, const typename S::index& sidx,
             const typename R::index& ridx, const query_group& q, const typename S::selection& sel,
             const archetype::executor& ex, partial_set<double>& p, stats& st) {
      { R::name } -> std::convertible_to<std::string_view>;
      { r.build(kv, s, sidx) } -> std::same_as<typename R::index>;
      r.estimate(ridx, kv, q, sel, ex, p, st);
    };

}  // namespace floe
