#include "tally/client/client.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cctype>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "client_impl.h"
#include "logging.h"
#include "op_state.h"
#include "shard_link.h"
#include "tally.pb.h"
#include "tally/client/option_names.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/connection_factory.h"
#include "tally/protocol/control.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/groups.h"
#include "tally/protocol/kernels.h"
#include "tally/protocol/pool.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {
namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using client_internal::backstop;
using client_internal::kDrainGrace;
using client_internal::kEarlyErrorsKept;
using client_internal::kSpareStagingKept;
using std::chrono::milliseconds;

void Client::Impl::pump(ShardLink& link) {
  // Within both windows from the Welcome: chunks (the reducer's slabs) and
  // bytes (its ingress budget).
  SendWindow& window = link.window();
  while (window.ready() && !link.closed() && !link.resyncing) {
    // Copies, not a structured binding: the send's completion captures `op`
    // (clang before 16 cannot capture a binding).
    const std::shared_ptr<Op> op = window.front().op;
    const uint32_t index = window.front().index;
    const bool replay = window.front().replay;
    const ChunkExtent e = op->plan->chunk(index);
    std::span<std::byte> payload =
        replay ? result_span(*op, e) : std::span(op->data + e.offset, e.length);
    if (!window.fits(payload.size())) break;
    window.pop();
    // A contribution's result is received where a replay would be sent
    // from; it can come only once the contribution is out.
    if (!replay)
      link.conn()->post_receive({FrameKind::kResult, op->id, index}, result_span(*op, e));
    if (!replay && op->wire != op->dtype) {
      // float32 -> bfloat16, the only narrowing wire (make_op).
      payload = std::span(op->staging.data() + e.offset, e.length);
      kernels().narrow_bf16(reinterpret_cast<uint16_t*>(payload.data()),
                            reinterpret_cast<const float*>(op->data + e.offset * 2), e.length / 2);
    }
    FrameHeader h;
    h.kind = replay ? FrameKind::kReplay : FrameKind::kContribution;
    h.dtype = op->wire;
    h.redop = op->redop;
    h.rank = options.rank;
    h.job = job;
    h.op = op->id;
    h.count = op->count;
    h.offset = e.offset;
    h.chunk = e.index;
    h.chunks_on_shard = static_cast<uint32_t>(op->plan->chunks_on_shard(e.shard));
    h.length = payload.size();
    // A replay carries the result as it came: float32 sums are accumulators.
    h.flags = !op->wide_result ? 0 : replay ? kFrameFlagAccumulators : kFrameFlagWideResult;
    if (replay) op->replaying[index] = 1;
    window.sent(payload.size());
    op->unanswered[link.shard()]++;
    op->unanswered_bytes[link.shard()] += payload.size();
    op->sending_on[link.shard()]++;
    const uint32_t shard = link.shard();
    counters.sent(payload.size());
    // A failed send always closes the stream, and on_closed fails the op
    // with the reducer named (or reopens it); here only the buffer is released.
    link.conn()->send(h, payload, [this, op, shard](const Status&) {
      op->sending_on[shard]--;
      if (op->finished) return trim_kept();
      maybe_finish(op);
    });
  }
}

void Client::Impl::start_op(const std::shared_ptr<Op>& op) {
  started_below = op->id + 1;
  const uint32_t shards = static_cast<uint32_t>(links.size());
  op->sending_on.assign(shards, 0);
  op->unanswered.assign(shards, 0);
  op->unanswered_bytes.assign(shards, 0);
  ops.emplace(op->id, op);
  if (broken) return fail_op(op, *broken);
  if (auto it = early_errors.find(op->id); it != early_errors.end()) {
    Status s = it->second;
    early_errors.erase(it);
    return fail_op(op, s);
  }
  op->got.assign(op->plan->chunk_count(), 0);
  op->replaying.assign(op->plan->chunk_count(), 0);
  if (op->wire != op->dtype) {
    const size_t bytes = op->plan->nbytes();
    auto fits = std::find_if(spare_staging.begin(), spare_staging.end(),
                             [&](const auto& b) { return b.capacity() >= bytes; });
    if (fits != spare_staging.end()) {
      op->staging = std::move(*fits);
      spare_staging.erase(fits);
    }
    op->staging.resize(bytes);
  }
  op->deadline.emplace(io, backstop(options.op_timeout));
  op->deadline->async_wait([this, op](const boost::system::error_code& ec) {
    if (ec) return;
    std::string pending;
    uint32_t shard = 0;
    for (uint64_t k = 0; k < op->plan->chunk_count(); ++k) {
      if (!op->got[k]) {
        shard = op->plan->chunk(k).shard;
        pending = "chunk " + std::to_string(k) + " (shard " + std::to_string(shard) + ")";
        break;
      }
    }
    if (const std::optional<Status>& lost = links[shard]->lost()) {
      // Its reducer is being reconnected to: that is the cause.
      return fail_op(op,
                     Status(lost->code(), "op " + std::to_string(op->id) + ": " + lost->message() +
                                              "; not back within " +
                                              std::to_string(backstop(options.op_timeout).count()) +
                                              " ms of the op's start"));
    }
    fail_op(op, Status(ErrorCode::kTimeout,
                       "op " + std::to_string(op->id) + ": no answer from the pool within " +
                           std::to_string(backstop(options.op_timeout).count()) +
                           " ms, first missing " + pending));
  });
  for (uint64_t k = 0; k < op->plan->chunk_count(); ++k) {
    const ChunkExtent e = op->plan->chunk(k);
    ShardLink& link = *links[e.shard];
    if (link.closed() || link.resyncing) continue;  // being reopened: resend() sends it
    link.window().push({op, e.index, false});
  }
  for (auto& link : links) pump(*link);
}

