// tally-reducer: accepts worker streams of any job, sums their chunks and
// streams the results back. One Reducer is one shard of a pool.
#pragma once

#include <prometheus/client_metric.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "tally/protocol/status.h"
#include "tally/reducer/reducer_counters.h"
#include "tally/reducer/reducer_options.h"

namespace tally {

// A snapshot of the reducer's counters and gauges (docs/operations.md lists
// their meaning as /metrics names them).
struct ReducerStats {
  // The counters (reducer_counters.h), levels clamped at 0.
  std::array<uint64_t, kCounts> counts{};
  std::array<uint64_t, kLevels> levels{};
  uint64_t& operator[](Count c) { return counts[static_cast<size_t>(c)]; }
  uint64_t& operator[](Level l) { return levels[static_cast<size_t>(l)]; }
  uint64_t operator[](Count c) const { return counts[static_cast<size_t>(c)]; }
  uint64_t operator[](Level l) const { return levels[static_cast<size_t>(l)]; }
  // By ErrorCode name ("TIMEOUT", ...); reasons never seen are absent.
  std::map<std::string, uint64_t> ops_failed_by_reason;
  std::map<std::string, uint64_t> chunks_failed_by_reason;
  // Seconds per completed op on this reducer (prometheus-cpp's buckets).
  prometheus::ClientMetric::Histogram op_seconds;
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
