// Job's Received/Released marks (docs/protocol.md, "Resuming"): the least
// mark over this group's ranks, the other replicas' group marks, the
// job-wide mark told to the members, and ending what is held of the ops
// below it. The rest of a job's life is job.cc; its replica side is
// job_replicas.cc.
#include <algorithm>
#include <limits>

#include "tally.pb.h"
#include "tally/reducer/job.h"

namespace tally {

void Job::on_received(uint32_t rank, uint64_t op_below, uint64_t released_below) {
  std::shared_ptr<const wire::Control> message;
  std::vector<std::shared_ptr<JobMember>> members;
  bool group_moved = false;
  {
    std::lock_guard lock(mu_);
    if (rank >= received_.size()) return;
    const uint64_t group_before = released_;
    message = note_mark_locked(rank, op_below);
    group_moved = released_ > group_before;
    if (released_below > job_released_) {
      // Found by another shard's reducers (while this one's count waits
      // for a lost replica's group, or its ranks are still reporting).
      job_released_ = released_below;
      if (job_marks_known_) {
        auto control = std::make_shared<wire::Control>();
        control->mutable_released()->set_op_below(job_released_);
        message = std::move(control);
      }
    }
    if (message) members = members_locked();
  }
  for (auto& m : members) m->send_control(message);
  if (message || group_moved) end_released_ops();
}

std::shared_ptr<const wire::Control> Job::note_mark_locked(uint32_t rank, uint64_t op_below) {
  const bool first = !reported_[rank];
  if (first) {
    reported_[rank] = true;
    ++reported_count_;
  }
  const uint64_t before = received_[rank];
  if (op_below <= before && !first) return nullptr;
  received_[rank] = std::max(before, op_below);
  // The least mark is known once every rank of the group has joined and
  // said its mark; the first time, every member is told it even if it is
  // 0: a worker that resumed sends nothing before it knows which of its
  // kept results someone still needs (docs/protocol.md, "Resuming").
  if (joined_.size() < local_size_ || reported_count_ < local_size_) return nullptr;
  const bool announce = !marks_known_;
  marks_known_ = true;
  if (announce) {
    not_above_released_ = -1;
  } else if (not_above_released_ > 0 && before <= released_ && received_[rank] > released_) {
    --not_above_released_;
  }
  if (not_above_released_ > 0) return nullptr;
  // Counted again only when the mark may move: O(group) per advance.
  uint64_t least = std::numeric_limits<uint64_t>::max();
  for (uint32_t r : joined_) least = std::min(least, received_[r]);
  not_above_released_ = 0;
  for (uint32_t r : joined_) not_above_released_ += received_[r] <= least;
  if (least <= released_ && !announce) return nullptr;
  released_ = std::max(released_, least);
  finished_finals_.erase(finished_finals_.begin(), finished_finals_.lower_bound({released_, 0}));
  if (participants_.size() > 1) {
    auto mark = std::make_shared<wire::Control>();
    mark->mutable_replica_mark()->set_job(name());
    mark->mutable_replica_mark()->set_mark(released_);
    for (uint32_t g : participants_) {
      if (g != settings_.group) mesh_->send_control(g, mark);
    }
  }
  return released_locked(announce);
}

void Job::end_released_ops() {
  std::vector<std::shared_ptr<Chunk>> ended;
  {
    std::lock_guard lock(mu_);
    // Below this group's own mark too: its ranks all have those results,
    // so no partial of another replica is of use here, and a chunk here
    // only waits for ranks that let theirs go (they resumed from a later
    // mark than the rank that replayed).
    const uint64_t below = std::max(released_, job_released_);
    early_.erase(early_.begin(), early_.lower_bound({below, 0}));
    for (auto it = chunks_.begin(); it != chunks_.end() && it->first.first < below; ++it) {
      ended.push_back(it->second);
    }
  }
  for (auto& chunk : ended) {
    if (chunk->end_released()) finish(chunk);
  }
}

std::shared_ptr<const wire::Control> Job::released_locked(bool announce) {
  if (!marks_known_) return nullptr;
  // A worker of any group keeps its results until every group has them:
  // after a restart, another group's ranks may need one replayed.
  uint64_t least = released_;
  for (size_t i = 0; i < participants_.size(); ++i) {
    if (i == my_index_) continue;
    if (!replica_marks_[i]) return nullptr;
    least = std::min(least, *replica_marks_[i]);
  }
  const bool first = !job_marks_known_;
  job_marks_known_ = true;
  if (!first && !announce && least <= job_released_) return nullptr;
  job_released_ = std::max(job_released_, least);
  auto control = std::make_shared<wire::Control>();
  control->mutable_released()->set_op_below(job_released_);
  return control;
}

}  // namespace tally
