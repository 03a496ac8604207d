#include "tally/protocol/frame.h"

#include <boost/endian/buffers.hpp>
#include <cstring>
#include <limits>

namespace tally {
namespace {

namespace be = boost::endian;

// The wire image: endian buffer types have alignment 1, so this struct is the
// byte layout documented in frame.h with no padding.
struct WireHeader {
  be::little_uint32_buf_t magic;
  be::little_uint16_buf_t version;
  be::little_uint8_buf_t kind;
  be::little_uint8_buf_t dtype;
  be::little_uint8_buf_t redop;
  be::little_uint8_buf_t round;
  be::little_uint16_buf_t flags;
  be::little_uint32_buf_t rank;
  be::little_uint64_buf_t job;
  be::little_uint64_buf_t op;
  be::little_uint64_buf_t count;
  be::little_uint64_buf_t offset;
  be::little_uint32_buf_t chunk;
  be::little_uint32_buf_t chunks_on_shard;
  be::little_uint64_buf_t length;
};
static_assert(sizeof(WireHeader) == kFrameHeaderBytes);
static_assert(alignof(WireHeader) == 1);
static_assert(offsetof(WireHeader, version) == 4);
static_assert(offsetof(WireHeader, kind) == 6);
static_assert(offsetof(WireHeader, dtype) == 7);
static_assert(offsetof(WireHeader, redop) == 8);
static_assert(offsetof(WireHeader, flags) == 10);
static_assert(offsetof(WireHeader, rank) == 12);
static_assert(offsetof(WireHeader, job) == 16);
static_assert(offsetof(WireHeader, op) == 24);
static_assert(offsetof(WireHeader, count) == 32);
static_assert(offsetof(WireHeader, offset) == 40);
static_assert(offsetof(WireHeader, chunk) == 48);
static_assert(offsetof(WireHeader, chunks_on_shard) == 52);
static_assert(offsetof(WireHeader, length) == 56);

Status protocol_error(std::string message) {
  return Status(ErrorCode::kProtocol, std::move(message));
}

}  // namespace

EncodedHeader encode_header(const FrameHeader& h) {
  WireHeader w{};
  w.magic = kFrameMagic;
  w.version = kProtocolVersion;
  w.kind = static_cast<uint8_t>(h.kind);
  w.dtype = static_cast<uint8_t>(h.dtype);
  w.redop = static_cast<uint8_t>(h.redop);
  w.round = h.round;
  w.flags = h.flags;
  w.rank = h.rank;
  w.job = h.job;
  w.op = h.op;
  w.count = h.count;
  w.offset = h.offset;
  w.chunk = h.chunk;
  w.chunks_on_shard = h.chunks_on_shard;
  w.length = h.length;
  EncodedHeader out;
  std::memcpy(out.data(), &w, sizeof(w));
  return out;
}

Result<FrameHeader> decode_header(std::span<const std::byte, kFrameHeaderBytes> bytes,
                                  const FrameLimits& limits) {
  WireHeader w;
  std::memcpy(&w, bytes.data(), sizeof(w));
  if (w.magic.value() != kFrameMagic) {
    return protocol_error("bad frame magic 0x" + [&] {
      char buf[16];
      std::snprintf(buf, sizeof(buf), "%08x", w.magic.value());
      return std::string(buf);
    }());
  }
  if (w.version.value() != kProtocolVersion) {
    return Status(ErrorCode::kVersionMismatch,
                  "peer speaks protocol version " + std::to_string(w.version.value()) +
                      ", this build speaks " + std::to_string(kProtocolVersion));
  }
  if (w.round.value() != 0 && w.kind.value() != static_cast<uint8_t>(FrameKind::kPartial)) {
    return protocol_error("round field set on a frame that is not a partial");
  }
  if ((w.flags.value() & ~(kFrameFlagAccumulators | kFrameFlagWideResult | kFrameFlagFinal)) != 0) {
    return protocol_error("unknown header flags 0x" + std::to_string(w.flags.value()));
  }
  FrameHeader h;
  const uint8_t kind = w.kind.value();
  if (kind < 1 || kind > 5) return protocol_error("unknown frame kind " + std::to_string(kind));
  h.kind = static_cast<FrameKind>(kind);
  h.rank = w.rank.value();
  h.job = w.job.value();
  h.op = w.op.value();
  h.count = w.count.value();
  h.offset = w.offset.value();
  h.chunk = w.chunk.value();
  h.chunks_on_shard = w.chunks_on_shard.value();
  h.length = w.length.value();
  h.flags = w.flags.value();
  h.round = w.round.value();

  if (h.kind == FrameKind::kControl) {
    if (h.flags != 0) return protocol_error("flags on a control frame");
    if (h.chunks_on_shard != 0) return protocol_error("control frame with a chunk count");
    if (h.length > kMaxControlBytes) {
      return protocol_error("control frame of " + std::to_string(h.length) +
                            " bytes exceeds the limit of " + std::to_string(kMaxControlBytes));
    }
    return h;
  }
  if (!is_known_dtype(w.dtype.value())) {
    return protocol_error("unknown dtype " + std::to_string(w.dtype.value()));
  }
  if (!is_known_redop(w.redop.value())) {
    return protocol_error("unknown reduction " + std::to_string(w.redop.value()));
  }
  h.dtype = static_cast<DType>(w.dtype.value());
  h.redop = static_cast<RedOp>(w.redop.value());
  const uint64_t esize = dtype_size(h.dtype);
  // With kFrameFlagAccumulators the payload holds float32 accumulators of the
  // op's 16-bit elements: 4 payload bytes per element of `esize` in the op.
  uint64_t extent = h.length;
  // On a contribution alone; on a partial beside the accumulators it says
  // the chunk's contributions asked for it (the replicas compare it).
  const bool accumulators = (h.flags & kFrameFlagAccumulators) != 0;
  if ((h.flags & kFrameFlagFinal) && h.kind != FrameKind::kPartial) {
    return protocol_error("final-result flag on a frame that is not a partial");
  }
  if ((h.flags & kFrameFlagWideResult) &&
      (esize != 2 || !((h.kind == FrameKind::kContribution && !accumulators) ||
                       (h.kind == FrameKind::kPartial && accumulators)))) {
    return protocol_error(
        "wide-result flag on a frame that is not a 16-bit contribution or partial");
  }
  if (accumulators) {
    if (h.kind == FrameKind::kContribution || esize != 2) {
      return protocol_error(
          "accumulator flag on a frame that is not a 16-bit partial, result or replay");
    }
    if (h.length % 4 != 0) return protocol_error("accumulator payload not a multiple of 4 bytes");
    extent = h.length / 4 * esize;
  }
  if (h.length > limits.max_data_bytes) {
    return protocol_error("data frame of " + std::to_string(h.length) +
                          " bytes exceeds the limit of " + std::to_string(limits.max_data_bytes));
  }
  if (h.length == 0) return protocol_error("empty data frame");
  if ((h.kind == FrameKind::kContribution || h.kind == FrameKind::kReplay) &&
      h.chunks_on_shard == 0) {
    return protocol_error(describe(h) + " without its shard's chunk count");
  }
  if (h.length % esize != 0 || h.offset % esize != 0) {
    return protocol_error("chunk offset/length not a multiple of the element size");
  }
  if (h.count > std::numeric_limits<uint64_t>::max() / esize) {
    return protocol_error("element count overflows");
  }
  const uint64_t total = h.count * esize;
  if (h.offset > total || extent > total - h.offset) {
    return protocol_error("chunk [" + std::to_string(h.offset) + ", +" + std::to_string(extent) +
                          ") lies outside the op's " + std::to_string(total) + " bytes");
  }
  return h;
}

uint64_t job_id(std::string_view job_name) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (char c : job_name) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::string describe(const FrameHeader& h) {
  std::string kind = h.kind == FrameKind::kControl        ? "control"
                     : h.kind == FrameKind::kContribution ? "contribution"
                     : h.kind == FrameKind::kResult       ? "result"
                     : h.kind == FrameKind::kReplay       ? "replay"
                                                          : "partial";
  return kind + " op=" + std::to_string(h.op) + " chunk=" + std::to_string(h.chunk) +
         " rank=" + std::to_string(h.rank) + " offset=" + std::to_string(h.offset) +
         " length=" + std::to_string(h.length);
}

}  // namespace tally
