// Pool addresses written as patterns, so that a pool of N reducers behind a
// Kubernetes headless Service is one short string:
//
//   tally-{0..7}.tally.ns.svc:7070          eight addresses, tally-0 .. tally-7
//   tally-{00..15}.example:7070             zero-padded to the width of the bounds
//   a:7070,b:7070                            an explicit list, unchanged
//   tally-{0..3}.g0:7070,tally-{0..3}.g1:7070  items are expanded in order
//
// Terms: the spec is a comma-separated list of items (newlines also
// separate, spaces around an item are dropped, empty items are skipped).
// An item holds at most one range `{A..B}` of decimal numbers with A <= B;
// it expands to B - A + 1 items, A first. If A or B is written with a
// leading zero, every number is padded with zeros to the wider bound's
// width. Anything else in braces is an error, never passed through.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tally/protocol/status.h"

namespace tally {

// Most addresses a pattern may expand to: a pool is at most 1024 groups of
// 256 shards in the bench and far less in practice; this bounds memory for
// a mistyped range such as {0..4000000000}.
inline constexpr size_t kMaxPoolAddresses = 1 << 18;

// The items of `spec`, with every range expanded. Pure; thread-safe.
// Errors: kInvalidArgument naming the item (unbalanced or nested braces,
// more than one range in an item, a bound that is not a decimal number,
// A > B, more than kMaxPoolAddresses addresses).
Result<std::vector<std::string>> expand_pool_pattern(std::string_view spec);

// The same, joined with commas: the explicit list a pattern stands for.
Result<std::string> expand_pool_pattern_joined(std::string_view spec);

}  // namespace tally
