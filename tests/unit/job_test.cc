// The accumulator: Job's chunk summation driven directly, with members that
// record what the job sends them (the streams themselves are covered by the
// integration tests). Covers every arrival order of headers and payloads,
// the pending path, disagreement, duplicates, losses and the memory quota;
// and, with replica groups, Jobs of three groups combining their partials
// through an in-process queue whose delivery order the test controls.
#include "tally/reducer/job.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <vector>

#include "tally.pb.h"

namespace tally {
namespace {

class RecordingMember : public JobMember {
 public:
  RecordingMember(uint32_t rank) : rank_(rank), peer_("test-peer-" + std::to_string(rank)) {}
  uint32_t rank() const override { return rank_; }
  const std::string& peer() const override { return peer_; }
  void send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) override {
    std::lock_guard lock(mu);
    results.push_back(
        {header, std::vector<float>(reinterpret_cast<float*>(slab->data()),
                                    reinterpret_cast<float*>(slab->data()) + header.length / 4)});
  }
  void send_control(std::shared_ptr<const wire::Control> message) override {
    std::lock_guard lock(mu);
    errors.push_back(*message);
  }
  void wake() override { wakes++; }

  struct Result {
    FrameHeader header;
    std::vector<float> values;
  };
  std::mutex mu;
  std::vector<Result> results;
  std::vector<wire::Control> errors;
  int wakes = 0;

