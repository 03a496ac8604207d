// The counters of one reducer, which its jobs and sessions count into and
// /metrics reads (Reducer::stats, reducer/metrics.cc).
#pragma once

#include <prometheus/histogram.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "tally/protocol/status.h"

namespace tally {

// Counters of one reducer, shared by its jobs. Bytes are payload bytes:
// worker_* to and from workers, replica_* to and from other replicas.
// Everything is a relaxed atomic (or prometheus-cpp's histogram, whose leaf
// lock is held for one bucket increment), so counting never takes a lock of
// the data path; /metrics reads them (reducer/metrics.cc).
struct ReducerCounters {
  // ErrorCode values are 0..kLastErrorCode (status.h): one slot each.
  static constexpr size_t kReasons = static_cast<size_t>(kLastErrorCode) + 1;

  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> replica_bytes_received{0};
  std::atomic<uint64_t> replica_bytes_sent{0};
  std::atomic<uint64_t> chunks_finished{0};
  std::atomic<uint64_t> ops_failed{0};
  // Ops whose every chunk on this reducer has been finished.
  std::atomic<uint64_t> ops_completed{0};
  // Failures by ErrorCode: ops, and the chunks in flight they took down.
  std::array<std::atomic<uint64_t>, kReasons> ops_failed_by{};
  std::array<std::atomic<uint64_t>, kReasons> chunks_failed_by{};
  // Distinct (job, rank) pairs some chunk has waited on for longer than
  // half the op timeout, as of the last sweep (a gauge).
  std::atomic<uint64_t> straggler_ranks{0};
  // Streams by kind (a gauge each): said Hello, said ReplicaHello.
  std::atomic<int64_t> worker_streams{0};
  std::atomic<int64_t> replica_streams{0};
  // Streams not reading because their job's buffers are all in use (a
  // gauge), and how often a stream was paused.
  std::atomic<int64_t> streams_paused{0};
  std::atomic<uint64_t> stream_pauses{0};
  // Seconds from an op's first contribution header here to its last
  // chunk's result being queued, observed once per completed op.
  prometheus::Histogram op_seconds{
      prometheus::Histogram::BucketBoundaries{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                              0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};

  void count_op_failed(ErrorCode code, size_t chunks) {
    const size_t i = static_cast<size_t>(code) < kReasons ? static_cast<size_t>(code) : 0;
    ops_failed.fetch_add(1, std::memory_order_relaxed);
    ops_failed_by[i].fetch_add(1, std::memory_order_relaxed);
    chunks_failed_by[i].fetch_add(chunks, std::memory_order_relaxed);
  }
};

}  // namespace tally