void Client::Impl::fail_op(std::shared_ptr<Op> op, const Status& status) {
  if (op->failed || op->unheld || op->finished) return;
  if (op->holding) {
    // Its results are all in: it ends well, without waiting for a Released.
    op->unheld = true;
  } else {
    op->failed = true;
    op->failure = status;
  }
  if (op->deadline) op->deadline->cancel();
  if (op->plan) {
    for (uint64_t k = 0; k < op->got.size(); ++k) {
      if (op->got[k]) continue;
      const ChunkExtent e = op->plan->chunk(k);
      ShardLink& link = *links[e.shard];
      if (link.closed()) continue;  // a closed stream touches no buffer
      link.conn()->cancel_receive({FrameKind::kResult, op->id, e.index});
    }
    // Chunks sent without a result give their window slot back; queued ones
    // are never sent.
    for (auto& link : links) {
      link->window().answered(op->unanswered[link->shard()], op->unanswered_bytes[link->shard()]);
      op->unanswered[link->shard()] = 0;
      op->unanswered_bytes[link->shard()] = 0;
      link->window().drop(op);
    }
    std::fill(op->replaying.begin(), op->replaying.end(), 0);  // their answers are discarded
  }
  maybe_finish(op);
  if (!op->finished) {
    op->drain.emplace(io, kDrainGrace);
    op->drain->async_wait([this, op](const boost::system::error_code& ec) {
      if (ec || op->finished) return;
      for (auto& link : links) {
        if (op->sending_on[link->shard()]) {
          link->close(Status(ErrorCode::kTimeout, "op " + std::to_string(op->id) +
                                                      " failed and its I/O did not drain in " +
                                                      std::to_string(kDrainGrace.count()) + " ms"));
        }
      }
    });
  }
  for (auto& link : links) pump(*link);
}

void Client::Impl::maybe_finish(std::shared_ptr<Op> op) {
  if (op->finished) return;
  for (size_t s = 0; s < links.size(); ++s) {
    if (op->sending_on[s]) return;
  }
  if (!op->failed && op->results != (op->plan ? op->plan->chunk_count() : 0)) return;
  if (!op->failed && !op->unheld && holds(*op) && op->id >= released_below()) {
    if (!op->holding) {
      // The reducers release it once every rank has said so: now, not
      // after the next ops (the caller may be waiting for this one).
      op->holding = true;
      finished_since_received += op->plan->nbytes();
      note_received();
    }
    return;
  }
  if (op->holding && !op->unheld) {
    // Released: its replays still queued are needed by no one, and those
    // sent wait for their answers (on_data_header ends it after the last).
    drop_queued(op);
    for (size_t s = 0; s < links.size(); ++s) {
      if (op->unanswered[s]) return;
    }
  }
  op->finished = true;
  if (op->failed) last_failure = op->failure;
  if (op->deadline) op->deadline->cancel();
  if (op->drain) op->drain->cancel();
  ops.erase(op->id);
  if (!op->failed && !holds(*op)) keep(op);
  if (!op->staging.empty() && spare_staging.size() < kSpareStagingKept) {
    spare_staging.push_back(std::move(op->staging));
  }
  counters.op_ended(op->failed, Clock::now() - op->called);
  op->handle->end_one(op->failed ? op->failure : Status::ok());
  // A kept op holds its results' copy only, not the caller's handle (nor a
  // fused call's staging buffers in it).
  op->handle.reset();
  if (op->plan && !op->holding) finished_since_received += op->plan->nbytes();
  note_received();
}

