#include "tally/reducer/job.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/protocol/groups.h"
#include "tally/reducer/kernels.h"

namespace tally {

// How many failed op ids a job remembers to answer late contributions.
constexpr size_t kFailedOpsRemembered = 4096;

struct ChunkState {
  uint64_t op = 0;
  uint32_t chunk = 0;
  FrameHeader meta;  // the first rank's header: what every other rank must match
  Job::Clock::time_point created;

  std::mutex mu;
  std::shared_ptr<Slab> accumulator;
  bool accumulator_ready = false;
  std::vector<std::shared_ptr<Slab>> pending;
  std::vector<bool> seen;  // by rank: header accepted
  // by rank: the stream that contributed, so a rank that rejoined on a new
  // stream is not sent a sum it had no part in (compared, never dereferenced)
  std::vector<const JobMember*> contributors;
  uint32_t added = 0;         // payloads summed (or parked)
  bool failed = false;

  // The butterfly between replicas (empty with one participant).
  std::vector<ButterflyStep> steps;
  std::vector<std::shared_ptr<Slab>> arrived;  // by step: the partial received for it
  size_t step = 0;           // the step being run
  bool step_sent = false;    // its send has been posted
  uint32_t sends_pending = 0;
  bool local_done = false;   // every rank of this group has been added
  bool done_reported = false;
  Job::Clock::time_point deadline;
};

namespace {

std::string ranks_string(const std::vector<uint32_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(ranks[i]);
  }
  return out;
}

std::string shape(const FrameHeader& h) {
  return "count=" + std::to_string(h.count) + " " + std::string(dtype_name(h.dtype)) + " " +
         std::string(redop_name(h.redop)) + " chunk@" + std::to_string(h.offset) + "+" +
         std::to_string(h.length);
}

std::string sizes_string(const std::vector<uint32_t>& sizes) {
  return "[" + ranks_string(sizes) + "]";
}

}  // namespace

Job::Job(JobSettings settings, std::shared_ptr<SlabQuota> quota, ReducerCounters& counters,
         std::shared_ptr<ReplicaMesh> mesh)
    : settings_(std::move(settings)),
      id_(job_id(settings_.name)),
      quota_(std::move(quota)),
      counters_(counters),
      mesh_(std::move(mesh)),
      members_(settings_.world_size),
      memberless_since_(Clock::now()) {
  if (settings_.group_sizes.empty()) {
    participants_ = {settings_.group};
    local_size_ = settings_.world_size;
  } else {
    for (uint32_t g = 0; g < settings_.group_sizes.size(); ++g) {
      if (settings_.group_sizes[g] == 0) continue;
      if (g == settings_.group) my_index_ = static_cast<uint32_t>(participants_.size());
      participants_.push_back(g);
    }
    TALLY_CHECK_LT(settings_.group, settings_.group_sizes.size());
    local_size_ = settings_.group_sizes[settings_.group];
  }
  TALLY_CHECK(participants_.size() == 1 || mesh_ != nullptr);
}

Job::~Job() = default;

size_t Job::quota_slabs(uint32_t window, size_t participants) {
  const size_t receives = butterfly_max_receives(static_cast<uint32_t>(participants));
  return size_t{window} * (1 + 2 * receives) + 2;
}

std::string Job::replica_name() const {
  return "replica (shard " + std::to_string(settings_.shard) + ", group " +
         std::to_string(settings_.group) + ")";
}

Status Job::check_peer_settings(const wire::PeerJob& peer, const std::string& who) const {
  std::vector<uint32_t> sizes(peer.group_sizes().begin(), peer.group_sizes().end());
  if (peer.world_size() != settings_.world_size || sizes != settings_.group_sizes) {
    return Status(ErrorCode::kMismatch,
                  who + " has job '" + name() + "' with world size " + std::to_string(peer.world_size()) +
                      " and group sizes " + sizes_string(sizes) + ", " + replica_name() +
                      " has world size " + std::to_string(settings_.world_size) + " and group sizes " +
                      sizes_string(settings_.group_sizes) + " (every rank must use the same TALLY_GROUPS and groups)");
  }
  return Status::ok();
}

