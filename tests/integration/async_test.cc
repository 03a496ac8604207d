// The async client API against a real pool: ranks are Clients in this
// process (one thread each), reducers are real tally-reducer processes.
// Inputs follow tally/bench/pattern.h, so every result has a closed form.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "clients.h"
#include "harness.h"
#include "tally/bench/pattern.h"
#include "tally/client/client.h"

namespace tally::testing {
namespace {

using std::chrono::milliseconds;

TEST(Async, ManyOpsInFlightEachWithItsCallback) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr uint32_t kWorld = 3;
  constexpr int kOps = 12;
  auto clients = connect_all(cluster, "async-many", kWorld);
  ASSERT_EQ(clients.size(), kWorld);
  on_every_rank(kWorld, [&](uint32_t r) {
    // Sizes 0, 1, primes and many chunks, all in flight at once.
    std::vector<std::vector<float>> data(kOps);
    std::vector<OpHandle> handles;
    std::atomic<int> called{0};
    for (int i = 0; i < kOps; ++i) {
      data[i].resize(i == 0 ? 0 : 1 + i * 331);
      bench::fill_pattern(data[i].data(), data[i].size(), r, i);
      handles.push_back(clients[r]->allreduce_async(data[i].data(), data[i].size(), DType::kFloat32,
                                                    RedOp::kSum, [&](const Status& s) {
                                                      EXPECT_TRUE(s.is_ok()) << s.to_string();
                                                      called++;
                                                    }));
      EXPECT_EQ(handles.back().op(), static_cast<uint64_t>(i));
    }
    for (int i = kOps - 1; i >= 0; --i) {  // any order
      Status s = handles[i].wait();
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_TRUE(handles[i].test().has_value());
      EXPECT_EQ(bench::count_wrong(data[i].data(), data[i].size(), kWorld, RedOp::kSum, i), 0u)
          << "op " << i;
    }
    EXPECT_EQ(called.load(), kOps);
  });
}

TEST(Async, WaitForGivesUpAndTestDoesNotBlockWhileARankIsMissing) {
  TestCluster cluster(PoolSpec{.shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, "async-wait", 2);
  ASSERT_EQ(clients.size(), 2u);
  std::vector<double> a(1000), b(1000);
  bench::fill_pattern(a.data(), a.size(), 0, 0);
  bench::fill_pattern(b.data(), b.size(), 1, 0);
  OpHandle h = clients[0]->allreduce_async(a.data(), a.size(), DType::kFloat64, RedOp::kAverage);
  EXPECT_FALSE(h.test().has_value());
  EXPECT_FALSE(h.wait_for(milliseconds(200)).has_value());  // rank 1 has not contributed
  ASSERT_TRUE(clients[1]->allreduce(b.data(), b.size(), DType::kFloat64, RedOp::kAverage).is_ok());
  auto s = h.wait_for(milliseconds(10000));
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->is_ok()) << s->to_string();
  EXPECT_EQ(bench::count_wrong(a.data(), a.size(), 2, RedOp::kAverage, 0), 0u);
  EXPECT_EQ(a, b);
}

TEST(Async, RefusedArgumentsEndAtOnceAndTakeNoOpNumber) {
  TestCluster cluster(PoolSpec{.shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, "async-refused", 1);
  ASSERT_EQ(clients.size(), 1u);
  bool called = false;
  OpHandle bad =
      clients[0]->allreduce_async(nullptr, 4, DType::kFloat32, RedOp::kSum, [&](const Status& s) {
        EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
        called = true;
      });
  EXPECT_TRUE(called);  // on this thread, before the call returned
  EXPECT_FALSE(bad.op().has_value());
  EXPECT_EQ(bad.wait().code(), ErrorCode::kInvalidArgument);
  std::vector<int64_t> v(10, 7);
  OpHandle good = clients[0]->allreduce_async(v.data(), v.size(), DType::kInt64, RedOp::kSum);
  EXPECT_EQ(good.op(), 0u);
  EXPECT_TRUE(good.wait().is_ok());
  EXPECT_EQ(v, std::vector<int64_t>(10, 7));
  EXPECT_EQ(OpHandle().wait().code(), ErrorCode::kInvalidArgument);
}

TEST(Async, FusedBucketsMatchTheClosedFormAndTakeOneOpPerGroup) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr uint32_t kWorld = 2;
  auto clients = connect_all(cluster, "async-fused", kWorld);
  ASSERT_EQ(clients.size(), kWorld);
  // 4-byte elements, threshold 4000 bytes: [10, 20, 0, 900] fuse (3720 B),
  // 2000 is alone (8000 B >= threshold), [5, 1] fuse: 3 ops.
  const std::vector<size_t> counts{10, 20, 0, 900, 2000, 5, 1};
  on_every_rank(kWorld, [&](uint32_t r) {
    std::vector<std::vector<int32_t>> data;
    std::vector<BufferRef> refs;
    for (size_t n : counts) {
      data.emplace_back(n);
      bench::fill_pattern(data.back().data(), n, r, data.size());  // a seed per buffer
    }
    for (auto& d : data) refs.push_back({d.data(), d.size()});
    OpHandle h = clients[r]->allreduce_fused_async(refs, DType::kInt32, RedOp::kSum, 4000);
    EXPECT_EQ(h.op(), 0u);
    ASSERT_TRUE(h.wait().is_ok());
    for (size_t i = 0; i < data.size(); ++i) {
      EXPECT_EQ(bench::count_wrong(data[i].data(), data[i].size(), kWorld, RedOp::kSum, i + 1), 0u)
          << "buffer " << i;
    }
    // The next op number shows how many the fused call took.
    std::vector<int32_t> one(1, 1);
    OpHandle next = clients[r]->allreduce_async(one.data(), 1, DType::kInt32, RedOp::kSum);
    EXPECT_EQ(next.op(), 3u);
    EXPECT_TRUE(next.wait().is_ok());  // `one` must outlive the op
    EXPECT_EQ(one[0], static_cast<int32_t>(kWorld));
  });
}

TEST(Async, OpsInFlightEndCancelledWhenTheClientIsDestroyed) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, "async-destroyed", 2);
  ASSERT_EQ(clients.size(), 2u);
  std::vector<float> v(5000, 1.0f);
  std::atomic<int> failed{0};
  OpHandle h = clients[0]->allreduce_async(v.data(), v.size(), DType::kFloat32, RedOp::kSum,
                                           [&](const Status& s) { failed += !s.is_ok(); });
  clients[0].reset();  // rank 1 never contributes
  auto s = h.test();
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(s->is_ok());
  EXPECT_EQ(failed.load(), 1);
}