 private:
  uint32_t rank_;
  std::string peer_;
};

struct Fixture {
  explicit Fixture(uint32_t world, size_t slabs = 16, size_t slab_bytes = 4096) {
    pool = *SlabPool::create(slab_bytes, slabs);
    JobSettings settings;
    settings.name = "unit-job";
    settings.world_size = world;
    settings.op_timeout = std::chrono::milliseconds(1000);
    job = std::make_shared<Job>(settings, *SlabQuota::reserve(pool, slabs), counters);
    for (uint32_t r = 0; r < world; ++r) {
      members.push_back(std::make_shared<RecordingMember>(r));
      EXPECT_TRUE(job->join(members.back()).is_ok());
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
  // Payload phase: writes rank-specific values into the destination first.
  void deliver(const FrameHeader& h, PendingContribution& p, std::span<std::byte> dst) {
    auto* f = reinterpret_cast<float*>(dst.data());
    for (size_t i = 0; i < h.length / 4; ++i) f[i] = static_cast<float>((h.rank + 1) * 1000 + i);
    job->on_contribution_payload(h, p);
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
    std::vector<std::span<std::byte>> dst(world);
    for (uint32_t r = 0; r < world; ++r) {
      headers.push_back(f.header(r, 7, 0, count, 0, count * 4));
      auto action = f.offer(headers[r], pending[r]);
      ASSERT_EQ(action.kind, PayloadAction::Kind::kReceive);
      ASSERT_EQ(action.dst.size(), count * 4);
      dst[r] = action.dst;
    }
    EXPECT_EQ(pending[0].role, SlabRole::kAccumulator);
    for (uint32_t r = 1; r < world; ++r) EXPECT_EQ(pending[r].role, SlabRole::kStaging);
    for (uint32_t r : order) f.deliver(headers[r], pending[r], dst[r]);
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

TEST(Accumulator, AverageIsDividedOnceByTheWorldSize) {
  Fixture f(2);
  PendingContribution p0, p1;
  auto h0 = f.header(0, 0, 0, 8, 0, 32, RedOp::kAverage);
  auto h1 = f.header(1, 0, 0, 8, 0, 32, RedOp::kAverage);
  auto a0 = f.offer(h0, p0);
  auto a1 = f.offer(h1, p1);
  f.deliver(h1, p1, a1.dst);
  f.deliver(h0, p0, a0.dst);
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
  f.deliver(f.header(0, 3, 0, 100, 0, 400), p0, a0.dst);
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
  f.deliver(h0, p, a0.dst);
  EXPECT_EQ(f.members[0]->results.size(), 1u);
  EXPECT_EQ(f.counters.ops_completed.load(), 0u);
  auto h1 = f.header(0, 0, 1, 16, 32, 32, RedOp::kSum, 2);
  auto a1 = f.offer(h1, p);
  ASSERT_EQ(a1.kind, PayloadAction::Kind::kReceive);
  f.deliver(h1, p, a1.dst);
  EXPECT_EQ(f.counters.ops_completed.load(), 1u);
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
  f.deliver(ha, a, aa.dst);
  f.deliver(hb, b, ab.dst);
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
  EXPECT_EQ(f.job->join(std::make_shared<RecordingMember>(2)).code(), ErrorCode::kUnavailable);
}

TEST(Accumulator, GoodbyeFailsOnlyWhatStillNeedsTheRank) {
  Fixture f(2);
  // Op 0 chunk 0: rank 1 already contributed, rank 0 not yet.
  PendingContribution p1;
  auto h1 = f.header(1, 0, 0, 8, 0, 32);
  auto a1 = f.offer(h1, p1);
  f.deliver(h1, p1, a1.dst);
  f.job->leave(f.members[1].get(), Status(ErrorCode::kCancelled, "done"), Departure::kGoodbye);
  EXPECT_TRUE(f.members[0]->errors.empty());
  // A new op needing rank 1 fails at once, naming it and its reason.
  PendingContribution p0;
  EXPECT_EQ(f.offer(f.header(0, 1, 0, 8, 0, 32), p0).kind, PayloadAction::Kind::kDiscard);
  ASSERT_EQ(f.members[0]->errors.size(), 1u);
  EXPECT_NE(f.members[0]->errors[0].error().message().find("it said: done"), std::string::npos);
  // The rank may join again.
  EXPECT_TRUE(f.job->join(std::make_shared<RecordingMember>(1)).is_ok());
}

// A rank that contributed, left with a goodbye and rejoined on a new stream
// must not be sent the old chunk's sum: its new client never asked for it.
TEST(Accumulator, RejoinedRankIsNotSentASumFromItsPreviousStream) {
  Fixture f(2);
  PendingContribution p1, p0;
  auto h1 = f.header(1, 4, 0, 8, 0, 32);
  auto a1 = f.offer(h1, p1);
  f.deliver(h1, p1, a1.dst);
  f.job->leave(f.members[1].get(), Status(ErrorCode::kCancelled, "restarting"),
               Departure::kGoodbye);
  auto rejoined = std::make_shared<RecordingMember>(1);
  ASSERT_TRUE(f.job->join(rejoined).is_ok());
  auto h0 = f.header(0, 4, 0, 8, 0, 32);
  auto a0 = f.offer(h0, p0);
  ASSERT_EQ(a0.kind, PayloadAction::Kind::kReceive);
  f.deliver(h0, p0, a0.dst);
  ASSERT_EQ(f.members[0]->results.size(), 1u);
  EXPECT_EQ(f.members[0]->results[0].values[0], expected_sum(2, 0));
  EXPECT_TRUE(rejoined->results.empty());
}

TEST(Accumulator, SweepTimesOutNamingMissingRanks) {
  Fixture f(3);
  PendingContribution p0;
  auto h = f.header(0, 9, 0, 8, 0, 32);
  auto a = f.offer(h, p0);
  f.deliver(h, p0, a.dst);
  f.job->sweep(Job::Clock::now());
  EXPECT_TRUE(f.members[0]->errors.empty());
  f.job->sweep(Job::Clock::now() + std::chrono::milliseconds(1500));
  ASSERT_EQ(f.members[0]->errors.size(), 1u);
  const auto& e = f.members[0]->errors[0].error();
  EXPECT_EQ(e.code(), wire::TIMEOUT);
  EXPECT_NE(e.message().find("waiting for ranks [1,2]"), std::string::npos) << e.message();
}

// ---------------------------------------------------------------------------
// Replica groups: three Jobs, one per group, joined by an in-process mesh
// that queues every partial until the test delivers it, so the order of
// arrival (partials before any local contribution, a replica far ahead) is
// chosen here rather than by threads.

namespace groups {

struct QueuedPartial {
  uint32_t from, to;
  FrameHeader header;
  std::shared_ptr<Slab> slab;
  size_t offset;
  ReplicaMesh::SendDone done;
};

class QueueMesh : public ReplicaMesh {
 public:
  QueueMesh(std::vector<QueuedPartial>& wire, uint32_t self) : wire_(wire), self_(self) {}
  void send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                    size_t byte_offset, std::chrono::steady_clock::time_point,
                    std::function<bool()>, SendDone done) override {
    std::lock_guard lock(mu_);
    wire_.push_back({self_, group, header, std::move(slab), byte_offset, std::move(done)});
  }
  void send_control(uint32_t group, std::shared_ptr<const wire::Control> message) override {
    std::lock_guard lock(mu_);
    controls.emplace_back(group, *message);
  }
  std::optional<Status> lost(uint32_t) const override { return std::nullopt; }
  std::string describe(uint32_t group) const override {
    return "replica group " + std::to_string(group);
  }

  std::vector<std::pair<uint32_t, wire::Control>> controls;

 private:
  std::mutex mu_;
  std::vector<QueuedPartial>& wire_;
  uint32_t self_;
};

// World 5 in groups {0,1}, {2,3}, {4}; one chunk of `count` floats.
struct Pool {
  explicit Pool(size_t count) : count(count) {
    slabs = *SlabPool::create(4096, 64);
    for (uint32_t g = 0; g < 3; ++g) {
      JobSettings settings;
      settings.name = "groups-job";
      settings.world_size = 5;
      settings.group = g;
      settings.group_sizes = {2, 2, 1};
      settings.op_timeout = std::chrono::milliseconds(1000);
      meshes.push_back(std::make_shared<QueueMesh>(wire, g));
      jobs.push_back(std::make_shared<Job>(
          settings, *SlabQuota::reserve(slabs, Job::quota_slabs(1, 3)), counters, meshes.back()));
    }
    for (uint32_t r = 0; r < 5; ++r) {
      members.push_back(std::make_shared<RecordingMember>(r));
      EXPECT_TRUE(jobs[group_of(r)]->join(members.back()).is_ok());
    }
  }
  static uint32_t group_of(uint32_t r) { return r < 2 ? 0 : r < 4 ? 1 : 2; }

  // Rank r's frame of the op's one chunk.
  FrameHeader header(uint32_t r, FrameKind kind = FrameKind::kContribution) const {
    FrameHeader h;
    h.kind = kind;
    h.dtype = DType::kFloat32;
    h.rank = r;
    h.job = job_id("groups-job");
    h.count = count;
    h.chunks_on_shard = 1;
    h.length = count * 4;
    return h;
  }

  // Rank r contributes 1/(r + 3 + i) (not exact in binary: order matters).
  void contribute(uint32_t r) {
    const FrameHeader h = header(r);
    PendingContribution p;
    auto action = jobs[group_of(r)]->on_contribution_header(members[r], h, p);
    ASSERT_EQ(action.kind, PayloadAction::Kind::kReceive);
    auto* f = reinterpret_cast<float*>(action.dst.data());
    for (size_t i = 0; i < count; ++i) f[i] = 1.0f / static_cast<float>(r + 3 + i);
    jobs[group_of(r)]->on_contribution_payload(h, p);
  }

  // Rank r replays a result of the chunk: `value(i)` at element i.
  void replay(uint32_t r, const std::function<float(size_t)>& value) {
    const FrameHeader h = header(r, FrameKind::kReplay);
    PendingContribution p;
    auto action = jobs[group_of(r)]->on_contribution_header(members[r], h, p);
    // A second replay of a chunk whose result is known is counted unread.
    if (action.kind == PayloadAction::Kind::kDiscard) return;
    ASSERT_EQ(action.kind, PayloadAction::Kind::kReceive);
    auto* f = reinterpret_cast<float*>(action.dst.data());
    for (size_t i = 0; i < count; ++i) f[i] = value(i);
    jobs[group_of(r)]->on_contribution_payload(h, p);
  }

  // Delivers the oldest queued partial; false when none is queued. A
  // partial its receiver does not take is dropped (counted in `discarded`).
  bool deliver_one() {
    if (wire.empty()) return false;
    QueuedPartial q = std::move(wire.front());
    wire.erase(wire.begin());
    PendingPartial pending;
    auto action = jobs[q.to]->on_partial_header(q.from, q.header, pending, [] {});
    if (action.kind == PayloadAction::Kind::kReceive) {
      std::memcpy(action.dst.data(), q.slab->data() + q.offset, q.header.length);
      jobs[q.to]->on_partial_payload(q.header, pending);
    } else {
      EXPECT_EQ(action.kind, PayloadAction::Kind::kDiscard);
      ++discarded;
    }
    q.done(Status::ok());
    return true;
  }

  size_t count;
  std::shared_ptr<SlabPool> slabs;
  ReducerCounters counters;
  std::vector<QueuedPartial> wire;
  std::vector<std::shared_ptr<QueueMesh>> meshes;
  std::vector<std::shared_ptr<Job>> jobs;
  std::vector<std::shared_ptr<RecordingMember>> members;
  size_t discarded = 0;
};

void expect_same_result_everywhere(Pool& pool) {
  ASSERT_EQ(pool.members[0]->results.size(), 1u);
  const auto& reference = pool.members[0]->results[0].values;
  for (size_t i = 0; i < pool.count; ++i) {
    double exact = 0;
    for (uint32_t r = 0; r < 5; ++r) exact += 1.0f / static_cast<float>(r + 3 + i);
    EXPECT_NEAR(reference[i], exact, 1e-5) << "element " << i;
  }
  for (auto& m : pool.members) {
    ASSERT_EQ(m->results.size(), 1u) << "rank " << m->rank();
    EXPECT_EQ(std::memcmp(m->results[0].values.data(), reference.data(), pool.count * 4), 0)
        << "rank " << m->rank();
  }
}

TEST(ReplicaGroups, ReplicasCombineTheirPartialsAndAgreeBitwise) {
  for (size_t count : {1u, 2u, 3u, 100u, 1000u}) {
    Pool pool(count);
    for (uint32_t r = 0; r < 5; ++r) pool.contribute(r);
    while (pool.deliver_one()) {
    }
    expect_same_result_everywhere(pool);
  }
}

TEST(ReplicaGroups, PartialsBeforeAnyLocalContributionWaitForIt) {
  Pool pool(100);
  // Groups 1 and 2 finish their sums and exchange everything they can while
  // group 0 has nothing yet: group 2's fold-in reaches group 0 early.
  for (uint32_t r : {2u, 3u, 4u}) pool.contribute(r);
  while (pool.deliver_one()) {
  }
  EXPECT_TRUE(pool.members[2]->results.empty());
  pool.contribute(1);
  pool.contribute(0);
  while (pool.deliver_one()) {
  }
  expect_same_result_everywhere(pool);
}

TEST(ReplicaGroups, OpFailureIsForwardedToTheOtherReplicas) {
  Pool pool(100);
  pool.contribute(0);
  // Rank 1 is lost before contributing: group 0 fails the op and tells groups 1 and 2.
  pool.jobs[0]->leave(pool.members[1].get(), Status(ErrorCode::kPeerLost, "killed"),
                      Departure::kLost);
  size_t forwarded = 0;
  for (auto& [group, message] : pool.meshes[0]->controls) {
    ASSERT_TRUE(message.has_replica_error());
    EXPECT_TRUE(message.replica_error().error().has_op());
    EXPECT_NE(message.replica_error().error().message().find("rank 1"), std::string::npos);
    pool.jobs[group]->on_replica_error(message.replica_error().error());
    ++forwarded;
  }
  EXPECT_EQ(forwarded, 2u);
  // Ranks of the other groups are told about the op, and their late
  // contributions get the same error instead of being summed.
  for (uint32_t r : {2u, 4u}) {
    ASSERT_FALSE(pool.members[r]->errors.empty()) << "rank " << r;
    EXPECT_NE(pool.members[r]->errors[0].error().message().find("rank 1"), std::string::npos);
  }
  PendingContribution p;
  EXPECT_EQ(pool.jobs[2]->on_contribution_header(pool.members[4], pool.header(4), p).kind,
            PayloadAction::Kind::kDiscard);
}

// After a restart (docs/protocol.md, "Resuming with replica groups"): the
// ranks of group 0 replay a result they had, the other groups' ranks send
// their inputs again. Group 0 sends the result to the other replicas as a
// final, which stands for the butterfly there: every rank of every group
// gets exactly the replayed bytes, not a new sum of the inputs.
TEST(ReplicaGroups, AReplayedResultReachesTheOtherGroupsAsTheFinal) {
  Pool pool(100);
  auto replayed = [](size_t i) { return 7.0f + static_cast<float>(i) / 3.0f; };
  pool.replay(0, replayed);
  pool.replay(1, replayed);
  for (uint32_t r : {2u, 3u, 4u}) pool.contribute(r);
  size_t finals = 0;
  for (auto& q : pool.wire) finals += (q.header.flags & kFrameFlagFinal) != 0;
  EXPECT_EQ(finals, 2u);  // to groups 1 and 2
  while (pool.deliver_one()) {
  }
  for (auto& m : pool.members) {
    ASSERT_EQ(m->results.size(), 1u) << "rank " << m->rank();
    for (size_t i = 0; i < pool.count; ++i) {
      ASSERT_EQ(m->results[0].values[i], replayed(i)) << "rank " << m->rank() << " element " << i;
    }
  }
  // The other groups' butterfly partials, sent before their final came,
  // found group 0's chunk finished and were dropped.
  EXPECT_GT(pool.discarded, 0u);
}

// A replica that is back after a loss starts a new round: each replica
// drops what it had summed and asks its workers to rejoin, a partial of the
// earlier round is dropped, and the ranks' second contributions on their
// new streams make one sum again.
TEST(ReplicaGroups, ANewRoundDropsTheOpsInFlightAndAsksEveryWorkerToRejoin) {
  Pool pool(100);
  for (uint32_t r : {0u, 1u, 2u, 3u}) pool.contribute(r);
  // Group 0 and 1's partials of round 0 are queued; group 2 was lost before
  // it sent anything and is back: group 0 starts round 1.
  std::vector<QueuedPartial> round0 = std::move(pool.wire);
  pool.wire.clear();
  pool.jobs[0]->on_replica_back(2);
  EXPECT_EQ(pool.jobs[0]->round(), 1u);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_FALSE(pool.members[r]->errors.empty());
    const wire::Control& last = pool.members[r]->errors.back();
    ASSERT_TRUE(last.has_rejoin()) << last.DebugString();
    EXPECT_NE(last.rejoin().reason().find("replica group 2 is back"), std::string::npos)
        << last.rejoin().reason();
  }
  // It announced round 1 to the others, which start it too.
  size_t announced = 0;
  for (auto& [group, message] : pool.meshes[0]->controls) {
    if (!message.has_replica_job()) continue;
    EXPECT_EQ(message.replica_job().round(), 1u);
    pool.jobs[group]->on_replica_round(0, 1, std::nullopt);
    ++announced;
  }
  EXPECT_EQ(announced, 2u);
  for (uint32_t g : {1u, 2u}) EXPECT_EQ(pool.jobs[g]->round(), 1u);
  // Round 0's partials are dropped wherever they arrive.
  pool.wire = std::move(round0);
  const size_t stale = pool.wire.size();
  while (pool.deliver_one()) {
  }
  EXPECT_EQ(pool.discarded, stale);
  // A contribution still arriving on a stream asked to rejoin is dropped.
  PendingContribution p;
  EXPECT_EQ(pool.jobs[2]->on_contribution_header(pool.members[4], pool.header(4), p).kind,
            PayloadAction::Kind::kDiscard);
  // Every rank rejoins on a new stream and contributes again.
  for (uint32_t r = 0; r < 5; ++r) {
    pool.members[r] = std::make_shared<RecordingMember>(r);
    ASSERT_TRUE(pool.jobs[Pool::group_of(r)]->join(pool.members[r]).is_ok());
  }
  for (uint32_t r = 0; r < 5; ++r) pool.contribute(r);
  pool.discarded = 0;
  while (pool.deliver_one()) {
  }
  EXPECT_EQ(pool.discarded, 0u);
  expect_same_result_everywhere(pool);
}

TEST(ReplicaGroups, QuotaCoversThePartials) {
  EXPECT_EQ(Job::quota_slabs(8, 1), 10u);
  EXPECT_EQ(Job::quota_slabs(8, 2), 42u);
  EXPECT_EQ(Job::quota_slabs(8, 3), 58u);
  EXPECT_EQ(Job::quota_slabs(1, 3), 9u);
}

}  // namespace groups

}  // namespace
}  // namespace tally
