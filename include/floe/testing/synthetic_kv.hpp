// A seeded synthetic KV cache that behaves like a real LLM's rather than i.i.d. Gaussians:
// an attention sink at token 0, massive key channels, RoPE with the semantic signal in the
// slow-rotating dimensions, topic segments, a RoPE-induced recency bias and needle tokens
// that retrieval queries match sharply. The model and its constants are documented in
// docs/evaluation.md ("The synthetic cache"); every number here is a logit or a norm.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/numeric_types.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/io/kv_dump.hpp"

namespace floe::testing {

struct synthetic_kv_config {
  index_t n = 32768;       // cached tokens
  index_t kv_heads = 8;
  index_t group = 4;       // GQA: query heads per KV head
  index_t d = 128;         // key dimension (even: RoPE rotates pairs)
  index_t dv = 128;
  index_t queries = 16;    // decode steps per query head, at positions n, n+1, ...
  std::uint64_t seed = 1;
  double rope_base = 500000.0;  // Llama-3-like: the slowest pairs turn < 0.1 rad over 32K tokens

  void validate() const {
    require(n >= 64, "n", "the synthetic cache needs at least 64 tokens, got ", n);
    require(kv_heads >= 1, "kv_heads", "must be at least 1");
    require(group >= 1, "group", "must be at least 1");
    require(d >= 32 && d % 2 == 0, "d", "must be even and at least 32, got ", d);
    require(dv >= 1, "dv", "must be positive");
    require(queries >= 1, "queries", "must be at least 1");
    require(std::isfinite(rope_base) && rope_base > 1.0, "rope_base", "must be a finite number > 1");
  }
};

// splitmix64 with Marsaglia-polar normals: fully specified, so one seed gives the same
// cache on every platform (std::normal_distribution is implementation-defined).
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  index_t below(index_t k) { return std::min(k - 1, static_cast<index_t>(uniform() * static_cast<double>(k))); }
  float normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u, v, r;
    do {
      u = 2 * uniform() - 1;
      v = 2 * uniform() - 1;
      r = u * u + v * v;
    } while (r >= 1 || r == 0);
    const double f = std::sqrt(-2 * std::log(r) / r);
    spare_ = static_cast<float>(v * f);
    has_spare_ = true;
    return static_cast<float>(u * f);
  }

 private:
  std::uint64_t s_;
  float spare_ = 0.f;
  bool has_spare_ = false;
};

// What a query head mostly does; query head q has role q % 5.
enum class head_role { retrieval, local, topical, sink, diffuse };

inline std::string_view head_role_name(head_role r) {
  constexpr std::string_view names[] = {"retrieval", "local", "topical", "sink", "diffuse"};
  return names[static_cast<int>(r)];
}
inline head_role role_of(index_t query_head) { return static_cast<head_role>(query_head % 5); }

// Where each signal lives, as RoPE pair indices j < d/2 (pair j rotates dims j and j + d/2
// at frequency base^(-2j/d), as Llama's rotate-half layout; high j rotates slowly):
// [topic_lo, needle_lo) topics, [needle_lo, sink) needles, sink = the slowest pair.
struct synthetic_bands {
  index_t pairs, sink, needle_lo, topic_lo, massive_a, massive_b, recency_lo, recency_hi;
  explicit synthetic_bands(index_t d)
      : pairs(d / 2), sink(pairs - 1), needle_lo(sink - std::max<index_t>(2, pairs / 8)),
        topic_lo(needle_lo - std::max<index_t>(4, pairs * 3 / 16)), massive_a(topic_lo - 2),
        massive_b(topic_lo - 4), recency_lo(pairs / 16), recency_hi(std::min(pairs * 5 / 8, massive_b)) {}
};

// The logit-scale constants of one query head (docs/evaluation.md lists the ranges).
struct query_profile {
  head_role role;
  double sink = 0, topic = 0, salient = 0, needle = 0, recency = 0;  // logits
  double noise = 1;            // query noise std per coordinate
  bool earlier_topic = false;  // attends a random earlier topic instead of the current one
  double needle_rate = 0;      // share of steps that look up a needle
};

