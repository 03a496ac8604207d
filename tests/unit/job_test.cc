// The accumulator: Job's chunk summation driven directly, with members that
// record what the job sends them (the streams themselves are covered by the
// integration tests). Covers every arrival order of headers and payloads,
// the pending path, disagreement, duplicates, losses and the memory quota.
// With replica groups: job_replicas_test.cc.
#include "tally/reducer/job.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <set>
#include <vector>

#include "job_test_support.h"
#include "tally.pb.h"

namespace tally {
namespace {
using job_testing::RecordingMember;

struct Fixture {
  // Every rank joined as a fresh worker; `resuming` ones come back instead.
  // `deterministic`: reproducible sums (JobSettings::deterministic).
  explicit Fixture(uint32_t world, size_t slabs = 16, size_t slab_bytes = 4096,
                   std::vector<uint32_t> resuming = {}, bool deterministic = false) {
    pool = *SlabPool::create(slab_bytes, slabs);
    JobSettings settings;
    settings.name = "unit-job";
    settings.world_size = world;
    settings.deterministic = deterministic;
    settings.op_timeout = std::chrono::milliseconds(1000);
    job = std::make_shared<Job>(settings, *SlabQuota::reserve(pool, slabs), counters);
    for (uint32_t r = 0; r < world; ++r) {
      members.push_back(std::make_shared<RecordingMember>(r));
      const bool resumes = std::find(resuming.begin(), resuming.end(), r) != resuming.end();
      EXPECT_TRUE(
          job->join(members.back(), resumes ? Arrival::kResuming : Arrival::kFresh).is_ok());
    }
  }

  FrameHeader header(uint32_t rank, uint64_t op, uint32_t chunk, uint64_t count, uint64_t offset,
                     uint64_t length, RedOp redop = RedOp::kSum, uint32_t chunks_on_shard = 1) {
    FrameHeader h;
    h.kind = FrameKind::kContribution;
    h.dtype = DType::kFloat32;
    h.redop = redop;
    h.rank = rank;
    h.job = job->id();
    h.op = op;
    h.count = count;
    h.offset = offset;
    h.chunk = chunk;
    h.chunks_on_shard = chunks_on_shard;
    h.length = length;
    return h;
  }

  // Header phase; returns the action and keeps the pending contribution.
  PayloadAction offer(const FrameHeader& h, PendingContribution& p) {
    return job->on_contribution_header(members[h.rank], h, p);
  }
  // Payload phase: writes rank-specific values into the destination first,
  // then lets go of its owner as a stream does once the payload is in.
  void deliver(const FrameHeader& h, PendingContribution& p, PayloadAction& action) {
    auto* f = reinterpret_cast<float*>(action.dst.data());
    for (size_t i = 0; i < h.length / 4; ++i) f[i] = static_cast<float>((h.rank + 1) * 1000 + i);
    job->on_contribution_payload(h, p);
    action.owner.reset();
  }

