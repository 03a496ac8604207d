// Job's side of the replica groups (job.h): announcing the job to the
// other replicas of its shard, checking what they announce, taking their
// partials of its chunks, and their errors, departures and loss.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/reducer/job.h"

namespace tally {
namespace {

std::string sizes_string(const std::vector<uint32_t>& sizes) {
  return "[" + ranks_string(sizes) + "]";
}

}  // namespace

std::string Job::replica_name() const {
  return tally::replica_name(settings_.shard, settings_.group);
}

Status Job::check_replica_settings(const wire::ReplicaJob& replica, const std::string& who) const {
  std::vector<uint32_t> sizes(replica.group_sizes().begin(), replica.group_sizes().end());
  if (replica.world_size() != settings_.world_size || sizes != settings_.group_sizes) {
    return Status(ErrorCode::kMismatch,
                  who + " has job '" + name() + "' with world size " +
                      std::to_string(replica.world_size()) + " and group sizes " +
                      sizes_string(sizes) + ", " + replica_name() + " has world size " +
                      std::to_string(settings_.world_size) + " and group sizes " +
                      sizes_string(settings_.group_sizes) +
                      " (every rank must use the same TALLY_GROUPS and groups)");
  }
  if (replica.deterministic() != settings_.deterministic) {
    return Status(ErrorCode::kMismatch,
                  "job '" + name() + "' has " + (settings_.deterministic ? "" : "no ") +
                      "reproducible sums on " + replica_name() + " but " +
                      (replica.deterministic() ? "" : "no ") + "reproducible sums on " + who +
                      " (set TALLY_DETERMINISTIC the same on every rank)");
  }
  if (replica.authenticated() != settings_.authenticated) {
    return Status(ErrorCode::kUnauthenticated,
                  "job '" + name() + "' is " + (settings_.authenticated ? "" : "not ") +
                      "authenticated on " + replica_name() + " but " +
                      (replica.authenticated() ? "" : "not ") + "on " + who +
                      " (give every rank the same TALLY_JOB_SECRET_FILE or TALLY_JOB_SECRET)");
  }
  return Status::ok();
}

std::shared_ptr<const wire::Control> Job::replica_job_message() const {
  std::lock_guard lock(mu_);
  return replica_job_message_locked();
}

std::shared_ptr<const wire::Control> Job::replica_job_message_locked() const {
  auto message = std::make_shared<wire::Control>();
  auto* rj = message->mutable_replica_job();
  rj->set_job(name());
  rj->set_world_size(settings_.world_size);
  for (uint32_t size : settings_.group_sizes) rj->add_group_sizes(size);
  rj->set_op_timeout_ms(static_cast<uint32_t>(settings_.op_timeout.count()));
  rj->set_groups_explicit(settings_.groups_explicit);
  rj->set_authenticated(settings_.authenticated);
  rj->set_deterministic(settings_.deterministic);
  rj->set_round(round_.number());
  if (marks_.group_known()) {
    rj->set_has_mark(true);
    rj->set_mark(marks_.group_mark());
  }
  return message;
}

uint64_t Job::round() const {
  std::lock_guard lock(mu_);
  return round_.number();
}

void Job::start_round_locked(uint64_t round, const std::string& why) {
  size_t dropped = 0;
  for (auto& [key, chunk] : chunks_) {
    chunk->fail();
    ++dropped;
  }
  chunks_.clear();
  early_.clear();
  op_timings_.clear();
  // Every member sends its ops in flight again on a new stream: chunks
  // this round has no result of as contributions, the others as replays.
  auto rejoin = std::make_shared<wire::Control>();
  rejoin->mutable_rejoin()->set_reason(why);
  std::set<uint32_t> asked;
  for (auto& m : members_) {
    if (!m) continue;
    m->send_control(rejoin);
    asked.insert(m->rank());
    m = nullptr;
  }
  const auto now = Clock::now();
  const size_t asked_count = asked.size();
  round_.start(round, std::move(asked), now + settings_.op_timeout);
  memberless_since_ = now;
  spdlog::info(
      "job '{}' shard {} group {} starts round {} ({}): {} chunks in flight dropped, {} "
      "workers asked to rejoin",
      name(), settings_.shard, settings_.group, round, why, dropped, asked_count);
  auto announce = replica_job_message_locked();
  for (uint32_t g : participants_) {
    if (g != settings_.group) mesh_->send_control(g, announce);
  }
}

void Job::on_replica_round(uint32_t group, uint64_t round, std::optional<uint64_t> mark) {
  std::vector<std::shared_ptr<JobMember>> members;
  std::shared_ptr<const wire::Control> released;
  {
    std::lock_guard lock(mu_);
    auto it = std::find(participants_.begin(), participants_.end(), group);
    if (it == participants_.end() || group == settings_.group) return;
    if (mark && (released = replica_said_mark_locked(group, *mark))) members = members_locked();
    if (round > round_.number()) {
      if (lost_ || retired_) {
        round_.skip_to(round);
      } else {
        start_round_locked(round, mesh_->describe(group) + " started round " +
                                      std::to_string(round) + " of the job");
        members.clear();
      }
    } else if (round < round_.number()) {
      // It has not heard of this round yet (it was restarted, or its
      // announcement crossed ours): this is what it needs to catch up.
      mesh_->send_control(group, replica_job_message_locked());
    }
  }
  for (auto& m : members) m->send_control(released);
  if (released) end_released_ops();
}

void Job::on_replica_mark(uint32_t group, uint64_t mark) {
  std::vector<std::shared_ptr<JobMember>> members;
  std::shared_ptr<const wire::Control> released;
  {
    std::lock_guard lock(mu_);
    auto it = std::find(participants_.begin(), participants_.end(), group);
    if (it == participants_.end() || group == settings_.group) return;
    released = replica_said_mark_locked(group, mark);
    if (!released) return;
    members = members_locked();
  }
  for (auto& m : members) m->send_control(released);
  end_released_ops();
}

PayloadAction Job::on_partial_header(uint32_t from_group, const FrameHeader& h,
                                     PendingPartial& pending, std::function<void()> wake) {
  std::lock_guard lock(mu_);
  if (std::find(participants_.begin(), participants_.end(), from_group) == participants_.end() ||
      from_group == settings_.group) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol, mesh_->describe(from_group) + " sent a partial of job '" +
                                         name() + "', in which its group has no workers"));
  }
  if (retired_) {
    mesh_->send_control(
        from_group,
        replica_error_message(
            name(), job_gone_here(settings_.shard, settings_.group, name(), retired_why_), h.op));
    return PayloadAction::discard();
  }
  // Rounds differ by far less than 128 between two replicas: the header's
  // 8 bits tell earlier from later (partials travel apart from the
  // ReplicaJob that announced their round on the fabric data path).
  const std::optional<uint64_t> round = round_.of_wire(h.round);
  if (!round) return PayloadAction::discard();
  if (*round > round_.number()) {
    if (lost_ || retired_) {
      round_.skip_to(*round);
    } else {
      start_round_locked(*round, mesh_->describe(from_group) + " sent a partial of round " +
                                     std::to_string(*round) + " of the job");
    }
  }
  if (stale_partial_locked(h)) return PayloadAction::discard();
  if (auto failed = failed_ops_.find(h.op)) {
    // It may not have heard of the failure yet.
    mesh_->send_control(from_group, replica_error_message(name(), failed->error()));
    return PayloadAction::discard();
  }
  if (lost_) {
    fail_op_locked(h.op, *lost_, lost_ranks_);
    return PayloadAction::discard();
  }
  auto slab = quota_->try_take(std::move(wake));
  if (!slab) return PayloadAction::pause();
  pending.slab = std::move(slab);
  pending.from_group = from_group;
  pending.round = round_.number();
  return PayloadAction::receive(pending.slab->first(h.length), pending.slab);
}