void Client::Impl::on_op_error(ShardLink& link, uint64_t op_id, const Status& reported) {
  Status status = reported;
  // A reducer's op timeout may name a rank or a replica that waits, as this
  // worker or another replica does, for a lost reducer, which that reducer
  // cannot know of: the error names the first such loss this worker knows.
  for (auto& link : links) {
    if (const std::optional<Status>& lost = link->lost()) {
      status = Status(status.code(),
                      status.message() +
                          "; at the time this worker was reconnecting after: " + lost->message());
      break;
    }
    const auto& replica = link->replica_lost();
    if (replica && !replica->replica.empty() &&
        status.message().find(replica->replica) == std::string::npos) {
      status = Status(status.code(), status.message() + "; at the time " + link->name() +
                                         " reported: " + replica->reason);
      break;
    }
  }
  if (auto it = ops.find(op_id); it != ops.end()) return fail_op(it->second, status);
  // Finished here, and replayed for the other ranks: its failure answers
  // the replays, which would otherwise hold their window slots.
  if (auto it = kept.find(op_id); it != kept.end()) answer_replays(link, it->second);
  if (op_id < started_below) return;  // already finished here
  if (early_errors.size() >= kEarlyErrorsKept) early_errors.erase(early_errors.begin());
  early_errors.emplace(op_id, status);
}

void Client::Impl::on_result(ShardLink& link, const FrameHeader& h) {
  const uint32_t shard = link.shard();
  auto it = ops.find(h.op);
  TALLY_CHECK(it != ops.end());  // a posted receive outlives its op's I/O
  std::shared_ptr<Op> op = it->second;
  TALLY_CHECK(!op->failed);  // a failed op's receives were cancelled: no result comes
  const ChunkExtent extent = op->plan->chunk(h.chunk);
  const uint16_t flags = op->wide_result ? kFrameFlagAccumulators : 0;
  const uint64_t length = op->wide_result ? extent.length * 2 : extent.length;
  if (h.count != op->count || h.dtype != op->wire || h.offset != extent.offset ||
      h.flags != flags || h.length != length || op->got[h.chunk]) {
    return fail_op(
        op, Status(ErrorCode::kProtocol, link.name() + " sent a result that does not match op " +
                                             std::to_string(op->id) + ": " + describe(h)));
  }
  if (op->wire != op->dtype && !op->wide_result) {
    // bfloat16 -> float32 into the caller's buffer (make_op's only narrowing wire).
    kernels().widen_bf16(reinterpret_cast<float*>(op->data + extent.offset * 2),
                         reinterpret_cast<const uint16_t*>(op->staging.data() + extent.offset),
                         extent.length / 2);
  }
  op->got[h.chunk] = 1;
  op->results++;
  counters.received(h.length);
  op->unanswered[shard]--;
  op->unanswered_bytes[shard] -= extent.length;
  link.window().answered(1, extent.length);
  pump(link);
  maybe_finish(op);
}

void Client::Impl::on_link_closed(uint32_t shard, const Status& status) {
  if (!broken) broken = status;
  on_link_lost(shard);
  std::vector<std::shared_ptr<Op>> all;
  for (auto& [id, op] : ops) all.push_back(op);
  for (auto& op : all) {
    fail_op(op, status);
    maybe_finish(op);
  }
}

