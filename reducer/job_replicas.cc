// Job's side of the replica groups (job.h): announcing the job to the
// other replicas of its shard, checking what they announce, taking their
// partials of its chunks, and their errors, departures and loss.
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
  if (replica.authenticated() != settings_.authenticated) {
    return Status(ErrorCode::kUnauthenticated,
                  "job '" + name() + "' is " + (settings_.authenticated ? "" : "not ") +
                      "authenticated on " + replica_name() + " but " +
                      (replica.authenticated() ? "" : "not ") + "on " + who +
                      " (give every rank the same TALLY_SECRET_FILE or TALLY_SECRET)");
  }
  return Status::ok();
}

std::shared_ptr<const wire::Control> Job::replica_job_message() const {
  auto message = std::make_shared<wire::Control>();
  auto* rj = message->mutable_replica_job();
  rj->set_job(name());
  rj->set_world_size(settings_.world_size);
  for (uint32_t size : settings_.group_sizes) rj->add_group_sizes(size);
  rj->set_op_timeout_ms(static_cast<uint32_t>(settings_.op_timeout.count()));
  rj->set_groups_explicit(settings_.groups_explicit);
  rj->set_authenticated(settings_.authenticated);
  return message;
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
  if (auto failed = failed_ops_.find(h.op); failed != failed_ops_.end()) {
    // It may not have heard of the failure yet.
    mesh_->send_control(from_group, replica_error_message(name(), failed->second->error()));
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
  return PayloadAction::receive(pending.slab->first(h.length));
}

void Job::on_partial_payload(const FrameHeader& h, PendingPartial& pending) {
  counters_.replica_bytes_received.fetch_add(h.length, std::memory_order_relaxed);
  std::shared_ptr<Slab> slab = std::move(pending.slab);
  const uint32_t from = pending.from_group;
  pending = {};
  std::shared_ptr<Chunk> chunk;
  {
    std::lock_guard lock(mu_);
    if (failed_ops_.count(h.op)) return;
    auto it = chunks_.find({h.op, h.chunk});
    if (it == chunks_.end()) {
      early_[{h.op, h.chunk}].push_back({from, h, std::move(slab), Clock::now()});
      return;
    }
    chunk = it->second;
  }
  Status why;
  const Chunk::Progress progress = chunk->on_partial(from, h, std::move(slab), butterfly_, why);
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

std::optional<Status> Job::left_group(uint32_t group) const {
  std::lock_guard lock(left_mu_);
  auto it = left_groups_.find(group);
  if (it == left_groups_.end()) return std::nullopt;
  return it->second;
}

void Job::on_replica_left(uint32_t group, const Status& why) {
  std::vector<std::shared_ptr<Chunk>> snapshot;
  {
    std::lock_guard lock(mu_);
    {
      std::lock_guard left_lock(left_mu_);
      left_groups_.emplace(group, why);
    }
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
  std::lock_guard lock(mu_);
  if (group == settings_.group ||
      std::find(participants_.begin(), participants_.end(), group) == participants_.end()) {
    return;
  }
  fail_all_ops_locked(why, {}, Forward::kYes);
}

}  // namespace tally
