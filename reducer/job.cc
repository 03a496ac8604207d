#include "tally/reducer/job.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "tally.pb.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/control.h"
#include "tally/reducer/kernels.h"

namespace tally {

namespace {

// Error messages list at most this many ranks, then a count, so that an
// error about a huge job still fits a control frame and reaches the worker.
constexpr size_t kRanksListed = 16;

}  // namespace

std::string ranks_string(const std::vector<uint32_t>& ranks) {
  std::string out;
  const size_t listed = std::min(ranks.size(), kRanksListed);
  for (size_t i = 0; i < listed; ++i) {
    if (i > 0) out += ",";
    out += std::to_string(ranks[i]);
  }
  if (ranks.size() > listed) out += " and " + std::to_string(ranks.size() - listed) + " more";
  return out;
}

namespace {

// The groups with workers in the job, in order (one, where there are none).
std::vector<uint32_t> participating_groups(const JobSettings& settings) {
  if (settings.group_sizes.empty()) return {settings.group};
  TALLY_CHECK_LT(settings.group, settings.group_sizes.size());
  std::vector<uint32_t> groups;
  for (uint32_t g = 0; g < settings.group_sizes.size(); ++g) {
    if (settings.group_sizes[g] > 0) groups.push_back(g);
  }
  return groups;
}

// Reproducible sums with replica groups: by participant index, the cover of
// its group's ranks (sum_tree.h).
std::vector<std::vector<TreeNode>> participant_covers(const JobSettings& settings,
                                                      const std::vector<uint32_t>& participants) {
  if (!settings.deterministic || participants.size() < 2) return {};
  const auto covers = sum_tree_covers(settings.group_sizes);
  std::vector<std::vector<TreeNode>> out;
  for (uint32_t g : participants) out.push_back(covers[g]);
  return out;
}

// Where `group` is in `groups` (0 if it has no workers in the job).
uint32_t index_of_group(const std::vector<uint32_t>& groups, uint32_t group) {
  auto it = std::find(groups.begin(), groups.end(), group);
  return it == groups.end() ? 0 : static_cast<uint32_t>(it - groups.begin());
}

}  // namespace

Job::Job(JobSettings settings, std::shared_ptr<SlabQuota> quota, ReducerCounters& counters,
         std::shared_ptr<ReplicaMesh> mesh)
    : settings_(std::move(settings)),
      id_(job_id(settings_.name)),
      quota_(std::move(quota)),
      counters_(counters),
      mesh_(std::move(mesh)),
      participants_(participating_groups(settings_)),
      my_index_(index_of_group(participants_, settings_.group)),
      local_size_(settings_.group_sizes.empty() ? settings_.world_size
                                                : settings_.group_sizes[settings_.group]),
      tree_covers_(participant_covers(settings_, participants_)),
      butterfly_{participants_,
                 mesh_.get(),
                 counters_[Count::kReplicaBytesSent],
                 [this](uint32_t group) { return left_groups_.find(group); },
                 [this](std::shared_ptr<Chunk> chunk) -> ReplicaMesh::SendDone {
                   return [self = shared_from_this(), chunk](const Status& status) {
                     Status why;
                     const Chunk::Progress progress = chunk->on_sent(status, self->butterfly_, why);
                     self->settle(chunk, progress, why);
                   };
                 },
                 tree_covers_,
                 my_index_},
      members_(settings_.world_size),
      memberless_since_(Clock::now()),
      round_(settings_.round),
      marks_(settings_.world_size, local_size_, participants_.size(), my_index_) {
  TALLY_CHECK(participants_.size() == 1 || mesh_ != nullptr);
}

// Slabs still out (a provider holding one after its stream was given up)
// keep themselves out of the pool, not the job's whole reservation.
Job::~Job() {
  if (quota_) quota_->retire();
}

size_t Job::quota_slabs(uint32_t window, size_t participants) {
  const size_t receives = butterfly_max_receives(static_cast<uint32_t>(participants));
  return size_t{window} * (1 + 2 * receives) + 2;
}

size_t Job::deterministic_quota_slabs(uint32_t window, uint32_t local, size_t received) {
  return size_t{window} * (local + 2 * received) + 2;
}

uint32_t Job::deterministic_window(uint32_t window, uint32_t local, size_t received,
                                   size_t free_slabs) {
  const size_t per_chunk = std::max<size_t>(local + 2 * received, 1);
  const size_t fits = free_slabs > 2 ? (free_slabs - 2) / per_chunk : 0;
  return static_cast<uint32_t>(std::clamp<size_t>(fits, 1, std::max<uint32_t>(window, 1)));
}

uint32_t Job::window_chunks(uint32_t window) const {
  return settings_.window_chunks ? settings_.window_chunks : window;
}

void Job::fail_op_locked(uint64_t op, const Status& status, const std::vector<uint32_t>& ranks,
                         Forward forward) {
  if (failed_ops_.contains(op)) return;
  auto message = std::make_shared<const wire::Control>(make_error(status, op, ranks));
  failed_ops_.add(op, message);
  auto first = chunks_.lower_bound({op, 0});
  auto last = chunks_.lower_bound({op + 1, 0});
  size_t failed_chunks = 0;
  for (auto it = first; it != last; ++it, ++failed_chunks) it->second->fail();
  counters_.count_op_failed(status.code(), failed_chunks);
  chunks_.erase(first, last);
  op_timings_.forget(op);
  early_.drop_op(op);
  spdlog::warn("job '{}' shard {} group {} op {} failed: {}", name(), settings_.shard,
               settings_.group, op, status.to_string());
  for (auto& m : members_locked()) m->send_control(message);
  if (forward == Forward::kYes && participants_.size() > 1) {
    auto error =
        replica_error_message(name(), status.with_context("on " + replica_name()), op, ranks);
    for (uint32_t g : participants_) {
      if (g != settings_.group) mesh_->send_control(g, error);
    }
  }
}

void Job::fail_all_ops_locked(const Status& status, const std::vector<uint32_t>& ranks,
                              Forward forward) {
  std::set<uint64_t> ops = early_.ops();
  for (auto& [key, chunk] : chunks_) ops.insert(key.first);
  for (uint64_t op : ops) fail_op_locked(op, status, ranks, forward);
}

namespace {

// A replay is checked and filed as the contribution it stands for: the same
// chunk, whose result has the replay's length and flags.
FrameHeader as_contribution(const FrameHeader& replay) {
  FrameHeader h = replay;
  h.kind = FrameKind::kContribution;
  if (replay.flags & kFrameFlagAccumulators) {  // 16-bit ops only (decode_header)
    h.flags = kFrameFlagWideResult;
    h.length =
        replay.length / dtype_size(accumulator_dtype(replay.dtype)) * dtype_size(replay.dtype);
  }
  return h;
}

// Why a reducer whose chunk buffers hold `max_chunk_bytes` (0: unbounded)
// cannot sum contribution `h`, if it cannot.
std::optional<Status> unsummable(const FrameHeader& h, size_t max_chunk_bytes) {
  if (!kernel_supports(h.dtype)) {
    return Status(ErrorCode::kUnimplemented, "rank " + std::to_string(h.rank) + " sent " +
                                                 std::string(dtype_name(h.dtype)) +
                                                 ", which this reducer cannot sum yet");
  }
  const uint64_t elements = h.length / dtype_size(h.dtype);
  if (const uint64_t most = max_chunk_elements(max_chunk_bytes, h.dtype);
      max_chunk_bytes > 0 && elements > most) {
    return Status(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(h.rank) + " sent a chunk of " +
                      std::to_string(elements) + " " + std::string(dtype_name(h.dtype)) +
                      " elements; this reducer sums at most " + std::to_string(most) +
                      " per chunk (" + std::to_string(max_chunk_bytes) +
                      "-byte buffers, 16-bit types accumulate in float32: lower "
                      "TALLY_CHUNK_BYTES)");
  }
  return std::nullopt;
}

}  // namespace

PayloadAction Job::on_contribution_header(const std::shared_ptr<JobMember>& member,
                                          const FrameHeader& frame, PendingContribution& pending) {
  const bool replay = frame.kind == FrameKind::kReplay;
  const FrameHeader h = replay ? as_contribution(frame) : frame;
  std::unique_lock lock(mu_);
  if (h.rank >= members_.size() || members_[h.rank] != member) {
    // Sent before this stream's worker heard it was to rejoin (a new round
    // of the job): it sends the chunk again on its new stream.
    return PayloadAction::discard();
  }
  if (auto failed = failed_ops_.find(h.op)) {
    // This member may have joined after the failure was announced.
    member->send_control(std::move(failed));
    return PayloadAction::discard();
  }
  if (lost_) {
    fail_op_locked(h.op, *lost_, lost_ranks_);
    return PayloadAction::discard();
  }
  if (auto why = unsummable(h, settings_.max_chunk_bytes)) {
    fail_op_locked(h.op, *why, {h.rank});
    return PayloadAction::discard();
  }
  std::shared_ptr<Chunk> chunk = chunk_for_locked(h);
  if (!chunk || !agrees_locked(*chunk, h)) return PayloadAction::discard();
  if (chunk->seen(h.rank)) {
    return PayloadAction::close(Status(
        ErrorCode::kProtocol, "rank " + std::to_string(h.rank) + " contributed twice to op " +
                                  std::to_string(h.op) + " chunk " + std::to_string(h.chunk)));
  }
  if (chunk->result_known()) {
    // Another rank replayed the result, or another replica sent it: this
    // payload is not needed, and takes no buffer.
    Status why;
    const Chunk::Progress progress =
        chunk->skip(h.rank, member.get(), local_size_, butterfly_, why);
    lock.unlock();
    settle(chunk, progress, why);
    return PayloadAction::discard();
  }
  std::weak_ptr<JobMember> weak = member;
  auto slab = quota_->try_take([weak] {
    if (auto m = weak.lock()) m->wake();
  });
  if (!slab) return PayloadAction::pause();
  pending.role = chunk->accept(h.rank, member.get(), slab, replay);
  pending.chunk = std::move(chunk);
  pending.slab = std::move(slab);
  if (replay) return PayloadAction::receive(pending.slab->first(frame.length), pending.slab);
  // The accumulator of a 16-bit chunk takes its payload in its upper half
  // and widens it in place (kernels.h).
  const size_t at = pending.role == SlabRole::kAccumulator ? payload_offset(h.dtype, h.length) : 0;
  return PayloadAction::receive(pending.slab->first(at + h.length).subspan(at), pending.slab);
}

std::shared_ptr<Chunk> Job::chunk_for_locked(const FrameHeader& h) {
  const ChunkKey key{h.op, h.chunk};
  if (auto it = chunks_.find(key); it != chunks_.end()) return it->second;
  std::vector<ButterflyStep> steps;
  if (participants_.size() > 1 && !settings_.deterministic) {
    steps = butterfly_schedule(static_cast<uint32_t>(participants_.size()), my_index_,
                               h.length / dtype_size(h.dtype));
  }
  const auto now = Clock::now();
  auto chunk = std::make_shared<Chunk>(h, now, now + settings_.op_timeout, settings_.world_size,
                                       std::move(steps), round_.number(), settings_.deterministic);
  chunks_.emplace(key, chunk);
  op_timings_.began(h.op, now, h.chunks_on_shard, h.rank);  // >= 1 chunk (decode_header)
  for (auto& p : early_.take(key)) {
    Status placed;
    if (p.header.flags & kFrameFlagFinal) {
      // No rank of this group is in yet: it waits for them.
      chunk->on_final(p.from_group, p.header, std::move(p.slab), local_size_, butterfly_, placed);
    } else {
      placed = chunk->place(p.from_group, p.header, std::move(p.slab), butterfly_);
    }
    if (!placed.is_ok()) {
      fail_op_locked(h.op, placed, {});
      return nullptr;
    }
  }
  return chunk;
}

bool Job::agrees_locked(const Chunk& chunk, const FrameHeader& h) {
  const FrameHeader& m = chunk.meta();
  // Every rank cuts the op with the same plan: the same chunk, and the same
  // number of chunks on this shard (checked per chunk, and against the op's
  // first chunk while the op is tracked).
  uint64_t op_chunks = m.chunks_on_shard;
  uint32_t op_rank = m.rank;
  if (const OpTimings::Op* timed = op_timings_.find(h.op)) {
    op_chunks = timed->expected;
    op_rank = timed->first_rank;
  }
  if (h.chunks_on_shard != m.chunks_on_shard || h.chunks_on_shard != op_chunks) {
    const bool this_chunk = h.chunks_on_shard != m.chunks_on_shard;
    const uint32_t other = this_chunk ? m.rank : op_rank;
    fail_op_locked(
        h.op,
        Status(ErrorCode::kMismatch,
               "ranks cut op " + std::to_string(h.op) + " differently: rank " +
                   std::to_string(h.rank) + " puts " + std::to_string(h.chunks_on_shard) +
                   " of its chunks on shard " + std::to_string(settings_.shard) + ", rank " +
                   std::to_string(other) + " puts " +
                   std::to_string(this_chunk ? m.chunks_on_shard : op_chunks) +
                   " (every rank must use the same TALLY_CHUNK_BYTES, and every "
                   "reducer the same --max-chunk-bytes)"),
        {other, h.rank});
    return false;
  }
  if (m.count != h.count || m.dtype != h.dtype || m.redop != h.redop || m.offset != h.offset ||
      m.length != h.length || m.flags != h.flags) {
    fail_op_locked(h.op,
                   Status(ErrorCode::kMismatch,
                          "contributions to op " + std::to_string(h.op) + " disagree: rank " +
                              std::to_string(m.rank) + " sent " + chunk_shape(m) + ", rank " +
                              std::to_string(h.rank) + " sent " + chunk_shape(h)),
                   {m.rank, h.rank});
    return false;
  }
  // Checked after agreement, so a mismatch is reported as such even when a
  // rank that saw it has already left.
  for (auto& [gone, reason] : departed_) {
    if (chunk.seen(gone)) continue;
    fail_op_locked(
        h.op,
        Status(ErrorCode::kPeerLost, "rank " + std::to_string(gone) + " has left job '" + name() +
                                         "' (it said: " + reason + "); op " + std::to_string(h.op) +
                                         " cannot complete without it"),
        {gone});
    return false;
  }
  return true;
}

void Job::on_contribution_payload(const FrameHeader& h, PendingContribution& pending) {
  counters_.add(Count::kWorkerBytesReceived, h.length);
  std::shared_ptr<Chunk> chunk = std::move(pending.chunk);
  std::shared_ptr<Slab> slab = std::move(pending.slab);
  const SlabRole role = pending.role;
  pending.reset();
  Status why;
  Chunk::Progress progress =
      chunk->add(h.rank, role, std::move(slab), local_size_, butterfly_, why);
  if (progress == Chunk::Progress::kWaiting && role == SlabRole::kReplay) {
    // A replay of an op every rank has: the ranks that sent theirs are
    // answered now; the others have let theirs go and send none.
    bool released;
    {
      std::lock_guard lock(mu_);
      released = chunk->op() < marks_.released_below();
    }
    if (released && chunk->end_released()) progress = Chunk::Progress::kDone;
  }
  // Before the chunk is finished: finishing hands its result to the members.
  if (role == SlabRole::kReplay && participants_.size() > 1) send_final(chunk);
  settle(chunk, progress, why);
}

void Job::send_final(const std::shared_ptr<Chunk>& chunk) {
  FrameHeader h;
  std::shared_ptr<Slab> result = chunk->final_to_send(h);
  if (!result) return;
  const auto deadline = chunk->created() + settings_.op_timeout;
  std::weak_ptr<Chunk> weak = chunk;
  for (uint32_t g : participants_) {
    if (g == settings_.group) continue;
    counters_.add(Count::kReplicaBytesSent, h.length);
    // A final that cannot be sent leaves that replica's chunk to time out.
    mesh_->send_partial(
        g, h, result, 0, deadline,
        [weak] {
          auto c = weak.lock();
          return !c || !c->dropped();
        },
        [](const Status&) {});
  }
}

void Job::settle(const std::shared_ptr<Chunk>& chunk, Chunk::Progress progress, const Status& why) {
  if (progress == Chunk::Progress::kDone) return finish(chunk);
  if (progress == Chunk::Progress::kFailed) {
    std::lock_guard lock(mu_);
    fail_op_locked(chunk->op(), why, {});
  }
}

void Job::finish(const std::shared_ptr<Chunk>& chunk) {
  std::vector<std::shared_ptr<JobMember>> members;
  std::optional<Clock::time_point> op_began;  // set when this was the op's last chunk here
  {
    std::lock_guard lock(mu_);
    auto it = chunks_.find({chunk->op(), chunk->index()});
    if (it == chunks_.end() || it->second != chunk) return;  // failed meanwhile
    chunks_.erase(it);
    if (participants_.size() > 1 && chunk->replayed() && chunk->op() >= marks_.group_mark()) {
      round_.finished_final({chunk->op(), chunk->index()});
    }
    op_began = op_timings_.chunk_finished(chunk->op());
    for (uint32_t r = 0; r < members_.size(); ++r) {
      if (members_[r] && chunk->contributed(r, members_[r].get())) members.push_back(members_[r]);
    }
  }
  // No other thread touches a chunk after it left the map and all payloads are in.
  auto [result, replayed] = chunk->take_result();
  FrameHeader out = chunk->meta();
  const size_t count = out.length / dtype_size(out.dtype);
  // The float32 sums are sent as they are where they were asked for (16-bit
  // ops only: decode_header), else narrowed to the op's dtype. A replayed
  // result is either already (Chunk::Result): finishing it again would
  // average it twice.
  const bool wide = out.flags & kFrameFlagWideResult;
  if (!replayed) {
    if (out.redop == RedOp::kAverage) {
      scale_average(out.dtype, result->data(), count * dtype_size(accumulator_dtype(out.dtype)),
                    settings_.world_size);
    }
    if (!wide) store_result(out.dtype, result->data(), count);
  }
  out.flags = wide ? kFrameFlagAccumulators : 0;
  if (wide) out.length = count * dtype_size(accumulator_dtype(out.dtype));
  out.kind = FrameKind::kResult;
  out.rank = kReducerRank;
  counters_.add(Count::kChunksFinished);
  counters_.add(Count::kWorkerBytesSent, out.length * members.size());
  if (op_began) {
    counters_.add(Count::kOpsCompleted);
    counters_.op_seconds.Observe(std::chrono::duration<double>(Clock::now() - *op_began).count());
  }
  for (auto& m : members) m->send_result(out, result);
}

}  // namespace tally
