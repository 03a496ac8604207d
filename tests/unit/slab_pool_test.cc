// SlabPool and SlabQuota: counts, exhaustion as a value, distinct writable
// memory, waiters woken outside locks, and slabs shared between threads.
#include "tally/reducer/slab_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace tally {
namespace {

using std::chrono::seconds;

// Generous: only a deadlock or a lost wake-up gets near it.
constexpr auto kDeadline = seconds(20);

std::shared_ptr<SlabPool> make_pool(size_t slab_bytes, size_t count) {
  auto pool = SlabPool::create(slab_bytes, count);
  if (!pool.is_ok()) {
    ADD_FAILURE() << pool.status().to_string();
    return nullptr;
  }
  return *pool;
}

std::shared_ptr<SlabQuota> make_quota(const std::shared_ptr<SlabPool>& pool, size_t n) {
  auto quota = SlabQuota::reserve(pool, n);
  if (!quota.is_ok()) {
    ADD_FAILURE() << quota.status().to_string();
    return nullptr;
  }
  return *quota;
}

// The decimal numbers in `text`, so a message can be checked for the numbers
// it reports without pinning its wording.
std::multiset<uint64_t> numbers_in(const std::string& text) {
  std::multiset<uint64_t> out;
  for (size_t i = 0; i < text.size();) {
    if (text[i] < '0' || text[i] > '9') {
      ++i;
      continue;
    }
    uint64_t v = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') v = v * 10 + (text[i++] - '0');
    out.insert(v);
  }
  return out;
}

// Runs `fn` on its own thread and waits for it up to the deadline, so a
// deadlock ends the test binary with a message instead of hanging it. A
// deadlocked thread cannot be cancelled and the objects it is stuck on live
// on the test's stack, so the process ends there rather than destroying them
// under it.
void run_or_abort_at_deadline(const char* what, std::function<void()> fn) {
  auto task = std::make_shared<std::packaged_task<void()>>(std::move(fn));
  auto done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (done.wait_for(kDeadline) != std::future_status::ready) {
    std::fprintf(stderr, "%s did not finish within %lld s: a deadlock\n", what,
                 static_cast<long long>(kDeadline.count()));
    std::abort();
  }
  done.get();
}

// ---------------------------------------------------------------------------
// SlabPool

TEST(SlabPool, CreateReportsItsShape) {
  auto pool = make_pool(4096, 8);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->slab_bytes(), 4096u);
  EXPECT_EQ(pool->total(), 8u);
  EXPECT_EQ(pool->available(), 8u);
}

TEST(SlabPool, TakeAndGiveBackKeepCounts) {
  auto pool = make_pool(4096, 8);
  ASSERT_NE(pool, nullptr);
  auto a = pool->take(3);
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(pool->available(), 5u);
  auto b = pool->take(5);
  EXPECT_EQ(b.size(), 5u);
  EXPECT_EQ(pool->available(), 0u);
  pool->give_back(a);
  EXPECT_EQ(pool->available(), 3u);
  pool->give_back(b);
  EXPECT_EQ(pool->available(), 8u);
  EXPECT_EQ(pool->total(), 8u);
}

TEST(SlabPool, TakeIsAllOrNothing) {
  auto pool = make_pool(4096, 4);
  ASSERT_NE(pool, nullptr);
  auto a = pool->take(3);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_TRUE(pool->take(2).empty());
  EXPECT_EQ(pool->available(), 1u) << "a failed take must not keep any slab";
  EXPECT_TRUE(pool->take(5).empty());
  EXPECT_EQ(pool->take(1).size(), 1u);
  EXPECT_EQ(pool->available(), 0u);
}

TEST(SlabPool, SlabsAreDistinctNonOverlappingAndWritable) {
  constexpr size_t kSlab = 8192;
  constexpr size_t kCount = 16;
  auto pool = make_pool(kSlab, kCount);
  ASSERT_NE(pool, nullptr);
  auto slabs = pool->take(kCount);
  ASSERT_EQ(slabs.size(), kCount);
  std::vector<std::byte*> sorted = slabs;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i + 1 < kCount; ++i) {
    ASSERT_GE(static_cast<size_t>(sorted[i + 1] - sorted[i]), kSlab)
        << "slabs " << i << " and " << i + 1 << " overlap";
  }
  // Fill every byte of every slab with its own pattern, then check none was
  // overwritten by a neighbour.
  for (size_t s = 0; s < kCount; ++s) {
    for (size_t i = 0; i < kSlab; ++i) slabs[s][i] = static_cast<std::byte>((s * 31 + i) & 0xFF);
  }
  for (size_t s = 0; s < kCount; ++s) {
    for (size_t i = 0; i < kSlab; ++i) {
      ASSERT_EQ(slabs[s][i], static_cast<std::byte>((s * 31 + i) & 0xFF))
          << "slab " << s << " byte " << i;
    }
  }
  pool->give_back(slabs);
  EXPECT_EQ(pool->available(), kCount);
}

