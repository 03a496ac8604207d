// libtally: the worker side of a tally reduction server.
//
//   auto options = tally::client_options_from_env();   // TALLY_POOL, TALLY_JOB, ...
//   auto client = tally::Client::connect(*options);
//   tally::Status s = (*client)->allreduce(grads.data(), grads.size(),
//                                          tally::DType::kFloat32, tally::RedOp::kAverage);
//   tally::OpHandle h = (*client)->allreduce_async(grads.data(), grads.size(),
//                                                  tally::DType::kFloat32, tally::RedOp::kSum);
//   ... compute ...;  tally::Status s2 = h.wait();
//
// Every worker of a job issues the same ops in the same order (as with NCCL
// and MPI collectives). An op either ends with the same complete result on
// every worker or fails on every worker with an error naming the cause.
//
// Op numbering: every call that is not refused for its arguments takes op
// numbers, in the order the calls are made on this Client: allreduce and
// allreduce_async take one (also for a count of 0), allreduce_fused takes
// one per fused group (see there). Rank r's n-th op is summed with every
// other rank's n-th op, so every rank must make the same calls, with the
// same counts, dtypes and reductions, in the same order.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tally/client/stats.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/status.h"

namespace tally {

struct ClientOptions {
  // Reducer addresses ("host:port") in (group, shard) order: the S reducers
  // of group 0, then those of group 1, ...
  std::vector<std::string> pool;
  // Replica groups in the pool; pool.size() must be a multiple of it.
  uint32_t groups = 1;
  // This worker's group. Unset: the contiguous block default_group_of()
  // (tally/protocol/groups.h) gives. Set (TALLY_GROUP), it needs group_sizes too.
  std::optional<uint32_t> group;
  // Workers per group, the same list on every rank; only with `group`.
  std::vector<uint32_t> group_sizes;
  std::string job;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // 0 (the default): the automatic chunk plan (tally/protocol/chunking.h)
  // spreads each tensor over all shards and sizes the chunks by the tensor.
  // Set (TALLY_CHUNK_BYTES): each shard's range is cut into chunks of
  // exactly this size (rounded down to whole elements); at least 8, at most
  // the reducers' maximum. Every rank must use the same value.
  size_t chunk_bytes = 0;
  // Unset: every tensor travels in its own dtype. kBFloat16
  // (TALLY_WIRE_DTYPE=bfloat16): float32 tensors are rounded to bfloat16
  // (nearest even) for the wire and their results come back as bfloat16,
  // widened into the caller's buffer: half the bytes each way, at a relative
  // error of about 2^-8 per element (docs/architecture.md, "The bfloat16
  // wire"). Tensors of any other dtype travel in their own. Every rank must
  // use the same value.
  std::optional<DType> wire_dtype;
  // With the bfloat16 wire: how results come back. Unset or kBFloat16: as
  // bfloat16 (half the bytes down too). kFloat32 (TALLY_WIRE_RESULT=float32):
  // the reducers' float32 sums as they are, straight into the caller's
  // buffer, so the only rounding is of the inputs (about half the bfloat16
  // round trip's error), for float32's bytes on the way down. Every rank
  // must use the same value.
  std::optional<DType> wire_result;
  // Reducers fail an op whose contributions are not all in by then.
  std::chrono::milliseconds op_timeout{60000};
  // How long connect() keeps trying to reach every reducer.
  std::chrono::milliseconds connect_timeout{30000};
  std::chrono::milliseconds heartbeat_interval{1000};
  // A reducer stream silent this long is dead.
  std::chrono::milliseconds peer_timeout{10000};
  // Data path: "tcp" (data frames on the TCP streams) or "fabric"
  // (libfabric tagged messages; control stays on TCP). The pool must serve it.
  std::string transport = "tcp";
  FabricOptions fabric;
  // The job secret (TALLY_JOB_SECRET_FILE, TALLY_JOB_SECRET): when set, the worker
  // authenticates to every reducer with it and requires each reducer to
  // prove it holds it too. Never logged, never sent.
  Secret secret;
  // TCP congestion control of the streams to the reducers (TCP_CONGESTION,
  // e.g. "cubic"); empty: the system's default. TALLY_TCP_CONGESTION.
  std::string tcp_congestion;
  // The rate of this worker's link, in bits per second (0: unknown). Each
  // stream to a reducer is paced to an equal share of it, so that the
  // contributions sent to the S reducers at once stay within the link; the
  // streams then use cubic unless tcp_congestion names another
  // (docs/architecture.md, "Pacing to the link"). TALLY_LINK_RATE, in tc's
  // units (e.g. 10gbit).
  uint64_t link_rate_bits = 0;
  // Bytes the S reducers' result streams together may have in flight
  // towards this worker (0: not bounded): each bounds its receive window to
  // an equal share, and to no more than its reducer offers in the Welcome,
  // so that results arriving from S reducers at once stay within this
  // worker's link and queue (docs/architecture.md, "The receive budget").
  // TALLY_RECEIVE_BUDGET, a size (e.g. 512KiB).
  uint64_t receive_budget_bytes = uint64_t{512} << 10;
  // Surviving a reducer restart (docs/protocol.md, "Resuming"): a worker
  // whose stream to a reducer is lost reconnects for up to op_timeout and
  // sends the chunks of its ops in flight again; to do so it keeps a copy
  // of the results of finished ops until every rank has them, up to this
  // many bytes (past it, ops go uncopied, and a restart then fails them).
  // 0: no resuming; a lost reducer fails every op in flight at once.
  // With replica groups, the whole shard starts its ops in flight again
  // once the lost reducer is back ("Resuming with replica groups").
  // TALLY_RESUME_BYTES.
  uint64_t resume_bytes = uint64_t{256} << 20;
  // Reproducible sums: every element of a result is summed over the ranks
  // in one fixed tree, so the same inputs give the same bits whatever the
  // arrival order, timing, restarts, shard count or transport
  // (docs/architecture.md, "Determinism"). Every rank of a job must agree;
  // it costs the reducers memory (a buffer per rank per chunk in flight).
  // TALLY_DETERMINISTIC.
  bool deterministic = false;
  // The level of tally's log lines (trace, debug, info, warn, error,
  // critical, off), set on spdlog's default logger when it is read and when
  // a client connects; empty: left as the process has it (info). The lines
  // go to stderr unless the process gave spdlog a default logger of its
  // own. TALLY_LOG_LEVEL (read before the other TALLY_* names).
  std::string log_level;
};

// Reads TALLY_POOL (comma-separated), TALLY_JOB, TALLY_RANK,
// TALLY_WORLD_SIZE, and optionally TALLY_GROUPS, TALLY_GROUP,
// TALLY_GROUP_SIZES, TALLY_CHUNK_BYTES, TALLY_OP_TIMEOUT_MS,
// TALLY_CONNECT_TIMEOUT_MS, TALLY_HEARTBEAT_MS, TALLY_PEER_TIMEOUT_MS,
// TALLY_TRANSPORT, TALLY_FABRIC_PROVIDER (else FI_PROVIDER),
// TALLY_FABRIC_FORCE_REGISTRATION, TALLY_FABRIC_MAX_MSG_BYTES,
// TALLY_WIRE_DTYPE, TALLY_WIRE_RESULT, TALLY_JOB_SECRET, TALLY_JOB_SECRET_FILE,
// TALLY_RESUME_BYTES (docs/configuration.md). Errors: kInvalidArgument naming the variable.
Result<ClientOptions> client_options_from_env();
// Checks the options; the same checks connect() applies.
Status validate(const ClientOptions& options);
// validate's checks, then the congestion control the options give the
// worker's streams: tcp_congestion, or under a link rate the paced choice
// (stream_congestion_control, tcp_transport.h), whose errors name
// TALLY_TCP_CONGESTION or TALLY_LINK_RATE. connect() takes it from here.
Result<std::string> validated_congestion_control(const ClientOptions& options);

// The end of an asynchronous op, handed to its callback: ok, or why it failed.
// Runs on the thread doing the client's I/O: its I/O thread, or a thread
// blocked in Client::allreduce(_fused) (or, for a call refused at once, on the
// calling thread before the call returns; for an op still in flight when the
// Client is destroyed, on the destroying thread), before the op's waiters
// wake. It must not block (nor wait on its own op) or throw; it may start new
// ops.
using OpCallback = std::function<void(const Status&)>;

// A handle on an op in flight (or on several, for a fused call). Copyable;
// all copies see the same op. Thread-safe. Dropping every handle neither
// waits for nor cancels the op: the buffers must stay valid until the op has
// ended (wait, test or the callback say when), or the Client is destroyed.
class OpHandle {
 public:
  OpHandle() = default;  // an empty handle: valid() is false
  bool valid() const { return state_ != nullptr; }
  // The op's number (the first one, for a fused call), or none when the call
  // took no number (refused arguments, an empty fused call).
  std::optional<uint64_t> op() const;
  // Blocks until the op has ended: ok once the result is in the buffer(s),
  // else why it failed (the errors of Client::allreduce). It always ends by
  // the client's backstop deadline (docs/configuration.md); waiting much
  // longer is a tally bug and aborts the process with a message.
  Status wait() const;
  // As wait(), but gives up at `deadline` (nullopt: still in flight).
  std::optional<Status> wait_until(std::chrono::steady_clock::time_point deadline) const;
  std::optional<Status> wait_for(std::chrono::milliseconds timeout) const {
    return wait_until(std::chrono::steady_clock::now() + timeout);
  }
  // Never blocks: the op's Status once it has ended, else nullopt.
  std::optional<Status> test() const;

