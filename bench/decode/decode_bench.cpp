// Decode attention speed of floe::exec::simd and of the scalar reference, dense and
// gathered, as bytes read per second and as a fraction of the machine's read bandwidth
// measured in the same run (docs/benchmarks.md).
//
//   decode_bench [--benchmark_format=json] [--benchmark_filter=...]
//   FLOE_BENCH_STREAM_MIB=1024       buffer of the streaming-read measurement, taken again
//                                    (median of 3 passes) right before every case
//   FLOE_BENCH_WORKING_SET_MIB=2048  KV copies rotated per iteration (a cold cache, as in a
//                                    model whose other layers evict this one between steps)
//   FLOE_BENCH_HUGEPAGES=1           KV caches and the streaming-read buffer in transparent
//                                    huge pages (madvise)
//   FLOE_BENCH_PAGED_POOL=S          paged views draw their blocks from a pool S times the
//                                    sequence's blocks (other sequences' blocks in between);
//                                    1 (default): a pool of exactly the sequence's blocks.
//                                    Paged cases then also measure the scattered-read
//                                    reference (scattered_GB/s, bw_fraction_scattered)
//   FLOE_BENCH_PAGED_BLOCK=B         tokens per paged block (default 16; cases "paged<B>")
//   FLOE_SIMD_ARCH=avx512|avx2|scalar
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "stream_read.hpp"

