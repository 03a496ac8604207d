#include "tally/protocol/groups.h"

namespace tally {

uint32_t default_group_of(uint32_t rank, uint32_t world_size, uint32_t groups) {
  return static_cast<uint32_t>(uint64_t{rank} * groups / world_size);
}

std::vector<uint32_t> default_group_sizes(uint32_t world_size, uint32_t groups) {
  std::vector<uint32_t> sizes(groups, 0);
  for (uint32_t r = 0; r < world_size; ++r) sizes[default_group_of(r, world_size, groups)]++;
  return sizes;
}

}  // namespace tally
