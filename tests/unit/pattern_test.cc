// The checked inputs of the bench and the tests (pattern.h): sums by table
// equal sums by hand, every op's inputs differ from its neighbours' at every
// element, and explain_wrong names what a wrong result is instead.
#include "tally/bench/pattern.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tally/bench/explain.h"

namespace tally::bench {
namespace {

RedOp alternating(uint64_t seed) { return seed % 2 ? RedOp::kAverage : RedOp::kSum; }

// The result every rank gets for the op with `seed`.
std::vector<float> result_of(size_t n, uint32_t world, RedOp redop, uint64_t seed) {
  std::vector<float> out(n);
  const PatternSums sums(world, seed);
  for (size_t i = 0; i < n; ++i) out[i] = sums.expected<float>(redop, i);
  return out;
}

TEST(Pattern, TableSumsAreTheSumsOfEveryRanksInputs) {
  for (uint32_t world : {1u, 3u, 8u}) {
    for (uint64_t seed : {0ull, 1ull, 1020ull, 1021ull, 123456789ull}) {
      const PatternSums sums(world, seed);
      for (uint64_t i : {0ull, 1ull, 1020ull, 1021ull, 5000ull}) {
        uint64_t by_hand = 0;
        for (uint32_t r = 0; r < world; ++r) by_hand += pattern_value(r, seed, i);
        EXPECT_EQ(sums.sum(i), by_hand) << "W=" << world << " seed " << seed << " i " << i;
      }
    }
  }
}

TEST(Pattern, ConsecutiveOpsAndRanksDifferAtEveryElement) {
  for (uint64_t i : {0ull, 17ull, 4096ull}) {
    for (uint64_t d = 1; d < kPatternPeriod; ++d) {
      ASSERT_NE(pattern_value(0, 40, i), pattern_value(0, 40 + d, i)) << "ops 40, " << 40 + d;
      ASSERT_NE(pattern_value(0, 40, i), pattern_value(static_cast<uint32_t>(d), 40, i));
    }
  }
}

TEST(Pattern, CountWrongCountsTheElementsOffTheExpectedResult) {
  std::vector<float> data = result_of(3000, 4, RedOp::kAverage, 9);
  EXPECT_EQ(count_wrong(data.data(), data.size(), 4, RedOp::kAverage, 9), 0u);
  EXPECT_EQ(count_wrong(data.data(), data.size(), 4, RedOp::kAverage, 10), data.size());
  data[5] += 1;
  EXPECT_EQ(count_wrong(data.data(), data.size(), 4, RedOp::kAverage, 9), 1u);
}

TEST(Explain, NamesWhatAWrongResultIsInstead) {
  constexpr size_t n = 2000;
  constexpr uint32_t w = 4;
  const PatternOp op{.rank = 2, .world_size = w, .redop = RedOp::kAverage, .seed = 7};
  std::vector<float> right = result_of(n, w, RedOp::kAverage, 7);
  EXPECT_EQ(explain_wrong(right.data(), n, op, 4, alternating), "");

  // Half of it averaged twice: a replay reduced again.
  std::vector<float> twice = right;
  for (size_t i = n / 2; i < n; ++i) twice[i] /= w;
  EXPECT_EQ(explain_wrong(twice.data(), n, op, 4, alternating),
            "1000 of 2000 elements wrong (elements 1000..1999), each the average divided by 4 "
            "again; the rest right");

  // Another op's result in this op's buffer (op 5 averages; op 8 sums).
  std::vector<float> stale = result_of(n, w, RedOp::kAverage, 5);
  EXPECT_EQ(explain_wrong(stale.data(), n, op, 4, alternating),
            "2000 of 2000 elements wrong (elements 0..1999), each op 5's avg");
  std::vector<float> next = result_of(n, w, RedOp::kSum, 8);
  EXPECT_EQ(explain_wrong(next.data(), n, op, 4, alternating),
            "2000 of 2000 elements wrong (elements 0..1999), each op 8's sum");

  // The sum where the average was asked, and the input never reduced.
  std::vector<float> sum = result_of(n, w, RedOp::kSum, 7);
  EXPECT_EQ(explain_wrong(sum.data(), n, op, 4, alternating),
            "2000 of 2000 elements wrong (elements 0..1999), each the sum, not averaged");
  std::vector<float> input(n);
  fill_pattern(input.data(), n, op.rank, op.seed);
  EXPECT_EQ(explain_wrong(input.data(), n, op, 4, alternating),
            "2000 of 2000 elements wrong (elements 0..1999), each this rank's input, not reduced");

  // Rank 1's buffer held part of the result where its input was, and it
  // was summed in again there.
  std::vector<float> again = right;
  const PatternSums sums(w, 7);
  for (size_t i = 100; i < 300; ++i) {
    again[i] = (sums.sum(i) - pattern_value(1, 7, i) + right[i]) / static_cast<float>(w);
  }
  EXPECT_EQ(explain_wrong(again.data(), n, op, 4, alternating),
            "200 of 2000 elements wrong (elements 100..299), each the result summed in again in "
            "place of the input of rank 1; the rest right");
  // Ranks 1 and 3 held it, in a sum.
  const PatternOp summed{.rank = 2, .world_size = w, .redop = RedOp::kSum, .seed = 7};
  for (size_t i = 0; i < n; ++i) {
    if (i < 100 || i >= 300)
      again[i] = static_cast<float>(sums.sum(i));
    else
      again[i] = static_cast<float>(sums.sum(i)) * 3 -
                 static_cast<float>(pattern_value(1, 7, i) + pattern_value(3, 7, i));
  }
  EXPECT_EQ(explain_wrong(again.data(), n, summed, 4, alternating),
            "200 of 2000 elements wrong (elements 100..299), each the result summed in again in "
            "place of the input of ranks 1, 3; the rest right");

  // Something else entirely.
  std::vector<float> odd = right;
  odd[3] = -1;
  EXPECT_EQ(
      explain_wrong(odd.data(), n, op, 4, alternating)
          .rfind("1 of 2000 elements wrong (elements 3..3), none explained: element 3 is -1", 0),
      0u);
}

}  // namespace
}  // namespace tally::bench
