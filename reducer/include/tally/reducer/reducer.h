// tally-reducer: accepts worker streams of any job, sums their chunks and
// streams the results back. One Reducer is one shard of a pool.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/status.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {

struct ReducerOptions {
  HostPort listen{"127.0.0.1", 7070};
  uint32_t shard = 0;
  uint32_t shard_count = 1;
  // Replica groups: this reducer serves group `group` of `group_count`.
  uint32_t group = 0;
  uint32_t group_count = 1;
  // With more than one group: the whole pool, "host:port,..." in (group,
  // shard) order (the same list workers get as TALLY_POOL), from which the
  // reducer takes the other replicas of its shard; or "@PATH", a file
  // holding that list, read when the replicas are first dialled (for
  // launchers that learn the ports only after start-up).
  std::string pool;
  size_t io_threads = 2;
  // All chunk memory, mapped at start-up and never grown.
  size_t memory_budget_bytes = 512u << 20;
  // Largest chunk accepted; the size of each buffer in the pool.
  size_t max_chunk_bytes = 4u << 20;
  // Chunks a worker may have in flight per stream; each job reserves this
  // many buffers plus two (job.h explains why that cannot deadlock).
  uint32_t window_chunks = 8;
  ConnectionOptions connection;
  // "tcp": data on the TCP streams only. "fabric": also serves workers that
  // ask for the libfabric data path (tcp workers are still served).
  std::string transport = "tcp";
  FabricOptions fabric;
  // Largest world size a job may declare: a Hello is untrusted input, and
  // per-job and per-chunk state grow with it.
  uint32_t max_world_size = 65536;
  // A stream that has not sent its hello by then is closed.
  std::chrono::milliseconds hello_timeout{10000};
  // Longest op timeout a worker may ask for.
  std::chrono::milliseconds max_op_timeout{3600 * 1000};
};

struct ReducerStats {
  uint64_t bytes_received = 0;  // payload bytes from workers
  uint64_t bytes_sent = 0;      // payload bytes to workers
  uint64_t replica_bytes_received = 0;
  uint64_t replica_bytes_sent = 0;
  uint64_t chunks_finished = 0;
  uint64_t ops_failed = 0;
  size_t jobs = 0;
  size_t connections = 0;
};

class Reducer {
 public:
  // Maps the buffer pool, binds, starts the I/O threads. Errors:
  // kInvalidArgument (options), kUnavailable (bind), kResourceExhausted.
  static Result<std::unique_ptr<Reducer>> start(const ReducerOptions& options);
  ~Reducer();  // stops and joins

  // The bound address (the real port when options.listen.port was 0).
  HostPort address() const;
  ReducerStats stats() const;
  // Sends every stream a shutdown error and closes it; idempotent,
  // thread-safe, does not block.
  void stop();
  // After stop(): waits up to a second for the streams to close, then stops
  // and joins the I/O threads.
  void wait();

 private:
  struct Impl;
  explicit Reducer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace tally
