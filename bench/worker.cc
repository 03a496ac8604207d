#include "worker.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "reducer_traffic.h"
#include "tally/bench/metrics_scrape.h"
#include "tally/bench/pattern.h"
#include "tally/bench/process.h"
#include "tally/bench/table.h"
#include "tally/client/client.h"
#include "tally/client/option_names.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/groups.h"
#include "tally/protocol/pool.h"
#include "tally/protocol/version.h"
#include "tally/reducer/butterfly.h"

namespace tally::bench {
namespace {

struct ReducerRow {
  uint32_t shard, group;
  Counters measured;  // per op
  Expected expected;
};

struct Row {
  size_t bytes;
  size_t count;
  double time_us;
  double algbw;
  double wrong;
  // The ranks' CPU over the timed loop, summed. The driver's `# cpu` line
  // counts each worker's whole life: start-up, the buffer, and the checks'
  // fill and compare, which are the bench's work.
  double timed_cpu;
  std::vector<ReducerRow> reducers;
};

// The checked op of a row: inputs seeded by the row's number (pattern.h),
// so a result of an earlier row's op does not pass for this one's.
template <typename T>
size_t run_check(Client& client, T* data, size_t count, DType dtype, RedOp redop, uint64_t seed,
                 Status& status, double relative = 0) {
  fill_pattern(data, count, client.rank(), seed);
  status = client.allreduce(data, count, dtype, redop);
  if (!status) return count;
  return count_wrong(data, count, client.world_size(), redop, seed, relative);
}

// TALLY_LINK_RATE as tc writes it ("1gbit"), or "none".
std::string link_rate_string(uint64_t bits) {
  if (bits == 0) return "none";
  for (auto [scale, unit] :
       {std::pair{1000000000ull, "gbit"}, {1000000ull, "mbit"}, {1000ull, "kbit"}}) {
    if (bits % scale == 0) return std::to_string(bits / scale) + unit;
  }
  return std::to_string(bits) + "bit";
}

// One rank's sweep: the client, the sweep's buffer, and (rank 0) the rows.
class Sweep {
 public:
  Sweep(const SweepOptions& sweep, const ClientOptions& options, Client& client, DType dtype,
        RedOp redop, void* mem)
      : sweep_(sweep),
        options_(options),
        client_(client),
        dtype_(dtype),
        redop_(redop),
        esize_(dtype_size(dtype)),
        mem_(mem),
        leader_(client.rank() == 0),
        measure_(!sweep.reducer_metrics.empty()),
        group_sizes_(default_group_sizes(client.world_size(), client.groups())) {}

  bool leader() const { return leader_; }
  bool measure() const { return measure_; }
  const std::vector<Row>& rows() const { return rows_; }

  void print_header() const;
  // Checks, warms up, times and gathers one size; rank 0 prints its row.
  Result<Row> run_row(size_t bytes, uint64_t seed);
  double print_summary(bool wrong) const;  // returns the mean algbw
  void print_reducer_bytes() const;
  Status write_json(double avg_busbw) const;

 private:
  size_t checked_op(size_t count, uint64_t seed, Status& status);
  std::vector<ReducerRow> reducer_rows(const std::vector<Counters>& before,
                                       const std::vector<Counters>& after, size_t count,
                                       uint64_t first_timed) const;
  // Every rank takes part; rank 0 reads the counters while the others wait.
  Status barrier() {
    double value = 0;
    return client_.allreduce(&value, 1, DType::kFloat64, RedOp::kSum);
  }
  // The counters are live: results are counted before they are sent, so
  // once every rank has its results the counters hold them.
  Result<std::vector<Counters>> snapshot() const;
  std::string wire_name() const;
  double timed_cpu() const;
  double timed_gb() const;  // sent by the ranks in the timed loops