using SlabPoolDeathTest = ::testing::Test;

TEST_F(SlabPoolDeathTest, CreateRejectsASizeThatOverflows) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // slab_bytes * count wraps to 8192 bytes: mapping that little would leave
  // the second slab pointing far outside the mapping. Checked in a child
  // process because a pool built that way computes slab addresses past the
  // mapping, which the UBSan build aborts on.
  const size_t slab_bytes = (size_t{1} << 63) + 4096;
  EXPECT_EXIT(
      {
        auto pool = SlabPool::create(slab_bytes, 2);
        if (pool.is_ok()) {
          std::fprintf(stderr, "created a pool of 2 x %zu bytes\n", slab_bytes);
          std::exit(1);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// ---------------------------------------------------------------------------
// SlabQuota: reservation

TEST(SlabQuota, ReserveDrawsFromThePool) {
  auto pool = make_pool(4096, 5);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 3);
  ASSERT_NE(quota, nullptr);
  EXPECT_EQ(pool->available(), 2u);
  EXPECT_EQ(quota->in_use(), 0u);
}

TEST(SlabQuota, ReserveFailsWithResourceExhaustedNamingTheNumbers) {
  auto pool = make_pool(4096, 5);
  ASSERT_NE(pool, nullptr);
  auto first = make_quota(pool, 3);
  ASSERT_NE(first, nullptr);
  auto second = SlabQuota::reserve(pool, 7);
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), ErrorCode::kResourceExhausted);
  // Needed 7, 2 free, 5 in all.
  const auto numbers = numbers_in(second.status().message());
  EXPECT_EQ(numbers.count(7), 1u) << second.status().message();
  EXPECT_EQ(numbers.count(2), 1u) << second.status().message();
  EXPECT_EQ(numbers.count(5), 1u) << second.status().message();
  EXPECT_EQ(pool->available(), 2u) << "a failed reserve must not keep any slab";
  // What is free can still be reserved.
  auto third = SlabQuota::reserve(pool, 2);
  EXPECT_TRUE(third.is_ok()) << third.status().to_string();
  EXPECT_EQ(pool->available(), 0u);
}

TEST(SlabQuota, ReserveMoreThanThePoolEverHeldFails) {
  auto pool = make_pool(4096, 2);
  ASSERT_NE(pool, nullptr);
  auto q = SlabQuota::reserve(pool, 3);
  ASSERT_FALSE(q.is_ok());
  EXPECT_EQ(q.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(pool->available(), 2u);
}

TEST(SlabQuota, DestroyingTheQuotaReturnsItsSlabsToThePool) {
  auto pool = make_pool(4096, 5);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 4);
  ASSERT_NE(quota, nullptr);
  {
    auto slab = quota->try_take([] {});
    ASSERT_NE(slab, nullptr);
    EXPECT_EQ(pool->available(), 1u);
  }
  quota.reset();
  EXPECT_EQ(pool->available(), 5u);
  // And they can be reserved again, all of them.
  auto again = make_quota(pool, 5);
  EXPECT_NE(again, nullptr);
}

TEST(SlabQuota, AnOutstandingSlabKeepsItsQuotaAlive) {
  auto pool = make_pool(4096, 2);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 2);
  ASSERT_NE(quota, nullptr);
  auto slab = quota->try_take([] {});
  ASSERT_NE(slab, nullptr);
  quota.reset();  // the job is gone, a send still holds the slab
  EXPECT_EQ(pool->available(), 0u);
  slab->data()[0] = std::byte{1};
  slab.reset();
  EXPECT_EQ(pool->available(), 2u);
}

