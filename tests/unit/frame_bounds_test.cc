// What the frame decoder bounds: control and data payload sizes, a chunk's
// extent within its op (overflow included), and hostile bytes (random
// buffers, every byte value at every offset), each refused cleanly.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

#include "frame_test_support.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"

namespace tally {
namespace {

using namespace frame_testing;

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

}  // namespace
}  // namespace tally