std::shared_ptr<const wire::Control> Job::peer_job_message() const {
  auto message = std::make_shared<wire::Control>();
  auto* pj = message->mutable_peer_job();
  pj->set_job(name());
  pj->set_world_size(settings_.world_size);
  for (uint32_t size : settings_.group_sizes) pj->add_group_sizes(size);
  pj->set_op_timeout_ms(static_cast<uint32_t>(settings_.op_timeout.count()));
  pj->set_groups_explicit(settings_.groups_explicit);
  return message;
}

Status Job::join(const std::shared_ptr<JobMember>& member) {
  std::lock_guard lock(mu_);
  const uint32_t rank = member->rank();
  TALLY_CHECK_LT(rank, settings_.world_size);
  if (lost_) {
    return Status(ErrorCode::kUnavailable,
                  "job '" + name() + "' has failed (" + lost_->message() +
                      "); every worker must disconnect before the job can start again");
  }
  if (members_[rank]) {
    return Status(ErrorCode::kAlreadyExists, "rank " + std::to_string(rank) + " of job '" +
                                                 name() + "' is already connected from " +
                                                 members_[rank]->peer());
  }
  if (!joined_.count(rank) && joined_.size() >= local_size_) {
    return Status(ErrorCode::kInvalidArgument,
                  "group " + std::to_string(settings_.group) + " of job '" + name() + "' already has its " +
                      std::to_string(local_size_) + " workers (ranks " +
                      ranks_string(std::vector<uint32_t>(joined_.begin(), joined_.end())) + "); rank " +
                      std::to_string(rank) + " cannot join it (check TALLY_GROUP_SIZES)");
  }
  members_[rank] = member;
  joined_.insert(rank);
  departed_.erase(rank);
  return Status::ok();
}

void Job::leave(const JobMember* member, const Status& why, bool goodbye) {
  std::lock_guard lock(mu_);
  const uint32_t rank = member->rank();
  if (rank >= members_.size() || members_[rank].get() != member) return;
  members_[rank] = nullptr;
  if (std::none_of(members_.begin(), members_.end(), [](auto& m) { return m != nullptr; })) {
    memberless_since_ = Clock::now();
  }
  std::set<uint64_t> ops;
  if (goodbye) {
    departed_[rank] = why.message();
    for (auto& [key, chunk] : chunks_) {
      std::lock_guard chunk_lock(chunk->mu);
      if (!chunk->seen[rank]) ops.insert(key.first);
    }
    const Status gone(ErrorCode::kPeerLost, "rank " + std::to_string(rank) + " (" + member->peer() +
                                                ") left job '" + name() +
                                                "' before contributing (it said: " + why.message() + ")");
    for (uint64_t op : ops) fail_op_locked(op, gone, {rank});
    return;
  }
  const Status lost(ErrorCode::kPeerLost, "rank " + std::to_string(rank) + " (" + member->peer() +
                                              ") of job '" + name() + "' was lost: " + why.message());
  if (!lost_) {
    lost_ = lost;
    lost_ranks_ = {rank};
  }
  for (auto& [key, chunk] : chunks_) ops.insert(key.first);
  for (auto& [key, early] : early_) ops.insert(key.first);
  for (uint64_t op : ops) fail_op_locked(op, lost, {rank});
}

std::vector<std::shared_ptr<JobMember>> Job::members_locked() const {
  std::vector<std::shared_ptr<JobMember>> out;
  for (auto& m : members_) {
    if (m) out.push_back(m);
  }
  return out;
}

void Job::fail_op_locked(uint64_t op, const Status& status, const std::vector<uint32_t>& ranks,
                         bool forward) {
  if (failed_ops_.count(op)) return;
  auto message = std::make_shared<const wire::Control>(make_error(status, op, ranks));
  failed_ops_.emplace(op, message);
  failed_order_.push_back(op);
  if (failed_order_.size() > kFailedOpsRemembered) {
    failed_ops_.erase(failed_order_.front());
    failed_order_.pop_front();
  }
  counters_.ops_failed.fetch_add(1, std::memory_order_relaxed);
  auto first = chunks_.lower_bound({op, 0});
  auto last = chunks_.lower_bound({op + 1, 0});
  for (auto it = first; it != last; ++it) {
    std::lock_guard chunk_lock(it->second->mu);
    it->second->failed = true;
    it->second->accumulator.reset();
    it->second->pending.clear();
    it->second->arrived.clear();
  }
  chunks_.erase(first, last);
  early_.erase(early_.lower_bound({op, 0}), early_.lower_bound({op + 1, 0}));
  straggler_logged_.erase(op);
  spdlog::warn("job '{}' shard {} group {} op {} failed: {}", name(), settings_.shard, settings_.group, op,
               status.to_string());
  for (auto& m : members_locked()) m->send_control(message);
  if (forward && participants_.size() > 1) {
    auto peer_error = std::make_shared<wire::Control>();
    peer_error->mutable_peer_error()->set_job(name());
    *peer_error->mutable_peer_error()->mutable_error() =
        make_error(status.with_context("on " + replica_name()), op, ranks).error();
    for (uint32_t g : participants_) {
      if (g != settings_.group) mesh_->send_control(g, peer_error);
    }
  }
}