  struct State;
  explicit OpHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// One buffer of a fused call: `count` elements at `data`.
struct BufferRef {
  void* data = nullptr;
  size_t count = 0;
};

// Buffers below this size are fused by default (Horovod's fusion threshold
// is 64 MiB; ours is smaller because a fused group is copied in and out on
// the I/O thread, and 4 MiB already fills every shard's pipeline).
constexpr size_t kDefaultFuseBytes = size_t{4} << 20;

class Client {
 public:
  // Connects to every reducer of the pool and joins the job. Blocks up to
  // options.connect_timeout. Errors: kInvalidArgument, kUnavailable,
  // kTimeout, or the reducer's refusal (kVersionMismatch, kAlreadyExists,
  // kMismatch, kResourceExhausted).
  static Result<std::unique_ptr<Client>> connect(const ClientOptions& options);
  // Closes the streams and joins the I/O thread. Ops still in flight end
  // with kCancelled (their callbacks run on this thread) and their buffers
  // are no longer touched once this returns.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // In-place all-reduce of `count` elements at `data`. Blocks until every
  // worker's contribution is summed and the result is in `data`, or until
  // the op fails (kMismatch, kPeerLost, kTimeout, kProtocol, kUnimplemented;
  // the message names the ranks or reducer involved). On failure `data`
  // holds a mix of input and result, and is no longer touched by tally.
  // Thread-safe, but ops are numbered in call order, which must match on
  // every worker. Once a reducer stream is lost every later op fails too.
  // While it blocks, the calling thread does the client's I/O itself where
  // no other blocking call is doing it (the callbacks of asynchronous ops
  // in flight may then run on it): a small op costs no wake-up of the I/O
  // thread. allreduce_async(...).wait() always waits for the I/O thread.
  Status allreduce(void* data, size_t count, DType dtype, RedOp op);

