// Inputs with a closed-form sum, shared by the bench's correctness checks,
// its load and chaos modes, and the tests.
//
// Element i of rank r in the op with seed k (every rank gives an op the
// same seed, and consecutive ops on one buffer different ones; the load
// and chaos modes use the op's number) is
//
//   v(r, k, i) = (7i + 13k + 29r) mod 1021 + 1,
//
// an integer in [1, 1021]. 1021 is prime, so v differs between any two of
// 1021 consecutive ops, and between any two of 1021 ranks, at every
// element: a result left over from another op (a stale buffer, a replay of
// another op, a result in the wrong bucket) does not pass for this one's.
// The sum over W ranks is below 1022 W, exact in float32 and in every order
// of summation for W <= 16384; an average is that sum divided by W in the
// element type, as the reducer divides it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tally/protocol/dtype.h"

namespace tally::bench {

inline constexpr uint64_t kPatternPeriod = 1021;

inline uint32_t pattern_value(uint32_t rank, uint64_t seed, uint64_t i) {
  return static_cast<uint32_t>((7 * (i % kPatternPeriod) + 13 * (seed % kPatternPeriod) +
                                29 * uint64_t{rank % kPatternPeriod}) %
                                   kPatternPeriod +
                               1);
}

template <typename T>
void fill_pattern(T* data, size_t count, uint32_t rank, uint64_t seed) {
  for (size_t i = 0; i < count; ++i) data[i] = static_cast<T>(pattern_value(rank, seed, i));
}

// The sums of every rank's inputs in the op with `seed`: a table of one
// period, so each element's sum costs a lookup, not W additions.
class PatternSums {
 public:
  PatternSums(uint32_t world_size, uint64_t seed) : world_size_(world_size), seed_(seed) {
    sums_.assign(kPatternPeriod, 0);
    for (uint64_t j = 0; j < kPatternPeriod; ++j) {
      for (uint32_t r = 0; r < world_size; ++r) sums_[j] += pattern_value(r, 0, j);
    }
  }
  uint64_t sum(uint64_t i) const { return sums_[index(i)]; }
  uint32_t world_size() const { return world_size_; }
  // The expected result of `redop` at element i, in T, as the reducer
  // computes it (a float sum divided in T).
  template <typename T>
  T expected(RedOp redop, uint64_t i) const {
    T e = static_cast<T>(sum(i));
    if (redop == RedOp::kAverage) e = static_cast<T>(e / static_cast<T>(world_size_));
    return e;
  }

 private:
  // The j with v(r, 0, j) = v(r, seed, i) for every r: 7j = 7i + 13 seed
  // (mod 1021), so j = i + 13 * 146 * seed, 146 being 7's inverse mod 1021.
  uint64_t index(uint64_t i) const {
    return (i % kPatternPeriod + 13 * 146 * (seed_ % kPatternPeriod)) % kPatternPeriod;
  }
  uint32_t world_size_;
  uint64_t seed_;
  std::vector<uint64_t> sums_;
};

// The relative error a float32 result on the bfloat16 wire (TALLY_WIRE_DTYPE)
// may have against the exact sum of positive inputs: each input rounded to
// bfloat16 (u = 2^-8), the float32 sum (W * 2^-24, W < 256), the result
// rounded once more (u): 2u + u^2 + 2^-16 covers it.
inline constexpr double kBfloat16WireRelativeError = 2 * 0x1p-8 + 0x1p-16 + 0x1p-16;

// Number of elements that differ from the expected result of `redop` (sum
// or average) over `world_size` ranks' fill_pattern inputs with `seed`;
// with `relative` > 0, by more than relative * |expected|.
template <typename T>
size_t count_wrong(const T* data, size_t count, uint32_t world_size, RedOp redop, uint64_t seed,
                   double relative = 0) {
  const PatternSums sums(world_size, seed);
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const T expected = sums.expected<T>(redop, i);
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
