// The 64-byte frame header codec: round trips, the documented byte layout,
// every rule decode_header applies to a field, and describe(). What it
// bounds (payload sizes, chunk extents, hostile bytes) is
// frame_bounds_test.cc.
#include "tally/protocol/frame.h"

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "frame_test_support.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/status.h"

namespace tally {
namespace {

using namespace frame_testing;

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
  // Version 5, little-endian.
  EXPECT_EQ(byte(4), 0x05);
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
  for (uint64_t version : {0ULL, 1ULL, 2ULL, 3ULL, 4ULL, 6ULL, 0x1234ULL, 0xFFFFULL, 0x0500ULL}) {
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

}  // namespace
}  // namespace tally
