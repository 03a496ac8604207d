// Inputs with a closed-form sum, shared by the bench's correctness check and
// the tests.
//
// Element i of rank r is v(r, i) = (i mod 1021) * 64 + (r mod 64) + 1, a
// small integer, unique per rank (for up to 64 ranks) and varying along the
// tensor. The sum over W ranks is W * (i mod 1021) * 64 + sum_r((r mod 64) + 1),
// an integer below 2^24 for W < 256, so it is exact in float32 and in every
// order of summation. An average is that sum divided by W in the element type.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tally/protocol/dtype.h"

namespace tally::bench {

inline uint64_t pattern_value(uint32_t rank, uint64_t i) {
  return (i % 1021) * 64 + (rank % 64) + 1;
}

inline uint64_t pattern_sum(uint32_t world_size, uint64_t i) {
  uint64_t rank_part = 0;
  for (uint32_t r = 0; r < world_size; ++r) rank_part += (r % 64) + 1;
  return uint64_t{world_size} * (i % 1021) * 64 + rank_part;
}

template <typename T>
void fill_pattern(T* data, size_t count, uint32_t rank) {
  for (size_t i = 0; i < count; ++i) data[i] = static_cast<T>(pattern_value(rank, i));
}

// The relative error a float32 result on the bfloat16 wire (TALLY_WIRE_DTYPE)
// may have against the exact sum of positive inputs: each input rounded to
// bfloat16 (u = 2^-8), the float32 sum (W * 2^-24, W < 256), the result
// rounded once more (u): 2u + u^2 + 2^-16 covers it.
inline constexpr double kBfloat16WireRelativeError = 2 * 0x1p-8 + 0x1p-16 + 0x1p-16;

// Number of elements that differ from the expected result of `redop` (sum
// or average) over `world_size` ranks' fill_pattern inputs; with `relative`
// > 0, by more than relative * |expected|.
template <typename T>
size_t count_wrong(const T* data, size_t count, uint32_t world_size, RedOp redop,
                   double relative = 0) {
  const bool average = redop == RedOp::kAverage;
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    T expected = static_cast<T>(pattern_sum(world_size, i));
    if (average) expected = static_cast<T>(expected / static_cast<T>(world_size));
    if (relative > 0) {
      const double e = static_cast<double>(expected);
      if (!(std::abs(static_cast<double>(data[i]) - e) <= relative * std::abs(e))) ++wrong;
    } else if (data[i] != expected) {
      ++wrong;
    }
  }
  return wrong;
}

}  // namespace tally::bench
