// Scorer `page_bounds` for topk_anchors (Quest): bounds every score of a page of keys by
// its elementwise minimum and maximum and reads the pages of largest bound whole.
// docs/methods/retrieval-completion.md, "page_bounds".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <string_view>
#include <vector>

#include "floe/core/budget.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/page_bounds_index.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

struct page_bounds {
  static constexpr std::string_view name = "page_bounds";
  index_t page_size = 16;  // tokens per page; pages are aligned to multiples of it

  using index = page_bounds_index;

  template <KvView KV>
  index build(const KV& kv) const { return page_bounds_index::build(kv, page_size); }

  // Adds whole pages (clipped to `middle`) in increasing order until they hold at least k
  // tokens, best shared bound first; for a mass budget, until the pages' estimated share
  // (page size times exp(bound), per head, averaged) reaches p. Keys are not read: false.
  template <KvView KV, class Exec>
  bool choose(const index& idx, const KV&, const query_group& q, const Exec&, token_range middle, index_t k,
              const budget& b, selection& out, stats& io) const {
    const index_t p0 = middle.begin / idx.page_size(), pages = (middle.end - 1) / idx.page_size() + 1 - p0;
    auto page_range = [&](index_t p) {
      return token_range{std::max(middle.begin, (p0 + p) * idx.page_size()),
                         std::min(middle.end, (p0 + p + 1) * idx.page_size())};
    };
    std::vector<float> bound(q.heads * pages);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t p = 0; p < pages; ++p) bound[h * pages + p] = idx.upper_bound(q, h, p0 + p);
    io.summary_bytes += static_cast<std::uint64_t>(pages) * idx.bytes_per_page();

    const std::vector<float> c = ranking::head_maxima(bound.data(), q.heads, pages, pages);
    std::vector<float> shared(pages);
    ranking::shared_scores(bound.data(), q.heads, pages, pages, c, shared.data());
    std::vector<index_t> order(pages);
    std::iota(order.begin(), order.end(), index_t{0});
    std::sort(order.begin(), order.end(), ranking::larger_first{shared.data()});

    std::vector<double> share;  // mass budgets: estimated share of each page, in `order`
    if (b.kind == budget::unit::mass) {
      share.assign(pages, 0.0);
      for (index_t h = 0; h < q.heads; ++h) {
        double total = 0.0;
        for (index_t p = 0; p < pages; ++p) total += page_range(p).size() * std::exp(double(bound[h * pages + p]) - c[h]);
        for (index_t r = 0; r < pages; ++r) {
          const index_t p = order[r];
          share[r] += page_range(p).size() * std::exp(double(bound[h * pages + p]) - c[h]) / (total * q.heads);
        }
      }
    }
    std::vector<index_t> chosen;
    index_t tokens = 0;
    double reached = 0.0;
    for (index_t r = 0; r < pages; ++r) {
      if (b.kind == budget::unit::mass) {
        if (tokens >= std::min(b.cap, middle.size()) || (reached >= b.value * (1.0 - 1e-12) && tokens >= b.floor)) break;
        reached += share[r];
      } else if (tokens >= k) {
        break;
      }
      chosen.push_back(order[r]);
      tokens += page_range(order[r]).size();
    }
    std::sort(chosen.begin(), chosen.end());
    for (index_t p : chosen) out.add(page_range(p).begin, page_range(p).end);
    return false;
  }
};

}  // namespace floe::select
