// The payload bytes each reducer moves per op, as its counters measure them
// and as the design predicts them: the per-reducer report of tally-bench
// --reducer-metrics. Private to tally-bench.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tally/protocol/chunking.h"
#include "tally/protocol/status.h"

namespace tally::bench {

// One reducer's counters (payload bytes), as its /metrics has them.
struct Counters {
  double worker_in = 0, worker_out = 0, replica_in = 0, replica_out = 0;
};

// Reads a reducer's /metrics at `http_address` (its --http-listen). Blocks
// up to http_get's deadline; a counter not there yet reads as 0. Errors:
// http_get's.
Result<Counters> read_counters(const std::string& http_address);

// Bytes per op the design predicts for reducer (shard s, group g), for a
// tensor of `bytes` (docs/architecture.md, Traffic): from and to workers
// w_g x (shard s's bytes); to and from the other replicas, per chunk, the
// butterfly's closed form (butterfly_traffic) times the chunk's bytes, or
// with reproducible sums the sum tree's covers (sum_tree.h): each of this
// group's nodes to every other participant, each of theirs from them.
struct Expected {
  double worker = 0, replica_in = 0, replica_out = 0;
};

// Pure. `sizes`: workers per group; `esize`: bytes per element.
Expected expected_bytes(const ChunkPlan& plan, size_t esize, uint32_t shard, uint32_t group,
                        const std::vector<uint32_t>& sizes, bool deterministic = false);

}  // namespace tally::bench
