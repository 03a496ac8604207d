#include "tally/protocol/address.h"

#include <charconv>

namespace tally {

std::string HostPort::to_string() const {
  return host.find(':') != std::string::npos ? "[" + host + "]:" + std::to_string(port)
                                             : host + ":" + std::to_string(port);
}

Result<HostPort> parse_host_port(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Status(ErrorCode::kInvalidArgument,
                  "bad address '" + std::string(text) + "': " + std::string(why));
  };
  HostPort out;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return bad("expected [ipv6]:port");
    }
    out.host = std::string(text.substr(1, close - 1));
    port_text = text.substr(close + 2);
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string_view::npos) return bad("expected host:port");
    out.host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
  }
  if (out.host.empty()) return bad("empty host");
  unsigned port = 0;
  auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port > 65535) {
    return bad("port must be a number from 0 to 65535");
  }
  out.port = static_cast<uint16_t>(port);
  return out;
}

}  // namespace tally
