#include "tally/bench/explain.h"

#include <algorithm>
#include <vector>

#include "tally/bench/pattern.h"

namespace tally::bench {
namespace {

// One thing a wrong element may be: a name and its value at element i.
struct Candidate {
  std::string name;
  std::function<float(uint64_t)> value;
};

}  // namespace

std::string explain_wrong(const float* data, size_t count, const PatternOp& op, uint64_t window,
                          const std::function<RedOp(uint64_t seed)>& redop_of) {
  const PatternSums sums(op.world_size, op.seed);
  std::vector<uint64_t> wrong;
  for (uint64_t i = 0; i < count; ++i) {
    if (data[i] != sums.expected<float>(op.redop, i)) wrong.push_back(i);
  }
  if (wrong.empty()) return "";
  const std::string w = std::to_string(op.world_size);
  std::vector<Candidate> candidates;
  if (op.redop == RedOp::kAverage) {
    candidates.push_back({"the average divided by " + w + " again", [&](uint64_t i) {
                            return sums.expected<float>(RedOp::kAverage, i) /
                                   static_cast<float>(op.world_size);
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
    for (uint64_t i : wrong) matches += data[i] == candidates[c].value(i);
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