inline query_profile profile_of(index_t query_head, double x) {  // x in [0, 1): intensity
  using r = head_role;
  switch (role_of(query_head)) {
    case r::retrieval:
      return {.role = r::retrieval, .sink = 8 + 4 * x, .topic = 3, .salient = 5, .needle = 14 + 8 * x, .recency = 1,
              .noise = 0.8, .earlier_topic = true, .needle_rate = 0.35};
    case r::local:
      return {.role = r::local, .sink = 8 + 4 * x, .topic = 2, .salient = 5, .recency = 6 + 5 * x, .noise = 1.0};
    case r::topical:
      return {.role = r::topical, .sink = 9 + 5 * x, .topic = 4 + 5 * x, .salient = 5.5, .recency = 1, .noise = 1.2,
              .earlier_topic = true};
    case r::sink: return {.role = r::sink, .sink = 9 + 5 * x, .topic = 1.5, .salient = 6, .recency = 2, .noise = 1.5};
    case r::diffuse:
      return {.role = r::diffuse, .sink = 4 + 6 * x, .topic = 1 + 2 * x, .salient = 2 + 4 * x, .recency = 0.5,
              .noise = 0.6 + 1.2 * x};
  }
  return {.role = r::diffuse};
}

// One KV head in float: keys [n, d], values [n, dv], queries [group, queries, d], and
// where its needles are (for tests).
struct synthetic_head {
  std::vector<float> keys, values, queries;
  std::vector<index_t> needle_positions;
};

namespace detail {
inline void rotate_pairs(float* row, index_t pairs, double position, const std::vector<double>& theta) {
  for (index_t j = 0; j < pairs; ++j) {
    const double a = position * theta[j], c = std::cos(a), s = std::sin(a);
    const double x = row[j], y = row[j + pairs];
    row[j] = static_cast<float>(x * c - y * s);
    row[j + pairs] = static_cast<float>(x * s + y * c);
  }
}
inline std::vector<float> unit_vector(splitmix64& g, index_t lo, index_t hi, index_t pairs) {
  std::vector<float> u(2 * pairs, 0.f);
  double norm = 0;
  for (index_t j = lo; j < hi; ++j)
    for (index_t half = 0; half < 2; ++half) {
      const float x = g.normal();
      u[j + half * pairs] = x;
      norm += static_cast<double>(x) * x;
    }
  for (auto& x : u) x = static_cast<float>(x / std::sqrt(norm));
  return u;
}
}  // namespace detail

