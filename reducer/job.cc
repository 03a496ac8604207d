#include "tally/reducer/job.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "tally.pb.h"
#include "tally/protocol/control.h"
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

}  // namespace

Job::Job(JobSettings settings, std::shared_ptr<SlabQuota> quota, ReducerCounters& counters)
    : settings_(std::move(settings)),
      id_(job_id(settings_.name)),
      quota_(std::move(quota)),
      counters_(counters),
      members_(settings_.world_size) {}

Job::~Job() = default;

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
  members_[rank] = member;
  departed_.erase(rank);
  return Status::ok();
}

void Job::leave(const JobMember* member, const Status& why, bool goodbye) {
  std::lock_guard lock(mu_);
  const uint32_t rank = member->rank();
  if (rank >= members_.size() || members_[rank].get() != member) return;
  members_[rank] = nullptr;
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
    lost_rank_ = rank;
  }
  for (auto& [key, chunk] : chunks_) ops.insert(key.first);
  for (uint64_t op : ops) fail_op_locked(op, lost, {rank});
}

std::vector<std::shared_ptr<JobMember>> Job::members_locked() const {
  std::vector<std::shared_ptr<JobMember>> out;
  for (auto& m : members_) {
    if (m) out.push_back(m);
  }
  return out;
}

void Job::fail_op_locked(uint64_t op, const Status& status, const std::vector<uint32_t>& ranks) {
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
  }
  chunks_.erase(first, last);
  straggler_logged_.erase(op);
  spdlog::warn("job '{}' shard {} op {} failed: {}", name(), settings_.shard, op, status.to_string());
  for (auto& m : members_locked()) m->send_control(message);
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
    fail_op_locked(h.op, *lost_, {lost_rank_});
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
    chunk->seen.assign(settings_.world_size, false);
    chunk->contributors.assign(settings_.world_size, nullptr);
    chunks_.emplace(key, chunk);
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
    finished = chunk->added == settings_.world_size;
    if (finished) TALLY_CHECK(chunk->accumulator_ready && chunk->pending.empty());
  }
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
  if (lost_) out[lost_rank_] = lost_->message();
  return out;
}

void Job::sweep(Clock::time_point now) {
  std::lock_guard lock(mu_);
  std::map<uint64_t, std::vector<uint32_t>> missing;  // op -> ranks, for timed-out ops
  for (auto& [key, chunk] : chunks_) {
    const auto age = now - chunk->created;
    const bool timed_out = age > settings_.op_timeout;
    const bool straggling = age > settings_.op_timeout / 2;
    if (!timed_out && !(straggling && !straggler_logged_.count(key.first))) continue;
    std::vector<uint32_t> ranks;
    {
      std::lock_guard chunk_lock(chunk->mu);
      for (uint32_t r = 0; r < chunk->seen.size(); ++r) {
        if (!chunk->seen[r]) ranks.push_back(r);
      }
    }
    if (timed_out) {
      auto& all = missing[key.first];
      for (uint32_t r : ranks) {
        if (std::find(all.begin(), all.end(), r) == all.end()) all.push_back(r);
      }
    } else {
      straggler_logged_.insert(key.first);
      spdlog::warn("job '{}' shard {} op {} chunk {}: still waiting for ranks [{}] after {} ms",
                   name(), settings_.shard, key.first, key.second, ranks_string(ranks),
                   std::chrono::duration_cast<std::chrono::milliseconds>(age).count());
    }
  }
  for (auto& [op, ranks] : missing) {
    std::sort(ranks.begin(), ranks.end());
    fail_op_locked(op,
                   Status(ErrorCode::kTimeout,
                          "op " + std::to_string(op) + " of job '" + name() + "' timed out after " +
                              std::to_string(settings_.op_timeout.count()) + " ms on shard " +
                              std::to_string(settings_.shard) + " waiting for ranks [" +
                              ranks_string(ranks) + "]" + history_of(ranks)),
                   ranks);
  }
}

}  // namespace tally