// Without resuming (TALLY_RESUME_BYTES=0), a lost reducer fails every op
// in flight at once. (With it, the worker reconnects: resume_test.cc.)
TEST(Async, KilledReducerFailsEveryOpInFlight) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, "async-killed", 2,
                             [](ClientOptions& o, uint32_t) { o.resume_bytes = 0; });
  ASSERT_EQ(clients.size(), 2u);
  std::vector<std::vector<float>> data(4, std::vector<float>(3000, 1.0f));
  std::vector<OpHandle> handles;
  for (auto& d : data) {
    handles.push_back(
        clients[0]->allreduce_async(d.data(), d.size(), DType::kFloat32, RedOp::kSum));
  }
  cluster.kill_reducer(1, SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  for (auto& h : handles) {
    auto s = h.wait_for(milliseconds(15000));
    ASSERT_TRUE(s.has_value()) << "op still in flight";
    EXPECT_EQ(s->code(), ErrorCode::kPeerLost) << s->to_string();
    EXPECT_NE(s->message().find("lost reducer " + cluster.addresses()[1]), std::string::npos)
        << s->to_string();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(10000));
}

// A blocking allreduce runs the client's I/O on its own thread (io_driver.h).
// An asynchronous op in flight beside it ends there too, its callback
// included, and the async op after a run of blocking ones ends by its
// callback alone: the I/O thread takes the context back without a wait().
TEST(Blocking, AsyncOpsBesideAndAfterBlockingOnesEnd) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr uint32_t kWorld = 3;
  auto clients = connect_all(cluster, "blocking-mixed", kWorld);
  ASSERT_EQ(clients.size(), kWorld);
  on_every_rank(kWorld, [&](uint32_t r) {
    Client& client = *clients[r];
    std::vector<std::vector<float>> data(8);
    for (size_t i = 0; i < data.size(); ++i) {
      data[i].resize(1000 + 997 * i);
      bench::fill_pattern(data[i].data(), data[i].size(), r, i);
    }
    std::atomic<int> called{0};
    OpHandle beside = client.allreduce_async(data[0].data(), data[0].size(), DType::kFloat32,
                                             RedOp::kSum, [&](const Status& s) {
                                               EXPECT_TRUE(s.is_ok()) << s.to_string();
                                               called++;
                                             });
    for (size_t i = 1; i < 6; ++i) {
      Status s = client.allreduce(data[i].data(), data[i].size(), DType::kFloat32, RedOp::kSum);
      EXPECT_TRUE(s.is_ok()) << s.to_string();
    }
    EXPECT_TRUE(beside.test().has_value());  // ended before the blocking ops after it
    std::promise<Status> after;
    client.allreduce_async(data[6].data(), data[6].size(), DType::kFloat32, RedOp::kSum,
                           [&](const Status& s) { after.set_value(s); });
    auto ended = after.get_future();
    ASSERT_EQ(ended.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    EXPECT_TRUE(ended.get().is_ok());
    Status s = client.allreduce(data[7].data(), data[7].size(), DType::kFloat32, RedOp::kSum);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(called.load(), 1);
    for (size_t i = 0; i < data.size(); ++i) {
      EXPECT_EQ(bench::count_wrong(data[i].data(), data[i].size(), kWorld, RedOp::kSum, i), 0u)
          << "op " << i;
    }
  });
}