  const SweepOptions& sweep_;
  const ClientOptions& options_;
  Client& client_;
  const DType dtype_;
  const RedOp redop_;
  const size_t esize_;
  void* const mem_;
  const bool leader_;
  const bool measure_;
  const std::vector<uint32_t> group_sizes_;
  std::vector<Row> rows_;  // rank 0's
};

std::string Sweep::wire_name() const {
  if (!options_.wire_dtype) return "native";
  std::string wire(dtype_name(*options_.wire_dtype));
  if (options_.wire_result == DType::kFloat32) wire += " (float32 results)";
  return wire;
}

void Sweep::print_header() const {
  std::printf(
      "# tally-bench %s (%s) transport=%s W=%u S=%u G=%u chunk=%s wire=%s link-rate=%s sums=%s\n",
      TALLY_VERSION, git_sha(), options_.transport.c_str(), client_.world_size(), client_.shards(),
      client_.groups(), options_.chunk_bytes ? human_bytes(options_.chunk_bytes).c_str() : "auto",
      wire_name().c_str(), link_rate_string(options_.link_rate_bits).c_str(),
      options_.deterministic ? "reproducible" : "arrival-order");
  std::printf(
      "# reduction server: every worker sends and receives the buffer once, so busbw = algbw\n");
  std::printf(
      "# warm-up %d, timed %d iterations; time is the mean over ranks; #wrong is checked "
      "outside the timed loop\n#\n",
      sweep_.warmup, sweep_.iters);
  std::fputs(table_header().c_str(), stdout);
  std::fflush(stdout);
}

Result<std::vector<Counters>> Sweep::snapshot() const {
  std::vector<Counters> out;
  if (!leader_) return out;
  for (auto& address : sweep_.reducer_metrics) {
    auto c = read_counters(address);
    if (!c) return c.status();
    out.push_back(*c);
  }
  return out;
}

size_t Sweep::checked_op(size_t count, uint64_t seed, Status& status) {
  switch (dtype_) {
    case DType::kFloat32:
      // On the bfloat16 wire the inputs are rounded: checked within its bound.
      return run_check(client_, static_cast<float*>(mem_), count, dtype_, redop_, seed, status,
                       options_.wire_dtype ? kBfloat16WireRelativeError : 0);
    case DType::kFloat64:
      return run_check(client_, static_cast<double*>(mem_), count, dtype_, redop_, seed, status);
    case DType::kInt32:
      return run_check(client_, static_cast<int32_t*>(mem_), count, dtype_, redop_, seed, status);
    case DType::kInt64:
      return run_check(client_, static_cast<int64_t*>(mem_), count, dtype_, redop_, seed, status);
    default:
      status = Status(ErrorCode::kUnimplemented, "bench cannot check " + sweep_.dtype);
      return 0;
  }
}

Result<Row> Sweep::run_row(size_t bytes, uint64_t seed) {
  const size_t count = bytes / esize_;
  Status status;
  const size_t wrong = sweep_.check ? checked_op(count, seed, status) : 0;
  for (int i = 0; status && i < sweep_.warmup; ++i)
    status = client_.allreduce(mem_, count, dtype_, redop_);
  std::vector<Counters> before;
  if (measure_ && status) {
    status = barrier();
    auto counters = snapshot();
    if (!counters) return counters.status();
    before = std::move(*counters);
    if (status) status = barrier();
  }
  const double cpu0 = rusage_cpu_seconds(RUSAGE_SELF);
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t first_timed = client_.next_op();  // the timed ops' numbers follow it
  for (int i = 0; status && i < sweep_.iters; ++i)
    status = client_.allreduce(mem_, count, dtype_, redop_);
  const auto t1 = std::chrono::steady_clock::now();
  const double cpu1 = rusage_cpu_seconds(RUSAGE_SELF);
  if (!status) {
    return Status(status.code(),
                  "all-reduce of " + std::to_string(bytes) + " bytes failed: " + status.message());
  }
  double stats[3] = {
      std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(1, sweep_.iters),
      static_cast<double>(wrong), cpu1 - cpu0};
  status = client_.allreduce(stats, 3, DType::kFloat64, RedOp::kSum);
  std::vector<Counters> after;
  if (measure_ && status) {
    auto counters = snapshot();
    if (!counters) return counters.status();
    after = std::move(*counters);
    status = barrier();
  }
  if (!status) return Status(status.code(), "gathering results failed: " + status.message());
  Row row{count * esize_, count, stats[0] / client_.world_size(), 0, stats[1], stats[2], {}};
  row.algbw = row.time_us > 0 ? static_cast<double>(row.bytes) / row.time_us / 1e3 : 0;
  if (!leader_) return row;
  if (measure_) row.reducers = reducer_rows(before, after, count, first_timed);
  rows_.push_back(row);
  std::fputs(format_row(TableRow{row.bytes, row.count, std::string(dtype_name(dtype_)),
                                 std::string(redop_name(redop_)), row.time_us, row.algbw, row.algbw,
                                 row.wrong})
                 .c_str(),
             stdout);
  std::fflush(stdout);
  return row;
}

std::vector<ReducerRow> Sweep::reducer_rows(const std::vector<Counters>& before,
                                            const std::vector<Counters>& after, size_t count,
                                            uint64_t first_timed) const {
  std::vector<ReducerRow> out;
  const double n = sweep_.iters;
  // A small op's plan turns over the shards with its number (op % S): the
  // mean over the timed ops, one plan per turn weighed by how many timed
  // ops take it.
  const int turns = std::min<int>(sweep_.iters, static_cast<int>(client_.shards()));
  for (uint32_t g = 0; g < client_.groups(); ++g) {
    for (uint32_t s = 0; s < client_.shards(); ++s) {
      const size_t i = pool_index(g, s, client_.shards());
      ReducerRow rr;
      rr.shard = s;
      rr.group = g;
      rr.measured.worker_in = (after[i].worker_in - before[i].worker_in) / n;
      rr.measured.worker_out = (after[i].worker_out - before[i].worker_out) / n;
      rr.measured.replica_in = (after[i].replica_in - before[i].replica_in) / n;
      rr.measured.replica_out = (after[i].replica_out - before[i].replica_out) / n;
      for (int t = 0; t < turns; ++t) {
        const double ops = (sweep_.iters - t + turns - 1) / turns;
        const Expected e = expected_bytes(client_.plan(count, dtype_, first_timed + t), esize_, s,
                                          g, group_sizes_, options_.deterministic);
        rr.expected.worker += e.worker * ops / n;
        rr.expected.replica_in += e.replica_in * ops / n;
        rr.expected.replica_out += e.replica_out * ops / n;
      }
      out.push_back(rr);
    }
  }
  return out;
}

double Sweep::timed_cpu() const {
  double cpu = 0;
  for (auto& r : rows_) cpu += r.timed_cpu;
  return cpu;
}

double Sweep::timed_gb() const {
  double bytes = 0;
  for (auto& r : rows_) bytes += static_cast<double>(r.bytes) * sweep_.iters * client_.world_size();
  return bytes / 1e9;
}

double Sweep::print_summary(bool wrong) const {
  double avg = 0;
  for (auto& r : rows_) avg += r.algbw;
  if (!rows_.empty()) avg /= static_cast<double>(rows_.size());
  std::printf("# Out of bounds values : %s\n", wrong ? "FAILED" : "0 OK");
  std::printf("# Avg bus bandwidth    : %.3f\n", avg);
  const double cpu = timed_cpu(), gb = timed_gb();
  const double per_gb = gb > 0 ? cpu / gb : 0.0;
  std::printf("# cpu of the workers in the timed loops: %.2f s = %.2f s/GB sent (%.2f GB)", cpu,
              per_gb, gb);
  if (sweep_.cpu_floor_s_per_gb > 0) {
    std::printf(" = %.2fx a bare TCP stream", per_gb / sweep_.cpu_floor_s_per_gb);
  }
  std::printf("\n#\n");
  return avg;
}

void Sweep::print_reducer_bytes() const {
  std::printf(
      "# Payload bytes per op at each reducer (shard s, group g; w = workers of the group), "
      "measured from its counters over the timed loop,\n"
      "# and the formula's: workers w x N_s each way (N_s: shard s's bytes of the tensor); "
      "replicas 2(P-1)/P x N_s each way\n"
      "# (P: largest power of two <= groups with workers; +N_s for a replica paired with an "
      "extra; an extra sends and receives N_s)\n");
  std::printf("# %10s %3s %3s %3s %12s %12s %12s %12s | %12s %12s %12s\n", "size", "s", "g", "w",
              "worker-in", "worker-out", "replica-in", "replica-out", "f:worker", "f:replica-in",
              "f:replica-out");
  for (const Row& r : rows_) {
    for (const ReducerRow& rr : r.reducers) {
      std::printf("  %10zu %3u %3u %3u %12.0f %12.0f %12.0f %12.0f | %12.0f %12.0f %12.0f\n",
                  r.bytes, rr.shard, rr.group, group_sizes_[rr.group], rr.measured.worker_in,
                  rr.measured.worker_out, rr.measured.replica_in, rr.measured.replica_out,
                  rr.expected.worker, rr.expected.replica_in, rr.expected.replica_out);
    }
  }
  std::printf("#\n");
}

Status Sweep::write_json(double avg_busbw) const {
  using nlohmann::json;
  json rows = json::array();
  for (const Row& r : rows_) {
    json row = {{"size", r.bytes},
                {"count", r.count},
                {"type", std::string(dtype_name(dtype_))},
                {"redop", std::string(redop_name(redop_))},
                {"time_us", r.time_us},
                {"algbw_gbps", r.algbw},
                {"busbw_gbps", r.algbw},
                {"wrong", r.wrong}};
    if (!r.reducers.empty()) {
      json reducers = json::array();
      for (const ReducerRow& rr : r.reducers) {
        reducers.push_back({{"shard", rr.shard},
                            {"group", rr.group},
                            {"worker_in", rr.measured.worker_in},
                            {"worker_out", rr.measured.worker_out},
                            {"replica_in", rr.measured.replica_in},
                            {"replica_out", rr.measured.replica_out},
                            {"expected_worker", rr.expected.worker},
                            {"expected_replica_in", rr.expected.replica_in},
                            {"expected_replica_out", rr.expected.replica_out}});
      }
      row["reducers"] = std::move(reducers);
    }
    rows.push_back(std::move(row));
  }
  const json doc = {
      {"tool", "tally-bench"},
      {"version", TALLY_VERSION},
      {"git", git_sha()},
      {"transport", options_.transport},
      {"workers", client_.world_size()},
      {"shards", client_.shards()},
      {"groups", client_.groups()},
      {"chunk_bytes", options_.chunk_bytes},
      {"wire_dtype",
       options_.wire_dtype ? std::string(dtype_name(*options_.wire_dtype)) : "native"},
      {"deterministic", options_.deterministic},
      {"busbw_factor", 1.0},
      {"rows", std::move(rows)},
      {"avg_busbw_gbps", avg_busbw},
      {"timed_worker_cpu_s", timed_cpu()},
      {"timed_gb", timed_gb()},
      {"bare_stream_cpu_s_per_gb", sweep_.cpu_floor_s_per_gb},
  };
  std::ofstream out(sweep_.json_path);
  out << doc.dump(1) << "\n";
  if (!out) return Status(ErrorCode::kInvalidArgument, "cannot write " + sweep_.json_path);
  return Status();
}

// The sweep's buffer: in huge pages where the kernel gives them, touched
// once up front, unmapped at the end.
class SweepBuffer {
 public:
  explicit SweepBuffer(size_t max_bytes) : capacity_((max_bytes + 4095) / 4096 * 4096 + 4096) {
    mem_ = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem_ == MAP_FAILED) {
      mem_ = nullptr;
      return;
    }
    madvise(mem_, capacity_, MADV_HUGEPAGE);
    std::memset(mem_, 0, capacity_);
  }
  ~SweepBuffer() {
    if (mem_) munmap(mem_, capacity_);
  }
  SweepBuffer(const SweepBuffer&) = delete;
  SweepBuffer& operator=(const SweepBuffer&) = delete;
  void* data() const { return mem_; }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  void* mem_;
};

// The client options of this rank: TALLY_* and the sweep's overrides.
Result<ClientOptions> sweep_client_options(const SweepOptions& sweep) {
  auto options = client_options_from_env();
  if (!options) return options.status();
  if (sweep.chunk_bytes) options->chunk_bytes = *sweep.chunk_bytes;
  if (Status s = set_client_option(*options, "TALLY_WIRE_DTYPE", sweep.wire_dtype); !s) return s;
  return options;
}

}  // namespace