// A job gone while one of its slabs is still out (a fabric provider holds
// it after the stream was given up) gives its other slabs back at once, and
// that one when it comes back.
TEST(SlabQuota, ARetiredQuotaKeepsOutOnlyTheSlabsStillOut) {
  auto pool = make_pool(4096, 6);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 4);
  ASSERT_NE(quota, nullptr);
  auto held = quota->try_take([] {});
  auto returned = quota->try_take([] {});
  ASSERT_NE(held, nullptr);
  ASSERT_NE(returned, nullptr);
  EXPECT_EQ(pool->available(), 2u);
  quota->retire();
  EXPECT_EQ(pool->available(), 4u);  // its two free slabs
  EXPECT_EQ(quota->try_take([] {}), nullptr);
  returned.reset();
  EXPECT_EQ(pool->available(), 5u);
  quota.reset();
  EXPECT_EQ(pool->available(), 5u);
  EXPECT_EQ(pool->in_use(), 1u);
  held->data()[0] = std::byte{1};
  held.reset();
  EXPECT_EQ(pool->available(), 6u);
  EXPECT_EQ(pool->in_use(), 0u);
  EXPECT_NE(make_quota(pool, 6), nullptr);
}

// ---------------------------------------------------------------------------
// SlabQuota: taking slabs and waiting

TEST(SlabQuota, TryTakeHandsOutEachSlabOnceUntilEmpty) {
  constexpr size_t kSlab = 4096;
  auto pool = make_pool(kSlab, 3);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 3);
  ASSERT_NE(quota, nullptr);
  int waiter_calls = 0;
  std::vector<std::shared_ptr<Slab>> held;
  std::set<std::byte*> seen;
  for (size_t i = 0; i < 3; ++i) {
    auto slab = quota->try_take([&] { ++waiter_calls; });
    ASSERT_NE(slab, nullptr) << "slab " << i;
    EXPECT_TRUE(seen.insert(slab->data()).second) << "slab handed out twice";
    EXPECT_EQ(slab->first(kSlab).size(), kSlab);
    EXPECT_EQ(slab->first(kSlab).data(), slab->data());
    std::fill_n(slab->data(), kSlab, static_cast<std::byte>(i));
    held.push_back(std::move(slab));
    EXPECT_EQ(quota->in_use(), i + 1);
  }
  EXPECT_EQ(quota->try_take([&] { ++waiter_calls; }), nullptr);
  EXPECT_EQ(waiter_calls, 0) << "a waiter ran before any slab came back";
  // The quota never reaches past its reservation into the pool.
  EXPECT_EQ(pool->available(), 0u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(held[i]->data()[kSlab - 1], static_cast<std::byte>(i));
  }
}

TEST(SlabQuota, WaiterRunsOnceWhenASlabIsDestroyed) {
  auto pool = make_pool(4096, 2);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 2);
  ASSERT_NE(quota, nullptr);
  auto a = quota->try_take([] {});
  auto b = quota->try_take([] {});
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  int calls = 0;
  ASSERT_EQ(quota->try_take([&] { ++calls; }), nullptr);
  a.reset();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(quota->in_use(), 1u);
  b.reset();
  EXPECT_EQ(calls, 1) << "a waiter is called once, not on every release";
  EXPECT_EQ(quota->in_use(), 0u);
}

TEST(SlabQuota, WaiterIsCalledOutsideLocksAndCanTakeTheFreedSlab) {
  auto pool = make_pool(4096, 1);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 1);
  ASSERT_NE(quota, nullptr);
  auto held = quota->try_take([] {});
  ASSERT_NE(held, nullptr);
  std::byte* const first_data = held->data();

  // The waiter re-enters the quota, as a connection resuming its read does.
  // Were it called under the quota's lock this would deadlock.
  std::shared_ptr<Slab> retaken;
  size_t in_use_seen = 99;
  int calls = 0;
  auto none = quota->try_take([&] {
    ++calls;
    in_use_seen = quota->in_use();
    retaken = quota->try_take([] {});
  });
  ASSERT_EQ(none, nullptr);
  run_or_abort_at_deadline("releasing a slab whose waiter re-enters the quota",
                           [&] { held.reset(); });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(in_use_seen, 0u);
  ASSERT_NE(retaken, nullptr) << "the woken waiter could not take the freed slab";
  EXPECT_EQ(retaken->data(), first_data);
  EXPECT_EQ(quota->in_use(), 1u);
}

