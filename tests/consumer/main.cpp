// Builds against an installed floe and checks one decode step against the reference.
#include <floe/floe.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const std::size_t n = 100, d = 8;
  std::vector<float> k(n * d), v(n * d), q(d, 0.1f), out(d), ref(d);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.37f * static_cast<float>(i));
    v[i] = std::cos(0.11f * static_cast<float>(i));
  }
  const floe::kv_view<float> kv(k.data(), v.data(), n, d, d);
  const auto group = floe::query_group::make(q.data(), 1, d);
  floe::stats s;
  floe::estimator<floe::select::streaming, floe::residual::none> stream({4, 200}, {});
  stream.decode(stream.build(kv), kv, group, floe::exec::scalar{}, floe::output_group<float>{out.data(), 1, d, 0}, s);
  floe::estimator<floe::select::dense, floe::residual::none> dense;
  dense.decode(dense.build(kv), kv, group, floe::exec::scalar{}, floe::output_group<float>{ref.data(), 1, d, 0}, s);
  for (std::size_t j = 0; j < d; ++j)
    if (std::fabs(out[j] - ref[j]) > 1e-6f) return std::printf("mismatch at %zu\n", j), 1;
  std::printf("floe consumer: ok (%llu tokens read)\n", static_cast<unsigned long long>(s.tokens_read));
  return 0;
}
