// Job with replica groups: Jobs of three groups combining their partials
// through an in-process queue whose delivery order the test controls,
// failures forwarded, replayed results sent as finals, a lost replica
// told to the workers, new rounds, and the quota the partials take.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "job_test_support.h"
#include "tally.pb.h"
#include "tally/reducer/job.h"

namespace tally {
namespace {

using job_testing::QueuedPartial;
using job_testing::QueueMesh;
using job_testing::RecordingMember;

// ---------------------------------------------------------------------------
// Replica groups: three Jobs, one per group, joined by an in-process mesh
// that queues every partial until the test delivers it, so the order of
// arrival (partials before any local contribution, a replica far ahead) is
// chosen here rather than by threads.

namespace groups {

// World 5 in groups {0,1}, {2,3}, {4}; one chunk of `count` floats;
// `deterministic`: reproducible sums.
struct Pool {
  explicit Pool(size_t count, bool deterministic = false) : count(count) {
    slabs = *SlabPool::create(4096, 64);
    for (uint32_t g = 0; g < 3; ++g) {
      JobSettings settings;
      settings.name = "groups-job";
      settings.world_size = 5;
      settings.group = g;
      settings.group_sizes = {2, 2, 1};
      settings.op_timeout = std::chrono::milliseconds(1000);
      settings.deterministic = deterministic;
      meshes.push_back(std::make_shared<QueueMesh>(wire, g));
      // Each group's cover is one node: two come from the others.
      const size_t quota =
          deterministic ? Job::deterministic_quota_slabs(1, 2, 2) : Job::quota_slabs(1, 3);
      jobs.push_back(std::make_shared<Job>(settings, *SlabQuota::reserve(slabs, quota), counters,
                                           meshes.back()));
    }
    for (uint32_t r = 0; r < 5; ++r) {
      members.push_back(std::make_shared<RecordingMember>(r));
      EXPECT_TRUE(jobs[group_of(r)]->join(members.back(), Arrival::kFresh).is_ok());
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

  // Delivers the queued partial `at` (the oldest by default); false when
  // none is queued. A partial its receiver does not take is dropped
  // (counted in `discarded`).
  bool deliver_one(size_t at = 0) {
    if (wire.empty()) return false;
    QueuedPartial q = std::move(wire[at % wire.size()]);
    wire.erase(wire.begin() + static_cast<std::ptrdiff_t>(at % wire.size()));
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
    if (message.has_replica_mark()) continue;  // the fresh ranks' marks, 0
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
    ASSERT_TRUE(pool.jobs[Pool::group_of(r)]->join(pool.members[r], Arrival::kFresh).is_ok());
  }
  for (uint32_t r = 0; r < 5; ++r) pool.contribute(r);
  pool.discarded = 0;
  while (pool.deliver_one()) {
  }
  EXPECT_EQ(pool.discarded, 0u);
  expect_same_result_everywhere(pool);
}

// A lost replica fails nothing, but every worker of a job that needs it is
// told at once, so that an op failing meanwhile on another shard (whose
// reducers cannot know) names it; a job that does not need it says nothing.
TEST(ReplicaGroups, AJobsWorkersAreToldOfALostReplicaItNeeds) {
  Pool pool(100);
  for (uint32_t r : {0u, 1u}) pool.contribute(r);
  pool.jobs[0]->on_replica_lost(
      2, Status(ErrorCode::kPeerLost, "replica group 2 lost: connection closed by peer"));
  for (uint32_t r : {0u, 1u}) {
    ASSERT_EQ(pool.members[r]->errors.size(), 1u) << "rank " << r;
    const wire::Control& told = pool.members[r]->errors.back();
    ASSERT_TRUE(told.has_replica_lost()) << told.DebugString();
    EXPECT_EQ(told.replica_lost().replica(), "replica group 2");
    EXPECT_EQ(told.replica_lost().reason(), "replica group 2 lost: connection closed by peer");
  }
  // Nothing failed: the op completes once the replica's partial comes.
  EXPECT_EQ(pool.jobs[0]->round(), 0u);
  for (uint32_t r : {2u, 3u, 4u}) pool.contribute(r);
  while (pool.deliver_one()) {
  }
  expect_same_result_everywhere(pool);
  // Its own group, or a group the job does not span, is not news to it.
  pool.jobs[0]->on_replica_lost(0, Status(ErrorCode::kPeerLost, "self"));
  pool.jobs[0]->on_replica_lost(7, Status(ErrorCode::kPeerLost, "a stranger"));
  EXPECT_EQ(pool.members[0]->errors.size(), 1u);
}

// A rank's Received carries the highest Released it has had from any
// reducer; a lying one (2^40) is bounded by what this reducer knows (its
// own group's mark), so the ops after it still complete on every group.
TEST(ReplicaGroups, AReleasedMarkClaimedBeyondTheGroupsOwnIsBounded) {
  Pool pool(100);
  for (uint32_t r = 0; r < 5; ++r) pool.jobs[Pool::group_of(r)]->on_received(r, 0, 0);
  pool.jobs[0]->on_received(0, uint64_t{1} << 40, uint64_t{1} << 40);
  for (uint32_t r = 0; r < 5; ++r) pool.contribute(r);
  while (pool.deliver_one()) {
  }
  expect_same_result_everywhere(pool);
}

TEST(ReplicaGroups, QuotaCoversThePartials) {
  EXPECT_EQ(Job::quota_slabs(8, 1), 10u);
  EXPECT_EQ(Job::quota_slabs(8, 2), 42u);
  EXPECT_EQ(Job::quota_slabs(8, 3), 58u);
  EXPECT_EQ(Job::quota_slabs(1, 3), 9u);
}

// Reproducible sums: a chunk holds a slab per rank of the group and per
// part of the tree from another group (twice: the partials' bound), so a
// job gets the widest window up to the reducer's whose quota the free slabs
// hold.
TEST(ReplicaGroups, ReproducibleSumsQuotaCoversARankPerChunk) {
  EXPECT_EQ(Job::deterministic_window(8, 4, 0, 128), 8u);
  EXPECT_EQ(Job::deterministic_quota_slabs(8, 4, 0), 34u);
  EXPECT_EQ(Job::deterministic_window(8, 16, 0, 128), 7u);
  EXPECT_EQ(Job::deterministic_quota_slabs(7, 16, 0), 114u);
  EXPECT_EQ(Job::deterministic_window(8, 16, 0, 113), 6u);
  EXPECT_EQ(Job::deterministic_window(8, 126, 0, 128), 1u);
  // None fits: a window of 1, whose reservation then fails.
  EXPECT_EQ(Job::deterministic_window(8, 127, 0, 128), 1u);
  EXPECT_EQ(Job::deterministic_window(8, 4, 0, 0), 1u);
  // W = 4 in two groups: 2 ranks and the other group's one node.
  EXPECT_EQ(Job::deterministic_quota_slabs(8, 2, 1), 34u);
  EXPECT_EQ(Job::deterministic_window(8, 2, 1, 128), 8u);
}

// Reproducible sums with replica groups: whatever the order in which the
// ranks arrive and the groups' parts of the tree are delivered, every rank
// of every group gets the bits of the sum tree over the 5 ranks,
// ((x0 + x1) + (x2 + x3)) + x4, which a pool of one group gives too.
TEST(ReplicaGroups, ReproducibleSumsAreTheTreesBitsWhateverTheOrder) {
  const size_t count = 100;
  auto x = [](uint32_t r, size_t i) { return 1.0f / static_cast<float>(r + 3 + i); };
  std::vector<float> tree(count);
  for (size_t i = 0; i < count; ++i)
    tree[i] = ((x(0, i) + x(1, i)) + (x(2, i) + x(3, i))) + x(4, i);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 30; ++trial) {
    Pool pool(count, /*deterministic=*/true);
    std::vector<uint32_t> ranks{0, 1, 2, 3, 4};
    std::shuffle(ranks.begin(), ranks.end(), rng);
    for (uint32_t r : ranks) {
      pool.contribute(r);
      if (rng() % 2) pool.deliver_one(rng());
    }
    while (pool.deliver_one(rng())) {
    }
    // Each group sent its one node to the two others.
    EXPECT_EQ(pool.discarded, 0u);
    for (auto& m : pool.members) {
      ASSERT_EQ(m->results.size(), 1u) << "trial " << trial << " rank " << m->rank();
      EXPECT_EQ(std::memcmp(m->results[0].values.data(), tree.data(), count * 4), 0)
          << "trial " << trial << " rank " << m->rank();
    }
    EXPECT_EQ(pool.slabs->in_use(), 0u) << "trial " << trial;
  }
}

}  // namespace groups

}  // namespace
}  // namespace tally
