// Fuzzes the frame decoder as a transport applies it: the 64-byte header
// through decode_header with a reducer's limits, then, for a control
// frame, its payload through parse_control (the TCP transport's
// on_header_read and on_control_read, without the socket).
//
// Input: the header's 64 bytes, then the payload bytes (possibly fewer
// or more than the header's length says; a transport would wait for the
// rest, the fuzzer takes what is there).
//
// Beyond "no crash, no UB", every header decode_header accepts must keep
// the promises the receiver relies on before it reads or allocates
// (docs/protocol.md, "What a receiver validates"), and must be the exact
// image of what encode_header writes for it.
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/frame.h"

namespace {

using namespace tally;

// A reducer's default --max-chunk-bytes (reducer.h).
constexpr size_t kMaxDataBytes = 4u << 20;

void check_accepted(const FrameHeader& h, std::span<const uint8_t, kFrameHeaderBytes> wire) {
  const EncodedHeader again = encode_header(h);
  if (h.kind == FrameKind::kControl) {
    TALLY_CHECK(h.length <= kMaxControlBytes);
    TALLY_CHECK(h.flags == 0 && h.chunks_on_shard == 0);
    // dtype and redop (bytes 7 and 8) are ignored in a control frame.
    TALLY_CHECK(std::memcmp(again.data(), wire.data(), 7) == 0);
    TALLY_CHECK(std::memcmp(again.data() + 9, wire.data() + 9, kFrameHeaderBytes - 9) == 0);
    return;
  }
  TALLY_CHECK(std::memcmp(again.data(), wire.data(), kFrameHeaderBytes) == 0);
  TALLY_CHECK(is_known_dtype(static_cast<uint8_t>(h.dtype)));
  TALLY_CHECK(is_known_redop(static_cast<uint8_t>(h.redop)));
  const uint64_t esize = dtype_size(h.dtype);
  TALLY_CHECK(h.length > 0 && h.length <= kMaxDataBytes);
  TALLY_CHECK(h.length % esize == 0 && h.offset % esize == 0);
  TALLY_CHECK(h.count <= std::numeric_limits<uint64_t>::max() / esize);
  const bool accumulators = (h.flags & kFrameFlagAccumulators) != 0;
  TALLY_CHECK(!accumulators || ((h.kind == FrameKind::kPartial || h.kind == FrameKind::kResult ||
                                 h.kind == FrameKind::kReplay) &&
                                esize == 2));
  const bool wide_result = (h.flags & kFrameFlagWideResult) != 0;
  TALLY_CHECK(!wide_result ||
              (esize == 2 && ((h.kind == FrameKind::kContribution && !accumulators) ||
                              (h.kind == FrameKind::kPartial && accumulators))));
  const uint64_t extent = accumulators ? h.length / 4 * esize : h.length;
  const uint64_t total = h.count * esize;
  TALLY_CHECK(h.offset <= total && extent <= total - h.offset);
  TALLY_CHECK((h.kind != FrameKind::kContribution && h.kind != FrameKind::kReplay) ||
              h.chunks_on_shard >= 1);
  TALLY_CHECK(!describe(h).empty());
}

}  // namespace

// Refused strings are reported by parse_control; libprotobuf's own line
// per refusal goes to spdlog at debug (dropped at its default level), as in
// the reducer.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  route_protobuf_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kFrameHeaderBytes) return 0;
  const std::span<const uint8_t, kFrameHeaderBytes> wire(data, kFrameHeaderBytes);
  auto decoded = decode_header(std::as_bytes(wire), FrameLimits{kMaxDataBytes});
  if (!decoded) {
    const ErrorCode code = decoded.status().code();
    TALLY_CHECK(code == ErrorCode::kProtocol || code == ErrorCode::kVersionMismatch);
    // A version mismatch is answered with an Error in our framing.
    if (code == ErrorCode::kVersionMismatch) {
      TALLY_CHECK(make_error(decoded.status()).ByteSizeLong() <= kMaxControlBytes);
    }
    return 0;
  }
  check_accepted(*decoded, wire);
  const std::span<const uint8_t> rest(data + kFrameHeaderBytes, size - kFrameHeaderBytes);
  if (decoded->kind != FrameKind::kControl || rest.size() < decoded->length) return 0;
  auto message = parse_control(std::as_bytes(rest.first(decoded->length)));
  if (message) {
    TALLY_CHECK(message->body_case() != wire::Control::BODY_NOT_SET);
  } else {
    TALLY_CHECK(message.status().code() == ErrorCode::kProtocol);
  }
  return 0;
}
