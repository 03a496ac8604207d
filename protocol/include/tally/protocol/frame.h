// The fixed 64-byte little-endian frame header that starts every message on
// a tally stream. Control frames carry a protobuf `tally.wire.Control` as
// payload; data frames carry raw tensor bytes, never protobuf-encoded.
//
//  offset size field    meaning
//   0     4    magic    "TALY" (0x594C4154 little-endian)
//   4     2    version  kProtocolVersion; another value is a version error
//   6     1    kind     FrameKind
//   7     1    dtype    DType of the payload elements (data frames)
//   8     1    redop    RedOp of the op (data frames)
//   9     1    round    partials: the sender's round of the job mod 256
//                       (protocol.md, "Resuming with replica groups"); 0
//                       on every other kind
//  10     2    flags    kFrameFlag* bits; unknown bits are a protocol error
//  12     4    rank     sender's rank (contributions); 0xFFFFFFFF (results);
//                       the butterfly exchange tag (partials, butterfly.h)
//  16     8    job      64-bit job id (job_id(name)), checked against the stream's job
//  24     8    op       op sequence number within the job
//  32     8    count    total elements of the op's tensor (agreement check)
//  40     8    offset   byte offset of this chunk (partials: of this segment) in the tensor
//  48     4    chunk    chunk index within the op
//  52     4    chunks   chunks of this op on this stream's shard (contributions,
//                       >= 1, the same from every rank; results and partials
//                       echo it); 0 in control frames
//  56     8    length   payload bytes following the header
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tally/protocol/dtype.h"
#include "tally/protocol/status.h"

namespace tally {

inline constexpr uint32_t kFrameMagic = 0x594C4154;  // "TALY" in memory order
inline constexpr uint16_t kProtocolVersion = 5;
inline constexpr size_t kFrameHeaderBytes = 64;
// Control messages are small (hello, errors); anything larger is hostile.
inline constexpr size_t kMaxControlBytes = 64 * 1024;
inline constexpr uint32_t kReducerRank = 0xFFFFFFFF;
// Flag bit 0 (partials and results of float16/bfloat16 ops only): the
// payload holds the segment's float32 accumulators, 4 bytes per element,
// while offset and count still count the op's 16-bit elements. Replicas
// exchange partials at full precision so the butterfly adds exactly what
// one reducer would; a result carries it when its contributions asked for
// kFrameFlagWideResult.
inline constexpr uint16_t kFrameFlagAccumulators = 0x1;
// Flag bit 1 (contributions of float16/bfloat16 ops; their partials): send
// this chunk's result as its float32 sums (kFrameFlagAccumulators), not
// rounded to the op's dtype. Workers set it for float32 tensors on the
// bfloat16 wire with TALLY_WIRE_RESULT=float32; every rank's contributions
// to a chunk must agree, and a partial carries it (beside bit 0) so that
// replicas whose groups disagree fail the op too.
inline constexpr uint16_t kFrameFlagWideResult = 0x2;
// Flag bit 2 (partials only, protocol 4): the payload is the chunk's final
// result, as its reducer sends it to workers (kFrameFlagAccumulators and
// kFrameFlagWideResult as on that result), not a butterfly segment. A
// replica that was given the result by a worker's replay after a restart
// sends it to the other replicas of its shard in place of its partials
// (docs/protocol.md, "Resuming with replica groups"); rank is 0.
inline constexpr uint16_t kFrameFlagFinal = 0x4;

enum class FrameKind : uint8_t {
  kControl = 1,       // payload: tally.wire.Control
  kContribution = 2,  // worker -> reducer: one chunk of the worker's input
  kResult = 3,        // reducer -> worker: one chunk of the finished sum
  kPartial = 4,       // reducer -> reducer: a segment of a chunk's partial sum (butterfly)
  // worker -> reducer, after a reconnect (protocol.md, "Resuming"): the
  // result of a chunk this worker already has, exactly as a reducer sent it
  // (flags: kFrameFlagAccumulators for float32 results of a 16-bit op).
  // It counts as the rank's share of the chunk, and whichever ranks still
  // need the chunk's result get these bytes.
  kReplay = 5,
};

struct FrameHeader {
  FrameKind kind = FrameKind::kControl;
  DType dtype = DType::kFloat32;
  RedOp redop = RedOp::kSum;
  uint32_t rank = 0;
  uint64_t job = 0;
  uint64_t op = 0;
  uint64_t count = 0;
  uint64_t offset = 0;
  uint32_t chunk = 0;
  uint32_t chunks_on_shard = 0;  // see the table above
  uint64_t length = 0;
  uint16_t flags = 0;  // kFrameFlag* bits
  uint8_t round = 0;   // partials only: the sender's round of the job, mod 256
};

using EncodedHeader = std::array<std::byte, kFrameHeaderBytes>;

// Limits a receiver applies before it reads or allocates anything.
struct FrameLimits {
  size_t max_data_bytes = 0;  // largest data payload accepted
};

EncodedHeader encode_header(const FrameHeader& header);
// Validates magic, version, kind, dtype, redop, reserved bits, the payload
// length against `limits` and the chunk's extent against the op's size.
// Errors: kVersionMismatch for another version, kProtocol for the rest.
Result<FrameHeader> decode_header(std::span<const std::byte, kFrameHeaderBytes> bytes,
                                  const FrameLimits& limits);

// Stable 64-bit id of a job name (FNV-1a), the same on every host and build.
uint64_t job_id(std::string_view job_name);

// "contribution job=.. op=3 chunk=1 rank=2 offset=.. length=.." for logs.
std::string describe(const FrameHeader& header);

}  // namespace tally
