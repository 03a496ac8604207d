// What a wrong float32 result of a fill_pattern op (pattern.h) is instead:
// the load and chaos modes print it beside each wrong op, so that a result
// of another op, an average divided twice, a sum that was not averaged, an
// input never reduced, or a result right in part only tells its cause.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "tally/protocol/dtype.h"

namespace tally::bench {

struct PatternOp {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  RedOp redop = RedOp::kSum;
  uint64_t seed = 0;
};

// "" when `data` is `op`'s right result. Otherwise how many elements are
// wrong and where, and what the most of them match (within float32
// rounding): the result of another op within `window` seeds (its reduction
// given by `redop_of`), the average divided by W again, the sum where the
// average was asked (or the other way), this rank's own input, the result
// summed in again in place of one rank's input, or nothing known.
std::string explain_wrong(const float* data, size_t count, const PatternOp& op, uint64_t window,
                          const std::function<RedOp(uint64_t seed)>& redop_of);

}  // namespace tally::bench
