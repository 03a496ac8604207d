#include "tally/protocol/pool.h"

#include "tally/protocol/pool_pattern.h"

namespace tally {
Result<std::vector<HostPort>> parse_pool(std::string_view text) {
  auto items = expand_pool_pattern(text);
  if (!items) return items.status();
  std::vector<HostPort> out;
  out.reserve(items->size());
  for (const std::string& item : *items) {
    auto address = parse_host_port(item);
    if (!address) return address.status();
    out.push_back(std::move(*address));
  }
  return out;
}

size_t pool_index(uint32_t group, uint32_t shard, uint32_t shard_count) {
  TALLY_CHECK(shard < shard_count);
  return size_t{group} * shard_count + shard;
}

}  // namespace tally
