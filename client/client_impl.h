// Private to libtally: the state of a Client (one I/O context, its streams
// to the reducers, the ops in flight) shared by client.cc and shard_link.cc.
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "io_driver.h"
#include "op_state.h"
#include "shard_link.h"
#include "tally/client/client.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/fabric_transport.h"

namespace tally {
namespace client_internal {

using std::chrono::milliseconds;

// After an op fails, how long its in-flight I/O may take to drain before the
// streams still touching the caller's buffer are closed.
inline constexpr milliseconds kDrainGrace{2000};
// Early op errors kept for ops this worker has not started yet.
inline constexpr size_t kEarlyErrorsKept = 1024;
// Staging buffers kept for reuse by bfloat16-wire ops (Client::Impl::spare_staging).
inline constexpr size_t kSpareStagingKept = 4;
// Released results' buffers kept for reuse by the next kept ops
// (Client::Impl::spare_kept), within TALLY_RESUME_BYTES with the kept ones.
inline constexpr size_t kSpareKeptBuffers = 4;
// A Received goes to the reducers once the mark has advanced this many ops,
// or once this many bytes of ops have finished since the last one.
inline constexpr uint64_t kReceivedEveryOps = 8;
inline constexpr uint64_t kReceivedEveryBytes = uint64_t{1} << 20;
// An op of at least this many result bytes is not copied for replays: it
// ends once a reducer has released it, its results still in the caller's
// buffer (Client::Impl::holds). A copy runs at a few GB/s and a release
// takes a round trip, so from here up holding costs less.
inline constexpr uint64_t kHoldResultsBytes = uint64_t{4} << 20;

// The client's own deadline is a backstop behind the reducers' op timeout,
// which is the one that names missing ranks.
inline milliseconds backstop(milliseconds op_timeout) {
  return op_timeout + op_timeout / 2 + milliseconds(1000);
}

struct Op {
  uint64_t id = 0;
  std::byte* data = nullptr;
  uint64_t count = 0;
  DType dtype = DType::kFloat32;  // the caller's buffer
  // What the frames carry. Another than `dtype` (the bfloat16 wire of float32
  // tensors): the plan's offsets and lengths count wire bytes, each chunk is
  // narrowed into `staging` before it is sent, and its result is received
  // there and widened into `data` (a result never arrives before the
  // reducer has this rank's whole chunk, so they share the bytes).
  DType wire = DType::kFloat32;
  std::vector<std::byte> staging;  // from Client::Impl::spare_staging; I/O thread only
  // With a narrowing wire and TALLY_WIRE_RESULT=float32: results come back
  // as the reducers' float32 sums (kFrameFlagWideResult), received straight
  // into `data`; `staging` then only carries the narrowed inputs.
  bool wide_result = false;
  RedOp redop = RedOp::kSum;
  // When the call that started it was made (ClientStats' op times).
  std::chrono::steady_clock::time_point called{};
  std::optional<ChunkPlan> plan;  // over count elements of `wire`
  uint64_t results = 0;
  std::vector<uint8_t> got;                // by chunk: result written
  std::vector<uint8_t> replaying;          // by chunk: replayed, its answer not in yet
  std::vector<uint32_t> sending_on;        // by shard: sends the transport still reads
  std::vector<uint32_t> unanswered;        // by shard: chunks sent whose result has not come
  std::vector<uint64_t> unanswered_bytes;  // by shard: their bytes
  bool failed = false;
  // Every result is in, and the op waits for a Released before it ends
  // (Client::Impl::holds); `unheld`: it ends without waiting (its stream or
  // deadline failed after its results came, so no Released may come).
  bool holding = false;
  bool unheld = false;
  bool finished = false;  // I/O thread's view; `done` below is the caller's
  Status failure;
  std::optional<boost::asio::steady_timer> deadline;
  std::optional<boost::asio::steady_timer> drain;
  // Where the caller learns the end (shared by the ops of a fused call).
  std::shared_ptr<OpHandle::State> handle;
  // After the op finished: a copy of its results as the reducers sent them,
  // kept until every rank has them (Client::Impl::kept), for replays.
  std::vector<std::byte> kept;
};

// Where the result bytes of `op`'s chunk `e` are, as a reducer sends them:
// where its receive is posted and what a replay sends back.
std::span<std::byte> result_span(Op& op, const ChunkExtent& e);

// ClientStats as the I/O thread counts it: written there, read by
// Client::stats() from any thread.
class Counters {
 public:
  void op_ended(bool failed, std::chrono::steady_clock::duration took);
  void sent(uint64_t bytes) { add(bytes_sent_, bytes); }
  void received(uint64_t bytes) { add(bytes_received_, bytes); }
  void reconnected() { add(reconnects_, 1); }
  void resent(uint64_t chunks) { add(replays_, chunks); }
  ClientStats snapshot() const;