  std::shared_ptr<SlabPool> pool;
  ReducerCounters counters;
  std::shared_ptr<Job> job;
  std::vector<std::shared_ptr<RecordingMember>> members;
};

float expected_sum(uint32_t world, size_t i) {
  float s = 0;
  for (uint32_t r = 0; r < world; ++r) s += static_cast<float>((r + 1) * 1000 + i);
  return s;
}

// Headers arrive in rank order; payloads complete in every permutation,
// including the first (accumulator) payload last, which parks the others.
TEST(Accumulator, EveryPayloadOrderGivesTheExactSum) {
  const uint32_t world = 4;
  std::vector<uint32_t> order(world);
  std::iota(order.begin(), order.end(), 0);
  int permutations = 0;
  do {
    Fixture f(world);
    const uint64_t count = 100;
    std::vector<FrameHeader> headers;
    std::vector<PendingContribution> pending(world);
    std::vector<PayloadAction> actions(world);
    for (uint32_t r = 0; r < world; ++r) {
      headers.push_back(f.header(r, 7, 0, count, 0, count * 4));
      auto action = f.offer(headers[r], pending[r]);
      ASSERT_EQ(action.kind, PayloadAction::Kind::kReceive);
      ASSERT_EQ(action.dst.size(), count * 4);
      actions[r] = action;
    }
    EXPECT_EQ(pending[0].role, SlabRole::kAccumulator);
    for (uint32_t r = 1; r < world; ++r) EXPECT_EQ(pending[r].role, SlabRole::kStaging);
    for (uint32_t r : order) f.deliver(headers[r], pending[r], actions[r]);
    for (auto& m : f.members) {
      ASSERT_EQ(m->results.size(), 1u);
      EXPECT_EQ(m->results[0].header.kind, FrameKind::kResult);
      EXPECT_EQ(m->results[0].header.op, 7u);
      EXPECT_EQ(m->results[0].header.rank, kReducerRank);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(m->results[0].values[i], expected_sum(world, i));
      EXPECT_TRUE(m->errors.empty());
    }
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(permutations, 24);
}

// Reproducible sums (JobSettings::deterministic). Inputs whose float sum
// depends on the order of its additions: a fraction unique per rank and
// element, most of them inexact in binary, plus a per-rank offset.
float order_sensitive_input(uint32_t rank, size_t i) {
  return 1.0f / static_cast<float>(1 + (rank * 131 + i * 7) % 97) + static_cast<float>(rank % 5);
}

// Sums one op of `order.size()` ranks whose headers, then payloads, arrive
// in `order`; returns the result's bits, the same on every rank.
std::vector<uint32_t> sum_in_arrival_order(const std::vector<uint32_t>& order, bool deterministic,
                                           size_t count) {
  const auto world = static_cast<uint32_t>(order.size());
  Fixture f(world, 16, 4096, {}, deterministic);
  std::vector<FrameHeader> headers(world);
  std::vector<PendingContribution> pending(world);
  std::vector<PayloadAction> actions(world);
  for (uint32_t r : order) {
    headers[r] = f.header(r, 0, 0, count, 0, count * 4);
    actions[r] = f.offer(headers[r], pending[r]);
    EXPECT_EQ(actions[r].kind, PayloadAction::Kind::kReceive);
  }
  for (uint32_t r : order) {
    auto* x = reinterpret_cast<float*>(actions[r].dst.data());
    for (size_t i = 0; i < count; ++i) x[i] = order_sensitive_input(r, i);
    f.job->on_contribution_payload(headers[r], pending[r]);
    actions[r].owner.reset();
  }
  std::vector<uint32_t> bits(count);
  for (auto& m : f.members) {
    EXPECT_EQ(m->results.size(), 1u);
    if (m->results.size() != 1) return {};
    std::vector<uint32_t> got(count);
    std::memcpy(got.data(), m->results[0].values.data(), count * 4);
    if (m->rank() == 0) bits = got;
    EXPECT_EQ(got, bits) << "rank " << m->rank();
  }
  // Every slab is back once the op is done: a deterministic chunk held
  // one per rank.
  EXPECT_EQ(f.pool->in_use(), 0u);
  return bits;
}

// Every order of 4 ranks' headers and payloads gives the bits of the tree
// (x0 + x1) + (x2 + x3); summed in arrival order, the same inputs come out
// differently in some orders (so the test can tell the modes apart).
TEST(Accumulator, ReproducibleSumsAreTheTreesBitsInEveryArrivalOrder) {
  const size_t count = 97;
  std::vector<uint32_t> tree(count);
  for (size_t i = 0; i < count; ++i) {
    const float sum = (order_sensitive_input(0, i) + order_sensitive_input(1, i)) +
                      (order_sensitive_input(2, i) + order_sensitive_input(3, i));
    std::memcpy(&tree[i], &sum, 4);
  }
  std::vector<uint32_t> order{0, 1, 2, 3};
  std::set<std::vector<uint32_t>> deterministic, arrival;
  int permutations = 0;
  do {
    deterministic.insert(sum_in_arrival_order(order, true, count));
    arrival.insert(sum_in_arrival_order(order, false, count));
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(permutations, 24);
  ASSERT_EQ(deterministic.size(), 1u);
  EXPECT_EQ(*deterministic.begin(), tree);
  EXPECT_GT(arrival.size(), 1u);
}

// An odd world: the tree over 3 ranks is (x0 + x1) + x2, whatever the order.
TEST(Accumulator, ReproducibleSumsOfAnOddWorldFollowTheTree) {
  const size_t count = 97;
  std::vector<uint32_t> tree(count);
  for (size_t i = 0; i < count; ++i) {
    const float sum =
        (order_sensitive_input(0, i) + order_sensitive_input(1, i)) + order_sensitive_input(2, i);
    std::memcpy(&tree[i], &sum, 4);
  }
  std::vector<uint32_t> order{0, 1, 2};
  do {
    EXPECT_EQ(sum_in_arrival_order(order, true, count), tree);
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST(Accumulator, AverageIsDividedOnceByTheWorldSize) {
  Fixture f(2);
  PendingContribution p0, p1;
  auto h0 = f.header(0, 0, 0, 8, 0, 32, RedOp::kAverage);
  auto h1 = f.header(1, 0, 0, 8, 0, 32, RedOp::kAverage);
  auto a0 = f.offer(h0, p0);
  auto a1 = f.offer(h1, p1);
  f.deliver(h1, p1, a1);
  f.deliver(h0, p0, a0);
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(f.members[0]->results[0].values[i], expected_sum(2, i) / 2.0f);
}

TEST(Accumulator, DisagreeingCountFailsTheOpForEveryoneNamingBothRanks) {
  Fixture f(3);
  PendingContribution p0, p2;
  auto a0 = f.offer(f.header(0, 3, 0, 100, 0, 400), p0);
  ASSERT_EQ(a0.kind, PayloadAction::Kind::kReceive);
  auto a2 = f.offer(f.header(2, 3, 0, 101, 0, 400), p2);
  EXPECT_EQ(a2.kind, PayloadAction::Kind::kDiscard);
  for (auto& m : f.members) {
    ASSERT_EQ(m->errors.size(), 1u);
    const auto& e = m->errors[0].error();
    EXPECT_EQ(e.code(), wire::MISMATCH);
    EXPECT_TRUE(e.has_op());
    EXPECT_EQ(e.op(), 3u);
    EXPECT_NE(e.message().find("rank 0 sent count=100"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("rank 2 sent count=101"), std::string::npos) << e.message();
    ASSERT_EQ(e.ranks_size(), 2);
  }
  // The first payload still lands (its slab is held by the session) and is dropped.
  f.deliver(f.header(0, 3, 0, 100, 0, 400), p0, a0);
  EXPECT_TRUE(f.members[0]->results.empty());
  // A late contribution to the failed op gets the same error again.
  PendingContribution p1;
  EXPECT_EQ(f.offer(f.header(1, 3, 1, 100, 0, 400), p1).kind, PayloadAction::Kind::kDiscard);
  EXPECT_EQ(f.members[1]->errors.size(), 2u);
}

// The chunk count a contribution's header carries (chunks of its op on this
// shard) must be the same from every rank, on the same chunk and across the
// op's chunks; the error names the ranks that disagree.
TEST(Accumulator, DisagreeingChunksOnShardFailsTheOpNamingBothRanks) {
  for (bool same_chunk : {true, false}) {
    SCOPED_TRACE(same_chunk ? "same chunk" : "another chunk of the op");
    Fixture f(2);
    PendingContribution p0, p1;
    ASSERT_EQ(f.offer(f.header(0, 5, 0, 16, 0, 32, RedOp::kSum, 2), p0).kind,
              PayloadAction::Kind::kReceive);
    auto h1 = same_chunk ? f.header(1, 5, 0, 16, 0, 32, RedOp::kSum, 3)
                         : f.header(1, 5, 1, 16, 32, 32, RedOp::kSum, 3);
    EXPECT_EQ(f.offer(h1, p1).kind, PayloadAction::Kind::kDiscard);
    const auto& e = f.members[1]->errors.at(0).error();
    EXPECT_EQ(e.code(), wire::MISMATCH);
    EXPECT_NE(e.message().find("rank 1 puts 3"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("rank 0 puts 2"), std::string::npos) << e.message();
    ASSERT_EQ(e.ranks_size(), 2);
  }
}

// An op counts as completed here (op latency) once all the chunks its header
// says land on this shard are done, not before.
TEST(Accumulator, OpCompletesWhenItsShardsChunksAreAllDone) {
  Fixture f(1);
  PendingContribution p;
  auto h0 = f.header(0, 0, 0, 16, 0, 32, RedOp::kSum, 2);
  auto a0 = f.offer(h0, p);
  ASSERT_EQ(a0.kind, PayloadAction::Kind::kReceive);
  f.deliver(h0, p, a0);
  EXPECT_EQ(f.members[0]->results.size(), 1u);
  EXPECT_EQ(f.counters[Count::kOpsCompleted].load(), 0u);
  auto h1 = f.header(0, 0, 1, 16, 32, 32, RedOp::kSum, 2);
  auto a1 = f.offer(h1, p);
  ASSERT_EQ(a1.kind, PayloadAction::Kind::kReceive);
  f.deliver(h1, p, a1);
  EXPECT_EQ(f.counters[Count::kOpsCompleted].load(), 1u);
}

TEST(Accumulator, DisagreeingDtypeOrReductionFailsTheOp) {
  Fixture f(2);
  PendingContribution p0, p1;
  f.offer(f.header(0, 0, 0, 8, 0, 32), p0);
  auto h = f.header(1, 0, 0, 8, 0, 32, RedOp::kAverage);
  EXPECT_EQ(f.offer(h, p1).kind, PayloadAction::Kind::kDiscard);
  EXPECT_EQ(f.members[0]->errors.at(0).error().code(), wire::MISMATCH);
}

TEST(Accumulator, SecondContributionFromARankClosesItsStream) {
  Fixture f(2);
  PendingContribution p, q;
  f.offer(f.header(0, 0, 0, 8, 0, 32), p);
  auto again = f.offer(f.header(0, 0, 0, 8, 0, 32), q);
  EXPECT_EQ(again.kind, PayloadAction::Kind::kClose);
  EXPECT_EQ(again.error.code(), ErrorCode::kProtocol);
}

TEST(Accumulator, FullQuotaPausesAndWakesWhenASlabFrees) {
  // Two slabs: two chunks' accumulators fill the quota; a third chunk pauses.
  Fixture f(2, /*slabs=*/2);
  PendingContribution a, b, c;
  auto ha = f.header(0, 0, 0, 2048, 0, 4096, RedOp::kSum, 2);
  auto hb = f.header(0, 0, 1, 2048, 4096, 4096, RedOp::kSum, 2);
  auto aa = f.offer(ha, a);
  auto ab = f.offer(hb, b);
  ASSERT_EQ(aa.kind, PayloadAction::Kind::kReceive);
  ASSERT_EQ(ab.kind, PayloadAction::Kind::kReceive);
  auto hc = f.header(1, 0, 0, 2048, 0, 4096, RedOp::kSum, 2);
  EXPECT_EQ(f.offer(hc, c).kind, PayloadAction::Kind::kPause);
  EXPECT_EQ(f.members[1]->wakes, 0);
  // Rank 0's payloads land; chunk 0 cannot finish without rank 1, so
  // nothing frees yet. A failed op frees its slabs and wakes the waiter.
  f.deliver(ha, a, aa);
  f.deliver(hb, b, ab);
  EXPECT_EQ(f.members[1]->wakes, 0);
  f.job->leave(f.members[0].get(), Status(ErrorCode::kPeerLost, "gone"), Departure::kLost);
  EXPECT_GE(f.members[1]->wakes, 1);
}

TEST(Accumulator, LostRankFailsUnfinishedChunksAndLaterOps) {
  Fixture f(3);
  PendingContribution p0;
  f.offer(f.header(0, 5, 0, 8, 0, 32), p0);
  f.job->leave(f.members[2].get(), Status(ErrorCode::kPeerLost, "connection reset"),
               Departure::kLost);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_EQ(f.members[r]->errors.size(), 1u);
    EXPECT_EQ(f.members[r]->errors[0].error().code(), wire::PEER_LOST);
    EXPECT_NE(f.members[r]->errors[0].error().message().find("rank 2"), std::string::npos);
  }
  PendingContribution p1;
  EXPECT_EQ(f.offer(f.header(1, 6, 0, 8, 0, 32), p1).kind, PayloadAction::Kind::kDiscard);
  EXPECT_EQ(f.members[1]->errors.back().error().op(), 6u);
  // The job stays failed: the rank cannot simply come back.
  EXPECT_EQ(f.job->join(std::make_shared<RecordingMember>(2), Arrival::kFresh).code(),
            ErrorCode::kUnavailable);
}

// A rank whose stream stalled (the peer timeout) may be paused or cut off
// and resume: nothing fails, the job drops what is in flight and asks the
// others to rejoin, and once every rank is back the ops complete.
TEST(Accumulator, StalledRankIsAwaitedAndTheJobGoesOnWhenItResumes) {
  Fixture f(3);
  PendingContribution p0;
  auto h0 = f.header(0, 5, 0, 8, 0, 32);
  auto a0 = f.offer(h0, p0);
  f.deliver(h0, p0, a0);
  f.job->leave(f.members[2].get(), Status(ErrorCode::kPeerLost, "no data or heartbeat for 10 s"),
               Departure::kStalled);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_EQ(f.members[r]->errors.size(), 1u);
    ASSERT_TRUE(f.members[r]->errors[0].has_rejoin());
    EXPECT_NE(f.members[r]->errors[0].rejoin().reason().find("rank 2"), std::string::npos);
  }
  EXPECT_FALSE(f.job->empty());
  // A new worker cannot take the stalled rank's place meanwhile.
  EXPECT_EQ(f.job->join(std::make_shared<RecordingMember>(2), Arrival::kFresh).code(),
            ErrorCode::kUnavailable);
  // Frames of the streams asked to rejoin are dropped.
  PendingContribution stale;
  EXPECT_EQ(f.offer(f.header(1, 5, 0, 8, 0, 32), stale).kind, PayloadAction::Kind::kDiscard);
  for (uint32_t r = 0; r < 3; ++r) {
    f.members[r] = std::make_shared<RecordingMember>(r);
    ASSERT_TRUE(f.job->join(f.members[r], Arrival::kResuming).is_ok());
  }
  // Rank 0's contribution went with the round: every rank sends it again.
  for (uint32_t r = 0; r < 3; ++r) {
    PendingContribution p;
    auto h = f.header(r, 5, 0, 8, 0, 32);
    auto a = f.offer(h, p);
    ASSERT_EQ(a.kind, PayloadAction::Kind::kReceive);
    f.deliver(h, p, a);
  }
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_EQ(f.members[r]->results.size(), 1u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(f.members[r]->results[0].values[i], expected_sum(3, i));
    }
    for (auto& c : f.members[r]->errors) EXPECT_FALSE(c.has_error()) << c.DebugString();
  }
}

// A stalled rank that does not resume within the op timeout fails the job
// as a lost one does, naming it.
TEST(Accumulator, StalledRankNotBackWithinTheOpTimeoutFailsTheJob) {
  Fixture f(2);
  f.job->leave(f.members[1].get(), Status(ErrorCode::kPeerLost, "no data or heartbeat"),
               Departure::kStalled);
  f.members[0] = std::make_shared<RecordingMember>(0);
  ASSERT_TRUE(f.job->join(f.members[0], Arrival::kResuming).is_ok());
  PendingContribution p0;
  auto h0 = f.header(0, 3, 0, 8, 0, 32);
  auto a0 = f.offer(h0, p0);
  f.deliver(h0, p0, a0);
  f.job->sweep(std::chrono::steady_clock::now() + std::chrono::milliseconds(500));
  for (auto& c : f.members[0]->errors) EXPECT_FALSE(c.has_error()) << c.DebugString();
  f.job->sweep(std::chrono::steady_clock::now() + std::chrono::milliseconds(1100));
  ASSERT_FALSE(f.members[0]->errors.empty());
  const wire::Control& failed = f.members[0]->errors.back();
  ASSERT_TRUE(failed.has_error());
  EXPECT_EQ(failed.error().op(), 3u);
  EXPECT_EQ(failed.error().code(), wire::PEER_LOST);
  EXPECT_NE(failed.error().message().find("rank 1"), std::string::npos);
  EXPECT_NE(failed.error().message().find("did not resume within 1000 ms"), std::string::npos)
      << failed.error().message();
  PendingContribution later;
  EXPECT_EQ(f.offer(f.header(0, 4, 0, 8, 0, 32), later).kind, PayloadAction::Kind::kDiscard);
  EXPECT_EQ(f.job->join(std::make_shared<RecordingMember>(1), Arrival::kResuming).code(),
            ErrorCode::kUnavailable);
}

TEST(Accumulator, GoodbyeFailsOnlyWhatStillNeedsTheRank) {
  Fixture f(2);
  // Op 0 chunk 0: rank 1 already contributed, rank 0 not yet.
  PendingContribution p1;
  auto h1 = f.header(1, 0, 0, 8, 0, 32);
  auto a1 = f.offer(h1, p1);
  f.deliver(h1, p1, a1);
  f.job->leave(f.members[1].get(), Status(ErrorCode::kCancelled, "done"), Departure::kGoodbye);
  EXPECT_TRUE(f.members[0]->errors.empty());
  // A new op needing rank 1 fails at once, naming it and its reason.
  PendingContribution p0;
  EXPECT_EQ(f.offer(f.header(0, 1, 0, 8, 0, 32), p0).kind, PayloadAction::Kind::kDiscard);
  ASSERT_EQ(f.members[0]->errors.size(), 1u);
  EXPECT_NE(f.members[0]->errors[0].error().message().find("it said: done"), std::string::npos);
  // The rank may join again.
  EXPECT_TRUE(f.job->join(std::make_shared<RecordingMember>(1), Arrival::kFresh).is_ok());
}

// A rank that contributed, left with a goodbye and rejoined on a new stream
// must not be sent the old chunk's sum: its new client never asked for it.
TEST(Accumulator, RejoinedRankIsNotSentASumFromItsPreviousStream) {
  Fixture f(2);
  PendingContribution p1, p0;
  auto h1 = f.header(1, 4, 0, 8, 0, 32);
  auto a1 = f.offer(h1, p1);
  f.deliver(h1, p1, a1);
  f.job->leave(f.members[1].get(), Status(ErrorCode::kCancelled, "restarting"),
               Departure::kGoodbye);
  auto rejoined = std::make_shared<RecordingMember>(1);
  ASSERT_TRUE(f.job->join(rejoined, Arrival::kFresh).is_ok());
  auto h0 = f.header(0, 4, 0, 8, 0, 32);
  auto a0 = f.offer(h0, p0);
  ASSERT_EQ(a0.kind, PayloadAction::Kind::kReceive);
  f.deliver(h0, p0, a0);
  ASSERT_EQ(f.members[0]->results.size(), 1u);
  EXPECT_EQ(f.members[0]->results[0].values[0], expected_sum(2, 0));
  EXPECT_TRUE(rejoined->results.empty());
}

TEST(Accumulator, SweepTimesOutNamingMissingRanks) {
  Fixture f(3);
  PendingContribution p0;
  auto h = f.header(0, 9, 0, 8, 0, 32);
  auto a = f.offer(h, p0);
  f.deliver(h, p0, a);
  f.job->sweep(Job::Clock::now());
  EXPECT_TRUE(f.members[0]->errors.empty());
  f.job->sweep(Job::Clock::now() + std::chrono::milliseconds(1500));
  ASSERT_EQ(f.members[0]->errors.size(), 1u);
  const auto& e = f.members[0]->errors[0].error();
  EXPECT_EQ(e.code(), wire::TIMEOUT);
  EXPECT_NE(e.message().find("waiting for ranks [1,2]"), std::string::npos) << e.message();
}

// A job evicted for a claim that outranks it (an authenticated job asking
// for its name): its ops fail, every member is closed with the reason, and
// later contributions are not summed.
TEST(Accumulator, AnEvictedJobFailsItsOpsAndClosesEveryMember) {
  Fixture f(2);
  PendingContribution p0;
  auto h = f.header(0, 0, 0, 8, 0, 32);
  auto a = f.offer(h, p0);
  ASSERT_EQ(a.kind, PayloadAction::Kind::kReceive);
  f.deliver(h, p0, a);
  f.job->evict(Status(ErrorCode::kUnauthenticated, "the name went to an authenticated job"));
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(f.members[r]->closed.has_value()) << "rank " << r;
    EXPECT_EQ(f.members[r]->closed->code(), ErrorCode::kUnauthenticated);
  }
  ASSERT_FALSE(f.members[0]->errors.empty());
  EXPECT_EQ(f.members[0]->errors[0].error().code(), wire::UNAUTHENTICATED);
  PendingContribution p1;
  EXPECT_EQ(f.offer(f.header(1, 0, 0, 8, 0, 32), p1).kind, PayloadAction::Kind::kDiscard);
  EXPECT_TRUE(f.members[1]->results.empty());
}

// A worker that resumes sends nothing before its reducer's first Released
// (docs/protocol.md, "Resuming"). Ranks that join fresh beside it (a job
// begun again with the rank whose stream broke, or ranks that first
// connected while the reducer restarted) have no results: their mark is 0
// as they join, so the Released comes once every rank is in.
TEST(Accumulator, ARankResumingBesideFreshOnesIsReleasedOnceAllHaveJoined) {
  Fixture f(3, 16, 4096, {0});
  EXPECT_TRUE(f.members[0]->released.empty()) << "released before rank 0 said its mark";
  f.job->on_received(0, 0, 0);  // what a resuming worker says first
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_EQ(f.members[r]->released.size(), 1u) << "rank " << r;
    EXPECT_EQ(f.members[r]->released[0], 0u) << "rank " << r;
  }
}

// Resuming ranks are counted by the marks they say: until every one has
// said its own, nothing is released.
TEST(Accumulator, ResumingRanksAreReleasedOnlyOnTheirOwnMarks) {
  Fixture f(2, 16, 4096, {0, 1});
  f.job->on_received(0, 4, 0);
  EXPECT_TRUE(f.members[0]->released.empty());
  f.job->on_received(1, 3, 0);
  ASSERT_EQ(f.members[0]->released.size(), 1u);
  EXPECT_EQ(f.members[0]->released[0], 3u);
}

}  // namespace
}  // namespace tally
