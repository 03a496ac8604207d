#include "tally/reducer/chunk.h"

#include <algorithm>
#include <cstring>

#include "tally/reducer/kernels.h"

namespace tally {
namespace {

// Partials of 16-bit ops carry float32 accumulators (frame.h).
uint16_t partial_flags(const FrameHeader& meta) {
  const uint16_t accumulators =
      accumulator_dtype(meta.dtype) != meta.dtype ? kFrameFlagAccumulators : 0;
  // The wide-result bit rides along, so that replicas whose workers asked
  // for different results find out (a chunk's shape, like its dtype).
  return accumulators | (meta.flags & kFrameFlagWideResult);
}

}  // namespace

std::string chunk_shape(const FrameHeader& h) {
  return "count=" + std::to_string(h.count) + " " + std::string(dtype_name(h.dtype)) + " " +
         std::string(redop_name(h.redop)) + " chunk@" + std::to_string(h.offset) + "+" +
         std::to_string(h.length) + " (" + std::to_string(h.chunks_on_shard) + " on this shard" +
         ((h.flags & kFrameFlagWideResult) ? ", float32 results" : "") + ")";
}

FrameHeader final_header(const FrameHeader& m) {
  FrameHeader h = m;
  h.kind = FrameKind::kPartial;
  h.rank = 0;
  h.flags = kFrameFlagFinal;
  if (m.flags & kFrameFlagWideResult) {
    h.flags |= kFrameFlagAccumulators | kFrameFlagWideResult;
    h.length = m.length / dtype_size(m.dtype) * dtype_size(accumulator_dtype(m.dtype));
  }
  return h;
}

Chunk::Chunk(const FrameHeader& first, Clock::time_point created, Clock::time_point deadline,
             uint32_t world_size, std::vector<ButterflyStep> steps, uint64_t round,
             bool deterministic)
    : meta_(first),
      created_(created),
      deadline_(deadline),
      steps_(std::move(steps)),
      round_(static_cast<uint8_t>(round)),
      deterministic_(deterministic),
      parts_(deterministic ? world_size : 0),
      part_end_(deterministic ? world_size : 0, 0),
      seen_(world_size, false),
      contributors_(world_size, nullptr),
      arrived_(steps_.size()) {}

bool Chunk::seen(uint32_t rank) const {
  std::lock_guard lock(mu_);
  return seen_[rank];
}

SlabRole Chunk::accept(uint32_t rank, const JobMember* member, std::shared_ptr<Slab> slab,
                       bool replay) {
  std::lock_guard lock(mu_);
  seen_[rank] = true;
  contributors_[rank] = member;
  if (replay) {
    replay_accepted_ = true;
    return SlabRole::kReplay;
  }
  if (deterministic_) {
    parts_[rank] = std::move(slab);
    return SlabRole::kAccumulator;
  }
  if (accumulator_) return SlabRole::kStaging;
  accumulator_ = std::move(slab);
  return SlabRole::kAccumulator;
}

Chunk::Progress Chunk::add(uint32_t rank, SlabRole role, std::shared_ptr<Slab> slab,
                           uint32_t local_size, const ButterflyContext& context, Status& why) {
  std::lock_guard lock(mu_);
  if (failed_) return Progress::kWaiting;
  // Ended before this payload came (end_released): its rank was answered
  // with the rest, and its result may have been taken.
  if (done_reported_) return Progress::kWaiting;
  const DType dtype = meta_.dtype;
  const size_t nbytes = meta_.length;
  if (role == SlabRole::kReplay) {
    if (!replay_) {
      // The result is known: what was summed so far is not needed (a
      // payload still arriving holds its own reference to its slab).
      replay_ = std::move(slab);
      drop_sums_locked();
    }
  } else if (replay_) {
    // Likewise for a contribution that arrives after the replay.
  } else if (deterministic_) {
    load_payload(dtype, parts_[rank]->data(), nbytes);
    part_end_[rank] = rank + 1;
    combine_locked({rank, rank + 1});
  } else if (role == SlabRole::kAccumulator) {
    load_payload(dtype, accumulator_->data(), nbytes);
    accumulator_ready_ = true;
    for (auto& p : pending_) reduce_into(dtype, accumulator_->data(), p->data(), nbytes);
    pending_.clear();
  } else if (accumulator_ready_) {
    reduce_into(dtype, accumulator_->data(), slab->data(), nbytes);
  } else {
    pending_.push_back(std::move(slab));
  }
  slab.reset();
  added_++;
  return completed_locked(local_size, context, why);
}

bool Chunk::result_known() const {
  std::lock_guard lock(mu_);
  return replay_accepted_ || replay_ != nullptr;
}

Chunk::Progress Chunk::skip(uint32_t rank, const JobMember* member, uint32_t local_size,
                            const ButterflyContext& context, Status& why) {
  std::lock_guard lock(mu_);
  seen_[rank] = true;
  contributors_[rank] = member;
  if (failed_) return Progress::kWaiting;
  added_++;
  return completed_locked(local_size, context, why);
}

size_t Chunk::accumulator_bytes() const {
  return meta_.length / dtype_size(meta_.dtype) * dtype_size(accumulator_dtype(meta_.dtype));
}

void Chunk::combine_locked(TreeNode node) {
  const auto world = static_cast<uint32_t>(parts_.size());
  const std::vector<TreeNode> above = sum_tree_ancestors(world, node);
  const DType acc_dtype = accumulator_dtype(meta_.dtype);
  const size_t acc_bytes = accumulator_bytes();
  for (auto n = above.rbegin(); n != above.rend(); ++n) {
    const uint32_t mid = sum_tree_mid(n->lo, n->hi);
    if (part_end_[n->lo] != mid || part_end_[mid] != n->hi) return;
    reduce_into(acc_dtype, parts_[n->lo]->data(), parts_[mid]->data(), acc_bytes);
    parts_[mid].reset();
    part_end_[n->lo] = n->hi;
  }
  if (part_end_[0] != world) return;
  accumulator_ = std::move(parts_[0]);
  accumulator_ready_ = true;
}

void Chunk::drop_sums_locked() {
  accumulator_.reset();
  pending_.clear();
  for (auto& p : parts_) p.reset();
  tree_received_.clear();
}

std::optional<uint32_t> Chunk::tree_missing_locked(const ButterflyContext& context) const {
  const auto& covers = context.tree_covers;
  for (uint32_t p = 0; p < covers.size(); ++p) {
    if (p == context.self) continue;
    for (const TreeNode& node : covers[p]) {
      if (!tree_received_.contains(node.lo)) return p;
    }
  }
  return std::nullopt;
}

Status Chunk::place_tree_part_locked(uint32_t from_group, const FrameHeader& h,
                                     std::shared_ptr<Slab> slab, const ButterflyContext& context,
                                     const std::function<Status(const std::string&)>& bad) {
  const auto& participants = context.participants;
  const auto from = static_cast<uint32_t>(
      std::find(participants.begin(), participants.end(), from_group) - participants.begin());
  const TreeNode* node = nullptr;
  if (from < context.tree_covers.size() && from != context.self) {
    for (const TreeNode& n : context.tree_covers[from]) {
      if (n.lo == h.rank) node = &n;
    }
  }
  if (!node) {
    return bad("has tag " + std::to_string(h.rank) +
               ", which is not the first rank of a part of the sum tree that replica sums");
  }
  const size_t acc_bytes = accumulator_bytes();
  if (h.offset != meta_.offset || h.length != acc_bytes) {
    return bad("covers bytes [" + std::to_string(h.offset) + ", +" + std::to_string(h.length) +
               "), a part of the sum tree is the whole chunk [" + std::to_string(meta_.offset) +
               ", +" + std::to_string(acc_bytes) + ")");
  }
  if (tree_received_.contains(node->lo) || done_reported_) return bad("arrived twice");
  tree_received_[node->lo] = {*node, std::move(slab)};
  return Status::ok();
}

Chunk::Progress Chunk::exchange_tree_locked(const ButterflyContext& context, Status& why) {
  const auto& covers = context.tree_covers;
  if (!tree_sent_) {
    tree_sent_ = true;
    const size_t acc_bytes = accumulator_bytes();
    for (const TreeNode& node : covers[context.self]) {
      // Every rank of the group is in, so its cover is summed.
      TALLY_CHECK_EQ(part_end_[node.lo], node.hi);
      FrameHeader h = meta_;
      h.kind = FrameKind::kPartial;
      h.round = round_;
      h.rank = node.lo;
      h.flags = partial_flags(meta_);
      h.length = acc_bytes;
      for (uint32_t p = 0; p < covers.size(); ++p) {
        if (p == context.self) continue;
        sends_pending_++;
        context.replica_bytes_sent.fetch_add(h.length, std::memory_order_relaxed);
        std::weak_ptr<Chunk> weak = weak_from_this();
        context.mesh->send_partial(
            context.participants[p], h, parts_[node.lo], 0, deadline_,
            [weak] {
              auto self = weak.lock();
              return self && !self->dropped();
            },
            context.on_sent(shared_from_this()));
      }
    }
  }
  if (auto missing = tree_missing_locked(context)) {
    if (auto left = context.left(context.participants[*missing])) {
      why = *left;
      return Progress::kFailed;
    }
    return Progress::kWaiting;
  }
  // Never write into a node while a send still reads it.
  if (sends_pending_ > 0) return Progress::kWaiting;
  for (auto& [lo, part] : tree_received_) {
    parts_[lo] = std::move(part.slab);
    part_end_[lo] = part.node.hi;
  }
  for (const auto& cover : covers) {
    for (const TreeNode& node : cover) combine_locked(node);
  }
  tree_received_.clear();
  TALLY_CHECK(accumulator_ready_);
  done_reported_ = true;
  return Progress::kDone;
}

Chunk::Progress Chunk::completed_locked(uint32_t local_size, const ButterflyContext& context,
                                        Status& why) {
  if (added_ < local_size || done_reported_) return Progress::kWaiting;
  // Every payload is in: a replay's (or another replica's final result),
  // or every contribution's (with reproducible sums and replica groups,
  // only this group's part of the tree is summed).
  TALLY_CHECK(replay_ || (accumulator_ready_ && pending_.empty()) ||
              (deterministic_ && context.participants.size() > 1));
  if (context.participants.size() == 1 || replay_) {
    // A known result needs no butterfly; a send of one still under way
    // holds its own reference to the slab it reads.
    done_reported_ = true;
    return Progress::kDone;
  }
  local_done_ = true;
  return advance_locked(context, why);
}

Status Chunk::place(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                    const ButterflyContext& context) {
  std::lock_guard lock(mu_);
  return place_locked(from_group, header, std::move(slab), context);
}

Status Chunk::place_locked(uint32_t from_group, const FrameHeader& h, std::shared_ptr<Slab> slab,
                           const ButterflyContext& context) {
  const FrameHeader& m = meta_;
  const size_t esize = dtype_size(m.dtype);
  const size_t acc_size = dtype_size(accumulator_dtype(m.dtype));
  const std::string who = context.mesh->describe(from_group);
  auto bad = [&](const std::string& why) {
    return Status(ErrorCode::kMismatch, "partial of op " + std::to_string(h.op) + " chunk " +
                                            std::to_string(h.chunk) + " from " + who + " " + why);
  };
  if (h.count != m.count || h.dtype != m.dtype || h.redop != m.redop ||
      h.flags != partial_flags(m) || h.chunks_on_shard != m.chunks_on_shard) {
    return bad("disagrees with this group's contributions: it has " + chunk_shape(h) + ", here " +
               chunk_shape(m));
  }
  if (deterministic_) return place_tree_part_locked(from_group, h, std::move(slab), context, bad);
  for (size_t i = 0; i < steps_.size(); ++i) {
    const ButterflyStep& s = steps_[i];
    if (context.participants[s.partner] != from_group || s.tag != h.rank || s.recv.empty())
      continue;
    if (h.offset != m.offset + s.recv.begin * esize || h.length != s.recv.size() * acc_size) {
      return bad("covers bytes [" + std::to_string(h.offset) + ", +" + std::to_string(h.length) +
                 "), the butterfly expects [" + std::to_string(m.offset + s.recv.begin * esize) +
                 ", +" + std::to_string(s.recv.size() * acc_size) +
                 ") (do the replicas' group sizes agree?)");
    }
    if (arrived_[i] || i < step_) return bad("arrived twice");
    arrived_[i] = std::move(slab);
    return Status::ok();
  }
  return bad("has tag " + std::to_string(h.rank) +
             ", which this replica's butterfly does not expect from it");
}

Chunk::Progress Chunk::on_final(uint32_t from_group, const FrameHeader& h,
                                std::shared_ptr<Slab> slab, uint32_t local_size,
                                const ButterflyContext& context, Status& why) {
  std::lock_guard lock(mu_);
  if (failed_) return Progress::kWaiting;
  const FrameHeader want = final_header(meta_);
  if (h.count != want.count || h.dtype != want.dtype || h.redop != want.redop ||
      h.offset != want.offset || h.length != want.length || h.flags != want.flags ||
      h.chunks_on_shard != want.chunks_on_shard) {
    why = Status(ErrorCode::kMismatch, "final result of op " + std::to_string(h.op) + " chunk " +
                                           std::to_string(h.chunk) + " from " +
                                           context.mesh->describe(from_group) +
                                           " does not fit this group's chunk: it has " +
                                           chunk_shape(h) + ", here " + chunk_shape(meta_));
    return Progress::kFailed;
  }
  if (replay_) return Progress::kWaiting;  // the same bytes, already here
  // What was summed so far, and the butterfly's partials, are not needed.
  replay_ = std::move(slab);
  drop_sums_locked();
  for (auto& a : arrived_) a.reset();
  return completed_locked(local_size, context, why);
}

std::shared_ptr<Slab> Chunk::final_to_send(FrameHeader& header) {
  std::lock_guard lock(mu_);
  // Only a worker's replay: another replica's final went to every replica.
  if (failed_ || !replay_ || !replay_accepted_ || final_sent_) return nullptr;
  final_sent_ = true;
  header = final_header(meta_);
  header.round = round_;
  return replay_;
}

bool Chunk::end_released() {
  std::lock_guard lock(mu_);
  if (failed_ || done_reported_ || !replay_) return false;
  done_reported_ = true;
  return true;
}

bool Chunk::dropped() const {
  std::lock_guard lock(mu_);
  return failed_;
}

Chunk::Progress Chunk::on_partial(uint32_t from_group, const FrameHeader& header,
                                  std::shared_ptr<Slab> slab, const ButterflyContext& context,
                                  Status& why) {
  std::lock_guard lock(mu_);
  if (failed_ || replay_) return Progress::kWaiting;
  why = place_locked(from_group, header, std::move(slab), context);
  if (!why.is_ok()) return Progress::kFailed;
  return local_done_ ? advance_locked(context, why) : Progress::kWaiting;
}

Chunk::Progress Chunk::on_sent(const Status& status, const ButterflyContext& context, Status& why) {
  std::lock_guard lock(mu_);
  sends_pending_--;
  if (failed_) return Progress::kWaiting;
  if (status.code() == ErrorCode::kTimeout) {
    // The replica was not reachable before the op's deadline.
    why = status;
    return Progress::kFailed;
  }
  if (!status.is_ok()) {
    // The replica was lost (the send was dropped, or its stream broke
    // under it): its return starts a new round of the job, which drops
    // this chunk (Job::on_replica_back), or the op times out naming it.
    return Progress::kWaiting;
  }
  return local_done_ ? advance_locked(context, why) : Progress::kWaiting;
}

Chunk::Progress Chunk::on_replica_left(uint32_t group, const ButterflyContext& context,
                                       const Status& why, Status& failed) {
  std::lock_guard lock(mu_);
  if (failed_) return Progress::kWaiting;
  if (deterministic_) {
    if (done_reported_ || replay_) return Progress::kWaiting;
    const auto& covers = context.tree_covers;
    for (uint32_t p = 0; p < covers.size(); ++p) {
      if (p == context.self || context.participants[p] != group) continue;
      for (const TreeNode& node : covers[p]) {
        if (!tree_received_.contains(node.lo)) {
          failed = why;
          return Progress::kFailed;
        }
      }
    }
    return Progress::kWaiting;
  }
  for (size_t i = step_; i < steps_.size(); ++i) {
    const ButterflyStep& s = steps_[i];
    if (context.participants[s.partner] == group && !s.recv.empty() && !arrived_[i]) {
      failed = why;
      return Progress::kFailed;
    }
  }
  return Progress::kWaiting;
}

Chunk::Progress Chunk::advance_locked(const ButterflyContext& context, Status& why) {
  if (failed_ || done_reported_ || replay_) return Progress::kWaiting;
  if (deterministic_) return exchange_tree_locked(context, why);
  // Header offsets count the op's elements; the accumulator (and so every
  // partial's payload) holds accumulator elements.
  const size_t esize = dtype_size(meta_.dtype);
  const DType acc_dtype = accumulator_dtype(meta_.dtype);
  const size_t acc_size = dtype_size(acc_dtype);
  while (step_ < steps_.size()) {
    const ButterflyStep& s = steps_[step_];
    const uint32_t group = context.participants[s.partner];
    if (!step_sent_) {
      step_sent_ = true;
      if (!s.send.empty()) {
        // A send to a lost replica is dropped (ReplicaLink::send): the
        // chunk waits for the round its return starts, or times out.
        FrameHeader h = meta_;
        h.kind = FrameKind::kPartial;
        h.round = round_;
        h.rank = s.tag;
        h.flags = partial_flags(meta_);
        h.offset = meta_.offset + s.send.begin * esize;
        h.length = s.send.size() * acc_size;
        sends_pending_++;
        context.replica_bytes_sent.fetch_add(h.length, std::memory_order_relaxed);
        std::weak_ptr<Chunk> weak = weak_from_this();
        context.mesh->send_partial(
            group, h, accumulator_, s.send.begin * acc_size, deadline_,
            [weak] {
              auto self = weak.lock();
              return self && !self->dropped();
            },
            context.on_sent(shared_from_this()));
      }
    }
    if (!s.recv.empty()) {
      if (!arrived_[step_]) {
        if (auto left = context.left(group)) {
          why = *left;
          return Progress::kFailed;
        }
        return Progress::kWaiting;
      }
      // Never write into the accumulator while a send still reads it.
      if (sends_pending_ > 0) return Progress::kWaiting;
      std::byte* dst = accumulator_->data() + s.recv.begin * acc_size;
      const std::byte* src = arrived_[step_]->data();
      if (s.apply == ButterflyStep::Apply::kAdd) {
        reduce_into(acc_dtype, dst, src, s.recv.size() * acc_size);
      } else {
        std::memcpy(dst, src, s.recv.size() * acc_size);
      }
      arrived_[step_].reset();
    }
    step_++;
    step_sent_ = false;
  }
  if (sends_pending_ > 0) return Progress::kWaiting;
  done_reported_ = true;
  return Progress::kDone;
}

void Chunk::fail() {
  std::lock_guard lock(mu_);
  failed_ = true;
  drop_sums_locked();
  replay_.reset();
  arrived_.clear();
}

Chunk::Waiting Chunk::waiting(const ButterflyContext& context) const {
  std::lock_guard lock(mu_);
  Waiting out;
  out.local_done = local_done_;
  if (local_done_) {
    if (deterministic_) {
      if (auto missing = tree_missing_locked(context)) {
        out.replica = context.participants[*missing];
      }
    } else if (step_ < steps_.size()) {
      out.replica = context.participants[steps_[step_].partner];
    }
  } else {
    out.seen = seen_;
  }
  return out;
}

Chunk::Result Chunk::take_result() {
  std::lock_guard lock(mu_);
  if (replay_) {
    accumulator_.reset();
    return {std::move(replay_), true};
  }
  return {std::move(accumulator_), false};
}

bool Chunk::replayed() const {
  std::lock_guard lock(mu_);
  return replay_ != nullptr;
}

bool Chunk::contributed(uint32_t rank, const JobMember* member) const {
  std::lock_guard lock(mu_);
  return contributors_[rank] == member;
}

}  // namespace tally