PayloadAction Job::on_contribution_header(const std::shared_ptr<JobMember>& member,
                                          const FrameHeader& h, PendingContribution& pending) {
  std::unique_lock lock(mu_);
  if (auto failed = failed_ops_.find(h.op); failed != failed_ops_.end()) {
    // This member may have joined after the failure was announced.
    member->send_control(failed->second);
    return PayloadAction::discard();
  }
  if (lost_) {
    fail_op_locked(h.op, *lost_, lost_ranks_);
    return PayloadAction::discard();
  }
  if (!kernel_supports(h.dtype)) {
    fail_op_locked(h.op,
                   Status(ErrorCode::kUnimplemented, "rank " + std::to_string(h.rank) + " sent " +
                                                         std::string(dtype_name(h.dtype)) +
                                                         ", which this reducer cannot sum yet"),
                   {h.rank});
    return PayloadAction::discard();
  }
  const ChunkKey key{h.op, h.chunk};
  auto it = chunks_.find(key);
  std::shared_ptr<ChunkState> chunk;
  if (it == chunks_.end()) {
    chunk = std::make_shared<ChunkState>();
    chunk->op = h.op;
    chunk->chunk = h.chunk;
    chunk->meta = h;
    chunk->created = Clock::now();
    chunk->deadline = chunk->created + settings_.op_timeout;
    chunk->seen.assign(settings_.world_size, false);
    chunk->contributors.assign(settings_.world_size, nullptr);
    if (participants_.size() > 1) {
      chunk->steps = butterfly_schedule(static_cast<uint32_t>(participants_.size()), my_index_,
                                        h.length / dtype_size(h.dtype));
      chunk->arrived.resize(chunk->steps.size());
    }
    chunks_.emplace(key, chunk);
    if (auto early = early_.find(key); early != early_.end()) {
      std::vector<EarlyPartial> partials = std::move(early->second);
      early_.erase(early);
      for (auto& p : partials) {
        Status placed;
        {
          std::lock_guard chunk_lock(chunk->mu);
          placed = place_locked(*chunk, p.from_group, p.header, std::move(p.slab));
        }
        if (!placed.is_ok()) {
          fail_op_locked(h.op, placed, {});
          return PayloadAction::discard();
        }
      }
    }
  } else {
    chunk = it->second;
  }
  const FrameHeader& m = chunk->meta;
  if (m.count != h.count || m.dtype != h.dtype || m.redop != h.redop || m.offset != h.offset ||
      m.length != h.length) {
    fail_op_locked(h.op,
                   Status(ErrorCode::kMismatch,
                          "contributions to op " + std::to_string(h.op) + " disagree: rank " +
                              std::to_string(m.rank) + " sent " + shape(m) + ", rank " +
                              std::to_string(h.rank) + " sent " + shape(h)),
                   {m.rank, h.rank});
    return PayloadAction::discard();
  }
  std::unique_lock chunk_lock(chunk->mu);
  // Checked after agreement, so a mismatch is reported as such even when a
  // rank that saw it has already left.
  for (auto& [gone, reason] : departed_) {
    if (chunk->seen[gone]) continue;
    chunk_lock.unlock();
    fail_op_locked(h.op,
                   Status(ErrorCode::kPeerLost, "rank " + std::to_string(gone) + " has left job '" +
                                                    name() + "' (it said: " + reason + "); op " +
                                                    std::to_string(h.op) +
                                                    " cannot complete without it"),
                   {gone});
    return PayloadAction::discard();
  }
  if (chunk->seen[h.rank]) {
    return PayloadAction::close(Status(
        ErrorCode::kProtocol, "rank " + std::to_string(h.rank) + " contributed twice to op " +
                                  std::to_string(h.op) + " chunk " + std::to_string(h.chunk)));
  }
  std::weak_ptr<JobMember> weak = member;
  auto slab = quota_->try_take([weak] {
    if (auto m = weak.lock()) m->wake();
  });
  if (!slab) return PayloadAction::pause();
  chunk->seen[h.rank] = true;
  chunk->contributors[h.rank] = member.get();
  pending.chunk = chunk;
  pending.owner = chunk->accumulator == nullptr;
  if (pending.owner) chunk->accumulator = slab;
  pending.slab = std::move(slab);
  return PayloadAction::receive(pending.slab->first(h.length));
}

