// Helpers around tally.wire.Control, shared by reducer and client.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/status.h"

namespace tally {

// The Goodbye reason of a worker that closes with no failure to report;
// reducers keep any other reason to explain later failures of the job.
inline constexpr std::string_view kCleanGoodbyeReason = "client closed";

// libprotobuf prints its own line to stderr for some inputs it refuses (a
// string field holding invalid UTF-8), once per message, outside spdlog and
// its levels: a stranger could fill a reducer's log with them. parse_control
// already reports the refusal, so this sends the library's words to spdlog
// at debug. For a daemon's main() (or a fuzz target's initialisation),
// before any thread parses: SetLogHandler is not thread-safe, and a library
// must not take over its host process's protobuf logging.
void route_protobuf_logs();

// The longest prefix of UTF-8 `text` of at most `max_bytes` bytes that does
// not cut a character: what a peer's string may be shortened to before it
// goes into a message (proto3 strings must be valid UTF-8, or the receiver
// refuses the whole message).
std::string utf8_prefix(std::string_view text, size_t max_bytes);

// The Control message a control frame's payload holds, as every transport
// reads it: a payload that does not parse, or sets no body, is refused.
// Errors: kProtocol ("malformed control message").
Result<wire::Control> parse_control(std::span<const std::byte> payload);

// An Error control message for `status`; `op` makes it an op failure.
wire::Control make_error(const Status& status, std::optional<uint64_t> op = std::nullopt,
                         const std::vector<uint32_t>& ranks = {});
// The Status an Error message carries.
Status status_from_error(const wire::Error& error);

}  // namespace tally
