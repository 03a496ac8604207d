// The 64-byte frame header codec: round trips, the documented byte layout,
// every rejection decode_header promises, hostile input, job ids, and the
// host:port parser used by every address option.
#include "tally/protocol/frame.h"

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/status.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {
namespace {

constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();

// decode_header only takes exactly 64 bytes: a short or unsized buffer is a
// compile error, so truncated input cannot reach it.
static_assert(
    std::is_invocable_v<decltype(&decode_header), std::span<const std::byte, kFrameHeaderBytes>,
                        const FrameLimits&>);
static_assert(
    !std::is_invocable_v<decltype(&decode_header),
                         std::span<const std::byte, kFrameHeaderBytes - 1>, const FrameLimits&>);
static_assert(
    !std::is_invocable_v<decltype(&decode_header), std::span<const std::byte>, const FrameLimits&>);
static_assert(
    !std::is_invocable_v<decltype(&decode_header),
                         const std::array<std::byte, kFrameHeaderBytes - 1>&, const FrameLimits&>);

constexpr std::array<DType, 6> kAllDTypes = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                             DType::kBFloat16, DType::kInt32,   DType::kInt64};
constexpr std::array<RedOp, 2> kAllRedOps = {RedOp::kSum, RedOp::kAverage};
constexpr std::array<FrameKind, 4> kAllKinds = {FrameKind::kControl, FrameKind::kContribution,
                                                FrameKind::kResult, FrameKind::kPartial};

const FrameLimits kLimits{.max_data_bytes = 1 << 20};

Result<FrameHeader> decode(const EncodedHeader& bytes, const FrameLimits& limits = kLimits) {
  return decode_header(std::span<const std::byte, kFrameHeaderBytes>(bytes), limits);
}

// Writes `value` little-endian into bytes [offset, offset + size).
void put_le(EncodedHeader& bytes, size_t offset, size_t size, uint64_t value) {
  for (size_t i = 0; i < size; ++i) {
    bytes[offset + i] = static_cast<std::byte>((value >> (8 * i)) & 0xFF);
  }
}

uint64_t get_le(const EncodedHeader& bytes, size_t offset, size_t size) {
  uint64_t value = 0;
  for (size_t i = 0; i < size; ++i) {
    value |= static_cast<uint64_t>(std::to_integer<uint8_t>(bytes[offset + i])) << (8 * i);
  }
  return value;
}

// A valid contribution: 1000 float64 elements, chunk [80, 880).
FrameHeader valid_data_header(DType dtype = DType::kFloat64) {
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

void expect_same_header(const FrameHeader& want, const FrameHeader& got) {
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
void expect_rejected(const EncodedHeader& bytes, ErrorCode code,
                     const FrameLimits& limits = kLimits) {
  auto r = decode(bytes, limits);
  ASSERT_FALSE(r.is_ok()) << "accepted: " << describe(r.value());
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_FALSE(r.status().message().empty());
}

// What every header decode_header accepts must satisfy.
void expect_invariants(const FrameHeader& h, const FrameLimits& limits) {
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

// ---------------------------------------------------------------------------
// Round trips over every kind x dtype x redop.

struct RoundTripCase {
  FrameKind kind;
  DType dtype;
  RedOp redop;
};

std::string round_trip_name(const ::testing::TestParamInfo<RoundTripCase>& info) {
  const auto& c = info.param;
  std::string kind = c.kind == FrameKind::kControl        ? "Control"
                     : c.kind == FrameKind::kContribution ? "Contribution"
                     : c.kind == FrameKind::kPartial      ? "Partial"
                                                          : "Result";
  return kind + "_" + std::string(dtype_name(c.dtype)) + "_" + std::string(redop_name(c.redop));
}

std::vector<RoundTripCase> all_round_trip_cases() {
  std::vector<RoundTripCase> out;
  for (FrameKind k : kAllKinds) {
    for (DType d : kAllDTypes) {
      for (RedOp r : kAllRedOps) out.push_back({k, d, r});
    }
  }
  return out;
}

class FrameRoundTripTest : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(FrameRoundTripTest, DecodeOfEncodeGivesBackEveryField) {
  const auto& c = GetParam();
  const uint64_t esize = dtype_size(c.dtype);
  FrameHeader h;
  h.kind = c.kind;
  h.dtype = c.dtype;
  h.redop = c.redop;
  h.rank = c.kind == FrameKind::kResult ? kReducerRank : 0x01020304;
  h.job = job_id("round-trip");
  h.op = 0x1122334455667788ULL;
  h.count = 0x0000123456789ABCULL;
  h.offset = 0x100000 * esize;
  h.chunk = 0xA1B2C3D4;
  h.chunks_on_shard = c.kind == FrameKind::kControl ? 0 : 0xB1B2B3B4;
  h.length = c.kind == FrameKind::kControl ? kMaxControlBytes : 4096 * esize;

  auto r = decode(encode_header(h));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  if (c.kind == FrameKind::kControl) {
    // dtype and redop describe data payloads; a control frame carries none,
    // so only the other fields are promised back.
    FrameHeader want = h;
    want.dtype = r->dtype;
    want.redop = r->redop;
    expect_same_header(want, *r);
  } else {
    expect_same_header(h, *r);
    // Encoding is deterministic: a decoded data header re-encodes to the
    // same bytes.
    EXPECT_EQ(encode_header(*r), encode_header(h));
  }
}

INSTANTIATE_TEST_SUITE_P(AllKindsDTypesRedOps, FrameRoundTripTest,
                         ::testing::ValuesIn(all_round_trip_cases()), round_trip_name);

TEST(FrameRoundTrip, ExtremeFieldValuesSurvive) {
  FrameHeader h = valid_data_header(DType::kInt32);
  h.rank = kReducerRank;
  h.job = kU64Max;
  h.op = kU64Max;
  h.chunk = std::numeric_limits<uint32_t>::max();
  h.count = kU64Max / 4;  // the largest count whose byte size fits in 64 bits
  h.length = 4;
  h.offset = h.count * 4 - h.length;  // the very last element
  auto r = decode(encode_header(h));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  expect_same_header(h, *r);
}

// ---------------------------------------------------------------------------
// Byte layout, as documented in frame.h.

TEST(FrameLayout, FieldsSitAtDocumentedOffsetsLittleEndian) {
  FrameHeader h;
  h.kind = FrameKind::kResult;
  h.dtype = DType::kInt64;
  h.redop = RedOp::kAverage;
  h.rank = 0x11223344;
  h.job = 0x0102030405060708ULL;
  h.op = 0x1112131415161718ULL;
  h.count = 0x2122232425262728ULL;
  h.offset = 0x3132333435363738ULL;
  h.chunk = 0x41424344;
  h.chunks_on_shard = 0x4A4B4C4D;
  h.length = 0x5152535455565758ULL;
  const EncodedHeader b = encode_header(h);
  ASSERT_EQ(b.size(), 64u);

  auto byte = [&](size_t i) { return std::to_integer<uint8_t>(b[i]); };
  // Magic: the ASCII letters "TALY" in memory order.
  EXPECT_EQ(byte(0), 'T');
  EXPECT_EQ(byte(1), 'A');
  EXPECT_EQ(byte(2), 'L');
  EXPECT_EQ(byte(3), 'Y');
  EXPECT_EQ(get_le(b, 0, 4), 0x594C4154u);
  // Version 4, little-endian.
  EXPECT_EQ(byte(4), 0x04);
  EXPECT_EQ(byte(5), 0x00);
  EXPECT_EQ(byte(6), 3);   // kind: result
  EXPECT_EQ(byte(7), 6);   // dtype: int64
  EXPECT_EQ(byte(8), 2);   // redop: average
  EXPECT_EQ(byte(9), 0);   // reserved
  EXPECT_EQ(byte(10), 0);  // flags
  EXPECT_EQ(byte(11), 0);
  // rank: least significant byte first.
  EXPECT_EQ(byte(12), 0x44);
  EXPECT_EQ(byte(13), 0x33);
  EXPECT_EQ(byte(14), 0x22);
  EXPECT_EQ(byte(15), 0x11);
  // job
  EXPECT_EQ(byte(16), 0x08);
  EXPECT_EQ(byte(23), 0x01);
  EXPECT_EQ(get_le(b, 16, 8), h.job);
  // op
  EXPECT_EQ(byte(24), 0x18);
  EXPECT_EQ(byte(31), 0x11);
  EXPECT_EQ(get_le(b, 24, 8), h.op);
  // count
  EXPECT_EQ(byte(32), 0x28);
  EXPECT_EQ(byte(39), 0x21);
  EXPECT_EQ(get_le(b, 32, 8), h.count);
  // offset
  EXPECT_EQ(byte(40), 0x38);
  EXPECT_EQ(byte(47), 0x31);
  EXPECT_EQ(get_le(b, 40, 8), h.offset);
  // chunk
  EXPECT_EQ(byte(48), 0x44);
  EXPECT_EQ(byte(51), 0x41);
  EXPECT_EQ(get_le(b, 48, 4), h.chunk);
  // chunks on this shard
  EXPECT_EQ(byte(52), 0x4D);
  EXPECT_EQ(byte(55), 0x4A);
  EXPECT_EQ(get_le(b, 52, 4), h.chunks_on_shard);
  // length
  EXPECT_EQ(byte(56), 0x58);
  EXPECT_EQ(byte(63), 0x51);
  EXPECT_EQ(get_le(b, 56, 8), h.length);
}

TEST(FrameLayout, EnumWireValuesAreStable) {
  EXPECT_EQ(static_cast<uint8_t>(FrameKind::kControl), 1);
  EXPECT_EQ(static_cast<uint8_t>(FrameKind::kContribution), 2);
  EXPECT_EQ(static_cast<uint8_t>(FrameKind::kResult), 3);
  EXPECT_EQ(static_cast<uint8_t>(FrameKind::kPartial), 4);
  EXPECT_EQ(static_cast<uint8_t>(DType::kFloat32), 1);
  EXPECT_EQ(static_cast<uint8_t>(DType::kFloat64), 2);
  EXPECT_EQ(static_cast<uint8_t>(DType::kFloat16), 3);
  EXPECT_EQ(static_cast<uint8_t>(DType::kBFloat16), 4);
  EXPECT_EQ(static_cast<uint8_t>(DType::kInt32), 5);
  EXPECT_EQ(static_cast<uint8_t>(DType::kInt64), 6);
  EXPECT_EQ(static_cast<uint8_t>(RedOp::kSum), 1);
  EXPECT_EQ(static_cast<uint8_t>(RedOp::kAverage), 2);
}

// ---------------------------------------------------------------------------
// Rejections.

TEST(FrameDecode, AcceptsTheValidBaseHeader) {
  // The rejection tests below each break one field of this header.
  auto r = decode(encode_header(valid_data_header()));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  expect_same_header(valid_data_header(), *r);
}

TEST(FrameDecode, RejectsBadMagic) {
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("magic byte " + std::to_string(i));
    EncodedHeader b = encode_header(valid_data_header());
    b[i] ^= std::byte{0x20};
    expect_rejected(b, ErrorCode::kProtocol);
  }
  // "TALY" written big-endian, as a host-endian encoder on the wrong machine
  // would, is not the magic.
  EncodedHeader b = encode_header(valid_data_header());
  put_le(b, 0, 4, 0x54414C59);
  expect_rejected(b, ErrorCode::kProtocol);
  // An all-zero buffer.
  expect_rejected(EncodedHeader{}, ErrorCode::kProtocol);
}

TEST(FrameDecode, RejectsOtherVersionsWithVersionMismatchNamingBoth) {
  for (uint64_t version : {0ULL, 1ULL, 2ULL, 3ULL, 5ULL, 0x1234ULL, 0xFFFFULL, 0x0400ULL}) {
    SCOPED_TRACE("version " + std::to_string(version));
    EncodedHeader b = encode_header(valid_data_header());
    put_le(b, 4, 2, version);
    auto r = decode(b);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kVersionMismatch) << r.status().to_string();
    const std::string& msg = r.status().message();
    EXPECT_NE(msg.find(std::to_string(version)), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(kProtocolVersion)), std::string::npos) << msg;
  }
}

TEST(FrameDecode, VersionMismatchWinsOverOtherwiseUnknownFields) {
  // A future version may use fields and values this one does not know; the
  // peer must learn it is a version problem, not a malformed frame.
  EncodedHeader b = encode_header(valid_data_header());
  put_le(b, 4, 2, kProtocolVersion + 1);
  put_le(b, 6, 1, 0x7F);  // kind
  put_le(b, 10, 2, 0x1);  // flags
  expect_rejected(b, ErrorCode::kVersionMismatch);
}

TEST(FrameDecode, RejectsUnknownKind) {
  for (uint64_t kind : {0ULL, 6ULL, 0x80ULL, 0xFFULL}) {
    SCOPED_TRACE("kind " + std::to_string(kind));
    EncodedHeader b = encode_header(valid_data_header());
    put_le(b, 6, 1, kind);
    expect_rejected(b, ErrorCode::kProtocol);
  }
}

TEST(FrameDecode, RejectsUnknownDTypeInDataFrames) {
  for (FrameKind kind : {FrameKind::kContribution, FrameKind::kResult, FrameKind::kPartial}) {
    for (uint64_t dtype : {0ULL, 7ULL, 0x80ULL, 0xFFULL}) {
      SCOPED_TRACE("dtype " + std::to_string(dtype));
      FrameHeader h = valid_data_header();
      h.kind = kind;
      EncodedHeader b = encode_header(h);
      put_le(b, 7, 1, dtype);
      expect_rejected(b, ErrorCode::kProtocol);
    }
  }
}

TEST(FrameDecode, RejectsUnknownRedOpInDataFrames) {
  for (FrameKind kind : {FrameKind::kContribution, FrameKind::kResult, FrameKind::kPartial}) {
    for (uint64_t redop : {0ULL, 3ULL, 0x80ULL, 0xFFULL}) {
      SCOPED_TRACE("redop " + std::to_string(redop));
      FrameHeader h = valid_data_header();
      h.kind = kind;
      EncodedHeader b = encode_header(h);
      put_le(b, 8, 1, redop);
      expect_rejected(b, ErrorCode::kProtocol);
    }
  }
}

TEST(FrameDecode, ContributionsNeedTheirShardsChunkCountAndControlFramesHaveNone) {
  FrameHeader h = valid_data_header();
  h.chunks_on_shard = 0;
  expect_rejected(encode_header(h), ErrorCode::kProtocol);
  // Results and partials echo the contribution's count; 0 is not checked there.
  for (FrameKind kind : {FrameKind::kResult, FrameKind::kPartial}) {
    h.kind = kind;
    EXPECT_TRUE(decode(encode_header(h)).is_ok());
  }
  h.chunks_on_shard = 0xFFFFFFFF;
  h.kind = FrameKind::kContribution;
  auto r = decode(encode_header(h));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->chunks_on_shard, 0xFFFFFFFFu);
  FrameHeader c;
  c.kind = FrameKind::kControl;
  c.chunks_on_shard = 1;
  expect_rejected(encode_header(c), ErrorCode::kProtocol);
}