void Job::on_contribution_payload(const FrameHeader& h, PendingContribution& pending) {
  counters_.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
  std::shared_ptr<ChunkState> chunk = std::move(pending.chunk);
  std::shared_ptr<Slab> slab = std::move(pending.slab);
  const bool owner = pending.owner;
  pending.reset();
  bool finished = false;
  std::optional<std::pair<Progress, Status>> pending_settle;
  {
    std::lock_guard chunk_lock(chunk->mu);
    if (chunk->failed) return;
    const DType dtype = chunk->meta.dtype;
    const size_t nbytes = chunk->meta.length;
    if (owner) {
      chunk->accumulator_ready = true;
      for (auto& p : chunk->pending) reduce_into(dtype, chunk->accumulator->data(), p->data(), nbytes);
      chunk->pending.clear();
    } else if (chunk->accumulator_ready) {
      reduce_into(dtype, chunk->accumulator->data(), slab->data(), nbytes);
    } else {
      chunk->pending.push_back(std::move(slab));
    }
    slab.reset();
    chunk->added++;
    finished = chunk->added == local_size_;
    if (finished) TALLY_CHECK(chunk->accumulator_ready && chunk->pending.empty());
    if (finished && !chunk->steps.empty()) {
      chunk->local_done = true;
      Status why;
      const Progress progress = advance_locked(chunk, why);
      finished = false;
      // settle() takes the job lock: leave the chunk's scope first.
      pending_settle = {progress, why};
    }
  }
  if (pending_settle) return settle(chunk, pending_settle->first, pending_settle->second);
  if (finished) finish(chunk);
}

void Job::finish(const std::shared_ptr<ChunkState>& chunk) {
  std::vector<std::shared_ptr<JobMember>> members;
  {
    std::lock_guard lock(mu_);
    auto it = chunks_.find({chunk->op, chunk->chunk});
    if (it == chunks_.end() || it->second != chunk) return;  // failed meanwhile
    chunks_.erase(it);
    straggler_logged_.erase(chunk->op);
    for (uint32_t r = 0; r < members_.size(); ++r) {
      if (members_[r] && members_[r].get() == chunk->contributors[r]) members.push_back(members_[r]);
    }
  }
  // No other thread touches a chunk after it left the map and all payloads are in.
  std::shared_ptr<Slab> result = std::move(chunk->accumulator);
  FrameHeader out = chunk->meta;
  if (out.redop == RedOp::kAverage) {
    scale_average(out.dtype, result->data(), out.length, settings_.world_size);
  }
  out.kind = FrameKind::kResult;
  out.rank = kReducerRank;
  counters_.chunks_finished.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_sent.fetch_add(out.length * members.size(), std::memory_order_relaxed);
  for (auto& m : members) m->send_result(out, result);
}

std::string Job::history_of(const std::vector<uint32_t>& ranks) const {
  std::string out;
  for (uint32_t r : ranks) {
    auto it = settings_.history.find(r);
    if (it != settings_.history.end()) out += " (rank " + std::to_string(r) + " left earlier: " + it->second + ")";
  }
  return out;
}

bool Job::empty() const {
  std::lock_guard lock(mu_);
  return std::none_of(members_.begin(), members_.end(), [](auto& m) { return m != nullptr; });
}

std::map<uint32_t, std::string> Job::departures() const {
  std::lock_guard lock(mu_);
  std::map<uint32_t, std::string> out = departed_;
  if (lost_) {
    for (uint32_t r : lost_ranks_) out[r] = lost_->message();
  }
  return out;
}