bool Job::stale_partial_locked(const FrameHeader& h) const {
  // Every rank of this group has the results of the ops below its least
  // mark, so their chunks here are finished: a partial for one was sent by
  // a replica that had not heard of a final result yet, and a final came
  // from a second replica with a replay.
  return h.op < marks_.released_below() || round_.final_finished({h.op, h.chunk});
}

void Job::on_partial_payload(const FrameHeader& h, PendingPartial& pending) {
  counters_.add(Count::kReplicaBytesReceived, h.length);
  std::shared_ptr<Slab> slab = std::move(pending.slab);
  const uint32_t from = pending.from_group;
  const uint64_t round = pending.round;
  pending = {};
  std::shared_ptr<Chunk> chunk;
  {
    std::lock_guard lock(mu_);
    // A new round began while it arrived, or it became unneeded.
    if (round != round_.number() || stale_partial_locked(h) || failed_ops_.contains(h.op)) return;
    auto it = chunks_.find({h.op, h.chunk});
    if (it == chunks_.end()) {
      early_.add(from, h, std::move(slab), Clock::now());
      return;
    }
    chunk = it->second;
  }
  Status why;
  const Chunk::Progress progress =
      (h.flags & kFrameFlagFinal)
          ? chunk->on_final(from, h, std::move(slab), local_size_, butterfly_, why)
          : chunk->on_partial(from, h, std::move(slab), butterfly_, why);
  settle(chunk, progress, why);
}