TEST(FrameDecode, RejectsAnyNonzeroReservedOrFlagBit) {
  // Byte 9 (reserved), 10-11 (flags): every single bit.
  for (size_t offset : {9, 10, 11}) {
    for (int bit = 0; bit < 8; ++bit) {
      SCOPED_TRACE("byte " + std::to_string(offset) + " bit " + std::to_string(bit));
      for (FrameKind kind : kAllKinds) {
        // The final-result bit and the round are a partial's (below).
        if (kind == FrameKind::kPartial && ((offset == 10 && bit == 2) || offset == 9)) continue;
        FrameHeader h = valid_data_header();
        h.kind = kind;
        EncodedHeader b = encode_header(h);
        b[offset] = static_cast<std::byte>(1u << bit);
        expect_rejected(b, ErrorCode::kProtocol);
      }
    }
  }
}

TEST(FrameDecode, AccumulatorFlagCarriesFloat32PartialsOfSixteenBitOps) {
  // A bfloat16 partial of elements [10, 110) carries 4 bytes per element.
  FrameHeader h = valid_data_header(DType::kBFloat16);
  h.kind = FrameKind::kPartial;
  h.flags = kFrameFlagAccumulators;
  h.length = 100 * 4;
  auto r = decode(encode_header(h));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->flags, kFrameFlagAccumulators);
  EXPECT_EQ(r->length, 400u);
  // Its extent counts elements: the last 990 elements fit, 991 do not.
  h.offset = 10 * 2;
  h.length = 990 * 4;
  EXPECT_TRUE(decode(encode_header(h)).is_ok());
  h.length = 991 * 4;
  expect_rejected(encode_header(h), ErrorCode::kProtocol);
  // Not a multiple of 4 bytes.
  h.length = 102;
  expect_rejected(encode_header(h), ErrorCode::kProtocol);
  // Only on partials of 16-bit ops.
  FrameHeader contribution = valid_data_header(DType::kBFloat16);
  contribution.flags = kFrameFlagAccumulators;
  expect_rejected(encode_header(contribution), ErrorCode::kProtocol);
  FrameHeader wide = valid_data_header(DType::kFloat32);
  wide.kind = FrameKind::kPartial;
  wide.flags = kFrameFlagAccumulators;
  expect_rejected(encode_header(wide), ErrorCode::kProtocol);
}

