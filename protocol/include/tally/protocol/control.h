// Helpers around tally.wire.Control, shared by reducer and client.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/status.h"

namespace tally {

// The Goodbye reason of a worker that closes with no failure to report;
// reducers keep any other reason to explain later failures of the job.
inline constexpr std::string_view kCleanGoodbyeReason = "client closed";

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
