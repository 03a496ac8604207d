#include "tally/reducer/release_marks.h"

#include <algorithm>
#include <limits>

namespace tally {

ReleaseMarks::ReleaseMarks(uint32_t world_size, uint32_t group_size, size_t participants,
                           size_t mine)
    : group_size_(group_size),
      mine_(mine),
      received_(world_size, 0),
      reported_(world_size, false),
      replica_marks_(participants) {}

void ReleaseMarks::joined(uint32_t rank) {
  if (ranks_.insert(rank).second) not_above_ = -1;
  if (received_[rank] == kLeft) {
    received_[rank] = 0;
    reported_[rank] = false;
    --reported_count_;
    not_above_ = -1;
  }
}

ReleaseMarks::Change ReleaseMarks::note(uint32_t rank, uint64_t op_below) {
  const bool first_mark = !reported_[rank];
  if (first_mark) {
    reported_[rank] = true;
    ++reported_count_;
  }
  const uint64_t before = received_[rank];
  if (op_below <= before && !first_mark) return {};
  received_[rank] = std::max(before, op_below);
  // Known once every rank of the group has joined and said its mark; the
  // first time, every member is told it even if it is 0: a worker that
  // resumed sends nothing before it knows which of its kept results someone
  // still needs (docs/protocol.md, "Resuming").
  if (ranks_.size() < group_size_ || reported_count_ < group_size_) return {};
  const bool first = !group_known_;
  group_known_ = true;
  if (first) {
    not_above_ = -1;
  } else if (not_above_ > 0 && before <= group_ && received_[rank] > group_) {
    --not_above_;
  }
  if (not_above_ > 0) return {};
  uint64_t least = std::numeric_limits<uint64_t>::max();
  for (uint32_t r : ranks_) least = std::min(least, received_[r]);
  not_above_ = 0;
  for (uint32_t r : ranks_) not_above_ += received_[r] <= least;
  if (least <= group_ && !first) return {};
  group_ = std::max(group_, least);
  return {true, first};
}

void ReleaseMarks::replica_said(size_t index, uint64_t mark) {
  auto& known = replica_marks_[index];
  known = std::max(known.value_or(0), mark);
}

std::optional<uint64_t> ReleaseMarks::job_release(bool announce) {
  if (!group_known_) return std::nullopt;
  // A worker of any group keeps its results until every group has them:
  // after a restart, another group's ranks may need one replayed.
  uint64_t least = group_;
  for (size_t i = 0; i < replica_marks_.size(); ++i) {
    if (i == mine_) continue;
    if (!replica_marks_[i]) return std::nullopt;
    least = std::min(least, *replica_marks_[i]);
  }
  const bool first = !job_known_;
  job_known_ = true;
  if (!first && !announce && least <= job_) return std::nullopt;
  job_ = std::max(job_, least);
  return job_;
}

bool ReleaseMarks::raise_job(uint64_t op_below) {
  claimed_ = std::max(claimed_, op_below);
  if (!group_known_) return false;
  // An honest claim is at most this group's mark, or soon will be (its
  // ranks are among those that have the results); the rest waits for it.
  const uint64_t bound = std::min(claimed_, group_);
  if (bound <= job_) return false;
  job_ = bound;
  return true;
}

}  // namespace tally