// The blocking fused call borrows the I/O as allreduce does: the same groups
// (the next op number shows them) and the fused buffers copied back.
TEST(Blocking, FusedCallMatchesTheClosedForm) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr uint32_t kWorld = 2;
  auto clients = connect_all(cluster, "blocking-fused", kWorld);
  ASSERT_EQ(clients.size(), kWorld);
  const std::vector<size_t> counts{10, 20, 0, 900, 2000, 5, 1};  // 3 ops at 4000 bytes
  on_every_rank(kWorld, [&](uint32_t r) {
    std::vector<std::vector<int32_t>> data;
    std::vector<BufferRef> refs;
    for (size_t n : counts) {
      data.emplace_back(n);
      bench::fill_pattern(data.back().data(), n, r, data.size());
    }
    for (auto& d : data) refs.push_back({d.data(), d.size()});
    Status s = clients[r]->allreduce_fused(refs, DType::kInt32, RedOp::kSum, 4000);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (size_t i = 0; i < data.size(); ++i) {
      EXPECT_EQ(bench::count_wrong(data[i].data(), data[i].size(), kWorld, RedOp::kSum, i + 1), 0u)
          << "buffer " << i;
    }
    EXPECT_EQ(clients[r]->next_op(), 3u);
    EXPECT_EQ(clients[r]->allreduce_fused({}, DType::kInt32, RedOp::kSum).code(), ErrorCode::kOk);
    std::vector<int32_t> bad(3);
    const BufferRef unaligned{reinterpret_cast<std::byte*>(bad.data()) + 1, 1};
    EXPECT_EQ(clients[r]->allreduce_fused({&unaligned, 1}, DType::kInt32, RedOp::kSum).code(),
              ErrorCode::kInvalidArgument);
    EXPECT_EQ(clients[r]->next_op(), 3u);  // refused: no op number taken
  });
}

// Two threads of one rank blocked in allreduce at once: one runs the I/O,
// the other waits for it. Every op has the same input on a rank, so the
// sums hold whichever thread takes which op number.
TEST(Blocking, TwoThreadsOfOneClientBlockAtOnce) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr uint32_t kWorld = 2;
  constexpr int kOps = 40;
  auto clients = connect_all(cluster, "blocking-threads", kWorld);
  ASSERT_EQ(clients.size(), kWorld);
  on_every_rank(kWorld, [&](uint32_t r) {
    auto run = [&] {
      std::vector<float> v(3000);
      for (int i = 0; i < kOps; ++i) {
        bench::fill_pattern(v.data(), v.size(), r, 0);
        Status s = clients[r]->allreduce(v.data(), v.size(), DType::kFloat32, RedOp::kSum);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        ASSERT_EQ(bench::count_wrong(v.data(), v.size(), kWorld, RedOp::kSum, 0), 0u);
      }
    };
    std::thread other(run);
    run();
    other.join();
  });
}