std::vector<uint32_t> Job::missing_locked(const ChunkState& chunk, std::string* note) const {
  std::vector<uint32_t> ranks;
  if (!settings_.groups_explicit) {
    const uint32_t groups = settings_.group_sizes.empty() ? 1 : static_cast<uint32_t>(settings_.group_sizes.size());
    for (uint32_t r = 0; r < chunk.seen.size(); ++r) {
      if (!chunk.seen[r] && (groups == 1 || default_group_of(r, settings_.world_size, groups) == settings_.group)) {
        ranks.push_back(r);
      }
    }
    return ranks;
  }
  // Explicit groups: only the ranks that joined are known to be ours.
  for (uint32_t r : joined_) {
    if (!chunk.seen[r]) ranks.push_back(r);
  }
  if (joined_.size() < local_size_ && note) {
    *note = " and " + std::to_string(local_size_ - joined_.size()) + " worker(s) of group " +
            std::to_string(settings_.group) + " that never joined";
  }
  return ranks;
}

void Job::sweep(Clock::time_point now) {
  std::lock_guard lock(mu_);
  struct Overdue {
    std::vector<uint32_t> ranks;
    std::string note;
    std::optional<uint32_t> replica;  // waiting for this group's partial
  };
  std::map<uint64_t, Overdue> overdue;  // op -> what it waits for, for timed-out ops
  for (auto& [key, chunk] : chunks_) {
    const auto age = now - chunk->created;
    const bool timed_out = age > settings_.op_timeout;
    const bool straggling = age > settings_.op_timeout / 2;
    if (!timed_out && !(straggling && !straggler_logged_.count(key.first))) continue;
    std::vector<uint32_t> ranks;
    std::string note;
    std::optional<uint32_t> replica;
    {
      std::lock_guard chunk_lock(chunk->mu);
      if (chunk->local_done) {
        if (chunk->step < chunk->steps.size()) replica = participants_[chunk->steps[chunk->step].partner];
      } else {
        ranks = missing_locked(*chunk, &note);
      }
    }
    if (timed_out) {
      Overdue& o = overdue[key.first];
      for (uint32_t r : ranks) {
        if (std::find(o.ranks.begin(), o.ranks.end(), r) == o.ranks.end()) o.ranks.push_back(r);
      }
      if (!note.empty()) o.note = note;
      if (replica && !o.replica) o.replica = replica;
    } else {
      straggler_logged_.insert(key.first);
      if (replica) {
        spdlog::warn("job '{}' shard {} op {} chunk {}: still waiting for {} after {} ms", name(),
                     settings_.shard, key.first, key.second, mesh_->describe(*replica),
                     std::chrono::duration_cast<std::chrono::milliseconds>(age).count());
      } else {
        spdlog::warn("job '{}' shard {} op {} chunk {}: still waiting for ranks [{}]{} after {} ms", name(),
                     settings_.shard, key.first, key.second, ranks_string(ranks), note,
                     std::chrono::duration_cast<std::chrono::milliseconds>(age).count());
      }
    }
  }
  // Partials whose chunk never got a local contribution: every rank of
  // this group is missing.
  for (auto& [key, partials] : early_) {
    if (partials.empty() || now - partials.front().arrived <= settings_.op_timeout) continue;
    if (overdue.count(key.first)) continue;
    ChunkState none;
    none.seen.assign(settings_.world_size, false);
    Overdue& o = overdue[key.first];
    o.ranks = missing_locked(none, &o.note);
  }
  for (auto& [op, o] : overdue) {
    std::sort(o.ranks.begin(), o.ranks.end());
    std::string what = o.ranks.empty() && o.replica ? mesh_->describe(*o.replica)
                                                    : "ranks [" + ranks_string(o.ranks) + "]" + o.note;
    fail_op_locked(op,
                   Status(ErrorCode::kTimeout,
                          "op " + std::to_string(op) + " of job '" + name() + "' timed out after " +
                              std::to_string(settings_.op_timeout.count()) + " ms on shard " +
                              std::to_string(settings_.shard) +
                              (participants_.size() > 1 ? " group " + std::to_string(settings_.group) : "") +
                              " waiting for " + what + history_of(o.ranks)),
                   o.ranks);
  }
}