// Generates KV head h of the cache described by cfg; independent of the other heads.
inline synthetic_head generate_synthetic_head(const synthetic_kv_config& cfg, index_t h) {
  cfg.validate();
  require(h < cfg.kv_heads, "kv_head", "head ", h, " of ", cfg.kv_heads);
  const index_t n = cfg.n, d = cfg.d, dv = cfg.dv, P = d / 2;
  const synthetic_bands b(d);
  const double s = 1.0 / std::sqrt(static_cast<double>(d));  // the scale floe uses by default
  splitmix64 g(cfg.seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull * (h + 1));

  std::vector<double> theta(P);
  for (index_t j = 0; j < P; ++j) theta[j] = std::pow(cfg.rope_base, -2.0 * static_cast<double>(j) / static_cast<double>(d));

  // Key norms of each signal; a query component of logit L has norm L / (s * norm).
  constexpr double sink_norm = 12, topic_norm = 4, salient_norm = 4, needle_norm = 10, recency_norm = 8,
                   semantic_noise = 0.5;

  // Topic segments: lengths uniform in [n/48, n/12], topics drawn from 12, never repeating back to back.
  constexpr index_t topics = 12;
  std::vector<std::vector<float>> topic_dir, topic_value;
  for (index_t c = 0; c < topics; ++c) {
    topic_dir.push_back(detail::unit_vector(g, b.topic_lo, b.needle_lo, P));
    std::vector<float> v(dv);
    for (auto& x : v) x = 0.4f * g.normal();
    topic_value.push_back(std::move(v));
  }
  std::vector<index_t> topic_of(n), segment_topics;
  for (index_t i = 0, prev = topics; i < n;) {
    const index_t len = n / 48 + g.below(n / 12 - n / 48 + 1);
    index_t c = g.below(topics);
    if (c == prev) c = (c + 1) % topics;
    for (index_t k = i; k < std::min(n, i + std::max<index_t>(len, 1)); ++k) topic_of[k] = c;
    segment_topics.push_back(c);
    prev = c;
    i += std::max<index_t>(len, 1);
  }

  // Salient tokens: 4 classes of scattered tokens, 0.5% of the cache each, sharing a
  // direction in the topic band (what delimiters or repeated words are to real heads).
  constexpr index_t salient_classes = 4;
  constexpr double salient_rate = 0.005;
  std::vector<std::vector<float>> salient_dir;
  for (index_t c = 0; c < salient_classes; ++c) salient_dir.push_back(detail::unit_vector(g, b.topic_lo, b.needle_lo, P));

  // Needles: distinct directions in the slowest band at random positions of the middle.
  const index_t needles = std::min<index_t>(8, n / 16);
  std::vector<index_t> needle_pos;
  std::vector<std::vector<float>> needle_dir;
  for (index_t k = 0; k < needles; ++k) {
    needle_pos.push_back(n / 32 + g.below(n - n / 16));
    needle_dir.push_back(detail::unit_vector(g, b.needle_lo, b.sink, P));
  }

  // Shared vectors of this head: recency direction, massive channels, value mean.
  const std::vector<float> recency_dir = detail::unit_vector(g, b.recency_lo, b.recency_hi, P);
  const double massive_a = (g.uniform() < 0.5 ? -1 : 1) * (12 + 8 * g.uniform());
  const double massive_b = (g.uniform() < 0.5 ? -1 : 1) * (12 + 8 * g.uniform());
  std::vector<float> value_mean(dv);
  for (auto& x : value_mean) x = 0.8f * g.normal();

  synthetic_head out;
  out.needle_positions = needle_pos;
  out.keys.assign(n * d, 0.f);
  out.values.assign(n * dv, 0.f);
  index_t next_needle = 0;
  std::vector<index_t> needle_order(needles);
  for (index_t k = 0; k < needles; ++k) needle_order[k] = k;
  std::sort(needle_order.begin(), needle_order.end(), [&](index_t a, index_t c) { return needle_pos[a] < needle_pos[c]; });
  for (index_t i = 0; i < n; ++i) {
    float* k = out.keys.data() + i * d;
    float* v = out.values.data() + i * dv;
    const float noise_std = i == 0 ? 0.3f : 1.f;  // the sink is an outlier, not a noisy token
    for (index_t j = 0; j < b.topic_lo; ++j) {
      k[j] = noise_std * g.normal();
      k[j + P] = noise_std * g.normal();
    }
    k[b.massive_a] += static_cast<float>(massive_a);
    k[b.massive_b] += static_cast<float>(massive_b);
    for (index_t t = 0; t < d; ++t) k[t] += static_cast<float>(recency_norm) * recency_dir[t];
    bool is_needle = false;
    index_t which = 0;
    while (next_needle < needles && needle_pos[needle_order[next_needle]] == i) {
      is_needle = true;
      which = needle_order[next_needle++];
    }
    const double u = g.uniform();
    const index_t salient = u < salient_classes * salient_rate ? static_cast<index_t>(u / salient_rate) : salient_classes;
    for (index_t j = b.topic_lo; j < P; ++j)
      for (index_t half = 0; half < 2; ++half) {
        const index_t t = j + half * P;
        double signal = j < b.needle_lo ? topic_norm * topic_dir[topic_of[i]][t]
                        : is_needle     ? needle_norm * needle_dir[which][t]
                                        : 0.0;
        if (salient < salient_classes) signal += salient_norm * salient_dir[salient][t];
        k[t] = static_cast<float>(signal + semantic_noise * g.normal());
      }
    if (i == 0) k[b.sink] += static_cast<float>(sink_norm);
    detail::rotate_pairs(k, P, static_cast<double>(i), theta);

    const std::vector<float>& tv = topic_value[topic_of[i]];
    for (index_t t = 0; t < dv; ++t) {
      const float noise = g.normal();
      if (is_needle) v[t] = 1.5f * noise;
      else if (i == 0) v[t] = 0.1f * (value_mean[t] + noise);  // sinks carry little value
      else v[t] = value_mean[t] + tv[t] + noise;
    }
  }

  // Queries of the g heads of this group, at positions n + t.
  const index_t steps = cfg.queries, current_topic = topic_of[n - 1];
  out.queries.assign(cfg.group * steps * d, 0.f);
  for (index_t j = 0; j < cfg.group; ++j) {
    const index_t qh = h * cfg.group + j;
    splitmix64 gq(cfg.seed * 0xd1b54a32d192ed03ull + 0x8cb92ba72f3d8dd7ull * (qh + 1));
    const query_profile p = profile_of(qh, gq.uniform());
    for (index_t t = 0; t < steps; ++t) {
      float* q = out.queries.data() + (j * steps + t) * d;
      for (index_t c = 0; c < b.topic_lo; ++c) {
        q[c] = static_cast<float>(p.noise * gq.normal());
        q[c + P] = static_cast<float>(p.noise * gq.normal());
      }
      for (index_t m : {b.massive_a, b.massive_b, b.massive_a + P, b.massive_b + P}) q[m] = 0.2f * gq.normal();
      const bool looks_up_needle = needles > 0 && gq.uniform() < p.needle_rate;
      const index_t topic =
          p.earlier_topic ? segment_topics[gq.below(segment_topics.size())] : current_topic;
      for (index_t c = 0; c < d; ++c) {
        double x = p.topic / (s * topic_norm) * topic_dir[topic][c] + p.recency / (s * recency_norm) * recency_dir[c] +
                   p.salient / (s * salient_norm) * salient_dir[qh % salient_classes][c];
        if (looks_up_needle) x += p.needle / (s * needle_norm) * needle_dir[(t + h) % needles][c];
        q[c] += static_cast<float>(x);
      }
      q[b.sink] += static_cast<float>(p.sink / (s * sink_norm));
      detail::rotate_pairs(q, P, static_cast<double>(n + t), theta);
    }
  }
  return out;
}

