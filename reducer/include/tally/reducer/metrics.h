// The reducer's metrics in the Prometheus data model: every counter and
// gauge of ReducerStats as a prometheus-cpp MetricFamily, the op-latency
// histogram as prometheus-cpp computed it, and the HTTP side's own request
// counters in a prometheus::Registry. The exposition text is written by
// prometheus-cpp's TextSerializer, never by hand. docs/operations.md lists
// every metric with its meaning.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/registry.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tally/reducer/reducer.h"

namespace tally {

// What a pool member is, for the constant labels of tally_reducer_info.
struct ReducerIdentity {
  uint32_t shard = 0;
  uint32_t shard_count = 1;
  uint32_t group = 0;
  uint32_t group_count = 1;
  std::string transport = "tcp";
};

// The ReducerStats snapshot as metric families (pure; for tests and the
// stats file). `ready` is the /readyz answer at the time.
std::vector<prometheus::MetricFamily> reducer_metric_families(const ReducerStats& stats,
                                                              const ReducerIdentity& identity,
                                                              bool ready);

// This process's resources, read from /proc/self when asked.
struct ProcessStats {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double open_fds = 0;
  double max_fds = 0;             // RLIMIT_NOFILE's soft limit
  double start_time_seconds = 0;  // since the Unix epoch
};
// Fields that cannot be read are 0.
ProcessStats read_process_stats();

// The process_* families every Prometheus client exports (process_cpu_
// seconds_total, process_resident_memory_bytes, ...), from `stats` (pure).
std::vector<prometheus::MetricFamily> process_metric_families(const ProcessStats& stats);

// What a running reducer and its process report now (its families and the
// process_* ones; not the HTTP server's counters): /metrics and the stats
// file both serve this.
std::vector<prometheus::MetricFamily> live_metric_families(const Reducer& reducer,
                                                           const ReducerIdentity& identity);

// Prometheus text exposition format (version 0.0.4) of `families`.
std::string metrics_text(const std::vector<prometheus::MetricFamily>& families);

// The content type of metrics_text, for the HTTP response.
inline constexpr const char* kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";

// Collects from a running Reducer on each scrape. Thread-safe: Collect()
// may run on any thread (the HTTP thread) while the reducer serves; it only
// reads atomics and takes the job table's and buffer pool's locks briefly.
// The reducer must outlive this.
class ReducerMetrics final : public prometheus::Collectable {
 public:
  ReducerMetrics(const Reducer& reducer, ReducerIdentity identity);

  std::vector<prometheus::MetricFamily> Collect() const override;
  // Every family, the HTTP counters included, as exposition text.
  std::string scrape() const;
  // Counts one HTTP request by path ("/metrics", "/healthz", "/readyz",
  // "other") and status code.
  void count_request(const std::string& path, unsigned status);
  // Counts a connection refused because the HTTP server was at its limit,
  // or cut by its deadline.
  void count_rejected();
  void count_timed_out();

 private:
  const Reducer& reducer_;
  const ReducerIdentity identity_;
  std::shared_ptr<prometheus::Registry> http_registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& rejected_;
  prometheus::Counter& timed_out_;
};

}  // namespace tally