void Job::on_replica_error(const wire::Error& error) {
  std::lock_guard lock(mu_);
  const Status status = status_from_error(error);
  const std::vector<uint32_t> ranks(error.ranks().begin(), error.ranks().end());
  if (error.has_op()) return fail_op_locked(error.op(), status, ranks, Forward::kNo);
  if (!lost_) {
    lost_ = status;
    lost_ranks_ = ranks;
  }
  fail_all_ops_locked(status, ranks, Forward::kNo);
}

void Job::on_replica_left(uint32_t group, const Status& why) {
  std::vector<std::shared_ptr<Chunk>> snapshot;
  {
    std::lock_guard lock(mu_);
    left_groups_.add(group, why);
    for (auto& [key, chunk] : chunks_) snapshot.push_back(chunk);
  }
  // Partials from it arrived before this (one stream, in order), so a chunk
  // still missing one will never get it.
  for (auto& chunk : snapshot) {
    Status failed;
    const Chunk::Progress progress = chunk->on_replica_left(group, butterfly_, why, failed);
    settle(chunk, progress, failed);
  }
}

void Job::on_replica_lost(uint32_t group, const Status& why) {
  std::vector<std::shared_ptr<JobMember>> members;
  {
    std::lock_guard lock(mu_);
    if (group == settings_.group || lost_ || retired_ ||
        std::find(participants_.begin(), participants_.end(), group) == participants_.end()) {
      return;
    }
    members = members_locked();
  }
  auto notice = std::make_shared<wire::Control>();
  notice->mutable_replica_lost()->set_replica(mesh_->describe(group));
  notice->mutable_replica_lost()->set_reason(why.message());
  for (auto& m : members) m->send_control(notice);
}

void Job::on_replica_back(uint32_t group) {
  std::lock_guard lock(mu_);
  if (group == settings_.group ||
      std::find(participants_.begin(), participants_.end(), group) == participants_.end()) {
    return;
  }
  // Whatever it had summed of the ops in flight may be gone with it (a
  // restart), and its partials are part of every replica's sums: every
  // replica drops them and its workers send those ops again.
  if (lost_ || retired_) return;
  start_round_locked(round_.number() + 1, mesh_->describe(group) + " is back after a loss");
}

}  // namespace tally