// The whole cache as a KV dump with keys and values in element type T.
template <KvElement T>
io::kv_dump make_synthetic_kv(const synthetic_kv_config& cfg, const parallel_for_fn& parallel_for = serial_for) {
  cfg.validate();
  io::kv_dump dump;
  dump.kv_heads = cfg.kv_heads;
  dump.n = cfg.n;
  dump.d = cfg.d;
  dump.dv = cfg.dv;
  dump.q_heads = cfg.kv_heads * cfg.group;
  dump.steps = cfg.queries;
  dump.scale = 1.f / std::sqrt(static_cast<float>(cfg.d));
  io::kv_arrays<T> kv;
  kv.keys.resize(cfg.kv_heads * cfg.n * cfg.d);
  kv.values.resize(cfg.kv_heads * cfg.n * cfg.dv);
  dump.queries.resize(dump.q_heads * cfg.queries * cfg.d);
  parallel_for(cfg.kv_heads, [&](index_t h) {
    const synthetic_head head = generate_synthetic_head(cfg, h);
    std::transform(head.keys.begin(), head.keys.end(), kv.keys.begin() + static_cast<std::ptrdiff_t>(h * cfg.n * cfg.d),
                   [](float x) { return from_float<T>(x); });
    std::transform(head.values.begin(), head.values.end(),
                   kv.values.begin() + static_cast<std::ptrdiff_t>(h * cfg.n * cfg.dv), [](float x) { return from_float<T>(x); });
    std::copy(head.queries.begin(), head.queries.end(),
              dump.queries.begin() + static_cast<std::ptrdiff_t>(h * cfg.group * cfg.queries * cfg.d));
  });
  dump.kv = std::move(kv);
  dump.meta = io::json(io::json::object{{"source", "floe::testing::synthetic_kv"},
                                        {"seed", static_cast<double>(cfg.seed)},
                                        {"rope_base", cfg.rope_base},
                                        {"rope_layout", "rotate_half"}});
  return dump;
}

// Same, with the element type by name: "f32", "f16" or "bf16".
inline io::kv_dump make_synthetic_kv(const synthetic_kv_config& cfg, std::string_view dtype,
                                     const parallel_for_fn& parallel_for = serial_for) {
  if (dtype == "f32") return make_synthetic_kv<float>(cfg, parallel_for);
  if (dtype == "f16") return make_synthetic_kv<half>(cfg, parallel_for);
  if (dtype == "bf16") return make_synthetic_kv<bfloat16>(cfg, parallel_for);
  throw invalid_argument("dtype", floe::detail::concat("\"", dtype, "\" is not one of f32, f16, bf16"));
}

}  // namespace floe::testing