// ---------------------------------------------------------------------------
// The butterfly between replicas.

Status Job::place_locked(ChunkState& chunk, uint32_t from_group, const FrameHeader& h,
                         std::shared_ptr<Slab> slab) {
  const FrameHeader& m = chunk.meta;
  const size_t esize = dtype_size(m.dtype);
  const std::string who = mesh_->describe(from_group);
  auto bad = [&](const std::string& why) {
    return Status(ErrorCode::kMismatch, "partial of op " + std::to_string(h.op) + " chunk " +
                                            std::to_string(h.chunk) + " from " + who + " " + why);
  };
  if (h.count != m.count || h.dtype != m.dtype || h.redop != m.redop) {
    return bad("disagrees with this group's contributions: it has " + shape(h) + ", here " + shape(m));
  }
  for (size_t i = 0; i < chunk.steps.size(); ++i) {
    const ButterflyStep& s = chunk.steps[i];
    if (participants_[s.partner] != from_group || s.tag != h.rank || s.recv.empty()) continue;
    if (h.offset != m.offset + s.recv.begin * esize || h.length != s.recv.size() * esize) {
      return bad("covers bytes [" + std::to_string(h.offset) + ", +" + std::to_string(h.length) +
                 "), the butterfly expects [" + std::to_string(m.offset + s.recv.begin * esize) + ", +" +
                 std::to_string(s.recv.size() * esize) + ") (do the replicas' group sizes agree?)");
    }
    if (chunk.arrived[i] || i < chunk.step) return bad("arrived twice");
    chunk.arrived[i] = std::move(slab);
    return Status::ok();
  }
  return bad("has tag " + std::to_string(h.rank) + ", which this replica's butterfly does not expect from it");
}

Job::Progress Job::advance_locked(const std::shared_ptr<ChunkState>& chunk, Status& why) {
  ChunkState& c = *chunk;
  if (c.failed || c.done_reported) return Progress::kWaiting;
  const size_t esize = dtype_size(c.meta.dtype);
  while (c.step < c.steps.size()) {
    const ButterflyStep& s = c.steps[c.step];
    const uint32_t group = participants_[s.partner];
    if (!c.step_sent) {
      c.step_sent = true;
      if (!s.send.empty()) {
        if (auto lost = mesh_->lost(group)) {
          why = *lost;
          return Progress::kFailed;
        }
        FrameHeader h = c.meta;
        h.kind = FrameKind::kPartial;
        h.rank = s.tag;
        h.offset = c.meta.offset + s.send.begin * esize;
        h.length = s.send.size() * esize;
        c.sends_pending++;
        counters_.replica_bytes_sent.fetch_add(h.length, std::memory_order_relaxed);
        mesh_->send_partial(group, h, c.accumulator, s.send.begin * esize, c.deadline,
                            [self = shared_from_this(), chunk](const Status& status) {
                              self->on_partial_sent(chunk, status);
                            });
      }
    }
    if (!s.recv.empty()) {
      if (!c.arrived[c.step]) {
        if (auto lost = mesh_->lost(group)) {
          why = *lost;
          return Progress::kFailed;
        }
        if (auto left = left_group(group)) {
          why = *left;
          return Progress::kFailed;
        }
        return Progress::kWaiting;
      }
      // Never write into the accumulator while a send still reads it.
      if (c.sends_pending > 0) return Progress::kWaiting;
      std::byte* dst = c.accumulator->data() + s.recv.begin * esize;
      const std::byte* src = c.arrived[c.step]->data();
      if (s.apply == ButterflyStep::Apply::kAdd) {
        reduce_into(c.meta.dtype, dst, src, s.recv.size() * esize);
      } else {
        std::memcpy(dst, src, s.recv.size() * esize);
      }
      c.arrived[c.step].reset();
    }
    c.step++;
    c.step_sent = false;
  }
  if (c.sends_pending > 0) return Progress::kWaiting;
  c.done_reported = true;
  return Progress::kDone;
}

void Job::settle(const std::shared_ptr<ChunkState>& chunk, Progress progress, const Status& why) {
  if (progress == Progress::kDone) return finish(chunk);
  if (progress == Progress::kFailed) {
    std::lock_guard lock(mu_);
    fail_op_locked(chunk->op, why, {});
  }
}