TEST(FrameDecode, WideResultFlagAsksForFloat32ResultsOfSixteenBitContributions) {
  // Asked for on a 16-bit contribution...
  FrameHeader ask = valid_data_header(DType::kBFloat16);
  ask.flags = kFrameFlagWideResult;
  auto r = decode(encode_header(ask));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->flags, kFrameFlagWideResult);
  // ... and answered by a result carrying accumulators, 4 bytes per element.
  FrameHeader answer = valid_data_header(DType::kBFloat16);
  answer.kind = FrameKind::kResult;
  answer.flags = kFrameFlagAccumulators;
  answer.length = 100 * 4;
  ASSERT_TRUE(decode(encode_header(answer)).is_ok());
  // A partial of such a chunk carries it beside its accumulators.
  FrameHeader partial = answer;
  partial.kind = FrameKind::kPartial;
  partial.flags = kFrameFlagAccumulators | kFrameFlagWideResult;
  ASSERT_TRUE(decode(encode_header(partial)).is_ok());
  // Not on a float32 contribution, a result, a partial without
  // accumulators, or a contribution with them.
  FrameHeader f32 = valid_data_header(DType::kFloat32);
  f32.flags = kFrameFlagWideResult;
  expect_rejected(encode_header(f32), ErrorCode::kProtocol);
  for (FrameKind kind : {FrameKind::kResult, FrameKind::kPartial}) {
    FrameHeader other = ask;
    other.kind = kind;
    expect_rejected(encode_header(other), ErrorCode::kProtocol);
  }
  FrameHeader result_both = answer;
  result_both.flags = kFrameFlagWideResult | kFrameFlagAccumulators;
  expect_rejected(encode_header(result_both), ErrorCode::kProtocol);
  FrameHeader both = ask;
  both.flags = kFrameFlagWideResult | kFrameFlagAccumulators;
  expect_rejected(encode_header(both), ErrorCode::kProtocol);
  // A float32 result never carries accumulators.
  FrameHeader f32_result = valid_data_header(DType::kFloat32);
  f32_result.kind = FrameKind::kResult;
  f32_result.flags = kFrameFlagAccumulators;
  expect_rejected(encode_header(f32_result), ErrorCode::kProtocol);
}

