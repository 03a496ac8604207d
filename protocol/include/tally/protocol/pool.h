// The pool list: every reducer of a pool, in (group, shard) order (index
// group x S + shard), as workers get it in TALLY_POOL, reducers in --pool
// and the bench in --pool. One parser for all of them, so they agree on
// what a list may look like.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "tally/protocol/address.h"
#include "tally/protocol/status.h"

namespace tally {

// Parses a pool list "host:port,host:port,..." (commas or newlines; blanks and
// CR trimmed; empty items skipped), each item possibly a pattern standing
// for several addresses (tally-{0..7}.tally.ns.svc:7070; pool_pattern.h).
// Pure. Errors: kInvalidArgument naming the
// bad item (parse_host_port's message). An empty list is not an error here:
// callers say what an empty pool means to them.
Result<std::vector<HostPort>> parse_pool(std::string_view text);

// Index of reducer (group, shard) in a pool listed in (group, shard) order.
// Pure; requires shard < shard_count.
size_t pool_index(uint32_t group, uint32_t shard, uint32_t shard_count);

}  // namespace tally