Result<std::unique_ptr<Client>> Client::connect(const ClientOptions& options) {
  auto congestion = validated_congestion_control(options);
  if (!congestion) return congestion.status();
  client_internal::log_to_stderr();
  if (!options.log_level.empty()) spdlog::set_level(spdlog::level::from_str(options.log_level));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->options.tcp_congestion = *congestion;
  impl->job = job_id(options.job);
  if (options.transport == "fabric") {
    auto fabric = Fabric::open(options.fabric);
    if (!fabric)
      return fabric.status().with_context("job '" + options.job + "' rank " +
                                          std::to_string(options.rank));
    impl->fabric = *fabric;
  }
  const uint32_t group = options.group
                             ? *options.group
                             : default_group_of(options.rank, options.world_size, options.groups);
  // Only the S reducers of this worker's group.
  const uint32_t shards = static_cast<uint32_t>(options.pool.size() / options.groups);
  const LinkSettings& settings = impl->link_settings.emplace(LinkSettings{
      impl->options, impl->io, impl->fabric, group,
      options.group ? options.group_sizes : default_group_sizes(options.world_size, options.groups),
      shards});
  for (uint32_t s = 0; s < shards; ++s) {
    impl->links.push_back(std::make_shared<ShardLink>(
        *impl, settings, s, *parse_host_port(options.pool[pool_index(group, s, shards)])));
  }
  impl->driver.start();
  // From here on `client` owns the thread: an early return closes and joins.
  std::unique_ptr<Client> client(new Client(std::move(impl)));
  Impl& im = *client->impl_;
  std::vector<std::future<Status>> welcomes;
  for (auto& link : im.links) welcomes.push_back(link->welcomed());
  const auto deadline = Clock::now() + options.connect_timeout;
  asio::post(im.io, [&im, deadline] {
    for (auto& link : im.links) link->connect(deadline);
  });
  for (auto& w : welcomes) {
    // The I/O thread settles every future by the deadline; the margin covers scheduling.
    if (w.wait_until(deadline + milliseconds(2000)) != std::future_status::ready) {
      return Status(ErrorCode::kTimeout, "joining the pool took longer than " +
                                             std::to_string(options.connect_timeout.count()) +
                                             " ms");
    }
    Status s = w.get();
    if (!s.is_ok())
      return s.with_context("job '" + options.job + "' rank " + std::to_string(options.rank));
  }
  // Every Welcome is in (each settled its link on the I/O thread before its
  // future became ready), and no op has started yet.
  im.plan_settings.chunk_bytes = options.chunk_bytes;
  im.plan_settings.max_chunk_bytes = std::numeric_limits<uint64_t>::max();
  uint64_t slowest_link = std::numeric_limits<uint64_t>::max();  // 0: some reducer has no rate
  for (auto& link : im.links) {
    im.plan_settings.max_chunk_bytes =
        std::min(im.plan_settings.max_chunk_bytes, link->max_chunk_bytes);
    slowest_link = std::min(slowest_link, link->link_rate_bits);
  }
  im.plan_settings.chunk_ceiling_bytes =
      chunk_ceiling_for_link(slowest_link, std::max(shards, options.world_size));
  return client;
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  impl_->driver.kick();  // a context lent to callers goes back to the I/O thread
  std::promise<void> left;
  asio::post(impl_->io, [im = impl_.get(), &left] {
    auto remaining = std::make_shared<size_t>(im->links.size());
    // Other ranks quote this, so a failure seen here explains why we left.
    const std::string reason = im->last_failure ? "closed after: " + im->last_failure->to_string()
                                                : std::string(kCleanGoodbyeReason);
    for (auto& link : im->links) {
      link->leave(reason, [remaining, &left] {
        if (--*remaining == 0) left.set_value();
      });
    }
  });
  // A stream that cannot take its goodbye in time is closed without it.
  if (left.get_future().wait_for(milliseconds(2000)) != std::future_status::ready) {
    asio::post(impl_->io, [im = impl_.get()] {
      for (auto& link : im->links)
        link->close(Status(ErrorCode::kCancelled, std::string(kCleanGoodbyeReason)));
    });
  }
  // After the closes posted above: the context stops even if a connect
  // attempt or a timer is still pending; what is left is destroyed with it.
  impl_->driver.join();
  if (impl_->fabric) impl_->fabric->close();
  // Nothing touches a caller's buffer any more: end what is still in flight
  // (every start_op was posted before the goodbyes, so it has run).
  for (auto& [id, op] : impl_->ops) {
    if (op->finished) continue;
    op->finished = true;
    // A held op has its results: only its release was still to come.
    op->handle->end_one(op->failed ? op->failure
                        : op->holding
                            ? Status::ok()
                            : Status(ErrorCode::kCancelled,
                                     "client closed with op " + std::to_string(id) + " in flight"));
  }
  impl_->ops.clear();
  // Break the link <-> connection cycles of streams that never opened.
  impl_->links.clear();
}

uint32_t Client::rank() const { return impl_->options.rank; }
uint32_t Client::world_size() const { return impl_->options.world_size; }
uint32_t Client::shards() const { return static_cast<uint32_t>(impl_->links.size()); }
uint32_t Client::groups() const { return impl_->options.groups; }
uint32_t Client::group() const { return impl_->link_settings->group; }
const ClientOptions& Client::options() const { return impl_->options; }
ChunkPlan Client::plan(uint64_t count, DType dtype, uint64_t op) const {
  return ChunkPlan(count * dtype_size(dtype), dtype, shards(), impl_->plan_settings, op);
}
ClientStats Client::stats() const { return impl_->counters.snapshot(); }
uint64_t Client::next_op() const { return impl_->next_op.load(); }

}  // namespace tally
