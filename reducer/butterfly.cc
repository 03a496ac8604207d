#include "tally/reducer/butterfly.h"

#include "tally/protocol/status.h"

namespace tally {
namespace {

uint32_t core_size(uint32_t n) {
  uint32_t p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

uint32_t log2_of(uint32_t p) {
  uint32_t l = 0;
  while ((1u << l) < p) ++l;
  return l;
}

}  // namespace

std::vector<ButterflyStep> butterfly_schedule(uint32_t n, uint32_t i, uint64_t elements) {
  TALLY_CHECK(i < n && elements > 0);
  std::vector<ButterflyStep> steps;
  if (n == 1) return steps;
  const uint32_t p = core_size(n);
  const uint32_t extras = n - p;
  const ElementRange all{0, elements};
  using Apply = ButterflyStep::Apply;
  if (i >= p) {
    steps.push_back({i - p, kTagFoldIn, all, {}, Apply::kNone});
    steps.push_back({i - p, kTagFoldOut, {}, all, Apply::kCopy});
    return steps;
  }
  const bool paired = i < extras;
  if (paired) steps.push_back({p + i, kTagFoldIn, {}, all, Apply::kAdd});
  const uint32_t levels = log2_of(p);
  if (elements >= p) {
    // Reduce-scatter; remember each step's exchange for the all-gather.
    std::vector<std::pair<ElementRange, ElementRange>> kept_given;
    ElementRange range = all;
    for (uint32_t k = 0; k < levels; ++k) {
      const uint32_t mask = p >> (k + 1);
      const uint64_t mid = range.begin + range.size() / 2;
      const ElementRange lower{range.begin, mid};
      const ElementRange upper{mid, range.end};
      const bool keep_lower = (i & mask) == 0;
      const ElementRange kept = keep_lower ? lower : upper;
      const ElementRange given = keep_lower ? upper : lower;
      steps.push_back({i ^ mask, kTagFirstStep + k, given, kept, Apply::kAdd});
      kept_given.emplace_back(kept, given);
      range = kept;
    }
    for (uint32_t k = levels; k-- > 0;) {
      const uint32_t mask = p >> (k + 1);
      const auto& [kept, given] = kept_given[k];
      steps.push_back({i ^ mask, kTagFirstGather + k, kept, given, Apply::kCopy});
    }
  } else {
    for (uint32_t k = 0; k < levels; ++k) {
      steps.push_back({i ^ (1u << k), kTagFirstStep + k, all, all, Apply::kAdd});
    }
  }
  if (paired) steps.push_back({p + i, kTagFoldOut, all, {}, Apply::kNone});
  return steps;
}

uint32_t butterfly_max_receives(uint32_t n) {
  if (n <= 1) return 0;
  const uint32_t p = core_size(n);
  return 2 * log2_of(p) + (n > p ? 1 : 0);
}

double butterfly_traffic(uint32_t n, uint32_t i, uint64_t elements) {
  TALLY_CHECK(i < n);
  if (n == 1) return 0;
  const uint32_t p = core_size(n);
  if (i >= p) return 1;  // an extra: its partial out, the final chunk back
  const double core = elements >= p ? 2.0 * (p - 1) / p : static_cast<double>(log2_of(p));
  return i < n - p ? core + 1 : core;
}

}  // namespace tally