 private:
  static void add(std::atomic<uint64_t>& counter, uint64_t n) {
    counter.fetch_add(n, std::memory_order_relaxed);
  }
  std::atomic<uint64_t> ops_completed_{0}, ops_failed_{0}, bytes_sent_{0}, bytes_received_{0},
      reconnects_{0}, replays_{0};
  std::atomic<uint64_t> op_nanos_sum_{0}, op_nanos_max_{0};
  std::array<std::atomic<uint64_t>, kOpSecondsBounds.size() + 1> op_buckets_{};
};

}  // namespace client_internal

using client_internal::Op;

struct Client::Impl final : LinkOwner {
  ClientOptions options;
  uint64_t job = 0;
  // Every op's chunk plan; max_chunk_bytes is the smallest the Welcomes
  // gave, chunk_floor_bytes follows the slowest reducer link they gave (set
  // before connect() returns, read-only afterwards).
  PlanSettings plan_settings;
  // Staging buffers of finished bfloat16-wire ops, reused by the next ones
  // (no allocation and no page faults per op once warm); I/O thread only.
  std::vector<std::vector<std::byte>> spare_staging;
  boost::asio::io_context io{1};
  // Runs `io`: the I/O thread, or a caller blocked in allreduce(). "I/O
  // thread only" below means whichever of them holds `io` (io_driver.h).
  client_internal::IoDriver driver{io};
  // After `io`: endpoints are closed before the context they live on goes.
  std::shared_ptr<Fabric> fabric;
  // What every link says and connects with, this worker's group among it
  // (set before the links are made).
  std::optional<LinkSettings> link_settings;
  std::vector<std::shared_ptr<ShardLink>> links;
  std::mutex start_mu;
  std::atomic<uint64_t> next_op{0};

  // I/O thread only.
  std::map<uint64_t, std::shared_ptr<Op>> ops;  // started, not finished
  // Finished ops whose results are kept for replays until every reducer has
  // released them (docs/protocol.md, "Resuming"), and their bytes.
  std::map<uint64_t, std::shared_ptr<Op>> kept;
  uint64_t kept_bytes = 0;
  // Buffers of released results, reused: a fresh one per op is a page fault
  // per 4 KiB of results (a 64 MiB op's copy took 0.2 s of faults, 4x
  // the op's own time) and an munmap when released.
  std::vector<std::vector<std::byte>> spare_kept;
  uint64_t spare_kept_bytes = 0;         // their capacities
  bool keeping_refused = false;          // the last op did not fit (its warning is out)
  uint64_t received_sent = 0;            // the Received mark last sent to every reducer
  uint64_t finished_since_received = 0;  // bytes of the ops finished since
  std::map<uint64_t, Status> early_errors;
  uint64_t started_below = 0;  // ops with smaller ids have been started
  std::optional<Status> broken;
  std::optional<Status> last_failure;  // of the latest failed op
  client_internal::Counters counters;

