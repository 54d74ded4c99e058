// Selector `topk_anchors<Scorer>`: sink tokens [0, S), the tail window [n - W, n), and
// the top k of the middle region between them as ranked by a pluggable scorer
// (exact_scan, quantized_scan, page_bounds). The retrieval half of retrieval-completion
// attention; docs/methods/retrieval-completion.md.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "floe/core/budget.hpp"
#include "floe/core/default_init_vector.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

// What a scorer of topk_anchors provides (see scorers/exact_scan.hpp for the simplest).
template <class Sc>
concept MiddleScorer = requires(const Sc& s, const typename Sc::index& idx) {
  { Sc::name } -> std::convertible_to<std::string_view>;
  { idx.bytes() } -> std::convertible_to<std::uint64_t>;
  { idx.tokens() } -> std::convertible_to<index_t>;
};

// The exact set of one step, and what a residual needs of it: the middle region and the
// ranges of it that were retrieved (the exact set is sink + retrieved + tail).
struct anchored_selection : floe::selection {
  token_range middle;
  std::vector<token_range> retrieved;
  // The scorer's score per head for every middle token, [heads, middle.size()], when it
  // makes one (quantized_scan: 4-bit estimates; exact_scan: exact), else empty. Resized
  // each step without zeroing (the scorer writes every element).
  default_init_vector<float> estimates;
  // From the same scorers: each middle token's group-shared score max_h (e_h,i - c_h) and
  // the c_h it is relative to (head h's largest estimate), else empty.
  default_init_vector<float> shared;
  std::vector<float> offsets;
};

namespace detail {
// "topk_anchors:" followed by the scorer's name, as one compile-time string.
template <class Sc>
struct anchored_name {
  static constexpr std::string_view prefix = "topk_anchors:";
  static constexpr auto chars = [] {
    std::array<char, prefix.size() + Sc::name.size()> a{};
    std::copy(prefix.begin(), prefix.end(), a.begin());
    std::copy(Sc::name.begin(), Sc::name.end(), a.begin() + prefix.size());
    return a;
  }();
  static constexpr std::string_view value{chars.data(), chars.size()};
};
}  // namespace detail

template <MiddleScorer Scorer>
struct topk_anchors {
  static constexpr std::string_view name = detail::anchored_name<Scorer>::value;
  index_t sink = 4;       // S
  index_t window = 64;    // W
  budget middle_budget = budget::fraction(0.05);  // counts and fractions are of the middle region
  Scorer scorer{};

  // k exact tokens in all: `sink` sinks, a window of up to k/4 (at most `window`), and
  // the rest Top-K of the middle.
  static topk_anchors with_budget(index_t k, index_t sink = 4, index_t window = 64, Scorer scorer = {}) {
    const index_t w = std::min(window, k / 4), s = std::min(sink, k - w);
    return {s, w, budget::tokens(k - s - w), std::move(scorer)};
  }

  // The scorer's index over every token (tail included, so the middle can grow into it).
  using index = typename Scorer::index;
  using selection = anchored_selection;

  template <KvView KV>
  index build(const KV& kv) const {
    check_anchors(kv.n());
    return scorer.build(kv);
  }

  // The middle region of a cache of n tokens: [S, n - W), cut at the tokens the index
  // covers (tokens past it, not yet appended, are attended exactly with the tail).
  token_range middle(index_t n, const index& idx) const {
    const index_t tail = n > window ? n - window : 0;
    const index_t end = std::min(tail, std::min<index_t>(idx.tokens(), n));
    return {sink, std::max(sink, end)};
  }

  template <KvView KV, class Exec>
  void select(const index& idx, const KV& kv, const query_group& q, const Exec& exec, selection& out,
              stats& io) const {
    out.clear();
    out.retrieved.clear();
    out.estimates.clear();
    out.shared.clear();
    out.offsets.clear();
    validate_query(q, kv.d());
    check_anchors(kv.n());
    const index_t n = kv.n();
    out.middle = middle(n, idx);
    const index_t size = out.middle.size();
    const index_t k = ranking::fixed_count(middle_budget, size);  // throws "budget" past the middle

    out.add(0, sink);
    bool keys_read = false;
    if (size > 0 && middle_budget.kind != budget::unit::mass && k >= size) {
      out.add(out.middle.begin, out.middle.end);  // the whole middle: nothing to rank
    } else if (size > 0) {
      keys_read = scorer.choose(idx, kv, q, exec, out.middle, k, middle_budget, out, io);
    }
    for (const token_range& r : out.ranges) {  // the middle part of what was chosen
      const token_range m{std::max(r.begin, out.middle.begin), std::min(r.end, out.middle.end)};
      if (m.begin < m.end) out.retrieved.push_back(m);
    }
    out.add(out.middle.end, n);
    if (keys_read) {  // the scorer read the retrieved keys; count the anchors' keys too
      out.keys_counted = true;
      io.key_bytes += static_cast<std::uint64_t>(sink + (n - out.middle.end)) * kv.d() *
                      sizeof(typename KV::element_type);
    }
  }

 private:
  void check_anchors(index_t n) const {
    require(sink + window < n, "window", "sink S = ", sink, " plus window W = ", window,
            " leaves no middle region in a cache of n = ", n, " tokens (S + W must be < n)");
  }
};

}  // namespace floe::select
