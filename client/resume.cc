// Surviving a reducer restart, the client's side (docs/protocol.md,
// "Resuming"): the results kept for replays and the Received/Released marks
// that release them, and what a lost and reopened stream to a reducer
// sends again. Private to libtally; the rest of an op's life is client.cc.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

#include "client_impl.h"
#include "shard_link.h"

namespace tally {
using client_internal::kReceivedEveryBytes;
using client_internal::kReceivedEveryOps;

std::span<std::byte> client_internal::result_span(Op& op, const ChunkExtent& e) {
  // A wide result is the float32 sums, at twice the wire offset.
  const uint64_t scale = op.wide_result ? 2 : 1;
  std::byte* base = !op.kept.empty()                        ? op.kept.data()
                    : op.wide_result || op.wire == op.dtype ? op.data
                                                            : op.staging.data();
  return {base + e.offset * scale, e.length * scale};
}

bool Client::Impl::keeps_results() const { return options.resume_bytes > 0; }

bool Client::Impl::holds(const Op& op) const {
  return keeps_results() && op.plan &&
         op.plan->nbytes() * (op.wide_result ? 2 : 1) >= client_internal::kHoldResultsBytes;
}

uint64_t Client::Impl::released_below() const {
  uint64_t below = 0;
  for (auto& link : links) below = std::max(below, link->released_below);
  return below;
}

void Client::Impl::keep(const std::shared_ptr<Op>& kept_op) {
  Op& op = *kept_op;
  if (!keeps_results() || !op.plan) return;
  const ChunkExtent whole{0, 0, 0, op.plan->nbytes()};
  const std::span<std::byte> results = result_span(op, whole);
  if (kept_bytes + results.size() > options.resume_bytes) {
    // Once per stretch of uncopied ops, not once per op.
    if (!keeping_refused) {
      spdlog::warn(
          "job '{}' rank {}: op {} (and the next ones, until results are released) is not kept "
          "for a reducer restart: {} bytes of results are kept already (TALLY_RESUME_BYTES={})",
          options.job, options.rank, op.id, kept_bytes, options.resume_bytes);
    }
    keeping_refused = true;
    return;
  }
  keeping_refused = false;
  // The smallest spare that holds it.
  auto fits = spare_kept.end();
  for (auto it = spare_kept.begin(); it != spare_kept.end(); ++it) {
    if (it->capacity() >= results.size() &&
        (fits == spare_kept.end() || it->capacity() < fits->capacity())) {
      fits = it;
    }
  }
  if (fits != spare_kept.end()) {
    spare_kept_bytes -= fits->capacity();
    op.kept = std::move(*fits);
    spare_kept.erase(fits);
  }
  op.kept.assign(results.begin(), results.end());
  kept_bytes += op.kept.size();
  kept.emplace(op.id, kept_op);
}

void Client::Impl::trim_kept() {
  // A Released from any reducer says every rank has every result of the
  // ops below it (Received counts all of a rank's results, on every shard).
  const uint64_t below = released_below();
  for (auto it = kept.begin(); it != kept.end() && it->first < below;) {
    Op& op = *it->second;
    const bool busy =
        std::any_of(op.sending_on.begin(), op.sending_on.end(), [](uint32_t n) { return n > 0; }) ||
        std::any_of(op.unanswered.begin(), op.unanswered.end(), [](uint32_t n) { return n > 0; });
    if (busy) {  // a replay of it is still being sent or answered
      ++it;
      continue;
    }
    drop_queued(it->second);  // a queued replay would read the recycled buffer
    kept_bytes -= op.kept.size();
    recycle_kept(std::move(op.kept));
    it = kept.erase(it);
  }
}

void Client::Impl::drop_queued(const std::shared_ptr<Op>& op) {
  for (auto& link : links) link->window().drop(op);
}

void Client::Impl::recycle_kept(std::vector<std::byte> buffer) {
  if (buffer.capacity() == 0) return;
  spare_kept_bytes += buffer.capacity();
  spare_kept.push_back(std::move(buffer));
  // Spares and kept results together stay within TALLY_RESUME_BYTES; the
  // oldest spare goes first.
  while (!spare_kept.empty() && (spare_kept.size() > client_internal::kSpareKeptBuffers ||
                                 kept_bytes + spare_kept_bytes > options.resume_bytes)) {
    spare_kept_bytes -= spare_kept.front().capacity();
    spare_kept.erase(spare_kept.begin());
  }
}

uint64_t Client::Impl::received_mark() const {
  // A held op has every result.
  for (auto& [id, op] : ops) {
    if (!op->holding) return std::min(started_below, id);
  }
  return started_below;
}

void Client::Impl::note_received() {
  // Coalesced: a Received (and the reducers' Released) per small op would
  // double the frames of a 4 KiB op and its latency; kept results then
  // wait a few ops longer, bounded by the bytes below.
  const uint64_t mark = received_mark();
  if (mark <= received_sent) return;
  // The ops left below the mark are held: their callers wait for this one.
  const bool held = !ops.empty() && ops.begin()->first < mark;
  if (!held && mark - received_sent < kReceivedEveryOps &&
      finished_since_received < kReceivedEveryBytes) {
    return;
  }
  received_sent = mark;
  finished_since_received = 0;
  for (auto& link : links) link->send_received(mark);
}

void Client::Impl::on_released(uint32_t shard, uint64_t op_below) {
  ShardLink& link = *links[shard];
  link.released_below = std::max(link.released_below, op_below);
  trim_kept();
  // The held ops it releases end.
  std::vector<std::shared_ptr<Op>> released;
  for (auto it = ops.begin(); it != ops.end() && it->first < op_below; ++it) {
    if (it->second->holding) released.push_back(it->second);
  }
  for (auto& op : released) maybe_finish(op);
  if (link.resyncing) {
    link.resyncing = false;
    // Another shard's reducers may know a later mark: no rank needs a
    // replay of the ops below either.
    resend(shard, released_below());
  }
}

bool Client::Impl::on_unposted_result(ShardLink& link, const FrameHeader& h) {
  const uint32_t shard = link.shard();
  std::shared_ptr<Op> op;
  if (auto it = ops.find(h.op); it != ops.end()) op = it->second;
  if (auto it = kept.find(h.op); it != kept.end()) op = it->second;
  if (op && h.chunk < op->replaying.size() && op->replaying[h.chunk]) {
    // The answer to a replay: this worker has the bytes already.
    answer_replay(link, *op, h.chunk);
    replays_answered(link, op);
    return true;
  }
  if (h.op >= started_below) return false;
  // A late result of an op that failed (its receives were cancelled).
  auto it = ops.find(h.op);
  return it == ops.end() || it->second->failed;
}

void Client::Impl::answer_replay(ShardLink& link, Op& op, uint32_t chunk) {
  const uint32_t shard = link.shard();
  const uint64_t bytes = result_span(op, op.plan->chunk(chunk)).size();
  op.replaying[chunk] = 0;
  op.unanswered[shard]--;
  op.unanswered_bytes[shard] -= bytes;
  link.window().answered(1, bytes);
}

void Client::Impl::replays_answered(ShardLink& link, std::shared_ptr<Op> op) {
  pump(link);
  trim_kept();
  if (op->holding) maybe_finish(op);  // a released op waits for these answers
}

void Client::Impl::answer_replays(ShardLink& link, std::shared_ptr<Op> op) {
  if (!op->plan || op->unanswered.empty()) return;
  // The reducer says an op's failure once per stream: the rest of its
  // replays would go unanswered.
  link.window().drop(op);
  const uint64_t first = op->plan->first_chunk(link.shard());
  for (uint64_t k = first; k < first + op->plan->chunks_on_shard(link.shard()); ++k) {
    if (op->replaying[k]) answer_replay(link, *op, static_cast<uint32_t>(k));
  }
  replays_answered(link, op);
}

void Client::Impl::on_link_lost(uint32_t shard) {
  ShardLink& link = *links[shard];
  // Nothing sent on the lost stream will be answered, and it writes into
  // no buffer any more.
  link.window().reset();
  link.resyncing = false;
  auto forget = [&](Op& op) {
    if (!op.plan || op.unanswered.empty()) return;
    op.unanswered[shard] = 0;
    op.unanswered_bytes[shard] = 0;
    const uint64_t first = op.plan->first_chunk(shard);
    for (uint64_t k = first; k < first + op.plan->chunks_on_shard(shard); ++k) op.replaying[k] = 0;
  };
  std::vector<std::shared_ptr<Op>> live;
  for (auto& [id, op] : ops) {
    forget(*op);
    live.push_back(op);
  }
  for (auto& [id, op] : kept) forget(*op);
  for (auto& op : live) maybe_finish(op);  // a failed op may have waited on that stream
}

void Client::Impl::on_link_resumed(uint32_t shard) {
  ShardLink& link = *links[shard];
  // Nothing goes until the reducer has every rank's mark (its first
  // Released): the chunks of ops below it are needed by no one, and a
  // replay of one would hold a window slot and a reducer buffer for
  // nothing until the reducer's op timeout.
  link.resyncing = true;
  counters.reconnected();
  link.send_received(received_mark());
}

void Client::Impl::resend(uint32_t shard, uint64_t op_below) {
  ShardLink& link = *links[shard];
  // In (op, chunk) order, as the reducer requires of a stream.
  std::map<uint64_t, std::shared_ptr<Op>> again;
  for (auto& [id, op] : kept) {
    if (id >= op_below) again.emplace(id, op);
  }
  for (auto& [id, op] : ops) {
    if (!op->failed && op->plan) again.emplace(id, op);
  }
  for (auto& [id, op] : again) {
    const uint64_t first = op->plan->first_chunk(shard);
    for (uint64_t k = first; k < first + op->plan->chunks_on_shard(shard); ++k) {
      link.window().push({op, static_cast<uint32_t>(k), op->finished || op->got[k] != 0});
    }
    counters.resent(op->plan->chunks_on_shard(shard));
  }
  pump(link);
}

}  // namespace tally