TEST(FrameDecode, FinalFlagMarksAPartialThatCarriesAChunksResult) {
  // A replica's final result of a float32 chunk, and of a bfloat16 chunk
  // whose workers asked for float32 results (as the result carries them).
  FrameHeader final_f32 = valid_data_header(DType::kFloat32);
  final_f32.kind = FrameKind::kPartial;
  final_f32.flags = kFrameFlagFinal;
  auto r = decode(encode_header(final_f32));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->flags, kFrameFlagFinal);
  FrameHeader final_wide = valid_data_header(DType::kBFloat16);
  final_wide.kind = FrameKind::kPartial;
  final_wide.flags = kFrameFlagFinal | kFrameFlagAccumulators | kFrameFlagWideResult;
  final_wide.length = 100 * 4;
  ASSERT_TRUE(decode(encode_header(final_wide)).is_ok());
  // On no other kind.
  for (FrameKind kind :
       {FrameKind::kContribution, FrameKind::kResult, FrameKind::kReplay, FrameKind::kControl}) {
    FrameHeader other = final_f32;
    other.kind = kind;
    expect_rejected(encode_header(other), ErrorCode::kProtocol);
  }
}

TEST(FrameDecode, APartialCarriesItsRoundAndNoOtherKindDoes) {
  FrameHeader partial = valid_data_header(DType::kFloat32);
  partial.kind = FrameKind::kPartial;
  partial.round = 0xAB;
  EncodedHeader b = encode_header(partial);
  EXPECT_EQ(get_le(b, 9, 1), 0xABu);
  auto r = decode(b);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->round, 0xAB);
  for (FrameKind kind :
       {FrameKind::kContribution, FrameKind::kResult, FrameKind::kReplay, FrameKind::kControl}) {
    FrameHeader other = partial;
    other.kind = kind;
    expect_rejected(encode_header(other), ErrorCode::kProtocol);
  }
}