void Job::on_partial_sent(const std::shared_ptr<ChunkState>& chunk, const Status& status) {
  Progress progress = Progress::kWaiting;
  Status why;
  {
    std::lock_guard chunk_lock(chunk->mu);
    chunk->sends_pending--;
    if (chunk->failed) return;
    if (!status.is_ok()) {
      why = status;
      progress = Progress::kFailed;
    } else if (chunk->local_done) {
      progress = advance_locked(chunk, why);
    }
  }
  settle(chunk, progress, why);
}

PayloadAction Job::on_partial_header(uint32_t from_group, const FrameHeader& h,
                                     PendingPartial& pending, std::function<void()> wake) {
  std::lock_guard lock(mu_);
  if (std::find(participants_.begin(), participants_.end(), from_group) == participants_.end() ||
      from_group == settings_.group) {
    return PayloadAction::close(Status(ErrorCode::kProtocol, mesh_->describe(from_group) +
                                                                 " sent a partial of job '" + name() +
                                                                 "', in which its group has no workers"));
  }
  auto answer = [&](const wire::Control& error) {
    auto reply = std::make_shared<wire::Control>();
    reply->mutable_peer_error()->set_job(name());
    *reply->mutable_peer_error()->mutable_error() = error.error();
    mesh_->send_control(from_group, reply);
  };
  if (retired_) {
    answer(make_error(Status(ErrorCode::kPeerLost, replica_name() + " no longer has job '" + name() +
                                                       "': " + retired_why_),
                      h.op));
    return PayloadAction::discard();
  }
  if (auto failed = failed_ops_.find(h.op); failed != failed_ops_.end()) {
    answer(*failed->second);  // it may not have heard of the failure yet
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
  std::shared_ptr<ChunkState> chunk;
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
  Progress progress = Progress::kWaiting;
  Status why;
  {
    std::lock_guard chunk_lock(chunk->mu);
    if (chunk->failed) return;
    why = place_locked(*chunk, from, h, std::move(slab));
    if (!why.is_ok()) {
      progress = Progress::kFailed;
    } else if (chunk->local_done) {
      progress = advance_locked(chunk, why);
    }
  }
  settle(chunk, progress, why);
}

void Job::on_peer_error(const wire::Error& error) {
  std::lock_guard lock(mu_);
  const Status status = status_from_error(error);
  const std::vector<uint32_t> ranks(error.ranks().begin(), error.ranks().end());
  if (error.has_op()) return fail_op_locked(error.op(), status, ranks, /*forward=*/false);
  if (!lost_) {
    lost_ = status;
    lost_ranks_ = ranks;
  }
  std::set<uint64_t> ops;
  for (auto& [key, chunk] : chunks_) ops.insert(key.first);
  for (auto& [key, early] : early_) ops.insert(key.first);
  for (uint64_t op : ops) fail_op_locked(op, status, ranks, /*forward=*/false);
}

std::optional<Status> Job::left_group(uint32_t group) const {
  std::lock_guard lock(left_mu_);
  auto it = left_groups_.find(group);
  if (it == left_groups_.end()) return std::nullopt;
  return it->second;
}

void Job::on_replica_left(uint32_t group, const Status& why) {
  std::vector<std::shared_ptr<ChunkState>> snapshot;
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
    Progress progress = Progress::kWaiting;
    Status failed;
    {
      std::lock_guard chunk_lock(chunk->mu);
      if (chunk->failed) continue;
      for (size_t i = chunk->step; i < chunk->steps.size(); ++i) {
        const ButterflyStep& s = chunk->steps[i];
        if (participants_[s.partner] == group && !s.recv.empty() && !chunk->arrived[i]) {
          progress = Progress::kFailed;
          failed = why;
          break;
        }
      }
    }
    settle(chunk, progress, failed);
  }
}

void Job::on_replica_lost(uint32_t group, const Status& why) {
  std::lock_guard lock(mu_);
  if (group == settings_.group ||
      std::find(participants_.begin(), participants_.end(), group) == participants_.end()) {
    return;
  }
  std::set<uint64_t> ops;
  for (auto& [key, chunk] : chunks_) ops.insert(key.first);
  for (auto& [key, early] : early_) ops.insert(key.first);
  for (uint64_t op : ops) fail_op_locked(op, why, {});
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
