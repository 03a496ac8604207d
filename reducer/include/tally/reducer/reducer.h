// tally-reducer: accepts worker streams of any job, sums their chunks and
// streams the results back. One Reducer is one shard of a pool.
#pragma once

#include <prometheus/client_metric.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "tally/protocol/auth.h"
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
  // Bytes of contributions all workers of a job together may have sent to
  // this reducer without their results (incast control); each worker stream
  // gets an equal share in its Welcome. docs/architecture.md says why 16 MiB.
  size_t ingress_window_bytes = 16u << 20;
  // The rate of this reducer's link, in bits per second (0: unknown). Each
  // worker stream is paced to an equal share of it, so that the results
  // sent to a job's workers at once stay within the link
  // (docs/architecture.md, "Pacing to the link"). --link-rate.
  uint64_t link_rate_bits = 0;
  ConnectionOptions connection;
  // "tcp": data on the TCP streams only. "fabric": also serves workers that
  // ask for the libfabric data path (tcp workers are still served).
  std::string transport = "tcp";
  FabricOptions fabric;
  // Largest world size a job may declare: a Hello is untrusted input, and
  // per-job and per-chunk state grow with it.
  uint32_t max_world_size = 65536;
  // Workers that hold the job secret authenticate with it (challenge-
  // response, docs/protocol.md); with require_auth every job must.
  Secret job_secret;
  bool require_auth = false;
  // Replicas of a shard authenticate their links with the pool secret.
  Secret pool_secret;
  // Open streams (workers, replicas, and streams still before their hello);
  // one more is closed as soon as it is accepted, so a flood of sockets
  // cannot take every descriptor the reducer has.
  size_t max_connections = 4096;
  // A stream that has not sent its hello by then is closed.
  std::chrono::milliseconds hello_timeout{10000};
  // Longest op timeout a worker may ask for.
  std::chrono::milliseconds max_op_timeout{3600 * 1000};
};

// A snapshot of the reducer's counters and gauges (docs/operations.md lists
// their meaning as /metrics names them).
struct ReducerStats {
  uint64_t bytes_received = 0;  // payload bytes from workers
  uint64_t bytes_sent = 0;      // payload bytes to workers
  uint64_t replica_bytes_received = 0;
  uint64_t replica_bytes_sent = 0;
  uint64_t chunks_finished = 0;
  uint64_t ops_failed = 0;
  uint64_t ops_completed = 0;
  // By ErrorCode name ("TIMEOUT", ...); reasons never seen are absent.
  std::map<std::string, uint64_t> ops_failed_by_reason;
  std::map<std::string, uint64_t> chunks_failed_by_reason;
  // Seconds per completed op on this reducer (prometheus-cpp's buckets).
  prometheus::ClientMetric::Histogram op_seconds;
  uint64_t straggler_ranks = 0;
  size_t worker_streams = 0;
  size_t replica_streams = 0;
  size_t streams_paused = 0;
  uint64_t stream_pauses = 0;
  // Chunk buffers: all, holding data, reserved by a job but idle, and not
  // reserved by any job; and what one more job (one group) reserves.
  size_t slabs_total = 0;
  size_t slabs_in_use = 0;
  size_t slabs_reserved_idle = 0;
  size_t slabs_free = 0;
  size_t slabs_per_job = 0;
  size_t replica_links_up = 0;
  size_t replica_links_expected = 0;
  size_t jobs = 0;
  size_t connections = 0;
  bool stopping = false;
};

class Reducer {
 public:
  // Maps the buffer pool, binds, starts the I/O threads. Errors:
  // kInvalidArgument (options), kUnavailable (bind), kResourceExhausted.
  static Result<std::unique_ptr<Reducer>> start(const ReducerOptions& options);
  ~Reducer();  // stops and joins

  // The bound address (the real port when options.listen.port was 0).
  HostPort address() const;
  // Thread-safe, never blocks on the data path (atomics; the job table's
  // and the buffer pool's locks for a moment, as a new job takes them).
  ReducerStats stats() const;
  // /healthz: ok unless stopping or I/O thread 0 has not run its 100 ms
  // sweep for 5 s. Thread-safe, non-blocking.
  Status liveness() const;
  // /readyz: live, every replica link up, and enough free chunk buffers
  // for one more job. Errors say which is missing. Thread-safe.
  Status readiness() const;
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