  void start_op(const std::shared_ptr<Op>& op);
  void fail_op(std::shared_ptr<Op> op,
               const Status& status);  // by value: callers may pass the ops map entry
  void maybe_finish(std::shared_ptr<Op> op);
  // LinkOwner
  // A result: widened where the wire is narrower, counted, the window moved.
  void on_result(ShardLink& link, const FrameHeader& h) override;
  // The answer to a replay frees its window slot (resume.cc).
  bool on_unposted_result(ShardLink& link, const FrameHeader& h) override;
  void on_op_error(ShardLink& link, uint64_t op_id, const Status& status) override;
  // The stream to `shard` is gone for good: every op in flight fails.
  void on_link_closed(uint32_t shard, const Status& status) override;
  // The stream to `shard` was lost and is being reopened: nothing in flight
  // on it will be answered, so its window and receives start again.
  void on_link_lost(uint32_t shard) override;
  // It is open again: this worker says its Received mark and waits for the
  // reducer's first Released (every rank's mark), then resend()s.
  void on_link_resumed(uint32_t shard) override;
  // Every chunk on `shard` of the ops in flight and of the kept ops from
  // `op_below` on goes again, as a contribution or, where this worker has
  // the result, as a replay.
  void resend(uint32_t shard, uint64_t op_below);
  // A replay of `op`'s chunk `chunk` was answered on `link` (its result,
  // or its op's failure): its window slot is free.
  void answer_replay(ShardLink& link, Op& op, uint32_t chunk);
  // After answers to `op`'s replays: the window sends on, kept results
  // may go, a released op may end.
  // `op` by value: trimming the kept results may drop the caller's pointer.
  void replays_answered(ShardLink& link, std::shared_ptr<Op> op);
  // `op` failed on `link`'s reducer: its replays there still unanswered
  // are answered, and those not sent yet will not be.
  void answer_replays(ShardLink& link, std::shared_ptr<Op> op);
  void on_released(uint32_t shard, uint64_t op_below) override;
  // Tells the reducers how far this worker has every result (Received).
  void note_received();
  // The lowest op this worker has not finished.
  uint64_t received_mark() const;
  // Keeps a copy of a finished op's results, within options.resume_bytes.
  void keep(const std::shared_ptr<Op>& op);
  // Whether finished ops' results are kept for replays at all (resuming on,
  // one replica group).
  bool keeps_results() const;
  // Whether `op`, its results in, ends only once a reducer has released it
  // (its results then stay in the caller's buffer for replays, uncopied).
  bool holds(const Op& op) const;
  // The highest Released mark of any reducer.
  uint64_t released_below() const override;
  // Drops the kept ops every reducer has released.
  void trim_kept();
  // Removes `op`'s chunks still queued on every link (replays of a released
  // op, which no rank needs).
  void drop_queued(const std::shared_ptr<Op>& op);
  // Takes a released op's results buffer for reuse, or frees it.
  void recycle_kept(std::vector<std::byte> buffer);
  // Sends what `link`'s queue holds, within its windows: a contribution
  // (its result's receive posted first) or a replay.
  void pump(ShardLink& link);

  // An op for `count` elements at `data`, or why the arguments are unusable.
  Result<std::shared_ptr<Op>> make_op(void* data, size_t count, DType dtype, RedOp redop);
  // The ops of one fused call and the handle that waits for them (its
  // staging copies in it), or why the buffers are refused.
  struct Fused {
    std::vector<std::shared_ptr<Op>> batch;
    std::shared_ptr<OpHandle::State> handle;
  };
  Result<Fused> fuse(std::span<const BufferRef> buffers, DType dtype, RedOp redop,
                     size_t fuse_bytes);
  // Who runs a submitted batch's ops: the I/O thread (an asynchronous
  // call), or the calling thread, which has borrowed `io` (blocking()).
  enum class Runner { kIoThread, kCaller };
  // Numbers `batch` (which may hold null entries: count-0 ops that only use
  // a number) and posts its ops, with `handle` waiting for all of them.
  OpHandle submit(const std::vector<std::shared_ptr<Op>>& batch,
                  std::shared_ptr<OpHandle::State> handle, OpCallback on_done,
                  Runner runner = Runner::kIoThread);
  // Submits `batch` and waits for its end, running `io` on the calling
  // thread where it can borrow it (io_driver.h).
  Status blocking(const std::vector<std::shared_ptr<Op>>& batch,
                  std::shared_ptr<OpHandle::State> handle);
};

}  // namespace tally
