// scan-completion-probe: an experiment, not a method. Would the 4-bit scan that
// quantized_scan already makes complete Top-K better than a feature map? For every
// (layer, query head, step) of a KV dump it selects with topk_anchors<quantized_scan>
// and compares, against dense attention in double:
//   none        selection only (renormalise over what was read);
//   mean        D^ = sum over left-out middle tokens of exp(4-bit estimated score),
//               N^ = D^ x the left-out tokens' unweighted mean value;
//   pages       same D^, N^ = sum over pages of 16 of (the page's left-out D^) x (its
//               left-out mean value);
//   true value  same D^, N^ = D^ x the true weighted left-out mean value: what D^ alone
//               is worth, a bound no value summary can beat;
//   tier        also reads the values (not the keys) of the m left-out tokens ranked next
//               by the group's shared estimate (m = the middle's top-k count, so half the
//               exact part's bytes again): they enter with their estimated weights;
//   tier+mean   tier, and the rest of the left-out tokens as in `mean`.
// At equal bytes, tier at budget b compares with none at budget 1.5 b.
// Value sums of the left-out tokens are exact here (a real index would keep page sums
// and subtract what the exact part read). Errors are p90 per attention-entropy bucket.
// With --norms it prints instead, per (layer, KV head), the mean scaled squared norms
// that set the variance of positive random features: s|k|^2, s|k - c|^2 (c: the key
// mean) and s|q|^2.
// usage: scan-completion-probe DUMP_DIR [budget ... | --norms]     docs/methods/retrieval-completion.md
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "floe/exec/scalar.hpp"
#include "floe/io/kv_dump.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"

