// floe::thread_pool: every index once, exceptions carried back, nested calls, reuse.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "floe/exec/thread_pool.hpp"
#include "support/random_kv.hpp"

using floe::index_t;

TEST_CASE("thread_pool runs every index exactly once", "[exec][thread_pool]") {
  INFO("seed " << floe::testing::seed());
  const index_t threads = GENERATE(1, 2, 3, 4);
  floe::thread_pool pool(threads);
  CHECK(pool.size() == threads);
  for (index_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, [&](index_t i) { hits[i].fetch_add(1); });
    index_t wrong = 0;
    for (auto& h : hits) wrong += h.load() != 1;
    CHECK(wrong == 0);
  }
  // Through the parallel_for_fn hook, many short jobs in a row.
  const auto hook = pool.hook();
  std::atomic<index_t> total{0};
  for (int rep = 0; rep < 200; ++rep) hook(5, [&](index_t i) { total += i; });
  CHECK(total.load() == 200 * 10);
}

TEST_CASE("thread_pool rethrows a body's exception and stays usable", "[exec][thread_pool]") {
  INFO("seed " << floe::testing::seed());
  floe::thread_pool pool(3);
  CHECK_THROWS_AS(pool.parallel_for(100, [](index_t i) { if (i == 37) throw std::runtime_error("body"); }),
                  std::runtime_error);
  std::atomic<index_t> count{0};
  pool.parallel_for(50, [&](index_t) { ++count; });
  CHECK(count.load() == 50);
}

TEST_CASE("thread_pool runs nested calls serially instead of deadlocking", "[exec][thread_pool]") {
  INFO("seed " << floe::testing::seed());
  floe::thread_pool pool(2);
  std::atomic<index_t> inner{0};
  pool.parallel_for(8, [&](index_t) { pool.parallel_for(8, [&](index_t) { ++inner; }); });
  CHECK(inner.load() == 64);
}

TEST_CASE("thread_pool runs every index once whether its threads spin or sleep", "[exec][thread_pool]") {
  INFO("seed " << floe::testing::seed());
  using std::chrono::microseconds;
  const auto spin = GENERATE(microseconds(0), microseconds(50), microseconds(100000));
  INFO("spin " << spin.count() << " us");
  floe::thread_pool pool(3, spin);
  // Calls back to back (workers still spinning) and after a pause longer than the short
  // spins (workers asleep on the condition variable).
  for (int rep = 0; rep < 20; ++rep) {
    if (rep % 4 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::vector<std::atomic<int>> hits(97);
    pool.parallel_for(97, [&](index_t i) { hits[i].fetch_add(1); });
    index_t wrong = 0;
    for (auto& h : hits) wrong += h.load() != 1;
    CHECK(wrong == 0);
  }
}

TEST_CASE("thread_pool rejects a negative spin", "[exec][thread_pool][errors]") {
  INFO("seed " << floe::testing::seed());
  try {
    floe::thread_pool pool(2, std::chrono::microseconds(-1));
    FAIL("no error");
  } catch (const floe::invalid_argument& e) {
    CHECK(e.argument() == "spin");
  }
}

TEST_CASE("thread_pool rejects zero threads", "[exec][thread_pool][errors]") {
  INFO("seed " << floe::testing::seed());
  try {
    floe::thread_pool pool(0);
    FAIL("no error");
  } catch (const floe::invalid_argument& e) {
    CHECK(e.argument() == "threads");
  }
}