namespace {

using floe::index_t;
using floe::token_range;

// Joins the parts of a name (GCC 12 warns falsely on chains of std::string operator+).
template <class... Parts>
std::string join(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

struct shape_config {
  index_t d, q_heads, kv_heads;
  std::string name() const { return join("d", d, "_hq", q_heads, "_hkv", kv_heads); }
};

enum class executor_kind { simd, scalar };
// gathered: 64-token ranges covering 5% of N; paged: blocks of FLOE_BENCH_PAGED_BLOCK tokens
enum class access_kind { dense, gathered, paged };

std::size_t env_count(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

std::size_t env_mib(const char* name, std::size_t fallback) { return env_count(name, fallback) << 20; }

// FLOE_BENCH_PAGED_IN_ORDER=1: the block table in order (a diagnostic: the same kernel path
// as the shuffled table, without the jumps between 4 KiB blocks).
bool paged_in_order() {
  const char* v = std::getenv("FLOE_BENCH_PAGED_IN_ORDER");
  return v && *v == '1';
}

// FLOE_BENCH_PAGED_POOL=S: each (copy, head) gets its own table of distinct slots drawn at
// random from a pool of S x its blocks, as if S sequences' blocks were interleaved.
index_t paged_pool_factor() { return std::max<index_t>(1, env_count("FLOE_BENCH_PAGED_POOL", 1)); }

index_t paged_block() { return std::max<index_t>(1, env_count("FLOE_BENCH_PAGED_BLOCK", 16)); }

bool huge_pages() {
  const char* v = std::getenv("FLOE_BENCH_HUGEPAGES");
  return v && *v == '1';
}

// The streaming-read buffer, allocated once; every case measures against it afresh.
const floe::bench::stream_reader& stream_buffer() {
  static const floe::bench::stream_reader reader(env_mib("FLOE_BENCH_STREAM_MIB", 1024), huge_pages());
  return reader;
}

// KV caches of one batch-1 decode step (Hkv heads of N tokens), in `copies` independent
// copies so that rotating through them keeps the working set far above the LLC.
constexpr index_t selections = 31;  // gathered selections in rotation (prime: decoupled from copies)

template <class T>
struct kv_set {
  shape_config shape;
  index_t n, copies;
  std::unique_ptr<void, decltype(&std::free)> storage{nullptr, &std::free};  // holds `cache`
  std::span<T> cache;                       // [copy][head][keys n*d | values n*d], on 64-byte lines
  std::vector<std::int32_t> table;          // a shuffled block table (FLOE_BENCH_PAGED_BLOCK tokens)
  std::vector<std::vector<std::int32_t>> sparse_tables;  // [copy * heads + head], FLOE_BENCH_PAGED_POOL > 1
  std::string paged_error;  // a FLOE_BENCH_PAGED_* setting that does not fit: the paged cases say so
  std::vector<std::vector<std::vector<token_range>>> exact;  // [selection][head]: gathered ranges
  std::vector<float> queries, outputs;      // [copy][Hq][d]

  kv_set(shape_config s, index_t n_) : shape(s), n(n_) {
    const std::size_t head_elems = 2 * n * s.d, copy_elems = head_elems * s.kv_heads;
    copies = std::max<std::size_t>(2, (env_mib("FLOE_BENCH_WORKING_SET_MIB", 2048) + copy_elems * sizeof(T) - 1) /
                                          (copy_elems * sizeof(T)));
    // Rows start on cache lines, as in an engine's cache: malloc alone gives 16-byte
    // alignment, which costs the kernel up to 40% (docs/benchmarks.md).
    // FLOE_BENCH_HUGEPAGES=1: on 2 MiB pages, madvise(MADV_HUGEPAGE) before the first
    // touch, as an engine may do.
    const std::size_t align = huge_pages() ? std::size_t{2} << 20 : 64;
    const std::size_t bytes = (copy_elems * copies * sizeof(T) + align - 1) / align * align;
    storage.reset(std::aligned_alloc(align, bytes));
    if (!storage) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
    if (huge_pages()) madvise(storage.get(), bytes, MADV_HUGEPAGE);
#endif
    cache = std::span<T>(static_cast<T*>(storage.get()), copy_elems * copies);
    std::mt19937_64 g(42);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<T> pattern(1 << 19);  // random values, repeated: speed does not depend on them
    for (auto& x : pattern) x = floe::from_float<T>(normal(g));
    for (std::size_t i = 0; i < cache.size(); i += pattern.size())
      std::memcpy(cache.data() + i, pattern.data(), std::min(pattern.size(), cache.size() - i) * sizeof(T));
    if (n % paged_block() != 0)
      paged_error = join("FLOE_BENCH_PAGED_BLOCK=", paged_block(), " does not divide N = ", n);
    table.resize(n / paged_block());
    for (index_t b = 0; b < table.size(); ++b) table[b] = static_cast<std::int32_t>(b);
    if (!paged_in_order()) std::shuffle(table.begin(), table.end(), g);
    if (const index_t spread = paged_pool_factor(), pool = pool_blocks(); spread > 1 && paged_error.empty()) {
      if (2 * pool * paged_block() * s.d > cache.size()) {
        paged_error = join("FLOE_BENCH_PAGED_POOL=", spread, " needs a working set of ", spread,
                           " x one head's KV (raise FLOE_BENCH_WORKING_SET_MIB)");
      } else {
        std::vector<std::int32_t> slots(pool);
        for (index_t i = 0; i < pool; ++i) slots[i] = static_cast<std::int32_t>(i);
        for (index_t v = 0; v < copies * s.kv_heads; ++v) {
          std::shuffle(slots.begin(), slots.end(), g);  // a random subset, in random order
          sparse_tables.emplace_back(slots.begin(), slots.begin() + static_cast<std::ptrdiff_t>(table.size()));
          if (paged_in_order()) std::sort(sparse_tables.back().begin(), sparse_tables.back().end());
        }
      }
    }
    // Fresh selections rotate independently of the copies, so that what gathered decode
    // reads over many steps is spread over the whole working set, not a cached 5% of it.
    const index_t slots = n / 64, chosen = std::max<index_t>(1, (n / 20 + 32) / 64);
    exact.resize(selections);
    for (auto& selection : exact)
      for (index_t h = 0; h < s.kv_heads; ++h) {
        std::vector<index_t> ids(slots);
        for (index_t i = 0; i < slots; ++i) ids[i] = i;
        std::shuffle(ids.begin(), ids.end(), g);
        ids.resize(chosen);
        std::sort(ids.begin(), ids.end());
        selection.emplace_back();
        for (index_t id : ids) selection.back().push_back({id * 64, id * 64 + 64});
      }
    queries.resize(copies * s.q_heads * s.d);
    for (auto& x : queries) x = normal(g);
    outputs.resize(copies * s.q_heads * s.d);
  }

  index_t pool_blocks() const { return paged_pool_factor() * (n / paged_block()); }
  const T* keys(index_t copy, index_t head) const { return cache.data() + (copy * shape.kv_heads + head) * 2 * n * shape.d; }
  const T* values(index_t copy, index_t head) const { return keys(copy, head) + n * shape.d; }
};

// One cached kv_set: consecutive cases of one (shape, N, type) share it.
template <class T>
const kv_set<T>& cached_kv_set(shape_config s, index_t n) {
  static std::string key;
  static std::shared_ptr<void> held;
  const std::string want = join(s.name(), "/", n, "/", floe::element_name<T>());
  if (key != want) {
    held.reset();  // free the previous set first
    held = std::make_shared<kv_set<T>>(s, n);
    key = want;
  }
  return *static_cast<const kv_set<T>*>(held.get());
}

template <class KV>
struct batch_views {
  std::vector<std::vector<KV>> heads;                   // [copy][head]
  std::vector<std::vector<floe::sequence<KV>>> batch;   // [copy] -> one sequence
};

template <class T>
batch_views<floe::kv_view<T>> contiguous_views(const kv_set<T>& set) {
  batch_views<floe::kv_view<T>> v;
  for (index_t c = 0; c < set.copies; ++c) {
    v.heads.emplace_back();
    for (index_t h = 0; h < set.shape.kv_heads; ++h)
      v.heads.back().emplace_back(set.keys(c, h), set.values(c, h), set.n, set.shape.d, set.shape.d);
  }
  return v;
}

template <class T>
batch_views<floe::paged_kv_view<T>> paged_views(const kv_set<T>& set) {
  batch_views<floe::paged_kv_view<T>> v;
  for (index_t c = 0; c < set.copies; ++c) {
    v.heads.emplace_back();
    for (index_t h = 0; h < set.shape.kv_heads; ++h) {
      if (set.sparse_tables.empty()) {
        v.heads.back().emplace_back(set.keys(c, h), set.values(c, h), set.n / paged_block(), paged_block(), set.table,
                                    set.n, set.shape.d, set.shape.d);
      } else {  // one pool shared by every view: keys, then values
        const index_t pool = set.pool_blocks();
        v.heads.back().emplace_back(set.cache.data(), set.cache.data() + pool * paged_block() * set.shape.d, pool,
                                    paged_block(), set.sparse_tables[c * set.shape.kv_heads + h], set.n, set.shape.d,
                                    set.shape.d);
      }
    }
  }
  return v;
}

template <class T, class KV>
void fill_batches(const kv_set<T>& set, batch_views<KV>& v) {
  auto& mutable_set = const_cast<kv_set<T>&>(set);  // outputs are scratch
  for (index_t c = 0; c < set.copies; ++c)
    v.batch.push_back({{v.heads[c], set.queries.data() + c * set.shape.q_heads * set.shape.d,
                        mutable_set.outputs.data() + c * set.shape.q_heads * set.shape.d}});
}

// The scalar reference over the batch: one partial per GQA group, groups over threads.
template <class KV>
void scalar_decode(const floe::sequence<KV>& seq, const shape_config& s, float scale,
                   const std::vector<std::vector<token_range>>* exact, floe::thread_pool& pool) {
  const index_t g = s.q_heads / s.kv_heads;
  pool.parallel_for(s.kv_heads, [&](index_t h) {
    const KV& kv = seq.kv_heads[h];
    const floe::query_group q{seq.queries + h * g * s.d, g, s.d, 0, scale};
    const std::vector<token_range> all{{0, kv.n()}};
    floe::partial_set<double> p(g, s.d);
    floe::exec::scalar{}.attend(kv, q, exact ? (*exact)[h] : all, p);
    p.finalize(floe::output_group<float>{seq.out + h * g * s.d, g, s.d, 0});
  });
}

template <class T>
void bm_decode(benchmark::State& state, shape_config s, index_t n, executor_kind exec_kind, access_kind access,
               index_t threads) {
  const kv_set<T>& set = cached_kv_set<T>(s, n);
  if (access == access_kind::paged && !set.paged_error.empty()) {
    state.SkipWithError(set.paged_error.c_str());
    return;
  }
  floe::thread_pool pool(threads);
  // The reference bandwidth, measured just before the case: the same threads, the same
  // moment's load from whatever else runs on the machine.
  const double stream_gbps = stream_buffer().measure(pool, 3).median_gbps;
  const floe::exec::simd simd(pool);
  const float scale = 1.f / std::sqrt(static_cast<float>(s.d));
  const bool gathered = access == access_kind::gathered;
  const index_t tokens = gathered ? set.exact[0][0].size() * 64 : n;
  auto run = [&](auto& views) {
    fill_batches(set, views);
    index_t copy = 0, selection = 0;
    for (auto _ : state) {
      const auto& seq = views.batch[copy];
      const auto* exact = gathered ? &set.exact[selection] : nullptr;
      if (exec_kind == executor_kind::scalar) {
        scalar_decode(seq[0], s, scale, exact, pool);
      } else {
        using seq_t = std::decay_t<decltype(seq[0])>;
        if (exact) simd.decode_gathered(std::span<const seq_t>(seq), {s.q_heads, s.kv_heads}, scale, *exact);
        else simd.decode(std::span<const seq_t>(seq), {s.q_heads, s.kv_heads}, scale);
      }
      benchmark::DoNotOptimize(seq[0].out[0]);
      benchmark::ClobberMemory();
      copy = (copy + 1) % set.copies;
      selection = (selection + 1) % selections;
    }
  };
  if (access == access_kind::paged) {
    auto views = paged_views(set);
    run(views);
  } else {
    auto views = contiguous_views(set);
    run(views);
  }
  const double bytes = static_cast<double>(s.kv_heads * tokens * 2 * s.d * sizeof(T));
  state.counters["bytes"] = bytes;
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bw_fraction"] =
      benchmark::Counter(bytes * 1e-9 / stream_gbps, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["stream_GB/s"] = stream_gbps;
  state.counters["copies"] = static_cast<double>(set.copies);
  if (access == access_kind::paged && paged_pool_factor() > 1) {
    // A sparse pool's own reference: one block-sized chunk out of every S, in address order.
    const double scattered =
        stream_buffer().measure_scattered(pool, paged_block() * s.d * sizeof(T), paged_pool_factor(), 7).median_gbps;
    state.counters["scattered_GB/s"] = scattered;
    if (scattered > 0)  // 0: the buffer holds fewer stretches than threads (FLOE_BENCH_STREAM_MIB too small)
      state.counters["bw_fraction_scattered"] =
          benchmark::Counter(bytes * 1e-9 / scattered, benchmark::Counter::kIsIterationInvariantRate);
  }
  state.SetLabel(exec_kind == executor_kind::simd ? std::string(floe::simd_arch_name(simd.arch())) : "double");
}

void bm_stream_read(benchmark::State& state, index_t threads) {
  floe::thread_pool pool(threads);
  floe::bench::stream_result r;
  for (auto _ : state) r = stream_buffer().measure(pool, 7);
  state.counters["GB/s"] = r.median_gbps;
  state.counters["best_GB/s"] = r.best_gbps;
  state.counters["bytes"] = static_cast<double>(r.bytes);
}

template <class T>
void register_cases(shape_config s, index_t n) {
  const std::string tail = join("/", floe::element_name<T>(), "/", s.name(), "/N:", n);
  const std::string paged_name = join("paged", paged_block());
  const std::pair<const char*, access_kind> accesses[] = {
      {"dense", access_kind::dense}, {"gathered", access_kind::gathered}, {"paged", access_kind::paged}};
  for (const auto& [access_name, access] : accesses)
    for (const auto exec_kind : {executor_kind::simd, executor_kind::scalar}) {
      if (exec_kind == executor_kind::scalar && access == access_kind::paged) continue;
      for (index_t threads : {1, 2}) {
        const std::string name = join("decode/", exec_kind == executor_kind::simd ? "simd/" : "scalar/",
                                      access == access_kind::paged ? paged_name.c_str() : access_name,
                                      tail, "/threads:", threads);
        benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& st) {
          bm_decode<T>(st, s, n, exec_kind, access, threads);
        })->UseRealTime()->Unit(benchmark::kMillisecond);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  for (index_t threads : {1, 2}) {
    benchmark::RegisterBenchmark(join("stream_read/threads:", threads).c_str(),
                                 [threads](benchmark::State& st) { bm_stream_read(st, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1);
  }
  for (const shape_config s : {shape_config{128, 32, 8}, shape_config{64, 9, 3}})
    for (index_t n : {4096, 32768, 131072}) {
      register_cases<floe::half>(s, n);
      register_cases<floe::bfloat16>(s, n);
    }
  benchmark::AddCustomContext("floe_simd_arch", std::string(floe::simd_arch_name(floe::exec::simd().arch())));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
