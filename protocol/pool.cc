#include "tally/protocol/pool.h"

namespace tally {
namespace {

// Pool files are written by hand and by shell scripts: tolerate indentation,
// a blank after a comma and Windows line ends.
std::string_view trim(std::string_view s) {
  constexpr std::string_view kBlanks = " \t\r";
  const auto first = s.find_first_not_of(kBlanks);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kBlanks) - first + 1);
}

}  // namespace

Result<std::vector<HostPort>> parse_pool(std::string_view text) {
  std::vector<HostPort> out;
  std::string_view rest = text;
  while (!rest.empty()) {
    const auto separator = rest.find_first_of(",\n");
    const std::string_view item = trim(rest.substr(0, separator));
    if (!item.empty()) {
      auto address = parse_host_port(item);
      if (!address) return address.status();
      out.push_back(std::move(*address));
    }
    if (separator == std::string_view::npos) break;
    rest.remove_prefix(separator + 1);
  }
  return out;
}

size_t pool_index(uint32_t group, uint32_t shard, uint32_t shard_count) {
  TALLY_CHECK(shard < shard_count);
  return size_t{group} * shard_count + shard;
}

}  // namespace tally