// A blocking call runs the timers and sees the streams close: a reducer
// killed under it fails the op at once, not at the op timeout.
TEST(Blocking, AKilledReducerFailsTheBlockedCall) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, "blocking-killed", 2,
                             [](ClientOptions& o, uint32_t) { o.resume_bytes = 0; });
  ASSERT_EQ(clients.size(), 2u);
  std::vector<float> v(20000, 1.0f);  // both shards; rank 1 never contributes
  std::thread killer([&] {
    // Once the call has sent a chunk, it is blocked on the results.
    const auto limit = std::chrono::steady_clock::now() + milliseconds(10000);
    while (clients[0]->stats().bytes_sent == 0 && std::chrono::steady_clock::now() < limit) {
      std::this_thread::yield();
    }
    cluster.kill_reducer(1, SIGKILL);
  });
  const auto start = std::chrono::steady_clock::now();
  Status s = clients[0]->allreduce(v.data(), v.size(), DType::kFloat32, RedOp::kSum);
  killer.join();
  EXPECT_EQ(s.code(), ErrorCode::kPeerLost) << s.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(10000));
}

// TALLY_WIRE_RESULT=float32: the inputs travel as bfloat16 and the results
// come back as the reducers' float32 sums. Inputs exact in bfloat16 whose
// sums are not (257, 259, ...: nine significant bits) come back exact; the
// same op with bfloat16 results comes back rounded, which is what makes the
// first check mean something.
TEST(Wire, Float32ResultsAreTheReducersUnroundedSums) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr size_t kCount = 3000;
  auto input = [](uint32_t rank, size_t i) {
    return rank == 0 ? 256.0f + 2.0f * static_cast<float>(i % 64) : 1.0f;
  };
  for (const DType result : {DType::kFloat32, DType::kBFloat16}) {
    auto clients = connect_all(cluster, result == DType::kFloat32 ? "wide" : "narrow", 2,
                               [&](ClientOptions& o, uint32_t) {
                                 o.wire_dtype = DType::kBFloat16;
                                 o.wire_result = result;
                               });
    ASSERT_EQ(clients.size(), 2u);
    std::vector<size_t> inexact(2, 0);
    on_every_rank(2, [&](uint32_t r) {
      std::vector<float> data(kCount);
      for (size_t i = 0; i < kCount; ++i) data[i] = input(r, i);
      const Status s = clients[r]->allreduce(data.data(), kCount, DType::kFloat32, RedOp::kSum);
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      for (size_t i = 0; i < kCount; ++i) inexact[r] += data[i] != input(0, i) + input(1, i);
    });
    for (uint32_t r = 0; r < 2; ++r) {
      if (result == DType::kFloat32) {
        EXPECT_EQ(inexact[r], 0u) << "rank " << r;
      } else {
        EXPECT_EQ(inexact[r], kCount) << "rank " << r;
      }
    }
  }
}

// One float32 op of two ranks on the bfloat16 wire where only rank 0 asks
// for float32 results; each rank's status.
std::vector<Status> allreduce_with_rank0_wide(const TestCluster& cluster, const std::string& job,
                                              uint32_t groups) {
  auto clients = connect_all(cluster, job, 2, [groups](ClientOptions& o, uint32_t r) {
    o.groups = groups;
    o.wire_dtype = DType::kBFloat16;
    if (r == 0) o.wire_result = DType::kFloat32;
  });
  EXPECT_EQ(clients.size(), 2u);
  std::vector<Status> statuses(clients.size());
  on_every_rank(static_cast<uint32_t>(clients.size()), [&](uint32_t r) {
    std::vector<float> data(100, 1.0f);
    statuses[r] = clients[r]->allreduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
  });
  return statuses;
}

// Ranks that disagree on TALLY_WIRE_RESULT fail the op on every rank, both
// ranks named.
TEST(Wire, RanksDisagreeingOnTheResultDtypeFailTheOp) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto statuses = allreduce_with_rank0_wide(cluster, "wide-mismatch", 1);
  ASSERT_EQ(statuses.size(), 2u);
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), ErrorCode::kMismatch) << s.to_string();
    EXPECT_NE(s.message().find("float32 results"), std::string::npos) << s.to_string();
  }
}

