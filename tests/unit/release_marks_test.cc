// ReleaseMarks: the group's least Received mark, and the job's over every
// participating group (reducer/include/tally/reducer/release_marks.h).
#include "tally/reducer/release_marks.h"

#include <gtest/gtest.h>

namespace tally {
namespace {

TEST(ReleaseMarks, TheGroupMarkIsKnownOnceEveryRankHasJoinedAndSaidOne) {
  ReleaseMarks marks(/*world_size=*/3, /*group_size=*/3, /*participants=*/1, /*mine=*/0);
  for (uint32_t r : {0u, 1u}) marks.joined(r);
  EXPECT_FALSE(marks.note(0, 5).moved);
  EXPECT_FALSE(marks.note(1, 7).moved);
  EXPECT_FALSE(marks.group_known());  // rank 2 has not joined
  marks.joined(2);
  // The first time it is known, it is announced, even at 0.
  const ReleaseMarks::Change change = marks.note(2, 0);
  EXPECT_TRUE(change.moved);
  EXPECT_TRUE(change.first);
  EXPECT_EQ(marks.group_mark(), 0u);
  EXPECT_EQ(marks.job_release(change.first), 0u);
}

TEST(ReleaseMarks, TheGroupMarkMovesOnlyWhenItsLeastRankDoes) {
  ReleaseMarks marks(3, 3, 1, 0);
  for (uint32_t r = 0; r < 3; ++r) marks.joined(r);
  marks.note(0, 4);
  marks.note(1, 4);
  ASSERT_TRUE(marks.note(2, 4).moved);
  EXPECT_EQ(marks.group_mark(), 4u);
  EXPECT_FALSE(marks.note(0, 9).moved);
  EXPECT_FALSE(marks.note(0, 3).moved) << "a mark never goes back";
  EXPECT_FALSE(marks.note(1, 6).moved);
  const ReleaseMarks::Change change = marks.note(2, 8);
  EXPECT_TRUE(change.moved);
  EXPECT_FALSE(change.first);
  EXPECT_EQ(marks.group_mark(), 6u);  // rank 1's
  EXPECT_EQ(marks.job_release(false), 6u);
  EXPECT_EQ(marks.job_release(false), std::nullopt) << "told once";
  EXPECT_EQ(marks.job_release(true), 6u) << "announced again when asked";
}

TEST(ReleaseMarks, ARankThatLeftNoLongerHoldsTheMarkAndHasNoneWhenBack) {
  ReleaseMarks marks(2, 2, 1, 0);
  marks.joined(0);
  marks.joined(1);
  marks.note(0, 10);
  marks.note(1, 2);
  EXPECT_EQ(marks.group_mark(), 2u);
  EXPECT_TRUE(marks.left(1).moved);
  EXPECT_EQ(marks.group_mark(), 10u);
  marks.joined(1);  // back: nothing known of it until it says a mark
  EXPECT_FALSE(marks.note(0, 12).moved);
  EXPECT_TRUE(marks.note(1, 20).moved);
  EXPECT_EQ(marks.group_mark(), 12u);
}

TEST(ReleaseMarks, TheJobMarkWaitsForEveryOtherGroupAndIsTheLeast) {
  // Three groups; this reducer's is the second.
  ReleaseMarks marks(/*world_size=*/4, /*group_size=*/2, /*participants=*/3, /*mine=*/1);
  marks.joined(2);
  marks.joined(3);
  marks.note(2, 8);
  const ReleaseMarks::Change change = marks.note(3, 9);
  ASSERT_TRUE(change.moved);
  EXPECT_EQ(marks.job_release(change.first), std::nullopt) << "no other group's mark yet";
  marks.replica_said(0, 5);
  EXPECT_EQ(marks.job_release(false), std::nullopt) << "group 2's is still unknown";
  marks.replica_said(2, 11);
  EXPECT_EQ(marks.job_release(false), 5u);
  EXPECT_TRUE(marks.job_known());
  marks.replica_said(0, 3);  // a replica's mark never goes back either
  EXPECT_EQ(marks.job_release(false), std::nullopt);
  marks.replica_said(0, 30);
  EXPECT_EQ(marks.job_release(false), 8u);  // now this group's own
  EXPECT_EQ(marks.released_below(), 8u);
}

TEST(ReleaseMarks, AnotherShardsReleaseRaisesTheJobMarkUpToTheGroupsOwn) {
  // Two groups; the other one's mark lags (its replica is lost).
  ReleaseMarks marks(/*world_size=*/4, /*group_size=*/2, /*participants=*/2, /*mine=*/0);
  EXPECT_FALSE(marks.raise_job(7)) << "this group's mark is not known yet";
  EXPECT_EQ(marks.job_mark(), 0u);
  marks.joined(0);
  marks.joined(1);
  marks.note(0, 9);
  marks.note(1, 5);
  marks.replica_said(1, 3);
  EXPECT_EQ(marks.job_release(true), 3u);
  // The claim of 7 counts up to this group's 5, then the rest as it passes.
  EXPECT_TRUE(marks.raise_job(0));
  EXPECT_EQ(marks.job_mark(), 5u);
  marks.note(1, 12);
  EXPECT_TRUE(marks.raise_job(0));
  EXPECT_EQ(marks.job_mark(), 7u);
  EXPECT_FALSE(marks.raise_job(3));
  // A lie goes no further than the group's own mark.
  EXPECT_TRUE(marks.raise_job(uint64_t{1} << 40));
  EXPECT_EQ(marks.job_mark(), 9u);
  EXPECT_EQ(marks.released_below(), 9u);
}

}  // namespace
}  // namespace tally
