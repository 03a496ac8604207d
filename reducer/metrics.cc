#include "tally/reducer/metrics.h"

#include <prometheus/text_serializer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tally/protocol/version.h"

namespace tally {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

ClientMetric sample(double value, MetricType type, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

MetricFamily family(std::string name, std::string help, MetricType type,
                    std::vector<ClientMetric> samples) {
  return MetricFamily{std::move(name), std::move(help), type, std::move(samples)};
}

MetricFamily single(std::string name, std::string help, MetricType type, double value) {
  return family(std::move(name), std::move(help), type, {sample(value, type)});
}

// One sample per reason seen; a family with no sample is still described
// (HELP and TYPE), so dashboards know it exists before the first failure.
MetricFamily by_reason(std::string name, std::string help,
                       const std::map<std::string, uint64_t>& counts) {
  std::vector<ClientMetric> samples;
  for (const auto& [reason, n] : counts) {
    samples.push_back(sample(static_cast<double>(n), MetricType::Counter, {{"reason", reason}}));
  }
  return family(std::move(name), std::move(help), MetricType::Counter, std::move(samples));
}

// The families of a description table (reducer_counters.h): one sample per
// entry, entries of one family together.
template <size_t N>
void append_described(std::vector<MetricFamily>& out, const std::array<MetricInfo, N>& info,
                      const std::array<uint64_t, N>& values, MetricType type) {
  for (size_t i = 0; i < N; ++i) {
    if (info[i].family.empty()) continue;
    std::vector<ClientMetric::Label> labels;
    if (!info[i].label.empty()) {
      labels.push_back({std::string(info[i].label), std::string(info[i].value)});
    }
    ClientMetric m = sample(static_cast<double>(values[i]), type, std::move(labels));
    if (i > 0 && info[i - 1].family == info[i].family) {
      out.back().metric.push_back(std::move(m));
    } else {
      out.push_back(family(std::string(info[i].family), std::string(info[i].help), type, {m}));
    }
  }
}

}  // namespace

std::vector<MetricFamily> reducer_metric_families(const ReducerStats& s, const ReducerIdentity& id,
                                                  bool ready) {
  const auto d = [](auto v) { return static_cast<double>(v); };
  std::vector<MetricFamily> out;
  out.push_back(family("tally_reducer_info", "This reducer's place in its pool; always 1.",
                       MetricType::Gauge,
                       {sample(1, MetricType::Gauge,
                               {{"version", TALLY_VERSION},
                                {"git", git_sha()},
                                {"shard", std::to_string(id.shard)},
                                {"shards", std::to_string(id.shard_count)},
                                {"group", std::to_string(id.group)},
                                {"groups", std::to_string(id.group_count)},
                                {"transport", id.transport}})}));
  append_described(out, kCountInfo, s.counts, MetricType::Counter);
  append_described(out, kLevelInfo, s.levels, MetricType::Gauge);
  // Streams accepted but not yet routed by their hello: the rest of the
  // open connections.
  const size_t routed = s[Level::kWorkerStreams] + s[Level::kReplicaStreams];
  for (MetricFamily& f : out) {
    if (f.name != "tally_streams_active") continue;
    f.metric.push_back(sample(d(s.connections > routed ? s.connections - routed : 0),
                              MetricType::Gauge, {{"kind", "handshake"}}));
  }
  out.push_back(by_reason("tally_chunks_failed_total",
                          "Chunks in flight here when their op failed, by the op's error code.",
                          s.chunks_failed_by_reason));
  out.push_back(by_reason("tally_ops_failed_total",
                          "Ops failed on this reducer, by error code (TIMEOUT, PEER_LOST, "
                          "MISMATCH, ...).",
                          s.ops_failed_by_reason));
  {
    ClientMetric h;
    h.histogram = s.op_seconds;
    out.push_back(family("tally_op_duration_seconds",
                         "Seconds from an op's first contribution on this reducer to its last "
                         "result here being queued, per completed op.",
                         MetricType::Histogram, {h}));
  }
  out.push_back(single("tally_jobs_active", "Jobs with state on this reducer.", MetricType::Gauge,
                       d(s.jobs)));
  out.push_back(
      family("tally_slabs",
             "Chunk buffers by state: holding data, reserved by a job but idle, not reserved.",
             MetricType::Gauge,
             {sample(d(s.slabs_in_use), MetricType::Gauge, {{"state", "in_use"}}),
              sample(d(s.slabs_reserved_idle), MetricType::Gauge, {{"state", "reserved_idle"}}),
              sample(d(s.slabs_free), MetricType::Gauge, {{"state", "free"}})}));
  out.push_back(single("tally_slabs_per_job",
                       "Chunk buffers a new one-group job reserves (window + 2).",
                       MetricType::Gauge, d(s.slabs_per_job)));
  out.push_back(single("tally_replica_links_up",
                       "Other replicas of this shard with both streams up.", MetricType::Gauge,
                       d(s.replica_links_up)));
  out.push_back(single("tally_replica_links", "Other replicas of this shard (groups - 1).",
                       MetricType::Gauge, d(s.replica_links_expected)));
  out.push_back(
      single("tally_ready", "1 when /readyz answers 200.", MetricType::Gauge, ready ? 1 : 0));
  return out;
}

ProcessStats read_process_stats() {
  ProcessStats p;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  if (std::ifstream in("/proc/self/stat"); in) {
    // Fields after the command (which may hold spaces, so it is skipped to
    // its closing parenthesis): 3 state ... 14 utime, 15 stime ... 22
    // starttime, 23 vsize (proc(5)).
    std::string line;
    std::getline(in, line);
    std::istringstream fields(line.substr(line.rfind(')') + 2));
    std::string field;
    for (int i = 3; fields >> field; ++i) {
      if (i == 14 || i == 15) p.cpu_seconds += std::stod(field) / tick;
      if (i == 22) p.start_time_seconds = std::stod(field) / tick;
      if (i == 23) p.virtual_bytes = std::stod(field);
    }
  }
  if (std::ifstream in("/proc/self/statm"); in) {
    double size = 0, resident = 0;
    if (in >> size >> resident) p.resident_bytes = resident * page;
  }
  if (std::ifstream in("/proc/stat"); in) {  // starttime counts from boot
    std::string key;
    double value = 0;
    while (in >> key) {
      if (key == "btime" && in >> value) {
        p.start_time_seconds += value;
        break;
      }
      in.ignore(1 << 20, '\n');
    }
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    p.open_fds += 1;
  }
  if (rlimit limit{}; getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    p.max_fds = static_cast<double>(limit.rlim_cur);
  }
  return p;
}

std::vector<MetricFamily> process_metric_families(const ProcessStats& p) {
  return {
      single("process_cpu_seconds_total", "User and system CPU time spent, in seconds.",
             MetricType::Counter, p.cpu_seconds),
      single("process_resident_memory_bytes", "Resident memory size in bytes.", MetricType::Gauge,
             p.resident_bytes),
      single("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge,
             p.virtual_bytes),
      single("process_open_fds", "Open file descriptors.", MetricType::Gauge, p.open_fds),
      single("process_max_fds", "The most file descriptors the process may open.",
             MetricType::Gauge, p.max_fds),
      single("process_start_time_seconds", "When the process started, in seconds since the epoch.",
             MetricType::Gauge, p.start_time_seconds),
  };
}

std::string metrics_text(const std::vector<MetricFamily>& families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

ReducerMetrics::ReducerMetrics(const Reducer& reducer, ReducerIdentity identity)
    : reducer_(reducer),
      identity_(std::move(identity)),
      http_registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("tally_http_requests_total")
                    .Help("HTTP requests answered, by path and status code.")
                    .Register(*http_registry_)),
      rejected_(prometheus::BuildCounter()
                    .Name("tally_http_connections_rejected_total")
                    .Help("HTTP connections closed at once because the server was at its "
                          "connection limit.")
                    .Register(*http_registry_)
                    .Add({})),
      timed_out_(prometheus::BuildCounter()
                     .Name("tally_http_connections_timed_out_total")
                     .Help("HTTP connections cut because a request was not read or its answer "
                           "not written within the deadline.")
                     .Register(*http_registry_)
                     .Add({})) {}

std::vector<MetricFamily> live_metric_families(const Reducer& reducer,
                                               const ReducerIdentity& identity) {
  auto out = reducer_metric_families(reducer.stats(), identity, reducer.readiness().is_ok());
  auto process = process_metric_families(read_process_stats());
  out.insert(out.end(), std::make_move_iterator(process.begin()),
             std::make_move_iterator(process.end()));
  return out;
}

std::vector<MetricFamily> ReducerMetrics::Collect() const {
  auto out = live_metric_families(reducer_, identity_);
  auto http = http_registry_->Collect();
  out.insert(out.end(), std::make_move_iterator(http.begin()), std::make_move_iterator(http.end()));
  return out;
}

std::string ReducerMetrics::scrape() const { return metrics_text(Collect()); }

void ReducerMetrics::count_request(const std::string& path, unsigned status) {
  requests_.Add({{"path", path}, {"code", std::to_string(status)}}).Increment();
}

void ReducerMetrics::count_rejected() { rejected_.Increment(); }

void ReducerMetrics::count_timed_out() { timed_out_.Increment(); }

}  // namespace tally
