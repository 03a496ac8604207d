// A reducer's or listener's network address, as the pool lists and the
// command lines take it. Shared by both transports (TCP dials it; the fabric
// transport's control stream is the same TCP connection) and by the pool
// list parser (pool.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tally/protocol/status.h"

namespace tally {

// A host name or IP literal and a port. A plain value; thread-compatible.
struct HostPort {
  std::string host;  // without brackets, also for IPv6
  uint16_t port = 0;
  // "host:port", bracketing an IPv6 host ("[::1]:7000"); parse_host_port reads it back.
  std::string to_string() const;
};

// Splits "host:port" ("[::1]:7000" for IPv6). Pure; does not resolve the
// host. Errors: kInvalidArgument quoting `text` and saying what is wrong.
Result<HostPort> parse_host_port(std::string_view text);

}  // namespace tally
