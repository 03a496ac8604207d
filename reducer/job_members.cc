// A job's membership on this reducer: ranks joining and resuming, leaving
// with a goodbye, lost, or stalled and awaited until the op timeout, and
// the job failing for good or ending. The sums are job.cc.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/reducer/job.h"

namespace tally {

Status Job::join(const std::shared_ptr<JobMember>& member, Arrival arrival) {
  std::lock_guard lock(mu_);
  const uint32_t rank = member->rank();
  TALLY_CHECK_LT(rank, settings_.world_size);
  if (auto it = stalled_.find(rank); it != stalled_.end() && !lost_) {
    if (arrival == Arrival::kFresh) {
      // A new worker in its place has none of its ops to send again.
      return Status(ErrorCode::kUnavailable,
                    "rank " + std::to_string(rank) + " of job '" + name() +
                        "' stalled and is awaited to resume with its ops until the op timeout; "
                        "a new worker cannot take its place before then");
    }
    stalled_.erase(it);
    spdlog::info("job '{}' shard {} group {}: rank {} resumed from {} after stalling", name(),
                 settings_.shard, settings_.group, rank, member->peer());
  }
  if (lost_) {
    return Status(ErrorCode::kUnavailable,
                  "job '" + name() + "' has failed (" + lost_->message() +
                      "); every worker must disconnect before the job can start again");
  }
  if (members_[rank]) {
    return Status(ErrorCode::kAlreadyExists, "rank " + std::to_string(rank) + " of job '" + name() +
                                                 "' is already connected from " +
                                                 members_[rank]->peer());
  }
  const std::set<uint32_t>& joined = marks_.ranks();
  if (!joined.count(rank) && joined.size() >= local_size_) {
    return Status(ErrorCode::kInvalidArgument,
                  "group " + std::to_string(settings_.group) + " of job '" + name() +
                      "' already has its " + std::to_string(local_size_) + " workers (ranks " +
                      ranks_string(std::vector<uint32_t>(joined.begin(), joined.end())) +
                      "); rank " + std::to_string(rank) +
                      " cannot join it (check TALLY_GROUP_SIZES)");
  }
  members_[rank] = member;
  round_.rejoined(rank);
  marks_.joined(rank);
  departed_.erase(rank);
  if (arrival == Arrival::kFresh) {
    if (auto released = note_mark_locked(rank, 0)) {
      // The group's mark is known now: every member is told it, this one
      // after its Welcome (posted behind it).
      for (auto& m : members_locked()) m->send_control(released);
      return Status::ok();
    }
  }
  // After its Welcome (posted behind it): where the job's marks stand.
  if (auto released = job_mark_message_locked()) member->send_control(std::move(released));
  return Status::ok();
}

void Job::leave(const JobMember* member, const Status& why, Departure how) {
  if (leave_locked(member, why, how)) end_released_ops();
}

bool Job::leave_locked(const JobMember* member, const Status& why, Departure how) {
  std::lock_guard lock(mu_);
  bool released_moved = false;
  const uint32_t rank = member->rank();
  if (rank >= members_.size() || members_[rank].get() != member) return false;
  members_[rank] = nullptr;
  if (how == Departure::kStalled && !lost_ && !retired_) {
    await_stalled_locked(rank, member->peer(), why);
    return false;
  }
  // A rank that left needs no replay in this job (a lost one never comes
  // back to it: every later op fails), so the others' results are released
  // without waiting for its mark; a worker holding a large op until its
  // release (docs/protocol.md, "Resuming") then ends it now.
  if (rank < settings_.world_size) {
    if (auto released = note_mark_locked(rank, kLeftJob)) {
      for (auto& m : members_locked()) m->send_control(released);
      released_moved = true;
    }
  }
  if (std::none_of(members_.begin(), members_.end(), [](auto& m) { return m != nullptr; })) {
    memberless_since_ = Clock::now();
  }
  if (how == Departure::kGoodbye) {
    departed_[rank] = why.message();
    std::set<uint64_t> ops;
    for (auto& [key, chunk] : chunks_) {
      if (!chunk->seen(rank)) ops.insert(key.first);
    }
    const Status gone(ErrorCode::kPeerLost,
                      "rank " + std::to_string(rank) + " (" + member->peer() + ") left job '" +
                          name() + "' before contributing (it said: " + why.message() + ")");
    for (uint64_t op : ops) fail_op_locked(op, gone, {rank});
    return released_moved;
  }
  return lose_locked(lost_status(rank, member->peer(), why.message()), {rank}) || released_moved;
}

Status Job::lost_status(uint32_t rank, const std::string& peer, const std::string& why) const {
  return Status(ErrorCode::kPeerLost, "rank " + std::to_string(rank) + " (" + peer + ") of job '" +
                                          name() + "' was lost: " + why);
}

bool Job::lose_locked(const Status& lost, const std::vector<uint32_t>& ranks) {
  bool released_moved = false;
  // The ranks still awaited after a stall will not be: every op fails.
  for (auto& [rank, s] : stalled_) {
    if (auto released = note_mark_locked(rank, kLeftJob)) {
      for (auto& m : members_locked()) m->send_control(released);
      released_moved = true;
    }
  }
  stalled_.clear();
  if (!lost_) {
    lost_ = lost;
    lost_ranks_ = ranks;
  }
  fail_all_ops_locked(lost, ranks, Forward::kYes);
  return released_moved;
}

void Job::await_stalled_locked(uint32_t rank, const std::string& peer, const Status& why) {
  // Not marked as having left: the others keep the results it may not
  // have, and send them again (as replays) for it.
  const auto now = Clock::now();
  stalled_[rank] = {lost_status(rank, peer,
                                why.message() + "; it did not resume within " +
                                    std::to_string(settings_.op_timeout.count()) + " ms"),
                    now + settings_.op_timeout};
  spdlog::warn(
      "job '{}' shard {} group {}: rank {} ({}) stalled ({}); its ops wait up to {} ms for it to "
      "resume",
      name(), settings_.shard, settings_.group, rank, peer, why.message(),
      settings_.op_timeout.count());
  // What it sent of the ops in flight is dropped with the chunks, and
  // every rank sends those ops again, the stalled one once it resumes.
  start_round_locked(round_.number() + 1,
                     "rank " + std::to_string(rank) + " (" + peer + ") stalled: " + why.message());
}

bool Job::give_up_stalled(Clock::time_point now) {
  std::lock_guard lock(mu_);
  std::vector<uint32_t> ranks;
  std::optional<Status> lost;
  for (auto& [rank, s] : stalled_) {
    if (now < s.until) continue;
    ranks.push_back(rank);
    if (!lost) lost = s.lost;
  }
  if (!lost || lost_) return false;
  spdlog::warn("job '{}' shard {} group {} fails: {}", name(), settings_.shard, settings_.group,
               lost->message());
  return lose_locked(*lost, ranks);
}

std::vector<std::shared_ptr<JobMember>> Job::members_locked() const {
  std::vector<std::shared_ptr<JobMember>> out;
  for (auto& m : members_) {
    if (m) out.push_back(m);
  }
  return out;
}

bool Job::empty() const {
  std::lock_guard lock(mu_);
  return std::none_of(members_.begin(), members_.end(), [](auto& m) { return m != nullptr; }) &&
         !round_.awaiting_rejoin(Clock::now()) && stalled_.empty();
}

std::map<uint32_t, std::string> Job::departures() const {
  std::lock_guard lock(mu_);
  std::map<uint32_t, std::string> out = departed_;
  if (lost_) {
    for (uint32_t r : lost_ranks_) out[r] = lost_->message();
  }
  return out;
}

void Job::evict(const Status& why) {
  std::vector<std::shared_ptr<JobMember>> members;
  {
    std::lock_guard lock(mu_);
    if (!lost_) lost_ = why;
    stalled_.clear();
    fail_all_ops_locked(why, {}, Forward::kNo);
    members = members_locked();
  }
  for (auto& m : members) m->close(why);
}

void Job::retire(std::string why) {
  std::lock_guard lock(mu_);
  retired_ = true;
  retired_why_ = std::move(why);
}

bool Job::abandoned(Clock::time_point now) const {
  std::lock_guard lock(mu_);
  return std::none_of(members_.begin(), members_.end(), [](auto& m) { return m != nullptr; }) &&
         chunks_.empty() && early_.empty() && now - memberless_since_ > settings_.op_timeout;
}

}  // namespace tally