namespace {
using namespace floe;
using selector = select::topk_anchors<select::quantized_scan>;
constexpr index_t page = 16;
const char* const variants[] = {"none", "mean", "pages", "true value", "tier", "tier+mean"};
constexpr int variant_count = 6;

double relative_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (index_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

double p90(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v[static_cast<index_t>(std::ceil(0.9 * static_cast<double>(v.size()))) - 1];
}

struct sample {
  double entropy;
  double error[variant_count];
};

// Every query head of one KV head and step: the four outputs' errors.
template <KvView KV>
void probe(const KV& kv, const query_group& q, const selector& sel, const selector::index& idx,
           std::vector<sample>& out) {
  const index_t n = kv.n(), dv = kv.dv();
  selector::selection chosen;
  stats io;
  sel.select(idx, kv, q, exec::scalar{}, chosen, io);
  std::vector<char> exact(n, 0);
  for (const auto& r : chosen.ranges)
    for (index_t i = r.begin; i < r.end; ++i) exact[i] = 1;
  const token_range mid = chosen.middle;
  std::vector<float> estimate(q.heads * mid.size()), radius(estimate.size()), z(n);
  idx.scan(idx.prepare(q), mid.begin, mid.end, estimate.data(), radius.data(), mid.size());
  // The value tier: the left-out middle tokens with the largest shared estimate.
  const index_t m_tier = chosen.count() > 0 ? std::min<index_t>(mid.size(), chosen.count()) : 0;
  std::vector<char> tier(n, 0);
  {
    std::vector<float> c(q.heads, -1e30f), shared(mid.size(), -1e30f);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t i = 0; i < mid.size(); ++i) c[h] = std::max(c[h], estimate[h * mid.size() + i]);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t i = 0; i < mid.size(); ++i) shared[i] = std::max(shared[i], estimate[h * mid.size() + i] - c[h]);
    std::vector<index_t> order;
    for (index_t i = 0; i < mid.size(); ++i)
      if (!exact[mid.begin + i]) order.push_back(i);
    const index_t take = std::min<index_t>(m_tier, order.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(take), order.end(),
                      [&](index_t a, index_t b) { return shared[a] > shared[b]; });
    for (index_t j = 0; j < take; ++j) tier[mid.begin + order[j]] = 1;
  }
  for (index_t h = 0; h < q.heads; ++h) {
    exec::scalar{}.score(kv, q, h, {0, n}, z.data());
    const double top = *std::max_element(z.begin(), z.end());
    double d_exact = 0, d_left = 0, d_hat = 0, entropy = 0, left_count = 0, d_tier = 0, d_rest = 0, rest_count = 0;
    std::vector<double> n_exact(dv, 0), n_left(dv, 0), v_left(dv, 0), n_pages(dv, 0), n_tier(dv, 0), v_rest(dv, 0);
    std::vector<double> page_mass((n + page - 1) / page, 0), page_count(page_mass.size(), 0),
        page_sum(page_mass.size() * dv, 0);
    for (index_t i = 0; i < n; ++i) {
      const double w = std::exp(static_cast<double>(z[i]) - top);
      const auto* v = kv.value_row(i);
      if (exact[i]) {
        d_exact += w;
        for (index_t j = 0; j < dv; ++j) n_exact[j] += w * to_float(v[j]);
        continue;
      }
      const double w_hat = std::exp(static_cast<double>(estimate[h * mid.size() + i - mid.begin]) - top);
      d_left += w;
      d_hat += w_hat;
      left_count += 1;
      if (tier[i]) {
        d_tier += w_hat;
        for (index_t j = 0; j < dv; ++j) n_tier[j] += w_hat * to_float(v[j]);
      } else {
        d_rest += w_hat;
        rest_count += 1;
        for (index_t j = 0; j < dv; ++j) v_rest[j] += to_float(v[j]);
      }
      page_mass[i / page] += w_hat;
      page_count[i / page] += 1;
      for (index_t j = 0; j < dv; ++j) {
        n_left[j] += w * to_float(v[j]);
        v_left[j] += to_float(v[j]);
        page_sum[i / page * dv + j] += to_float(v[j]);
      }
    }
    for (index_t p = 0; p < page_mass.size(); ++p)
      if (page_count[p] > 0)
        for (index_t j = 0; j < dv; ++j) n_pages[j] += page_mass[p] * page_sum[p * dv + j] / page_count[p];
    for (index_t i = 0; i < n; ++i) {
      const double w = std::exp(static_cast<double>(z[i]) - top) / (d_exact + d_left);
      if (w > 0) entropy -= w * std::log(w);
    }
    std::vector<double> want(dv), got[variant_count];
    for (auto& g : got) g.resize(dv);
    for (index_t j = 0; j < dv; ++j) {
      want[j] = (n_exact[j] + n_left[j]) / (d_exact + d_left);
      got[0][j] = n_exact[j] / d_exact;
      got[1][j] = (n_exact[j] + d_hat * v_left[j] / left_count) / (d_exact + d_hat);
      got[2][j] = (n_exact[j] + n_pages[j]) / (d_exact + d_hat);
      got[3][j] = (n_exact[j] + d_hat * n_left[j] / d_left) / (d_exact + d_hat);
      got[4][j] = (n_exact[j] + n_tier[j]) / (d_exact + d_tier);
      got[5][j] = (n_exact[j] + n_tier[j] + (rest_count > 0 ? d_rest * v_rest[j] / rest_count : 0.0)) /
                  (d_exact + d_tier + d_rest);
    }
    sample s{entropy, {}};
    for (int k = 0; k < variant_count; ++k) s.error[k] = relative_l2(got[k], want);
    out.push_back(s);
  }
}
// Mean s|k|^2, s|k - c|^2 and s|q|^2 of one KV head.
template <KvView KV>
void print_norms(const std::string& layer, index_t head, const KV& kv, const io::kv_dump& dump) {
  std::vector<double> mean(kv.d(), 0.0);
  for (index_t i = 0; i < kv.n(); ++i)
    for (index_t t = 0; t < kv.d(); ++t) mean[t] += to_float(kv.key_row(i)[t]) / static_cast<double>(kv.n());
  double raw = 0, centred = 0, query = 0;
  for (index_t i = 0; i < kv.n(); ++i)
    for (index_t t = 0; t < kv.d(); ++t) {
      const double x = to_float(kv.key_row(i)[t]);
      raw += x * x / static_cast<double>(kv.n());
      centred += (x - mean[t]) * (x - mean[t]) / static_cast<double>(kv.n());
    }
  for (index_t t = 0; t < dump.steps; ++t) {
    const query_group q = dump.queries_of(head, t);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t x = 0; x < q.d; ++x)
        query += static_cast<double>(q.row(h)[x]) * q.row(h)[x] / static_cast<double>(dump.steps * q.heads);
  }
  const double s = dump.scale;
  std::printf("%-10s kv head %zu   s|k|^2 %6.1f   s|k-c|^2 %6.1f   s|q|^2 %6.1f\n", layer.c_str(), head, s * raw,
              s * centred, s * query);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: scan-completion-probe DUMP_DIR [budget ...]\n");
    return 2;
  }
  if (argc == 3 && std::string(argv[2]) == "--norms") {
    for (const auto& dir : io::kv_dump_layers(argv[1])) {
      const io::kv_dump dump = io::load_kv_dump(dir);
      for (index_t h = 0; h < dump.kv_heads; ++h)
        dump.visit_head(h, [&](const auto& kv) { print_norms(dir.filename().string(), h, kv, dump); });
    }
    return 0;
  }
  std::vector<double> budgets;
  for (int a = 2; a < argc; ++a) budgets.push_back(std::atof(argv[a]));
  if (budgets.empty()) budgets = {0.02, 0.05, 0.1};
  try {
    const auto layers = io::kv_dump_layers(argv[1]);
    std::printf("%-8s %-11s %10s %10s %10s\n", "budget", "variant", "p90 all", "p90 <=5", "p90 >5");
    for (double b : budgets) {
      std::vector<sample> samples;
      for (const auto& dir : layers) {
        const io::kv_dump dump = io::load_kv_dump(dir);
        for (index_t h = 0; h < dump.kv_heads; ++h)
          dump.visit_head(h, [&](const auto& kv) {
            const selector sel = selector::with_budget(static_cast<index_t>(std::ceil(b * static_cast<double>(kv.n()))));
            const auto idx = sel.build(kv);
            for (index_t t = 0; t < dump.steps; ++t) probe(kv, dump.queries_of(h, t), sel, idx, samples);
          });
      }
      for (int k = 0; k < variant_count; ++k) {
        std::vector<double> all, low, high;
        for (const auto& s : samples) {
          all.push_back(s.error[k]);
          (s.entropy > 5 ? high : low).push_back(s.error[k]);
        }
        std::printf("%-8g %-11s %10.3e %10.3e %10.3e\n", b, variants[k], p90(all), p90(low), p90(high));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scan-completion-probe: %s\n", e.what());
    return 1;
  }
}