  template <typename T>
  Status allreduce(std::span<T> data, DType dtype, RedOp op) {
    return allreduce(data.data(), data.size(), dtype, op);
  }

  // Starts the all-reduce of allreduce() and returns at once. Many ops may
  // be in flight; each ends as its chunks return. `on_done`, if given, runs
  // once when the op ends (see OpCallback). The buffer must stay valid and
  // untouched until then. Refused arguments (kInvalidArgument) take no op
  // number and give a handle that has already ended. Thread-safe; op numbers
  // are taken in call order (see the top of this file).
  OpHandle allreduce_async(void* data, size_t count, DType dtype, RedOp op,
                           OpCallback on_done = {});

  // All-reduces several buffers of one dtype, fusing the small ones. Walking
  // `buffers` in order, a buffer of at least `fuse_bytes` is its own op, in
  // place; smaller ones are packed into a group until adding the next would
  // pass `fuse_bytes`, and each group of two or more is one op on a staging
  // copy (copied in now, copied back on success, on the I/O thread). Empty
  // buffers are skipped. The number of ops is a function of the sizes and
  // `fuse_bytes` alone, so it matches on every rank that passes the same
  // sizes. The handle ends when every op has; it fails with the first
  // failure, and then fused buffers are unchanged while unfused ones are as
  // after a failed allreduce. `fuse_bytes` = 0 fuses nothing.
  OpHandle allreduce_fused_async(std::span<const BufferRef> buffers, DType dtype, RedOp op,
                                 size_t fuse_bytes = kDefaultFuseBytes, OpCallback on_done = {});
  // The same, blocking as allreduce() does.
  Status allreduce_fused(std::span<const BufferRef> buffers, DType dtype, RedOp op,
                         size_t fuse_bytes = kDefaultFuseBytes);

  uint32_t rank() const;
  uint32_t world_size() const;
  uint32_t shards() const;
  uint32_t groups() const;
  uint32_t group() const;
  const ClientOptions& options() const;
  // The chunk plan this client uses for op number `op` of `count` elements
  // of `dtype` (the settings the pool's Welcomes gave included).
  ChunkPlan plan(uint64_t count, DType dtype, uint64_t op) const;
  // Its counters so far (stats.h). Thread-safe.
  ClientStats stats() const;
  // The number the next op will take (ops numbered so far).
  uint64_t next_op() const;

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tally
