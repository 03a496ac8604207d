// ChunkPlan: an op spreads over one shard per kPlanMinShardBytes (all of
// them from S times that, or with TALLY_CHUNK_BYTES), in contiguous,
// element-aligned, near-equal ranges, a small op's first range on shard
// op % S; each range is cut into chunks sized by the tensor (automatic) or by
// TALLY_CHUNK_BYTES (override); chunks tile the tensor in index order, range
// after range.
#include "tally/protocol/chunking.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace tally {
namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * KiB;

struct PlanCase {
  std::string label;  // what the size is about, for the test name
  uint64_t nbytes;
  DType dtype;
  uint32_t shards;
  uint64_t chunk_bytes;  // 0: automatic
  uint64_t op = 0;       // the op's number
};

std::string plan_name(const PlanCase& c) {
  return c.label + "_" + std::to_string(c.nbytes) + "B_e" + std::to_string(dtype_size(c.dtype)) +
         "_S" + std::to_string(c.shards) +
         (c.chunk_bytes ? "_c" + std::to_string(c.chunk_bytes) : "_auto") + "_op" +
         std::to_string(c.op);
}

std::vector<PlanCase> plan_cases() {
  std::vector<PlanCase> out;
  for (uint32_t shards : {1u, 2u, 3u, 4u, 5u, 8u}) {
    for (DType dtype : {DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
      const uint64_t e = dtype_size(dtype);
      for (uint64_t chunk : {uint64_t{0}, uint64_t{4096}, 13 * e, uint64_t{4095}, e - 1}) {
        auto add = [&](const std::string& label, uint64_t nbytes) {
          // Op 7: a small op's ranges start past shard 0 (and wrap) at S > 1.
          for (uint64_t op : {uint64_t{0}, uint64_t{7}}) {
            out.push_back({label, nbytes, dtype, shards, chunk, op});
          }
        };
        add("Empty", 0);
        add("OneElement", e);
        add("FewerElementsThanShards", (shards > 1 ? shards - 1 : 1) * e);
        add("ExactlyShardsElements", shards * e);
        add("ShardsPlusOneElement", (shards + 1) * e);
        add("Prime", 7919 * e);
        add("JustOverTheShardFloor", kPlanMinShardBytes + e);
        add("PrimeLarge", 1000003 * e);
        if (chunk >= 4096 || chunk == 0) {
          add("OneMiB", MiB);
          add("SixteenMiBPlusOne", 16 * MiB + e);
        }
      }
    }
  }
  return out;
}

PlanSettings settings_for(const PlanCase& c) {
  PlanSettings s;
  s.chunk_bytes = c.chunk_bytes;
  return s;
}

// Every case of plan_cases() runs in one test (one process): as 1,404
// separate CTest entries they cost minutes of process start-up per build.
void check_tiles(const PlanCase& c) {
  const uint64_t e = dtype_size(c.dtype);
  const ChunkPlan plan(c.nbytes, c.dtype, c.shards, settings_for(c), c.op);
  const uint64_t elements = c.nbytes / e;
  const uint64_t floors = (c.nbytes + kPlanMinShardBytes - 1) / kPlanMinShardBytes;
  const uint32_t spread = c.chunk_bytes > 0
                              ? c.shards
                              : static_cast<uint32_t>(std::clamp<uint64_t>(floors, 1, c.shards));
  ASSERT_EQ(plan.spread(), spread);
  const uint32_t first = spread < c.shards ? c.op % c.shards : 0;

  EXPECT_EQ(plan.nbytes(), c.nbytes);
  EXPECT_EQ(plan.shards(), c.shards);
  ASSERT_GE(plan.full_chunk_bytes(), e);
  ASSERT_EQ(plan.full_chunk_bytes() % e, 0u);
  if (c.chunk_bytes > 0) {
    EXPECT_EQ(plan.full_chunk_bytes(), std::max(e, c.chunk_bytes / e * e)) << "override not exact";
  } else if (elements >= c.shards) {
    EXPECT_LE(plan.full_chunk_bytes(), kPlanChunkCeilingBytes);
  }

  // Ranges: contiguous, range j on shard (first + j) % S, near-equal (within
  // one element); the shards past the spread get nothing.
  uint64_t expect_offset = 0;
  uint64_t total_chunks = 0;
  for (uint32_t j = 0; j < c.shards; ++j) {
    const uint32_t s = (first + j) % c.shards;
    const uint64_t range = plan.shard_bytes(s);
    if (j >= spread) {
      EXPECT_EQ(range, 0u) << "shard " << s;
      EXPECT_EQ(plan.chunks_on_shard(s), 0u) << "shard " << s;
      continue;
    }
    ASSERT_EQ(plan.shard_offset(s), expect_offset) << "shard " << s;
    ASSERT_EQ(range % e, 0u);
    EXPECT_EQ(range / e, elements / spread + (j < elements % spread ? 1 : 0)) << "shard " << s;
    EXPECT_EQ(plan.first_chunk(s), total_chunks) << "shard " << s;
    // A range is empty only when there are fewer elements than ranges.
    if (elements >= spread) {
      EXPECT_GT(plan.chunks_on_shard(s), 0u) << "shard " << s;
    }
    EXPECT_EQ(plan.chunks_on_shard(s) == 0, range == 0) << "shard " << s;
    expect_offset += range;
    total_chunks += plan.chunks_on_shard(s);
  }
  EXPECT_EQ(expect_offset, c.nbytes);
  ASSERT_EQ(plan.chunk_count(), total_chunks);

  uint64_t next = 0;  // where the next chunk must start
  std::vector<uint64_t> per_shard(c.shards, 0);
  for (uint64_t k = 0; k < plan.chunk_count(); ++k) {
    const ChunkExtent x = plan.chunk(k);
    ASSERT_EQ(x.index, k);
    ASSERT_LT(x.shard, c.shards);
    ASSERT_EQ(x.offset, next) << "gap or overlap before chunk " << k;
    ASSERT_GT(x.length, 0u) << "chunk " << k;
    ASSERT_LE(x.length, plan.full_chunk_bytes()) << "chunk " << k;
    ASSERT_EQ(x.offset % e, 0u) << "chunk " << k;
    ASSERT_EQ(x.length % e, 0u) << "chunk " << k;
    // Inside its shard's range; only a range's last chunk may be short.
    const uint64_t start = plan.shard_offset(x.shard), end = start + plan.shard_bytes(x.shard);
    ASSERT_GE(x.offset, start) << "chunk " << k;
    ASSERT_LE(x.offset + x.length, end) << "chunk " << k;
    if (x.offset + x.length < end) {
      ASSERT_EQ(x.length, plan.full_chunk_bytes()) << "chunk " << k;
    }
    next = x.offset + x.length;
    ++per_shard[x.shard];
  }
  EXPECT_EQ(next, c.nbytes) << "chunks do not end at the tensor's end";
  for (uint32_t s = 0; s < c.shards; ++s) {
    EXPECT_EQ(plan.chunks_on_shard(s), per_shard[s]) << "shard " << s;
  }
}

// The plan depends on its inputs only: built again (another rank) and
// asked in another order (as a retransmit would), it gives the same chunks.
void check_same_plan(const PlanCase& c) {
  const ChunkPlan a(c.nbytes, c.dtype, c.shards, settings_for(c), c.op);
  const ChunkPlan b(c.nbytes, c.dtype, c.shards, settings_for(c), c.op);
  ASSERT_EQ(a.chunk_count(), b.chunk_count());
  for (uint64_t k = a.chunk_count(); k-- > 0;) {
    const ChunkExtent x = a.chunk(k), y = b.chunk(k);
    ASSERT_EQ(x.offset, y.offset);
    ASSERT_EQ(x.length, y.length);
    ASSERT_EQ(x.shard, y.shard);
  }
}

TEST(ChunkPlan, ChunksTileTheTensorInContiguousShardRanges) {
  for (const PlanCase& c : plan_cases()) {
    SCOPED_TRACE(plan_name(c));
    check_tiles(c);
    if (HasFailure()) return;
  }
}

TEST(ChunkPlan, EveryRankComputesTheSamePlan) {
  for (const PlanCase& c : plan_cases()) {
    SCOPED_TRACE(plan_name(c));
    check_same_plan(c);
    if (HasFailure()) return;
  }
}

TEST(ChunkPlan, EmptyTensorHasNoChunks) {
  for (uint32_t shards = 1; shards <= 5; ++shards) {
    EXPECT_EQ(ChunkPlan(0, DType::kFloat32, shards).chunk_count(), 0u);
    EXPECT_EQ(ChunkPlan(0, DType::kFloat32, shards, {.chunk_bytes = 4096}).chunk_count(), 0u);
  }
}

TEST(ChunkPlan, OneMiBSpreadsOverEveryShardInFloorSizedChunks) {
  // A 1 MiB op spreads over every shard rather than landing on one.
  const ChunkPlan plan(MiB, DType::kFloat32, 4);
  for (uint32_t s = 0; s < 4; ++s) EXPECT_EQ(plan.shard_bytes(s), 256 * KiB);
  // 256 KiB / 16 chunks = 16 KiB, under the floor: 32 KiB chunks, 8 a shard.
  EXPECT_EQ(kPlanChunkFloorBytes, 32 * KiB);
  EXPECT_EQ(plan.full_chunk_bytes(), kPlanChunkFloorBytes);
  EXPECT_EQ(plan.chunks_on_shard(0), 8u);
  EXPECT_EQ(plan.chunk_count(), 32u);
  // From 4 MiB (1 MiB a shard, 64 KiB / 16) the floor no longer binds.
  EXPECT_EQ(ChunkPlan(4 * MiB, DType::kFloat32, 4).full_chunk_bytes(), 64 * KiB);
}

// On slow paced links the ceiling is about 3 ms of a stream's share of the
// link, max(S, W) streams sharing it (architecture.md, "The chunk plan").
TEST(ChunkPlan, SlowPacedLinksLowerTheChunkCeiling) {
  EXPECT_EQ(chunk_ceiling_for_link(0, 8), kPlanChunkCeilingBytes);  // no rate: unpaced
  // 29.7 MB/s a stream: 89,061 bytes in 3 ms, 84 KiB in whole pages.
  EXPECT_EQ(chunk_ceiling_for_link(1000000000, 4), 84 * KiB);
  // 14.8 MB/s: 44,529 bytes, 40 KiB.
  EXPECT_EQ(chunk_ceiling_for_link(1000000000, 8), 40 * KiB);
  EXPECT_EQ(chunk_ceiling_for_link(1000000000, 64), kPlanChunkFloorBytes);
  EXPECT_EQ(chunk_ceiling_for_link(10000000000, 4), kPlanChunkCeilingBytes);
  EXPECT_EQ(chunk_ceiling_for_link(1000000000, 0), kPlanChunkCeilingBytes);  // no streams: 1
  // 16 MiB at W = 8, S = 8 on 1 Gbit/s links: 2 MiB a shard, in 52 chunks
  // of 40 KiB (the last one shorter) instead of 16 of 128 KiB.
  const PlanSettings paced{.chunk_ceiling_bytes = chunk_ceiling_for_link(1000000000, 8)};
  const ChunkPlan plan(16 * MiB, DType::kFloat32, 8, paced);
  EXPECT_EQ(plan.full_chunk_bytes(), 40 * KiB);
  EXPECT_EQ(plan.chunks_on_shard(0), 52u);
  // A 1 MiB op (128 KiB a shard, 8 KiB / 16) takes the floor: 4 chunks a shard.
  EXPECT_EQ(ChunkPlan(MiB, DType::kFloat32, 8, paced).full_chunk_bytes(), 32 * KiB);
}

TEST(ChunkPlan, LargeTensorsGetTheTargetChunksPerShard) {
  // 16 MiB over 4 shards: 4 MiB each, / 16 = 256 KiB chunks.
  const ChunkPlan plan(16 * MiB, DType::kFloat32, 4);
  EXPECT_EQ(plan.full_chunk_bytes(), 256 * KiB);
  for (uint32_t s = 0; s < 4; ++s) EXPECT_EQ(plan.chunks_on_shard(s), kPlanTargetChunks);
}

TEST(ChunkPlan, ChunksStopAtTheCeiling) {
  // 1 GiB over 2 shards: 512 MiB / 16 = 32 MiB, capped at 256 KiB.
  const ChunkPlan plan(1024 * MiB, DType::kFloat32, 2);
  EXPECT_EQ(plan.full_chunk_bytes(), kPlanChunkCeilingBytes);
  EXPECT_EQ(plan.full_chunk_bytes(), 256 * KiB);
  EXPECT_EQ(plan.chunks_on_shard(0), 2048u);
  // A reducer that takes less bounds the chunks further.
  const ChunkPlan small(1024 * MiB, DType::kFloat32, 2, {.max_chunk_bytes = 128 * KiB});
  EXPECT_EQ(small.full_chunk_bytes(), 128 * KiB);
  // Even below the floor: a reducer's limit is never exceeded.
  const ChunkPlan tiny(MiB, DType::kFloat32, 1, {.max_chunk_bytes = 4096});
  EXPECT_EQ(tiny.full_chunk_bytes(), 4096u);
}

TEST(ChunkPlan, MaxChunkElementsIsTheReducersSlabOverTheElementSize) {
  EXPECT_EQ(max_chunk_elements(4 * MiB, DType::kFloat32), MiB);
  EXPECT_EQ(max_chunk_elements(4 * MiB, DType::kFloat64), MiB / 2);
  EXPECT_EQ(max_chunk_elements(4 * MiB, DType::kFloat16), MiB);  // float32 accumulators
  EXPECT_EQ(max_chunk_elements(4, DType::kFloat64), 1u);         // at least one
}

TEST(ChunkPlan, ChunkSizeRoundsToWholeElements) {
  // Automatic: 3 shards of a 7-element-odd size still cut at element bounds.
  const ChunkPlan plan(3 * 1000 * 8 + 8, DType::kFloat64, 3, {.chunk_floor_bytes = 100});
  EXPECT_EQ(plan.full_chunk_bytes() % 8, 0u);
  // Override: rounded down, at least one element.
  EXPECT_EQ(ChunkPlan(100, DType::kFloat64, 1, {.chunk_bytes = 20}).full_chunk_bytes(), 16u);
  EXPECT_EQ(ChunkPlan(100, DType::kFloat32, 1, {.chunk_bytes = 4097}).full_chunk_bytes(), 4096u);
  EXPECT_EQ(ChunkPlan(100, DType::kFloat64, 1, {.chunk_bytes = 7}).full_chunk_bytes(), 8u);
}

TEST(ChunkPlan, OverrideCutsEachShardRangeIntoExactChunks) {
  // 10 KiB over 2 shards with 4 KiB chunks: each 5 KiB range is 4 KiB + 1 KiB.
  const ChunkPlan plan(10 * KiB, DType::kFloat32, 2, {.chunk_bytes = 4096});
  ASSERT_EQ(plan.chunk_count(), 4u);
  EXPECT_EQ(plan.chunk(0).length, 4096u);
  EXPECT_EQ(plan.chunk(1).length, 1024u);
  EXPECT_EQ(plan.chunk(1).shard, 0u);
  EXPECT_EQ(plan.chunk(2).offset, 5 * KiB);
  EXPECT_EQ(plan.chunk(2).shard, 1u);
  EXPECT_EQ(plan.chunk(3).length, 1024u);
}

TEST(ChunkPlan, FewerElementsThanShardsGivesOneElementToTheFirstShards) {
  // With every op over all S (a floor of 0).
  const ChunkPlan plan(3 * 4, DType::kFloat32, 5, {.min_shard_bytes = 0});
  ASSERT_EQ(plan.chunk_count(), 3u);
  for (uint32_t s = 0; s < 3; ++s) {
    EXPECT_EQ(plan.chunks_on_shard(s), 1u);
    EXPECT_EQ(plan.chunk(s).shard, s);
    EXPECT_EQ(plan.chunk(s).length, 4u);
  }
  EXPECT_EQ(plan.chunks_on_shard(3), 0u);
  EXPECT_EQ(plan.chunks_on_shard(4), 0u);
  EXPECT_EQ(plan.first_chunk(4), 3u);
}

TEST(ChunkPlan, SmallOpsReachOneShardPerFloorTakingTurnsByOpNumber) {
  static_assert(kPlanMinShardBytes == 16 * KiB, "the sizes below are in floors");
  // 4 KiB at S = 4: one shard, the op's number mod 4, one chunk.
  for (uint64_t op = 0; op < 8; ++op) {
    const ChunkPlan plan(4 * KiB, DType::kFloat32, 4, {}, op);
    EXPECT_EQ(plan.spread(), 1u);
    ASSERT_EQ(plan.chunk_count(), 1u);
    EXPECT_EQ(plan.chunk(0).shard, op % 4);
    EXPECT_EQ(plan.chunk(0).length, 4 * KiB);
    for (uint32_t s = 0; s < 4; ++s) EXPECT_EQ(plan.chunks_on_shard(s), s == op % 4 ? 1u : 0u);
  }
  // 48 KiB, op 3: three ranges of 16 KiB on shards 3, 0, 1 (wrapping); 2 idle.
  const ChunkPlan three(48 * KiB, DType::kFloat32, 4, {}, 3);
  EXPECT_EQ(three.spread(), 3u);
  EXPECT_EQ(three.chunk(0).shard, 3u);
  EXPECT_EQ(three.chunk(0).offset, 0u);
  EXPECT_EQ(three.shard_offset(0), 16 * KiB);
  EXPECT_EQ(three.shard_offset(1), 32 * KiB);
  EXPECT_EQ(three.shard_bytes(2), 0u);
  EXPECT_EQ(three.first_chunk(2), three.chunk_count());
  // From S floors up every shard takes part, shard 0 first, whatever the op.
  const ChunkPlan all(64 * KiB, DType::kFloat32, 4, {}, 5);
  EXPECT_EQ(all.spread(), 4u);
  EXPECT_EQ(all.chunk(0).shard, 0u);
  // The override, or a floor of 0, spreads even 4 KiB over all S.
  EXPECT_EQ(ChunkPlan(4 * KiB, DType::kFloat32, 4, {.chunk_bytes = 512}, 1).spread(), 4u);
  EXPECT_EQ(ChunkPlan(4 * KiB, DType::kFloat32, 4, {.min_shard_bytes = 0}, 1).spread(), 4u);
}

TEST(ChunkPlan, HugeTensorsCountChunksWithoutOverflow) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const uint64_t nbytes = kMax - (kMax % 8);  // 2^64 - 8, whole float64 elements
  for (uint32_t shards : {1u, 3u, 4u}) {
    const ChunkPlan plan(nbytes, DType::kFloat64, shards);
    EXPECT_EQ(plan.full_chunk_bytes(), kPlanChunkCeilingBytes);
    uint64_t total = 0;
    for (uint32_t s = 0; s < shards; ++s) total += plan.chunks_on_shard(s);
    EXPECT_EQ(plan.chunk_count(), total);
    const ChunkExtent last = plan.chunk(plan.chunk_count() - 1);
    EXPECT_EQ(last.offset + last.length, nbytes);
    EXPECT_EQ(last.shard, shards - 1);
    const ChunkExtent first_of_last = plan.chunk(plan.first_chunk(shards - 1));
    EXPECT_EQ(first_of_last.offset, plan.shard_offset(shards - 1));
  }
}

using ChunkPlanDeathTest = ::testing::Test;

TEST_F(ChunkPlanDeathTest, RejectsBadArgumentsAsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(ChunkPlan(100, static_cast<DType>(0), 1), "TALLY_CHECK");
  EXPECT_DEATH(ChunkPlan(100, DType::kFloat32, 0), "TALLY_CHECK");
}

TEST_F(ChunkPlanDeathTest, ChunkIndexPastTheEndIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const ChunkPlan plan(4096 * 2, DType::kFloat32, 1, {.chunk_bytes = 4096});
  ASSERT_EQ(plan.chunk_count(), 2u);
  EXPECT_DEATH(plan.chunk(2), "TALLY_CHECK");
  const ChunkPlan empty(0, DType::kFloat32, 1);
  EXPECT_DEATH(empty.chunk(0), "TALLY_CHECK");
}

}  // namespace
}  // namespace tally
