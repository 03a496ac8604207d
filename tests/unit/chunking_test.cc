// ChunkPlan: chunks tile the tensor exactly, each no larger than the chunk
// size, striped round-robin over the shards.
#include "tally/protocol/chunking.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace tally {
namespace {

struct PlanCase {
  std::string label;  // what the size is about, for the test name
  uint64_t nbytes;
  size_t element_bytes;
  size_t chunk_bytes;  // as requested, before rounding
  uint32_t shards;
};

std::string plan_name(const ::testing::TestParamInfo<PlanCase>& info) {
  const auto& c = info.param;
  return c.label + "_" + std::to_string(c.nbytes) + "B_e" + std::to_string(c.element_bytes) + "_c" +
         std::to_string(c.chunk_bytes) + "_S" + std::to_string(c.shards);
}

// The chunk size the plan must use: rounded down to whole elements, at
// least one element.
uint64_t effective_chunk(size_t element_bytes, size_t chunk_bytes) {
  const uint64_t whole = chunk_bytes / element_bytes * element_bytes;
  return whole == 0 ? element_bytes : whole;
}

std::vector<PlanCase> plan_cases() {
  std::vector<PlanCase> out;
  for (uint32_t shards = 1; shards <= 5; ++shards) {
    for (size_t esize : {2, 4, 8}) {
      const size_t chunk = 4096;
      const uint64_t e = esize;
      auto add = [&](const std::string& label, uint64_t nbytes, size_t chunk_bytes) {
        out.push_back({label, nbytes, esize, chunk_bytes, shards});
      };
      add("Empty", 0, chunk);
      add("OneElement", e, chunk);
      add("ChunkMinusOneElement", chunk - e, chunk);
      add("ExactlyOneChunk", chunk, chunk);
      add("ChunkPlusOneElement", chunk + e, chunk);
      add("TwoChunksMinusOneElement", 2 * chunk - e, chunk);
      add("Prime", 1000003 * e, chunk);
      add("PrimeElementsPrimeChunkElems", 7919 * e, 13 * e);
      add("ManyChunks", 1000 * chunk + 3 * e, chunk);
      add("ExactlyShardsChunks", shards * chunk, chunk);
      add("TinyChunkOneElement", 97 * e, e);
      // Chunk sizes that are not a multiple of the element size round down.
      add("ChunkNotElementMultiple", 10007 * e, 4095);
      add("ChunkOneByteOverElement", 101 * e, e + 1);
      // Smaller than one element: one element per chunk.
      add("ChunkSmallerThanElement", 31 * e, 1);
      add("ChunkOneLessThanElement", 31 * e, e - 1);
    }
  }
  return out;
}

class ChunkPlanTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(ChunkPlanTest, ChunksTileTheTensorRoundRobinOverShards) {
  const PlanCase& c = GetParam();
  const ChunkPlan plan(c.nbytes, c.element_bytes, c.chunk_bytes, c.shards);
  const uint64_t chunk = effective_chunk(c.element_bytes, c.chunk_bytes);

  EXPECT_EQ(plan.nbytes(), c.nbytes);
  EXPECT_EQ(plan.shards(), c.shards);
  ASSERT_EQ(plan.chunk_bytes(), chunk);
  EXPECT_EQ(plan.chunk_bytes() % c.element_bytes, 0u);
  EXPECT_GE(plan.chunk_bytes(), c.element_bytes);
  EXPECT_EQ(plan.chunk_count(), (c.nbytes + chunk - 1) / chunk);

  uint64_t next = 0;  // where the next chunk must start
  std::vector<uint64_t> per_shard(c.shards, 0);
  for (uint64_t k = 0; k < plan.chunk_count(); ++k) {
    const ChunkExtent e = plan.chunk(k);
    ASSERT_EQ(e.index, k);
    ASSERT_EQ(e.shard, k % c.shards);
    ASSERT_EQ(e.offset, next) << "gap or overlap before chunk " << k;
    ASSERT_GT(e.length, 0u) << "chunk " << k;
    ASSERT_LE(e.length, plan.chunk_bytes()) << "chunk " << k;
    ASSERT_EQ(e.offset % c.element_bytes, 0u) << "chunk " << k;
    ASSERT_EQ(e.length % c.element_bytes, 0u) << "chunk " << k;
    // Only the last chunk may be short.
    if (k + 1 < plan.chunk_count()) {
      ASSERT_EQ(e.length, plan.chunk_bytes()) << "chunk " << k;
    }
    next = e.offset + e.length;
    ++per_shard[e.shard];
  }
  EXPECT_EQ(next, c.nbytes) << "chunks do not end at the tensor's end";
  for (uint32_t s = 0; s < c.shards; ++s) {
    EXPECT_EQ(plan.chunks_on_shard(s), per_shard[s]) << "shard " << s;
  }

