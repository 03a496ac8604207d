// How the ranks of a job are split into replica groups by default, shared by
// the client (which group to join) and the reducer (which ranks to name
// when a group's chunk times out).
//
// Rank r of W is in group floor(r * G / W): G contiguous blocks whose sizes
// differ by at most one (with W < G some groups are empty). TALLY_GROUP
// overrides this per rank (docs/configuration.md).
#pragma once

#include <cstdint>
#include <vector>

namespace tally {

// Requires rank < world_size and groups > 0.
uint32_t default_group_of(uint32_t rank, uint32_t world_size, uint32_t groups);
// The number of ranks in each group under that default.
std::vector<uint32_t> default_group_sizes(uint32_t world_size, uint32_t groups);

}  // namespace tally