TEST(FrameDecode, ReplayCarriesAResultAsItCameWithItsShardsChunkCount) {
  // A replay of a float32 result, and of a bfloat16 op's float32 results.
  FrameHeader replay = valid_data_header(DType::kFloat32);
  replay.kind = FrameKind::kReplay;
  auto r = decode(encode_header(replay));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->kind, FrameKind::kReplay);
  FrameHeader wide = valid_data_header(DType::kBFloat16);
  wide.kind = FrameKind::kReplay;
  wide.flags = kFrameFlagAccumulators;
  wide.length = 100 * 4;
  ASSERT_TRUE(decode(encode_header(wide)).is_ok());
  // Like a contribution, it names its shard's chunk count; it never asks
  // for float32 results (it is one), and a float32 op has no accumulators.
  FrameHeader no_count = replay;
  no_count.chunks_on_shard = 0;
  expect_rejected(encode_header(no_count), ErrorCode::kProtocol);
  FrameHeader asks = wide;
  asks.flags = kFrameFlagWideResult | kFrameFlagAccumulators;
  expect_rejected(encode_header(asks), ErrorCode::kProtocol);
  FrameHeader f32 = replay;
  f32.flags = kFrameFlagAccumulators;
  expect_rejected(encode_header(f32), ErrorCode::kProtocol);
}

// A peer's string shortened for an error message stays valid UTF-8 (a
// proto3 string that is not would make the receiver refuse the message).
TEST(Utf8Prefix, NeverCutsACharacter) {
  const std::string text = "ab\xc3\xa9\xe2\x82\xac";  // "ab", e-acute (2 bytes), euro (3 bytes)
  EXPECT_EQ(utf8_prefix(text, 100), text);
  EXPECT_EQ(utf8_prefix(text, 7), text);
  EXPECT_EQ(utf8_prefix(text, 6), "ab\xc3\xa9");
  EXPECT_EQ(utf8_prefix(text, 5), "ab\xc3\xa9");
  EXPECT_EQ(utf8_prefix(text, 4), "ab\xc3\xa9");
  EXPECT_EQ(utf8_prefix(text, 3), "ab");
  EXPECT_EQ(utf8_prefix(text, 2), "ab");
  EXPECT_EQ(utf8_prefix(text, 0), "");
  wire::Control m;
  m.mutable_goodbye()->set_reason(utf8_prefix(text, 5));
  const std::string bytes = m.SerializeAsString();
  EXPECT_TRUE(parse_control(std::as_bytes(std::span(bytes))).is_ok());
}

TEST(FrameDecode, ControlPayloadUpToTheLimitIsAcceptedAndOneMoreIsNot) {
  FrameHeader h;
  h.kind = FrameKind::kControl;
  h.length = kMaxControlBytes;
  ASSERT_TRUE(decode(encode_header(h)).is_ok());
  h.length = 0;  // an empty control message is allowed
  ASSERT_TRUE(decode(encode_header(h)).is_ok());
  h.length = kMaxControlBytes + 1;
  expect_rejected(encode_header(h), ErrorCode::kProtocol);
  h.length = kU64Max;
  expect_rejected(encode_header(h), ErrorCode::kProtocol);
}

