// JobRound, EarlyPartials and LeftGroups: what a job holds of its replica
// groups beside its chunks (reducer/include/tally/reducer/job_replica_state.h).
#include "tally/reducer/job_replica_state.h"

#include <gtest/gtest.h>

namespace tally {
namespace {

using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

TEST(JobRound, AWireRoundIsThisOneALaterOneOrEarlier) {
  JobRound zero;
  EXPECT_EQ(zero.of_wire(0), 0u);
  EXPECT_EQ(zero.of_wire(3), 3u);
  EXPECT_EQ(zero.of_wire(127), 127u);
  EXPECT_EQ(zero.of_wire(255), std::nullopt);  // round -1: earlier
  EXPECT_EQ(zero.of_wire(128), std::nullopt);

  // The 8 bits wrap: round 257 is sent as 1.
  JobRound late(254);
  EXPECT_EQ(late.of_wire(254), 254u);
  EXPECT_EQ(late.of_wire(255), 255u);
  EXPECT_EQ(late.of_wire(1), 257u);
  EXPECT_EQ(late.of_wire(253), std::nullopt);
  EXPECT_EQ(late.of_wire(200), std::nullopt);
}

TEST(JobRound, RanksAskedToRejoinAreAwaitedUntilBackOrDue) {
  const auto t0 = Clock::now();
  JobRound round;
  EXPECT_FALSE(round.awaiting_rejoin(t0));
  round.start(1, {0, 2}, t0 + seconds(10));
  EXPECT_EQ(round.number(), 1u);
  EXPECT_TRUE(round.awaiting_rejoin(t0));
  round.rejoined(0);
  EXPECT_TRUE(round.awaiting_rejoin(t0));
  round.rejoined(2);
  EXPECT_FALSE(round.awaiting_rejoin(t0));

  // Not back in time: the job no longer waits for it.
  round.start(2, {1}, t0 + seconds(10));
  EXPECT_TRUE(round.awaiting_rejoin(t0 + seconds(9)));
  EXPECT_FALSE(round.awaiting_rejoin(t0 + seconds(10)));
}

TEST(JobRound, ARankStillDueFromTheRoundBeforeIsAwaitedInTheNext) {
  const auto t0 = Clock::now();
  JobRound round;
  round.start(1, {0, 1}, t0 + seconds(10));
  round.rejoined(0);
  // Rank 1 was not back when round 2 began (it is no member to ask again).
  round.start(2, {0}, t0 + seconds(20));
  round.rejoined(0);
  EXPECT_TRUE(round.awaiting_rejoin(t0 + seconds(15)));
  round.rejoined(1);
  EXPECT_FALSE(round.awaiting_rejoin(t0 + seconds(15)));
}

TEST(JobRound, FinishedFinalsAreForgottenBelowTheMarkAndInANewRound) {
  JobRound round;
  round.finished_final({3, 0});
  round.finished_final({4, 1});
  round.finished_final({6, 0});
  EXPECT_TRUE(round.final_finished({3, 0}));
  EXPECT_FALSE(round.final_finished({3, 1}));
  round.forget_finals_below(4);
  EXPECT_FALSE(round.final_finished({3, 0}));
  EXPECT_TRUE(round.final_finished({4, 1}));
  round.skip_to(5);  // skipping asks no one back and keeps what it knows
  EXPECT_TRUE(round.final_finished({6, 0}));
  round.start(6, {}, Clock::now());
  EXPECT_FALSE(round.final_finished({4, 1}));
  EXPECT_FALSE(round.final_finished({6, 0}));
}

class EarlyPartialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pool = SlabPool::create(/*slab_bytes=*/64, /*count=*/8);
    ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
    auto quota = SlabQuota::reserve(*pool, 8);
    ASSERT_TRUE(quota.is_ok()) << quota.status().to_string();
    quota_ = *quota;
  }
  // A partial of (op, chunk) from `group`, its slab taken from the quota.
  void add(uint64_t op, uint32_t chunk, uint32_t group, Clock::time_point at) {
    FrameHeader h;
    h.op = op;
    h.chunk = chunk;
    auto slab = quota_->try_take([] {});
    ASSERT_NE(slab, nullptr);
    early_.add(group, h, std::move(slab), at);
  }
  std::shared_ptr<SlabQuota> quota_;
  EarlyPartials early_;
};

TEST_F(EarlyPartialsTest, AChunksPartialsAreTakenInArrivalOrder) {
  const auto t0 = Clock::now();
  add(3, 0, 2, t0);
  add(3, 0, 1, t0);
  add(3, 1, 1, t0);
  EXPECT_EQ(early_.ops(), (std::set<uint64_t>{3}));
  auto taken = early_.take({3, 0});
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_EQ(taken[0].from_group, 2u);
  EXPECT_EQ(taken[1].from_group, 1u);
  EXPECT_EQ(taken[0].header.op, 3u);
  EXPECT_TRUE(early_.take({3, 0}).empty());
  EXPECT_FALSE(early_.empty());
  taken.clear();
  EXPECT_EQ(quota_->in_use(), 1u);  // the slabs of the taken partials are back
}

TEST_F(EarlyPartialsTest, DroppingAnOpOrTheOpsBelowAMarkGivesTheirSlabsBack) {
  const auto t0 = Clock::now();
  for (uint64_t op = 1; op <= 4; ++op) add(op, 0, 1, t0);
  add(2, 1, 1, t0);
  EXPECT_EQ(quota_->in_use(), 5u);
  early_.drop_op(2);
  EXPECT_EQ(early_.ops(), (std::set<uint64_t>{1, 3, 4}));
  EXPECT_EQ(quota_->in_use(), 3u);
  early_.drop_below(4);
  EXPECT_EQ(early_.ops(), (std::set<uint64_t>{4}));
  EXPECT_EQ(quota_->in_use(), 1u);
  early_.clear();
  EXPECT_TRUE(early_.empty());
  EXPECT_EQ(quota_->in_use(), 0u);
}

TEST_F(EarlyPartialsTest, AnOpIsOverdueWhenItsFirstPartialWaitedPastTheTimeout) {
  const auto t0 = Clock::now();
  add(1, 0, 1, t0);
  add(1, 0, 2, t0 + seconds(8));  // a later one does not make it younger
  add(2, 0, 1, t0 + seconds(5));
  EXPECT_TRUE(early_.overdue(t0 + seconds(10), seconds(10)).empty());
  EXPECT_EQ(early_.overdue(t0 + seconds(11), seconds(10)), (std::set<uint64_t>{1}));
  EXPECT_EQ(early_.overdue(t0 + seconds(16), seconds(10)), (std::set<uint64_t>{1, 2}));
}

TEST(LeftGroups, AGroupLeavesOnceWithItsFirstReason) {
  LeftGroups left;
  EXPECT_EQ(left.find(1), std::nullopt);
  left.add(1, Status(ErrorCode::kUnavailable, "first"));
  left.add(1, Status(ErrorCode::kUnavailable, "second"));
  ASSERT_TRUE(left.find(1).has_value());
  EXPECT_EQ(left.find(1)->message(), "first");
  EXPECT_EQ(left.find(0), std::nullopt);
}

}  // namespace
}  // namespace tally