  // Round robin keeps every shard within one chunk of the others.
  if (plan.chunk_count() > 0) {
    const auto [lo, hi] = std::minmax_element(per_shard.begin(), per_shard.end());
    EXPECT_LE(*hi - *lo, 1u);
  }
}

TEST_P(ChunkPlanTest, ChunkAtIsAPureFunctionOfTheIndex) {
  const PlanCase& c = GetParam();
  const ChunkPlan plan(c.nbytes, c.element_bytes, c.chunk_bytes, c.shards);
  if (c.nbytes == 0) {
    EXPECT_EQ(plan.chunk_count(), 0u);
    return;
  }
  // Asking out of order (as a retransmit would) gives the same extents.
  const uint64_t last = plan.chunk_count() - 1;
  for (uint64_t k : {last, uint64_t{0}, last / 2, last}) {
    const ChunkExtent e = plan.chunk(k);
    EXPECT_EQ(e.offset, k * plan.chunk_bytes());
    EXPECT_EQ(e.length, std::min<uint64_t>(plan.chunk_bytes(), c.nbytes - e.offset));
  }
}

INSTANTIATE_TEST_SUITE_P(SizesAndShards, ChunkPlanTest, ::testing::ValuesIn(plan_cases()),
                         plan_name);

TEST(ChunkPlan, EmptyTensorHasNoChunks) {
  for (uint32_t shards = 1; shards <= 5; ++shards) {
    EXPECT_EQ(ChunkPlan(0, 4, 4096, shards).chunk_count(), 0u);
  }
}

TEST(ChunkPlan, ChunkSizeRoundsDownToWholeElements) {
  EXPECT_EQ(ChunkPlan(100, 8, 20, 1).chunk_bytes(), 16u);
  EXPECT_EQ(ChunkPlan(100, 4, 4097, 1).chunk_bytes(), 4096u);
  EXPECT_EQ(ChunkPlan(100, 4, 4096, 1).chunk_bytes(), 4096u);
  EXPECT_EQ(ChunkPlan(100, 8, 7, 1).chunk_bytes(), 8u);  // at least one element
  EXPECT_EQ(ChunkPlan(100, 2, 1, 1).chunk_bytes(), 2u);
}

TEST(ChunkPlan, LastChunkHoldsTheRemainder) {
  const ChunkPlan plan(4096 * 3 + 12, 4, 4096, 2);
  ASSERT_EQ(plan.chunk_count(), 4u);
  const ChunkExtent last = plan.chunk(3);
  EXPECT_EQ(last.offset, 4096u * 3);
  EXPECT_EQ(last.length, 12u);
  EXPECT_EQ(last.shard, 1u);
}

TEST(ChunkPlan, HugeTensorsCountChunksWithoutOverflow) {
  // Sizes near 2^64: (nbytes + chunk - 1) / chunk must not wrap around.
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const uint64_t nbytes = kMax - (kMax % 8);  // 2^64 - 8, whole float64 elements
  const ChunkPlan plan(nbytes, 8, 1 << 20, 4);
  const uint64_t expected = nbytes / (1 << 20) + (nbytes % (1 << 20) != 0 ? 1 : 0);
  ASSERT_EQ(plan.chunk_count(), expected);
  const ChunkExtent last = plan.chunk(plan.chunk_count() - 1);
  EXPECT_EQ(last.offset + last.length, nbytes);
}

using ChunkPlanDeathTest = ::testing::Test;

TEST_F(ChunkPlanDeathTest, RejectsZeroArgumentsAsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(ChunkPlan(100, 0, 4096, 1), "TALLY_CHECK");
  EXPECT_DEATH(ChunkPlan(100, 4, 0, 1), "TALLY_CHECK");
  EXPECT_DEATH(ChunkPlan(100, 4, 4096, 0), "TALLY_CHECK");
}

TEST_F(ChunkPlanDeathTest, ChunkIndexPastTheEndIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const ChunkPlan plan(4096 * 2, 4, 4096, 1);
  ASSERT_EQ(plan.chunk_count(), 2u);
  EXPECT_DEATH(plan.chunk(2), "TALLY_CHECK");
  const ChunkPlan empty(0, 4, 4096, 1);
  EXPECT_DEATH(empty.chunk(0), "TALLY_CHECK");
}

}  // namespace
}  // namespace tally