TEST(FrameDecode, ControlLimitDoesNotDependOnDataLimit) {
  FrameHeader h;
  h.kind = FrameKind::kControl;
  h.length = kMaxControlBytes + 1;
  expect_rejected(encode_header(h), ErrorCode::kProtocol, FrameLimits{.max_data_bytes = kU64Max});
}

TEST(FrameDecode, DataPayloadUpToTheLimitIsAcceptedAndOneElementMoreIsNot) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const uint64_t esize = dtype_size(dtype);
    const FrameLimits limits{.max_data_bytes = 4096};
    FrameHeader h = valid_data_header(dtype);
    h.count = 1 << 20;
    h.offset = 0;
    h.length = 4096;
    auto ok = decode(encode_header(h), limits);
    ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
    h.length = 4096 + esize;
    expect_rejected(encode_header(h), ErrorCode::kProtocol, limits);
    h.length = kU64Max - (kU64Max % esize);
    expect_rejected(encode_header(h), ErrorCode::kProtocol, limits);
  }
}

TEST(FrameDecode, ZeroDataLimitRejectsEveryDataFrame) {
  // The default FrameLimits: a receiver that forgot to set a limit accepts
  // no data rather than any size.
  expect_rejected(encode_header(valid_data_header()), ErrorCode::kProtocol, FrameLimits{});
}

TEST(FrameDecode, RejectsEmptyDataFrame) {
  for (FrameKind kind : {FrameKind::kContribution, FrameKind::kResult, FrameKind::kPartial}) {
    FrameHeader h = valid_data_header();
    h.kind = kind;
    h.length = 0;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
  }
}

TEST(FrameDecode, RejectsOffsetOrLengthNotAMultipleOfTheElementSize) {
  for (DType dtype : kAllDTypes) {
    const uint64_t esize = dtype_size(dtype);
    for (uint64_t off = 1; off < esize; ++off) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " +" + std::to_string(off));
      FrameHeader h = valid_data_header(dtype);
      h.offset += off;
      expect_rejected(encode_header(h), ErrorCode::kProtocol);
      h = valid_data_header(dtype);
      h.length += off;
      expect_rejected(encode_header(h), ErrorCode::kProtocol);
      h = valid_data_header(dtype);
      h.length -= off;
      expect_rejected(encode_header(h), ErrorCode::kProtocol);
    }
  }
}

TEST(FrameDecode, RejectsCountWhoseByteSizeOverflows) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const uint64_t esize = dtype_size(dtype);
    FrameHeader h = valid_data_header(dtype);
    h.offset = 0;
    h.length = esize;
    h.count = kU64Max / esize + 1;  // count * esize wraps to a small number
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
    h.count = kU64Max;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
    // The largest count that still fits is fine.
    h.count = kU64Max / esize;
    auto r = decode(encode_header(h));
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  }
}

TEST(FrameDecode, ChunkEndingExactlyAtTheOpsEndIsAccepted) {
  for (DType dtype : kAllDTypes) {
    const uint64_t esize = dtype_size(dtype);
    FrameHeader h = valid_data_header(dtype);
    h.count = 1000;
    h.length = 100 * esize;
    h.offset = h.count * esize - h.length;
    auto r = decode(encode_header(h));
    EXPECT_TRUE(r.is_ok()) << dtype_name(dtype) << ": " << r.status().to_string();
  }
}

TEST(FrameDecode, RejectsChunkOutsideTheOpsExtent) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const uint64_t esize = dtype_size(dtype);
    const uint64_t total = 1000 * esize;
    FrameHeader h = valid_data_header(dtype);
    h.count = 1000;

    // One element past the end.
    h.length = 100 * esize;
    h.offset = total - h.length + esize;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
    // Starting exactly at the end.
    h.offset = total;
    h.length = esize;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
    // Far past the end.
    h.offset = total * 1000;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
    // A chunk longer than the whole op.
    h.offset = 0;
    h.length = total + esize;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
    // An op of zero elements has no valid chunk.
    h.count = 0;
    h.length = esize;
    expect_rejected(encode_header(h), ErrorCode::kProtocol);
  }
}

TEST(FrameDecode, RejectsChunkWhoseEndOverflows) {
  // offset + length wraps past 2^64 to a small number that would pass a
  // naive `offset + length <= total` check.
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const uint64_t esize = dtype_size(dtype);
    const uint64_t top = kU64Max - (kU64Max % esize);  // 2^64 - esize: aligned, at the top
    ASSERT_EQ(top % esize, 0u);
    FrameHeader h = valid_data_header(dtype);
    const FrameLimits limits{.max_data_bytes = kU64Max};

    h.count = 1000;
    h.offset = top;
    h.length = 2 * esize;  // offset + length wraps to esize or less
    expect_rejected(encode_header(h), ErrorCode::kProtocol, limits);

    h.offset = esize;
    h.length = top;  // wraps the other way round
    expect_rejected(encode_header(h), ErrorCode::kProtocol, limits);

    // Largest op: count * esize just fits, the chunk starts at the last
    // element and runs one element past it.
    h.count = kU64Max / esize;
    h.offset = h.count * esize - esize;
    h.length = 2 * esize;
    expect_rejected(encode_header(h), ErrorCode::kProtocol, limits);
    h.length = esize;
    auto r = decode(encode_header(h), limits);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  }
}

