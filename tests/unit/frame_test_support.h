// What the frame codec's tests share (frame_test.cc, frame_bounds_test.cc):
// every dtype, redop and kind, a valid header to start from, the raw
// little-endian field writer, and the checks on a decode's outcome.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "tally/protocol/dtype.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"

namespace tally::frame_testing {

inline constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();
inline constexpr std::array<DType, 6> kAllDTypes = {DType::kFloat32, DType::kFloat64,
                                                    DType::kFloat16, DType::kBFloat16,
                                                    DType::kInt32,   DType::kInt64};
inline constexpr std::array<RedOp, 2> kAllRedOps = {RedOp::kSum, RedOp::kAverage};
inline constexpr std::array<FrameKind, 4> kAllKinds = {
    FrameKind::kControl, FrameKind::kContribution, FrameKind::kResult, FrameKind::kPartial};

inline const FrameLimits kLimits{.max_data_bytes = 1 << 20};

inline Result<FrameHeader> decode(const EncodedHeader& bytes, const FrameLimits& limits = kLimits) {
  return decode_header(std::span<const std::byte, kFrameHeaderBytes>(bytes), limits);
}

// Writes `value` little-endian into bytes [offset, offset + size).
inline void put_le(EncodedHeader& bytes, size_t offset, size_t size, uint64_t value) {
  for (size_t i = 0; i < size; ++i) {
    bytes[offset + i] = static_cast<std::byte>((value >> (8 * i)) & 0xFF);
  }
}

inline uint64_t get_le(const EncodedHeader& bytes, size_t offset, size_t size) {
  uint64_t value = 0;
  for (size_t i = 0; i < size; ++i) {
    value |= static_cast<uint64_t>(std::to_integer<uint8_t>(bytes[offset + i])) << (8 * i);
  }
  return value;
}

// A valid contribution: 1000 float64 elements, chunk [80, 880).
inline FrameHeader valid_data_header(DType dtype = DType::kFloat64) {
  const uint64_t esize = dtype_size(dtype);
  FrameHeader h;
  h.kind = FrameKind::kContribution;
  h.dtype = dtype;
  h.redop = RedOp::kSum;
  h.rank = 3;
  h.job = job_id("frame-test");
  h.op = 42;
  h.count = 1000;
  h.offset = 10 * esize;
  h.chunk = 1;
  h.chunks_on_shard = 3;
  h.length = 100 * esize;
  return h;
}

inline void expect_same_header(const FrameHeader& want, const FrameHeader& got) {
  EXPECT_EQ(want.kind, got.kind);
  EXPECT_EQ(want.dtype, got.dtype);
  EXPECT_EQ(want.redop, got.redop);
  EXPECT_EQ(want.rank, got.rank);
  EXPECT_EQ(want.job, got.job);
  EXPECT_EQ(want.op, got.op);
  EXPECT_EQ(want.count, got.count);
  EXPECT_EQ(want.offset, got.offset);
  EXPECT_EQ(want.chunk, got.chunk);
  EXPECT_EQ(want.chunks_on_shard, got.chunks_on_shard);
  EXPECT_EQ(want.length, got.length);
}

// Decodes `bytes` and expects a clean error of `code` with a message.
inline void expect_rejected(const EncodedHeader& bytes, ErrorCode code,
                            const FrameLimits& limits = kLimits) {
  auto r = decode(bytes, limits);
  ASSERT_FALSE(r.is_ok()) << "accepted: " << describe(r.value());
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_FALSE(r.status().message().empty());
}

// What every header decode_header accepts must satisfy.
inline void expect_invariants(const FrameHeader& h, const FrameLimits& limits) {
  const auto kind = static_cast<uint8_t>(h.kind);
  ASSERT_GE(kind, 1);
  ASSERT_LE(kind, 5);
  if (h.kind == FrameKind::kControl) {
    EXPECT_LE(h.length, kMaxControlBytes);
    EXPECT_EQ(h.chunks_on_shard, 0u);
    return;
  }
  if (h.kind == FrameKind::kContribution || h.kind == FrameKind::kReplay) {
    EXPECT_GT(h.chunks_on_shard, 0u);
  }
  ASSERT_TRUE(is_known_dtype(static_cast<uint8_t>(h.dtype)));
  ASSERT_TRUE(is_known_redop(static_cast<uint8_t>(h.redop)));
  const uint64_t esize = dtype_size(h.dtype);
  EXPECT_GT(h.length, 0u);
  EXPECT_LE(h.length, limits.max_data_bytes);
  EXPECT_EQ(h.length % esize, 0u);
  EXPECT_EQ(h.offset % esize, 0u);
  // Checked in 128 bits so the test itself cannot overflow.
  const unsigned __int128 total = static_cast<unsigned __int128>(h.count) * esize;
  EXPECT_LE(total, static_cast<unsigned __int128>(kU64Max));
  EXPECT_LE(static_cast<unsigned __int128>(h.offset) + h.length, total);
}

}  // namespace tally::frame_testing
