// FailedOps and OpTimings: what a job remembers of its ops beside their
// chunks, bounded whatever the workers send (reducer/include/tally/reducer/op_memory.h).
#include "tally/reducer/op_memory.h"

#include <gtest/gtest.h>

#include "tally.pb.h"

namespace tally {
namespace {

std::shared_ptr<const wire::Control> error_saying(const std::string& text) {
  auto control = std::make_shared<wire::Control>();
  control->mutable_error()->set_message(text);
  return control;
}

TEST(FailedOps, AnOpFailsOnceWithItsFirstError) {
  FailedOps failed;
  EXPECT_EQ(failed.find(3), nullptr);
  EXPECT_TRUE(failed.add(3, error_saying("first")));
  EXPECT_FALSE(failed.add(3, error_saying("second")));
  ASSERT_NE(failed.find(3), nullptr);
  EXPECT_EQ(failed.find(3)->error().message(), "first");
  EXPECT_TRUE(failed.contains(3));
  EXPECT_FALSE(failed.contains(4));
}

TEST(FailedOps, TheOldestIsForgottenPastTheCapacity) {
  FailedOps failed(/*capacity=*/3);
  for (uint64_t op = 10; op < 14; ++op) failed.add(op, error_saying(std::to_string(op)));
  EXPECT_FALSE(failed.contains(10));
  for (uint64_t op = 11; op < 14; ++op) EXPECT_TRUE(failed.contains(op)) << op;
}

TEST(OpTimings, AnOpEndsWithItsLastChunkOnThisShard) {
  OpTimings timings;
  const auto t0 = OpTimings::Clock::now();
  timings.began(5, t0, /*chunks_on_shard=*/2, /*rank=*/1);
  timings.began(5, t0 + std::chrono::seconds(1), 9, 3);  // a later chunk: kept as it was
  ASSERT_NE(timings.find(5), nullptr);
  EXPECT_EQ(timings.find(5)->expected, 2u);
  EXPECT_EQ(timings.find(5)->first_rank, 1u);
  EXPECT_EQ(timings.chunk_finished(5), std::nullopt);
  EXPECT_EQ(timings.chunk_finished(5), t0);
  EXPECT_EQ(timings.find(5), nullptr);
  EXPECT_EQ(timings.chunk_finished(5), std::nullopt) << "an op not tracked is not measured";
}

TEST(OpTimings, AStragglingOpIsLoggedOnceUntilOneOfItsChunksFinishes) {
  OpTimings timings;
  const auto now = OpTimings::Clock::now();
  EXPECT_FALSE(timings.first_straggle(4)) << "an op not tracked is not logged";
  timings.began(4, now, /*chunks_on_shard=*/3, /*rank=*/0);
  EXPECT_TRUE(timings.first_straggle(4));
  EXPECT_FALSE(timings.first_straggle(4));
  EXPECT_EQ(timings.chunk_finished(4), std::nullopt);
  EXPECT_TRUE(timings.first_straggle(4)) << "its next chunk may straggle for a new reason";
  timings.forget(4);
  EXPECT_FALSE(timings.first_straggle(4));
}

TEST(OpTimings, TheLowestOpIsForgottenPastTheCapacity) {
  OpTimings timings(/*capacity=*/2);
  const auto now = OpTimings::Clock::now();
  for (uint64_t op : {7u, 8u, 9u}) timings.began(op, now, 1, 0);
  EXPECT_EQ(timings.find(7), nullptr);
  EXPECT_NE(timings.find(8), nullptr);
  EXPECT_NE(timings.find(9), nullptr);
  timings.forget(8);
  EXPECT_EQ(timings.find(8), nullptr);
  timings.clear();
  EXPECT_EQ(timings.find(9), nullptr);
}

}  // namespace
}  // namespace tally