// ---------------------------------------------------------------------------
// Hostile input.

TEST(FrameDecodeHostile, RandomBuffersNeverCrashAndAcceptedHeadersHoldTheInvariants) {
  std::mt19937_64 rng(0x7A11'5EED);
  const FrameLimits limits{.max_data_bytes = 1 << 16};
  int accepted_data = 0;
  int accepted_control = 0;
  for (int iter = 0; iter < 200000; ++iter) {
    EncodedHeader b;
    for (size_t i = 0; i < b.size(); i += 8) put_le(b, i, 8, rng());
    // Pure noise almost never gets past the magic; most buffers get a valid
    // prefix so the later checks see hostile values too.
    const uint64_t shape = rng() % 8;
    if (shape >= 1) {
      put_le(b, 0, 4, kFrameMagic);
      put_le(b, 4, 2, shape == 1 ? rng() % 4 : kProtocolVersion);
    }
    if (shape >= 2) {
      put_le(b, 6, 1, rng() % 6);  // kind 0..5
      put_le(b, 7, 1, rng() % 8);  // dtype 0..7
      put_le(b, 8, 1, rng() % 4);  // redop 0..3
      if (rng() % 8 != 0) {
        put_le(b, 9, 1, 0);
        put_le(b, 10, 2, 0);
        put_le(b, 52, 4, rng() % 4);
      }
    }
    if (shape >= 4) {
      // Small, element-aligned or near-boundary numbers for count, offset
      // and length.
      auto pick = [&]() -> uint64_t {
        switch (rng() % 5) {
          case 0:
            return rng() % 64;
          case 1:
            return (rng() % 1024) * 8;
          case 2:
            return rng() % (1 << 17);
          case 3:
            return kU64Max - rng() % 64;
          default:
            return rng();
        }
      };
      put_le(b, 32, 8, pick());
      put_le(b, 40, 8, pick());
      put_le(b, 56, 8, pick());
      // An op large enough that many chunks fit in it.
      if (shape >= 6) put_le(b, 32, 8, rng() % (1 << 20));
    }

    auto r = decode(b, limits);
    if (!r.is_ok()) {
      ASSERT_TRUE(r.status().code() == ErrorCode::kProtocol ||
                  r.status().code() == ErrorCode::kVersionMismatch)
          << r.status().to_string();
      ASSERT_FALSE(r.status().message().empty());
      continue;
    }
    SCOPED_TRACE("iteration " + std::to_string(iter) + ": " + describe(*r));
    ASSERT_NO_FATAL_FAILURE(expect_invariants(*r, limits));
    EXPECT_EQ(get_le(b, 0, 4), kFrameMagic);
    EXPECT_EQ(get_le(b, 4, 2), kProtocolVersion);
    if (r->kind == FrameKind::kControl) {
      ++accepted_control;
    } else {
      ++accepted_data;
      // Every byte of an accepted data header is meaningful: re-encoding
      // what was decoded gives back the input.
      ASSERT_EQ(encode_header(*r), b);
    }
  }
  // The generator must actually reach the accepting paths, or this test
  // checks nothing.
  EXPECT_GT(accepted_data, 500);
  EXPECT_GT(accepted_control, 1000);
}

TEST(FrameDecodeHostile, EverySingleByteValueAtEveryOffsetDecodesOrFailsCleanly) {
  const FrameHeader base = valid_data_header(DType::kFloat32);
  const EncodedHeader good = encode_header(base);
  for (size_t offset = 0; offset < kFrameHeaderBytes; ++offset) {
    for (unsigned value = 0; value < 256; ++value) {
      EncodedHeader b = good;
      b[offset] = static_cast<std::byte>(value);
      const bool unchanged = b == good;
      auto r = decode(b);
      SCOPED_TRACE("byte " + std::to_string(offset) + " = " + std::to_string(value));
      if (unchanged) {
        ASSERT_TRUE(r.is_ok());
        continue;
      }
      if (r.is_ok()) {
        ASSERT_NO_FATAL_FAILURE(expect_invariants(*r, kLimits));
      } else {
        ASSERT_TRUE(r.status().code() == ErrorCode::kProtocol ||
                    r.status().code() == ErrorCode::kVersionMismatch)
            << r.status().to_string();
        ASSERT_FALSE(r.status().message().empty());
      }
      // Which outcome each region must give.
      if (offset < 4 || offset == 9 || offset == 10 || offset == 11) {
        ASSERT_FALSE(r.is_ok()) << "magic/reserved/flags change accepted";
        EXPECT_EQ(r.status().code(), ErrorCode::kProtocol);
      } else if (offset == 4 || offset == 5) {
        ASSERT_FALSE(r.is_ok()) << "version change accepted";
        EXPECT_EQ(r.status().code(), ErrorCode::kVersionMismatch);
      } else if (offset >= 52 && offset < 56) {
        // chunks on shard: any value but 0 (a contribution needs it).
        EXPECT_EQ(r.is_ok(), get_le(b, 52, 4) != 0);
        if (r.is_ok()) {
          EXPECT_EQ(r->chunks_on_shard, get_le(b, 52, 4));
        }
      } else if ((offset >= 12 && offset < 32) || (offset >= 48 && offset < 52)) {
        // rank, job, op, chunk: any value is valid and comes back as sent.
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        EXPECT_EQ(r->rank, get_le(b, 12, 4));
        EXPECT_EQ(r->job, get_le(b, 16, 8));
        EXPECT_EQ(r->op, get_le(b, 24, 8));
        EXPECT_EQ(r->chunk, get_le(b, 48, 4));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// job_id: FNV-1a 64, checked against published vectors and an independent
// implementation.

constexpr uint64_t reference_fnv1a64(std::string_view s) {
  constexpr uint64_t kOffsetBasis = 14695981039346656037ULL;
  constexpr uint64_t kPrime = 1099511628211ULL;  // 2^40 + 2^8 + 0xb3
  uint64_t h = kOffsetBasis;
  for (size_t i = 0; i < s.size(); ++i) {
    h = (h ^ static_cast<unsigned char>(s[i])) * kPrime;
  }
  return h;
}

TEST(JobId, MatchesPublishedFnv1a64Vectors) {
  EXPECT_EQ(job_id(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(job_id("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(job_id("foobar"), 0x85944171f73967e8ULL);
}

TEST(JobId, TreatsHighBitBytesAsUnsigned) {
  // A signed-char implementation would sign-extend 0xFF before the xor.
  EXPECT_EQ(job_id("\xff"), 0xaf64724c8602eb6eULL);
  EXPECT_EQ(job_id("job-\xc3\xbc"), reference_fnv1a64("job-\xc3\xbc"));
}

TEST(JobId, MatchesIndependentImplementationAndIsStable) {
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 1000; ++i) {
    std::string name(rng() % 40, '\0');
    for (char& c : name) c = static_cast<char>(rng() & 0xFF);
    ASSERT_EQ(job_id(name), reference_fnv1a64(name)) << "length " << name.size();
    ASSERT_EQ(job_id(name), job_id(std::string(name)));
  }
  EXPECT_EQ(job_id("job-0"), 0xf2c2e9802008f6a9ULL);
  EXPECT_NE(job_id("job-0"), job_id("job-1"));
  // Embedded NULs count: the name is a view, not a C string.
  EXPECT_NE(job_id(std::string_view("a\0b", 3)), job_id("a"));
}

// ---------------------------------------------------------------------------
// describe

TEST(FrameDescribe, NamesKindAndNumbers) {
  FrameHeader h = valid_data_header();
  const std::string s = describe(h);
  EXPECT_EQ(s.rfind("contribution", 0), 0u) << s;
  EXPECT_NE(s.find("op=42"), std::string::npos) << s;
  EXPECT_NE(s.find("chunk=1"), std::string::npos) << s;
  EXPECT_NE(s.find("rank=3"), std::string::npos) << s;
  h.kind = FrameKind::kResult;
  EXPECT_EQ(describe(h).rfind("result", 0), 0u);
  h.kind = FrameKind::kControl;
  EXPECT_EQ(describe(h).rfind("control", 0), 0u);
}

// ---------------------------------------------------------------------------
// parse_host_port

TEST(ParseHostPort, AcceptsIpv4Address) {
  auto r = parse_host_port("127.0.0.1:7000");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->host, "127.0.0.1");
  EXPECT_EQ(r->port, 7000);
  EXPECT_EQ(r->to_string(), "127.0.0.1:7000");
}

TEST(ParseHostPort, AcceptsBracketedIpv6Address) {
  auto r = parse_host_port("[::1]:7000");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->host, "::1");
  EXPECT_EQ(r->port, 7000);
  EXPECT_EQ(r->to_string(), "[::1]:7000");
}

TEST(ParseHostPort, AcceptsHostNameWithPortZeroAndMaxPort) {
  auto r = parse_host_port("host:0");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->host, "host");
  EXPECT_EQ(r->port, 0);
  auto max = parse_host_port("reducer-0.tally.svc:65535");
  ASSERT_TRUE(max.is_ok()) << max.status().to_string();
  EXPECT_EQ(max->host, "reducer-0.tally.svc");
  EXPECT_EQ(max->port, 65535);
}

TEST(ParseHostPort, RejectsMalformedAddressesWithInvalidArgument) {
  for (std::string_view text :
       {"nohost", ":1", "h:70000", "h:65536", "h:x", "h:", "h:-1", "h:7000x", "h: 7000",
        "[::1]7000", "[::1]", "[::1", "[]:7000", "", ":"}) {
    SCOPED_TRACE(std::string(text));
    auto r = parse_host_port(text);
    ASSERT_FALSE(r.is_ok()) << r->host << " port " << r->port;
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(std::string(text)), std::string::npos)
        << r.status().message();
  }
}

}  // namespace
}  // namespace tally
