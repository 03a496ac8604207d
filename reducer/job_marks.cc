// Job's side of its release marks (release_marks.h holds the counting):
// the Released told to the members, the ReplicaMark told to the other
// replicas, and ending what is held of the ops below the marks.
#include "tally.pb.h"
#include "tally/reducer/job.h"

namespace tally {

namespace {

std::shared_ptr<const wire::Control> released_message(std::optional<uint64_t> op_below) {
  if (!op_below) return nullptr;
  auto control = std::make_shared<wire::Control>();
  control->mutable_released()->set_op_below(*op_below);
  return control;
}

}  // namespace

void Job::on_received(uint32_t rank, uint64_t op_below, uint64_t released_below) {
  std::shared_ptr<const wire::Control> message;
  std::vector<std::shared_ptr<JobMember>> members;
  bool group_moved = false;
  {
    std::lock_guard lock(mu_);
    if (rank >= settings_.world_size) return;
    const uint64_t group_before = marks_.group_mark();
    message = note_mark_locked(rank, op_below);
    group_moved = marks_.group_mark() > group_before;
    // Found by another shard's reducers (while this one's count waits for
    // a lost replica's group, or its ranks are still reporting).
    if (marks_.raise_job(released_below) && marks_.job_known()) {
      message = released_message(marks_.job_mark());
    }
    if (message) members = members_locked();
  }
  for (auto& m : members) m->send_control(message);
  if (message || group_moved) end_released_ops();
}

std::shared_ptr<const wire::Control> Job::note_mark_locked(uint32_t rank, uint64_t op_below) {
  const ReleaseMarks::Change change = marks_.note(rank, op_below);
  if (!change.moved) return nullptr;
  const uint64_t group = marks_.group_mark();
  round_.forget_finals_below(group);
  if (participants_.size() > 1) {
    auto mark = std::make_shared<wire::Control>();
    mark->mutable_replica_mark()->set_job(name());
    mark->mutable_replica_mark()->set_mark(group);
    for (uint32_t g : participants_) {
      if (g != settings_.group) mesh_->send_control(g, mark);
    }
  }
  return released_message(marks_.job_release(change.first));
}

std::shared_ptr<const wire::Control> Job::replica_said_mark_locked(uint32_t group, uint64_t mark) {
  auto it = std::find(participants_.begin(), participants_.end(), group);
  marks_.replica_said(static_cast<size_t>(it - participants_.begin()), mark);
  return released_message(marks_.job_release(false));
}

std::shared_ptr<const wire::Control> Job::job_mark_message_locked() const {
  return marks_.job_known() ? released_message(marks_.job_mark()) : nullptr;
}

void Job::end_released_ops() {
  std::vector<std::shared_ptr<Chunk>> ended;
  {
    std::lock_guard lock(mu_);
    // Below this group's own mark too: its ranks all have those results,
    // so no partial of another replica is of use here, and a chunk here
    // only waits for ranks that let theirs go (they resumed from a later
    // mark than the rank that replayed).
    const uint64_t below = marks_.released_below();
    early_.drop_below(below);
    for (auto it = chunks_.begin(); it != chunks_.end() && it->first.first < below; ++it) {
      ended.push_back(it->second);
    }
  }
  for (auto& chunk : ended) {
    if (chunk->end_released()) finish(chunk);
  }
}

}  // namespace tally