int run_worker(const SweepOptions& sweep) {
  auto options = sweep_client_options(sweep);
  if (!options) {
    spdlog::error("{}", options.status().to_string());
    return 2;
  }
  auto dtype = parse_dtype(sweep.dtype);
  auto redop = parse_redop(sweep.redop);
  if (!dtype || !redop) {
    spdlog::error("unknown dtype '{}' or reduction '{}'", sweep.dtype, sweep.redop);
    return 2;
  }
  auto connected = Client::connect(*options);
  if (!connected) {
    spdlog::error("rank {}: {}", options->rank, connected.status().to_string());
    return 2;
  }
  Client& client = **connected;
  SweepBuffer buffer(sweep.max_bytes);
  if (!buffer.data()) {
    spdlog::error("cannot map {} bytes", buffer.capacity());
    return 2;
  }
  Sweep run(sweep, *options, client, *dtype, *redop, buffer.data());
  if (run.measure() && sweep.reducer_metrics.size() != size_t{client.shards()} * client.groups()) {
    spdlog::error("--reducer-metrics lists {} addresses for {} reducers",
                  sweep.reducer_metrics.size(), client.shards() * client.groups());
    return 2;
  }
  if (run.leader()) run.print_header();
  bool wrong = false;
  uint64_t seed = 0;  // the row's number
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes;
       bytes = sweep.factor > 1 ? bytes * sweep.factor : bytes + 1) {
    if (bytes / dtype_size(*dtype) == 0) continue;
    auto row = run.run_row(bytes, seed++);
    if (!row) {
      spdlog::error("rank {}: {}", client.rank(), row.status().to_string());
      return 1;
    }
    if (row->wrong > 0) wrong = true;
    if (sweep.factor <= 1 && bytes == sweep.max_bytes) break;
  }
  if (!run.leader()) return wrong ? 3 : 0;
  const double avg = run.print_summary(wrong);
  if (run.measure()) run.print_reducer_bytes();
  if (!sweep.json_path.empty()) {
    if (Status s = run.write_json(avg); !s) {
      spdlog::error("{}", s.to_string());
      return 2;
    }
  }
  return wrong ? 3 : 0;
}

}  // namespace tally::bench
