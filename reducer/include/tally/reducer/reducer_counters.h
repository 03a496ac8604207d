// What one reducer counts, each count described once (kCountInfo,
// kLevelInfo): its jobs and sessions count into ReducerCounters,
// Reducer::stats copies them into ReducerStats, and /metrics
// (reducer/metrics.cc) makes its families from the same descriptions.
#pragma once

#include <prometheus/histogram.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tally/protocol/status.h"

namespace tally {

// Counts that only grow (Prometheus counters). Bytes are payload bytes:
// Worker* to and from workers, Replica* to and from other replicas.
enum class Count : size_t {
  kWorkerBytesReceived,
  kReplicaBytesReceived,
  kWorkerBytesSent,
  kReplicaBytesSent,
  kChunksFinished,
  kOpsCompleted,  // ops whose every chunk on this reducer has been finished
  kOpsFailed,
  kStreamPauses,
};
inline constexpr size_t kCounts = 8;

// Levels that go up and down (Prometheus gauges).
enum class Level : size_t {
  kWorkerStreams,   // streams that said Hello
  kReplicaStreams,  // streams that said ReplicaHello
  kStreamsPaused,   // not read because their job's buffers are all in use
  // Distinct (job, rank) pairs some chunk has waited on for longer than
  // half the op timeout, as of the last sweep.
  kStragglerRanks,
};
inline constexpr size_t kLevels = 4;

// How a count or a level is published: a sample of metric `family`,
// labelled `label`=`value` when the family has several (an empty family:
// not published on its own). Entries of one family are next to each other,
// in the order their samples are written.
struct MetricInfo {
  std::string_view family;
  std::string_view help;  // the family's, on its first entry
  std::string_view label = {};
  std::string_view value = {};
};

inline constexpr std::array<MetricInfo, kCounts> kCountInfo = {{
    {"tally_payload_bytes_received_total",
     "Payload bytes received (frame headers and control messages not included), by peer kind.",
     "peer", "worker"},
    {"tally_payload_bytes_received_total", "", "peer", "replica"},
    {"tally_payload_bytes_sent_total",
     "Payload bytes queued for sending (results to workers, partial sums to replicas), by peer "
     "kind.",
     "peer", "worker"},
    {"tally_payload_bytes_sent_total", "", "peer", "replica"},
    {"tally_chunks_completed_total",
     "Chunks summed here and whose result was queued to the workers."},
    {"tally_ops_completed_total", "Ops whose every chunk on this reducer was completed."},
    {"", "Ops failed on this reducer: tally_ops_failed_total's reasons together."},
    {"tally_stream_pauses_total", "Times a stream was paused for back-pressure."},
}};

inline constexpr std::array<MetricInfo, kLevels> kLevelInfo = {{
    {"tally_streams_active",
     "Open streams: from workers, from other replicas, and accepted but not yet past hello.",
     "kind", "worker"},
    {"tally_streams_active", "", "kind", "replica"},
    {"tally_streams_paused",
     "Streams not being read because their job's chunk buffers are all in use (back-pressure)."},
    {"tally_straggler_ranks",
     "Ranks some chunk here has waited on for longer than half the op timeout, as of the last "
     "100 ms sweep."},
}};

// Every Count and Level has its entry: an entry left out of a table (value-
// initialized) has no help and is not its neighbour's second sample.
template <size_t N>
constexpr bool every_entry_described(const std::array<MetricInfo, N>& info) {
  for (size_t i = 0; i < N; ++i) {
    if (info[i].help.empty() && (i == 0 || info[i].family != info[i - 1].family)) return false;
  }
  return true;
}
static_assert(every_entry_described(kCountInfo) && every_entry_described(kLevelInfo));
static_assert(static_cast<size_t>(Count::kStreamPauses) + 1 == kCounts);
static_assert(static_cast<size_t>(Level::kStragglerRanks) + 1 == kLevels);

// The counters of one reducer, shared by its jobs. Everything is a relaxed
// atomic (or prometheus-cpp's histogram, whose leaf lock is held for one
// bucket increment), so counting never takes a lock of the data path.
struct ReducerCounters {
  // ErrorCode values are 0..kLastErrorCode (status.h): one slot each.
  static constexpr size_t kReasons = static_cast<size_t>(kLastErrorCode) + 1;

  std::array<std::atomic<uint64_t>, kCounts> counts{};
  std::array<std::atomic<int64_t>, kLevels> levels{};
  // Failures by ErrorCode: ops, and the chunks in flight they took down.
  std::array<std::atomic<uint64_t>, kReasons> ops_failed_by{};
  std::array<std::atomic<uint64_t>, kReasons> chunks_failed_by{};
  // Seconds from an op's first contribution header here to its last
  // chunk's result being queued, observed once per completed op.
  prometheus::Histogram op_seconds{
      prometheus::Histogram::BucketBoundaries{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                              0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};

  std::atomic<uint64_t>& operator[](Count c) { return counts[static_cast<size_t>(c)]; }
  std::atomic<int64_t>& operator[](Level l) { return levels[static_cast<size_t>(l)]; }
  void add(Count c, uint64_t n = 1) { (*this)[c].fetch_add(n, std::memory_order_relaxed); }
  void add(Level l, int64_t n) { (*this)[l].fetch_add(n, std::memory_order_relaxed); }
  void set(Level l, int64_t v) { (*this)[l].store(v, std::memory_order_relaxed); }

  void count_op_failed(ErrorCode code, size_t chunks) {
    const size_t i = static_cast<size_t>(code) < kReasons ? static_cast<size_t>(code) : 0;
    add(Count::kOpsFailed);
    ops_failed_by[i].fetch_add(1, std::memory_order_relaxed);
    chunks_failed_by[i].fetch_add(chunks, std::memory_order_relaxed);
  }
};

}  // namespace tally
