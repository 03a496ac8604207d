#include "tally/bench/explain.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tally/bench/pattern.h"

namespace tally::bench {
namespace {

// One thing a wrong element may be: a name and its value at element i.
struct Candidate {
  std::string name;
  std::function<float(uint64_t)> value;
};

// Whether `got` is `candidate`, within the rounding of a float32 sum in
// another order (a candidate made of fractions is not summed as the
// reducer did).
bool same(float got, float candidate) {
  return std::abs(static_cast<double>(got) - candidate) <= 1e-6 * std::abs(candidate);
}

}  // namespace

std::string explain_wrong(const float* data, size_t count, const PatternOp& op, uint64_t window,
                          const std::function<RedOp(uint64_t seed)>& redop_of) {
  const PatternSums sums(op.world_size, op.seed);
  std::vector<uint64_t> wrong;
  for (uint64_t i = 0; i < count; ++i) {
    if (data[i] != sums.expected<float>(op.redop, i)) wrong.push_back(i);
  }
  if (wrong.empty()) return "";
  const uint32_t w = op.world_size;
  std::vector<Candidate> candidates;
  if (op.redop == RedOp::kAverage) {
    candidates.push_back(
        {"the average divided by " + std::to_string(w) + " again", [&](uint64_t i) {
           return sums.expected<float>(RedOp::kAverage, i) / static_cast<float>(op.world_size);
         }});
    candidates.push_back({"the sum, not averaged",
                          [&](uint64_t i) { return sums.expected<float>(RedOp::kSum, i); }});
  } else {
    candidates.push_back({"the average, where the sum was asked",
                          [&](uint64_t i) { return sums.expected<float>(RedOp::kAverage, i); }});
  }
  candidates.push_back({"this rank's input, not reduced", [&](uint64_t i) {
                          return static_cast<float>(pattern_value(op.rank, op.seed, i));
                        }});
  // A result that ranks' buffers held where their inputs should have been
  // (a partial result sent again as a contribution): the other ranks'
  // inputs and that result, reduced. Every set of ranks up to 8 ranks,
  // one rank at a time beyond.
  const uint64_t sets = w <= 8 ? (uint64_t{1} << w) : w + 1;
  for (uint64_t set = 1; set < sets; ++set) {
    std::vector<uint32_t> ranks;
    for (uint32_t r = 0; r < w; ++r) {
      if (w <= 8 ? (set >> r) & 1 : r + 1 == set) ranks.push_back(r);
    }
    std::string names;
    for (uint32_t r : ranks) names += (names.empty() ? "" : ", ") + std::to_string(r);
    candidates.push_back({"the result summed in again in place of the input of rank" +
                              std::string(ranks.size() > 1 ? "s " : " ") + names,
                          [&, ranks](uint64_t i) {
                            const double result = sums.expected<float>(op.redop, i);
                            double sum = static_cast<double>(sums.sum(i));
                            for (uint32_t r : ranks) sum += result - pattern_value(r, op.seed, i);
                            return static_cast<float>(op.redop == RedOp::kAverage ? sum / w : sum);
                          }});
  }
  // Other ops' results, nearest first; reserved, so the pointers stay.
  std::vector<PatternSums> others;
  others.reserve(2 * window);
  auto other_op = [&](uint64_t seed) {
    const RedOp r = redop_of(seed);
    const PatternSums* s = &others.emplace_back(op.world_size, seed);
    candidates.push_back({"op " + std::to_string(seed) + "'s " + std::string(redop_name(r)),
                          [s, r](uint64_t i) { return s->expected<float>(r, i); }});
  };
  for (uint64_t d = 1; d <= window; ++d) {
    if (d <= op.seed) other_op(op.seed - d);
    other_op(op.seed + d);
  }
  size_t best = 0, best_matches = 0;
  for (size_t c = 0; c < candidates.size(); ++c) {
    size_t matches = 0;
    for (uint64_t i : wrong) matches += same(data[i], candidates[c].value(i));
    if (matches > best_matches) {
      best = c;
      best_matches = matches;
    }
  }
  std::string out = std::to_string(wrong.size()) + " of " + std::to_string(count) +
                    " elements wrong (elements " + std::to_string(wrong.front()) + ".." +
                    std::to_string(wrong.back()) + ")";
  if (best_matches == wrong.size()) {
    out += ", each " + candidates[best].name;
  } else if (best_matches > 0) {
    out += ", " + std::to_string(best_matches) + " of them " + candidates[best].name;
  } else {
    const uint64_t i = wrong.front();
    out += ", none explained: element " + std::to_string(i) + " is " + std::to_string(data[i]) +
           ", " + std::to_string(sums.expected<float>(op.redop, i)) + " expected";
  }
  out += wrong.size() == count ? "" : "; the rest right";
  return out;
}

}  // namespace tally::bench
