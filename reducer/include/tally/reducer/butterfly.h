// The butterfly among the replicas of one shard: how the n replicas that
// hold a partial sum of a chunk all end with the full sum.
//
// Terms: the chunk has E elements. The n participants are the replica
// groups that have workers in the job, numbered 0..n-1 in group order (the
// participant index). P is the largest power of two <= n; participants
// P..n-1 are the extras, and extra P+j is paired with core participant j.
//
// 1. Fold in: extra P+j sends its whole partial to j, which adds it.
// 2. Among the P core participants, if E >= P (Rabenseifner):
//    - reduce-scatter by recursive halving: at step k (mask = P >> (k+1)),
//      i and i^mask hold the same element range [lo, hi); it is split at
//      mid = lo + (hi - lo) / 2, the one with the mask bit clear keeps
//      [lo, mid) and the other [mid, hi); each sends the half it gives up
//      and adds the half it receives into the half it keeps. After log2(P)
//      steps participant i holds the final sum of segment i (never empty,
//      since E >= P);
//    - all-gather by recursive doubling: the same pairs in reverse order,
//      each sends what it holds and copies what it receives.
//    If E < P (too small to split): recursive doubling of the whole chunk,
//    step k exchanging with i ^ (1 << k) and adding.
// 3. Fold out: j sends the final chunk to P+j, which copies it.
//
// Each replica sends about 2(P-1)/P x E elements (exactly that when P
// divides E) plus E for a fold, and receives the same.
//
// Determinism: in Rabenseifner every final element is summed in one place
// (the segment's owner) and copied everywhere else; in recursive doubling
// both partners compute a + b and b + a, which IEEE addition makes the same
// bits. So every replica ends with the same bytes, whatever the arrival order.
//
// Both partners of an exchange give it the same tag (carried in the rank
// field of a partial frame), so a receiver can tell which step a frame
// belongs to even when a partner sends it two frames of one chunk.
#pragma once

#include <cstdint>
#include <vector>

namespace tally {

struct ElementRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  bool empty() const { return begin == end; }
  bool operator==(const ElementRange&) const = default;
};

struct ButterflyStep {
  enum class Apply { kNone, kAdd, kCopy };
  uint32_t partner = 0;        // participant index
  uint32_t tag = 0;            // the same on both sides of the exchange
  ElementRange send;           // sent to the partner first (empty: nothing sent)
  ElementRange recv;           // then received from it (empty: nothing received)
  Apply apply = Apply::kNone;  // what to do with what was received
};

// Tags: fold-in, fold-out, then one per reduce-scatter / all-gather /
// doubling step.
inline constexpr uint32_t kTagFoldIn = 0;
inline constexpr uint32_t kTagFoldOut = 1;
inline constexpr uint32_t kTagFirstStep = 2;
inline constexpr uint32_t kTagFirstGather = 34;  // reduce-scatter has at most 32 steps

// The steps participant `index` of `participants` runs, in order, for a
// chunk of `elements` elements. Requires index < participants and
// elements > 0. Pure function; no steps for a single participant.
std::vector<ButterflyStep> butterfly_schedule(uint32_t participants, uint32_t index,
                                              uint64_t elements);

// Largest number of frames one participant receives per chunk, for any
// index and size: 2 log2(P), plus one when there are extras.
uint32_t butterfly_max_receives(uint32_t participants);

// What participant `index` of `participants` sends, and receives, for one
// chunk of `elements` elements, as a multiple of the chunk's size, by the
// closed form of docs/architecture.md (Traffic): a core participant moves
// 2(P-1)/P (elements >= P) or log2(P) (elements < P), plus 1 when paired
// with an extra; an extra moves 1; a lone participant 0. butterfly_schedule
// meets it exactly when P divides `elements` (else within a few elements).
// Pure; requires index < participants.
double butterfly_traffic(uint32_t participants, uint32_t index, uint64_t elements);

}  // namespace tally