TEST(SlabQuota, EveryWaiterIsWokenByOneRelease) {
  auto pool = make_pool(4096, 1);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 1);
  ASSERT_NE(quota, nullptr);
  auto held = quota->try_take([] {});
  ASSERT_NE(held, nullptr);
  constexpr int kWaiters = 5;
  std::vector<int> calls(kWaiters, 0);
  for (int w = 0; w < kWaiters; ++w) {
    ASSERT_EQ(quota->try_take([&calls, w] { ++calls[w]; }), nullptr);
  }
  held.reset();
  for (int w = 0; w < kWaiters; ++w) EXPECT_EQ(calls[w], 1) << "waiter " << w;
}

TEST(SlabQuota, WokenWaitersThatLoseTheRaceCanWaitAgain) {
  // Two waiters, one slab freed: the first takes it, the second finds none,
  // registers again, and is woken by the next release.
  auto pool = make_pool(4096, 1);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, 1);
  ASSERT_NE(quota, nullptr);
  auto held = quota->try_take([] {});
  ASSERT_NE(held, nullptr);

  std::shared_ptr<Slab> got_a;
  std::shared_ptr<Slab> got_b;
  int b_calls = 0;
  std::function<void()> waiter_b = [&] {
    ++b_calls;
    got_b = quota->try_take(waiter_b);
  };
  ASSERT_EQ(quota->try_take([&] { got_a = quota->try_take([] {}); }), nullptr);
  ASSERT_EQ(quota->try_take(waiter_b), nullptr);

  // The waiters re-enter the quota.
  run_or_abort_at_deadline("first release", [&] { held.reset(); });
  ASSERT_NE(got_a, nullptr);
  EXPECT_EQ(b_calls, 1);
  EXPECT_EQ(got_b, nullptr);
  run_or_abort_at_deadline("second release", [&] { got_a.reset(); });
  EXPECT_EQ(b_calls, 2) << "the re-registered waiter was not woken";
  EXPECT_NE(got_b, nullptr);
}

// ---------------------------------------------------------------------------
// Threads

TEST(SlabQuota, ThreadsTakingAndReleasingEndWithEverySlabFree) {
  constexpr size_t kSlab = 4096;
  constexpr size_t kSlabs = 3;
  constexpr int kThreads = 4;
  constexpr int kIterations = 2000;
  auto pool = make_pool(kSlab, kSlabs + 2);
  ASSERT_NE(pool, nullptr);
  auto quota = make_quota(pool, kSlabs);
  ASSERT_NE(quota, nullptr);

  std::mutex owners_mu;
  std::set<std::byte*> owned;  // slabs some thread holds right now
  std::atomic<int> double_handouts{0};
  std::atomic<int> corrupted{0};
  std::atomic<int> lost_wakeups{0};
  std::atomic<long> takes{0};

  auto worker = [&](int id) {
    struct Wake {
      std::mutex mu;
      std::condition_variable cv;
      bool woken = false;
    };
    auto wake = std::make_shared<Wake>();
    for (int it = 0; it < kIterations; ++it) {
      std::shared_ptr<Slab> slab;
      while (!slab) {
        {
          std::lock_guard lock(wake->mu);
          wake->woken = false;
        }
        slab = quota->try_take([wake] {
          std::lock_guard lock(wake->mu);
          wake->woken = true;
          wake->cv.notify_one();
        });
        if (slab) break;
        std::unique_lock lock(wake->mu);
        if (!wake->cv.wait_for(lock, kDeadline, [&] { return wake->woken; })) {
          ++lost_wakeups;
          return;
        }
      }
      ++takes;
      {
        std::lock_guard lock(owners_mu);
        if (!owned.insert(slab->data()).second) ++double_handouts;
      }
      const auto pattern = static_cast<std::byte>(id * 16 + it % 16);
      std::fill_n(slab->data(), kSlab, pattern);
      std::this_thread::yield();
      if (slab->data()[0] != pattern || slab->data()[kSlab - 1] != pattern) ++corrupted;
      {
        std::lock_guard lock(owners_mu);
        owned.erase(slab->data());
      }
      slab.reset();
    }
  };

  run_or_abort_at_deadline("the worker threads", [&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
    for (auto& t : threads) t.join();
  });
  EXPECT_EQ(lost_wakeups.load(), 0) << "a waiter was never woken although slabs came back";
  EXPECT_EQ(double_handouts.load(), 0) << "one slab was held by two threads at once";
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(takes.load(), long{kThreads} * kIterations);
  EXPECT_EQ(quota->in_use(), 0u);
  EXPECT_EQ(pool->available(), 2u);
  quota.reset();
  EXPECT_EQ(pool->available(), kSlabs + 2);
}

}  // namespace
}  // namespace tally
