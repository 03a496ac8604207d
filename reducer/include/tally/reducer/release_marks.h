// The Received/Released marks of one job on one reducer (docs/protocol.md,
// "Resuming"). Each rank of this reducer's group says the op below which it
// has every result (Received). The least of them over the group is the
// group's mark; the least of every participating group's mark is the job's,
// which the members are told (Released) so that they let their kept results
// go. A rank that left counts as having everything: it needs no replay.
//
// Plain data, no lock and no messages: Job holds it under its mutex and
// sends what it returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <vector>

namespace tally {

class ReleaseMarks {
 public:
  // `group_size` ranks of a world of `world_size` form this reducer's
  // group; `participants` groups have workers in the job, this one at
  // index `mine`.
  ReleaseMarks(uint32_t world_size, uint32_t group_size, size_t participants, size_t mine);

  // Ranks of the group that have joined at least once.
  const std::set<uint32_t>& ranks() const { return ranks_; }
  // `rank` joined. Back after leaving, it has no mark until it says one.
  void joined(uint32_t rank);

  // How the group's mark changed.
  struct Change {
    bool moved = false;  // advanced, or became known
    bool first = false;  // became known: every member is told it, even unchanged
  };
  // `rank` (< world size) has every result below `op_below`. The group's
  // mark is known once every rank of the group has joined and said one.
  Change note(uint32_t rank, uint64_t op_below);
  // `rank` left: the others' marks no longer wait for it.
  Change left(uint32_t rank) { return note(rank, kLeft); }

  // The group of participant `index` (not this one) has every result below
  // `mark`.
  void replica_said(size_t index, uint64_t mark);
  // The job's mark to tell the members: once every participant's mark is
  // known, when it first is, when it advanced, and whenever `announce`.
  std::optional<uint64_t> job_release(bool announce);
  // A rank had Released `op_below` from another shard's reducer (which
  // counted it while this one waits for a lost replica's group): whether
  // the job's mark advanced. A claim is a peer's word: it raises the job's
  // mark no higher than this group's own (every rank has those results,
  // this group's included), and what is above waits for the group's mark
  // to pass it; before the group's mark is known it raises nothing. So a
  // rank that lies ends no op that its own group has not received.
  // Called again with 0, it applies what was claimed up to the group's mark.
  bool raise_job(uint64_t op_below);

  uint64_t group_mark() const { return group_; }
  bool group_known() const { return group_known_; }
  uint64_t job_mark() const { return job_; }
  bool job_known() const { return job_known_; }
  // Every rank of every group has the results of the ops below this.
  uint64_t released_below() const { return group_ > job_ ? group_ : job_; }

 private:
  static constexpr uint64_t kLeft = UINT64_MAX;

  const uint32_t group_size_;
  const size_t mine_;
  std::set<uint32_t> ranks_;
  std::vector<uint64_t> received_;  // by rank; kLeft for a rank that left
  std::vector<bool> reported_;      // by rank: has said a mark
  uint32_t reported_count_ = 0;
  uint64_t group_ = 0;
  bool group_known_ = false;
  // How many ranks are not above group_ (-1: to count). The least is
  // counted again only when this reaches 0: O(group) per advance.
  int64_t not_above_ = -1;
  std::vector<std::optional<uint64_t>> replica_marks_;  // by participant index
  uint64_t job_ = 0;
  bool job_known_ = false;
  uint64_t claimed_ = 0;  // the highest Released a rank said it had had
};

}  // namespace tally
