// Fuzzes the control-message parser as every transport applies it
// (parse_control: one protobuf tally.wire.Control with a body), and the
// pure checks the receivers apply to what it returns: an Error's and a
// ReplicaError's Status (status_from_error), an AuthResponse's MAC
// comparison. The checks that live in the sessions (a Hello's admission,
// a ReplicaHello's and a ReplicaJob's shape) are reached by the
// live-session targets, which carry these messages to a real reducer.
//
// Input: the payload of one control frame (at most kMaxControlBytes, as
// decode_header allows). The seed corpus has one valid message of each
// kind the protocol defines.
#include <cstdint>
#include <span>
#include <string>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"
#include "tally/protocol/frame.h"

namespace {

using namespace tally;

void check_error(const wire::Error& error) {
  const Status status = status_from_error(error);
  // Received, OK and unknown codes read as internal: never a success.
  TALLY_CHECK(!status.is_ok());
  TALLY_CHECK(static_cast<uint32_t>(status.code()) <= static_cast<uint32_t>(kLastErrorCode));
  TALLY_CHECK(!status.with_context("reducer 127.0.0.1:1").to_string().empty());
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
  if (size > kMaxControlBytes) return 0;
  auto message = parse_control(std::as_bytes(std::span(data, size)));
  if (!message) {
    TALLY_CHECK(message.status().code() == ErrorCode::kProtocol);
    return 0;
  }
  TALLY_CHECK(message->body_case() != wire::Control::BODY_NOT_SET);
  // What a peer re-sends (a forwarded error, a queued announcement) parses
  // back to the same message.
  const std::string again = message->SerializeAsString();
  auto reparsed = parse_control(std::as_bytes(std::span(again.data(), again.size())));
  TALLY_CHECK(reparsed && reparsed->SerializeAsString() == again);

  if (message->has_error()) check_error(message->error());
  if (message->has_replica_error()) check_error(message->replica_error().error());
  if (message->has_auth_response()) {
    static const Secret secret(std::string(32, 's'));
    const std::string expected =
        auth_mac(secret, AuthRole::kWorker, std::string(kAuthNonceBytes, 'r'),
                 std::string(kAuthNonceBytes, 'w'), "fuzz");
    TALLY_CHECK(auth_mac_matches(expected, expected));
    if (message->auth_response().mac() != expected) {
      TALLY_CHECK(!auth_mac_matches(message->auth_response().mac(), expected));
    }
  }
  return 0;
}