// The same across replica groups: each group's reducer sees only its own
// ranks, so the bit rides on the partials and the replicas compare it.
TEST(Wire, GroupsDisagreeingOnTheResultDtypeFailTheOp) {
  TestCluster cluster(PoolSpec{.shards = 1, .groups = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  // Rank 0 is in group 0, rank 1 in group 1 (the default blocks).
  const auto statuses = allreduce_with_rank0_wide(cluster, "wide-groups", 2);
  ASSERT_EQ(statuses.size(), 2u);
  for (const Status& s : statuses) EXPECT_EQ(s.code(), ErrorCode::kMismatch) << s.to_string();
}

// Float32 results without the bfloat16 wire are refused before connecting.
TEST(Wire, Float32ResultsNeedTheBfloat16Wire) {
  ClientOptions o;
  o.pool = {"127.0.0.1:1"};
  o.job = "x";
  o.wire_result = DType::kFloat32;
  const Status s = validate(o);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("TALLY_WIRE_DTYPE=bfloat16"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace tally::testing

namespace tally::testing {
namespace {

// Client::stats() counts what the client did: each op once, its bytes as
// they crossed the wire, no reconnects, and every op in the time histogram;
// an op refused by the reducers as failed.
TEST(ClientStats, CountTheOpsAndTheBytesOnTheWire) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr uint32_t kWorld = 2;
  constexpr int kOps = 10;
  constexpr size_t kFloats = 3000;
  auto clients = connect_all(cluster, "stats", kWorld);
  ASSERT_EQ(clients.size(), kWorld);
  for (uint32_t r = 0; r < kWorld; ++r) {
    const ClientStats s = clients[r]->stats();
    EXPECT_EQ(s.ops_completed + s.ops_failed + s.bytes_sent + s.bytes_received, 0u);
  }
  on_every_rank(kWorld, [&](uint32_t r) {
    std::vector<float> data(kFloats);
    for (int i = 0; i < kOps; ++i) {
      bench::fill_pattern(data.data(), data.size(), r, i);
      EXPECT_TRUE(
          clients[r]->allreduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum).is_ok());
    }
  });
  for (uint32_t r = 0; r < kWorld; ++r) {
    const ClientStats s = clients[r]->stats();
    const uint64_t wire_bytes = kOps * kFloats * sizeof(float);
    EXPECT_EQ(s.ops_completed, uint64_t{kOps}) << "rank " << r;
    EXPECT_EQ(s.ops_failed, 0u);
    EXPECT_EQ(s.bytes_sent, wire_bytes) << "rank " << r;
    EXPECT_EQ(s.bytes_received, wire_bytes) << "rank " << r;
    EXPECT_EQ(s.reconnects, 0u);
    EXPECT_EQ(s.replays, 0u);
    uint64_t timed = 0;
    for (uint64_t n : s.op_seconds_buckets) timed += n;
    EXPECT_EQ(timed, uint64_t{kOps});
    EXPECT_GT(s.op_seconds_max, 0.0);
    EXPECT_LE(s.op_seconds_max, s.op_seconds_sum);
    EXPECT_GT(s.op_seconds_quantile(0.5), 0.0);
    EXPECT_LE(s.op_seconds_quantile(0.5), s.op_seconds_quantile(0.99));
    EXPECT_LE(s.op_seconds_quantile(0.99), s.op_seconds_max);
  }
  // Ranks that disagree on an op's size: it fails on both, counted so.
  on_every_rank(kWorld, [&](uint32_t r) {
    std::vector<float> data(16 + r, 1.0f);
    EXPECT_FALSE(
        clients[r]->allreduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum).is_ok());
    EXPECT_EQ(clients[r]->stats().ops_failed, 1u) << "rank " << r;
    EXPECT_EQ(clients[r]->stats().ops_completed, uint64_t{kOps}) << "rank " << r;
  });
}

// The quantiles come from the buckets: the bound of the bucket where the
// op at q falls, the largest time for the last bucket.
TEST(ClientStats, QuantilesAreTheBoundsOfTheirBuckets) {
  ClientStats s;
  EXPECT_EQ(s.op_seconds_quantile(0.5), 0.0);
  s.op_seconds_buckets[3] = 2;   // up to 1 ms
  s.op_seconds_buckets[9] = 1;   // up to 100 ms
  s.op_seconds_buckets[15] = 1;  // over 10 s
  s.op_seconds_max = 12.5;
  EXPECT_EQ(s.op_seconds_quantile(0.0), kOpSecondsBounds[3]);
  EXPECT_EQ(s.op_seconds_quantile(0.5), kOpSecondsBounds[3]);
  EXPECT_EQ(s.op_seconds_quantile(0.7), kOpSecondsBounds[9]);
  EXPECT_EQ(s.op_seconds_quantile(1.0), 12.5);
}

}  // namespace
}  // namespace tally::testing
