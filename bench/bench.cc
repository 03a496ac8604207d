// tally-bench: nccl-tests-style all-reduce sweeps through a tally pool.
//
// Driver mode (default) launches a local pool unless --pool is given, starts
// --workers copies of itself in worker mode, and waits for them. Worker mode
// (--worker, configured by TALLY_* like any training process) runs the sweep
// as one rank; rank 0 prints the table and writes --json. Each size is
// checked for correctness apart from the timed loop, after warm-up.
//
// With --reducer-metrics (the driver passes it for a local pool, and with
// --pool --metrics), rank 0 also reads every reducer's /metrics just before
// and just after each size's timed loop, with all ranks held at a barrier
// (a one-element all-reduce) while it does, and prints the payload bytes
// each reducer received and sent per op, from workers and from the other
// replicas, beside the formula's values.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "reducer_traffic.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/metrics_scrape.h"
#include "tally/bench/pattern.h"
#include "tally/bench/process.h"
#include "tally/client/client.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/groups.h"
#include "tally/protocol/pool.h"
#include "tally/protocol/pool_pattern.h"
#include "tally/reducer/butterfly.h"

namespace tally::bench {
namespace {

struct SweepOptions {
  size_t min_bytes = 4096;
  size_t max_bytes = 64u << 20;
  size_t factor = 2;
  int warmup = 5;
  int iters = 20;
  std::string dtype = "float";
  std::string redop = "sum";
  std::string json_path;
  bool check = true;
  // Reducers' HTTP host:port (--http-listen), by index ((group, shard) order).
  std::vector<std::string> reducer_metrics;
};

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
  std::vector<ReducerRow> reducers;
};

std::string human_bytes(size_t b) {
  if (b % (1u << 20) == 0) return std::to_string(b >> 20) + "MiB";
  if (b % 1024 == 0) return std::to_string(b >> 10) + "KiB";
  return std::to_string(b) + "B";
}

template <typename T>
size_t run_check(Client& client, T* data, size_t count, DType dtype, RedOp redop, Status& status) {
  fill_pattern(data, count, client.rank());
  status = client.allreduce(data, count, dtype, redop);
  if (!status) return count;
  return count_wrong(data, count, client.world_size(), redop);
}

int run_worker(const SweepOptions& sweep) {
  auto options = client_options_from_env();
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
  const size_t esize = dtype_size(*dtype);
  // One buffer for the whole sweep, in huge pages, touched once up front.
  const size_t capacity = (sweep.max_bytes + 4095) / 4096 * 4096 + 4096;
  void* mem = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    spdlog::error("cannot map {} bytes", capacity);
    return 2;
  }
  madvise(mem, capacity, MADV_HUGEPAGE);
  std::memset(mem, 0, capacity);

  const bool leader = client.rank() == 0;
  const bool measure = !sweep.reducer_metrics.empty();
  if (measure && sweep.reducer_metrics.size() != size_t{client.shards()} * client.groups()) {
    spdlog::error("--reducer-metrics lists {} addresses for {} reducers",
                  sweep.reducer_metrics.size(), client.shards() * client.groups());
    return 2;
  }
  const std::vector<uint32_t> group_sizes =
      default_group_sizes(client.world_size(), client.groups());
  // Every rank takes part; rank 0 reads the counters while the others wait.
  double barrier_value = 0;
  auto barrier = [&] { return client.allreduce(&barrier_value, 1, DType::kFloat64, RedOp::kSum); };
  // The counters are live: results are counted before they are sent, so
  // once every rank has its results the counters hold them.
  Status scraped;
  auto snapshot = [&] {
    std::vector<Counters> out;
    if (!leader) return out;
    for (auto& address : sweep.reducer_metrics) {
      auto c = read_counters(address);
      if (!c) scraped = c.status();
      out.push_back(c ? *c : Counters{});
    }
    return out;
  };
  std::vector<Row> rows;
  if (leader) {
    std::printf("# tally-bench %s (%s) transport=%s W=%u S=%u G=%u chunk=%s\n", TALLY_VERSION,
                TALLY_GIT_SHA, options->transport.c_str(), client.world_size(), client.shards(),
                client.groups(), human_bytes(options->chunk_bytes).c_str());
    std::printf(
        "# reduction server: every worker sends and receives the buffer once, so busbw = algbw\n");
    std::printf(
        "# warm-up %d, timed %d iterations; time is the mean over ranks; #wrong is checked "
        "outside the timed loop\n#\n",
        sweep.warmup, sweep.iters);
    std::printf("# %10s %12s %8s %6s %10s %12s %12s %8s\n", "size", "count", "type", "redop",
                "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    std::fflush(stdout);
  }
  int exit_code = 0;
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes;
       bytes = sweep.factor > 1 ? bytes * sweep.factor : bytes + 1) {
    const size_t count = bytes / esize;
    if (count == 0) continue;
    Status status;
    size_t wrong = 0;
    if (sweep.check) {
      switch (*dtype) {
        case DType::kFloat32:
          wrong = run_check(client, static_cast<float*>(mem), count, *dtype, *redop, status);
          break;
        case DType::kFloat64:
          wrong = run_check(client, static_cast<double*>(mem), count, *dtype, *redop, status);
          break;
        case DType::kInt32:
          wrong = run_check(client, static_cast<int32_t*>(mem), count, *dtype, *redop, status);
          break;
        case DType::kInt64:
          wrong = run_check(client, static_cast<int64_t*>(mem), count, *dtype, *redop, status);
          break;
        default:
          status = Status(ErrorCode::kUnimplemented, "bench cannot check " + sweep.dtype);
      }
    }
    for (int i = 0; status && i < sweep.warmup; ++i)
      status = client.allreduce(mem, count, *dtype, *redop);
    std::vector<Counters> before;
    if (measure && status) {
      status = barrier();
      before = snapshot();
      if (status) status = barrier();
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; status && i < sweep.iters; ++i)
      status = client.allreduce(mem, count, *dtype, *redop);
    const auto t1 = std::chrono::steady_clock::now();
    if (!status) {
      spdlog::error("rank {}: all-reduce of {} bytes failed: {}", client.rank(), bytes,
                    status.to_string());
      return 1;
    }
    double stats[2] = {
        std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(1, sweep.iters),
        static_cast<double>(wrong)};
    status = client.allreduce(stats, 2, DType::kFloat64, RedOp::kSum);
    std::vector<Counters> after;
    if (measure && status) {
      after = snapshot();
      status = barrier();
    }
    if (!status) {
      spdlog::error("rank {}: gathering results failed: {}", client.rank(), status.to_string());
      return 1;
    }
    if (!scraped) {
      spdlog::error("reading the reducers' /metrics failed: {}", scraped.to_string());
      return 1;
    }
    Row row{count * esize, count, stats[0] / client.world_size(), 0, stats[1], {}};
    row.algbw = row.time_us > 0 ? static_cast<double>(row.bytes) / row.time_us / 1e3 : 0;
    if (measure && leader) {
      const ChunkPlan plan(row.bytes, esize, options->chunk_bytes, client.shards());
      const double n = sweep.iters;
      for (uint32_t g = 0; g < client.groups(); ++g) {
        for (uint32_t s = 0; s < client.shards(); ++s) {
          const size_t i = pool_index(g, s, client.shards());
          ReducerRow rr;
          rr.shard = s;
          rr.group = g;
          rr.measured.worker_in = (after[i].worker_in - before[i].worker_in) / n;
          rr.measured.worker_out = (after[i].worker_out - before[i].worker_out) / n;
          rr.measured.replica_in = (after[i].replica_in - before[i].replica_in) / n;
          rr.measured.replica_out = (after[i].replica_out - before[i].replica_out) / n;
          rr.expected = expected_bytes(plan, esize, s, g, group_sizes);
          row.reducers.push_back(rr);
        }
      }
    }
    if (row.wrong > 0) exit_code = 3;
    if (leader) {
      rows.push_back(row);
      std::printf("  %10zu %12zu %8s %6s %10.1f %12.3f %12.3f %8.0f\n", row.bytes, row.count,
                  std::string(dtype_name(*dtype)).c_str(), std::string(redop_name(*redop)).c_str(),
                  row.time_us, row.algbw, row.algbw, row.wrong);
      std::fflush(stdout);
    }
    if (sweep.factor <= 1 && bytes == sweep.max_bytes) break;
  }
  if (leader) {
    double avg = 0;
    for (auto& r : rows) avg += r.algbw;
    if (!rows.empty()) avg /= static_cast<double>(rows.size());
    std::printf("# Out of bounds values : %s\n", exit_code == 0 ? "0 OK" : "FAILED");
    std::printf("# Avg bus bandwidth    : %.3f\n#\n", avg);
    if (measure) {
      std::printf(
          "# Payload bytes per op at each reducer (shard s, group g; w = workers of the group), "
          "measured from its counters over the timed loop,\n"
          "# and the formula's: workers w x N_s each way (N_s: shard s's bytes of the tensor); "
          "replicas 2(P-1)/P x N_s each way\n"
          "# (P: largest power of two <= groups with workers; +N_s for a replica paired with an "
          "extra; an extra sends and receives N_s)\n");
      std::printf("# %10s %3s %3s %3s %12s %12s %12s %12s | %12s %12s %12s\n", "size", "s", "g",
                  "w", "worker-in", "worker-out", "replica-in", "replica-out", "f:worker",
                  "f:replica-in", "f:replica-out");
      for (const Row& r : rows) {
        for (const ReducerRow& rr : r.reducers) {
          std::printf("  %10zu %3u %3u %3u %12.0f %12.0f %12.0f %12.0f | %12.0f %12.0f %12.0f\n",
                      r.bytes, rr.shard, rr.group, group_sizes[rr.group], rr.measured.worker_in,
                      rr.measured.worker_out, rr.measured.replica_in, rr.measured.replica_out,
                      rr.expected.worker, rr.expected.replica_in, rr.expected.replica_out);
        }
      }
      std::printf("#\n");
    }
    if (!sweep.json_path.empty()) {
      std::ofstream out(sweep.json_path);
      out << "{\n  \"tool\": \"tally-bench\",\n  \"version\": \"" << TALLY_VERSION
          << "\",\n  \"git\": \"" << TALLY_GIT_SHA << "\",\n  \"transport\": \""
          << options->transport << "\",\n"
          << "  \"workers\": " << client.world_size() << ",\n  \"shards\": " << client.shards()
          << ",\n  \"groups\": " << client.groups()
          << ",\n  \"chunk_bytes\": " << options->chunk_bytes
          << ",\n  \"busbw_factor\": 1.0,\n  \"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        char line[512];
        std::snprintf(
            line, sizeof(line),
            "    {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", "
            "\"time_us\": %.3f, \"algbw_gbps\": %.6f, \"busbw_gbps\": %.6f, \"wrong\": %.0f",
            r.bytes, r.count, std::string(dtype_name(*dtype)).c_str(),
            std::string(redop_name(*redop)).c_str(), r.time_us, r.algbw, r.algbw, r.wrong);
        out << line;
        if (!r.reducers.empty()) {
          out << ", \"reducers\": [";
          for (size_t j = 0; j < r.reducers.size(); ++j) {
            const ReducerRow& rr = r.reducers[j];
            std::snprintf(
                line, sizeof(line),
                "%s{\"shard\": %u, \"group\": %u, \"worker_in\": %.0f, \"worker_out\": %.0f, "
                "\"replica_in\": %.0f, \"replica_out\": %.0f, \"expected_worker\": %.0f, "
                "\"expected_replica_in\": %.0f, \"expected_replica_out\": %.0f}",
                j ? ", " : "", rr.shard, rr.group, rr.measured.worker_in, rr.measured.worker_out,
                rr.measured.replica_in, rr.measured.replica_out, rr.expected.worker,
                rr.expected.replica_in, rr.expected.replica_out);
            out << line;
          }
          out << "]";
        }
        out << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
      }
      out << "  ],\n  \"avg_busbw_gbps\": " << avg << "\n}\n";
      if (!out) {
        spdlog::error("cannot write {}", sweep.json_path);
        return 2;
      }
    }
  }
  munmap(mem, capacity);
  return exit_code;
}

// One transport's sweep from the driver: W worker processes against the
// pool, and the CPU the reducers and the workers spent on it.
struct Phase {
  std::string transport;
  std::string job;
  std::string json_path;
  std::vector<std::string> metrics;  // the reducers' HTTP host:port, for --reducer-metrics
};

// What every phase of a driver run shares: the pool, how the workers are
// started, and the run's deadline.
struct PhaseOptions {
  SweepOptions sweep;
  std::string pool;  // TALLY_POOL for the workers
  uint32_t workers = 4;
  uint32_t groups = 1;
  size_t chunk_bytes = 1u << 20;
  int64_t op_timeout_ms = 60000;
  std::string fabric_provider;  // empty: the workers' default
  std::string log_level = "warn";
  LocalPool* local = nullptr;  // the pool this driver started, if any (not owned)
  std::chrono::steady_clock::time_point deadline;
};

// Bytes each worker sends (and receives) in a sweep: every size's check,
// warm-up and timed all-reduces.
double bytes_per_worker(const SweepOptions& sweep) {
  const size_t esize = parse_dtype(sweep.dtype) ? dtype_size(*parse_dtype(sweep.dtype)) : 4;
  double total = 0;
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes;
       bytes = sweep.factor > 1 ? bytes * sweep.factor : bytes + 1) {
    const size_t b = bytes / esize * esize;
    total += static_cast<double>(b) * ((sweep.check ? 1 : 0) + sweep.warmup + sweep.iters);
    if (sweep.factor <= 1 && bytes == sweep.max_bytes) break;
  }
  return total;
}

double children_cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_CHILDREN, &ru);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

int run_phase(const Phase& phase, const PhaseOptions& options) {
  const SweepOptions& sweep = options.sweep;
  const uint32_t workers = options.workers;
  LocalPool* local = options.local;
  std::vector<std::string> args{"--worker",
                                "-b",
                                std::to_string(sweep.min_bytes),
                                "-e",
                                std::to_string(sweep.max_bytes),
                                "-f",
                                std::to_string(sweep.factor),
                                "-w",
                                std::to_string(sweep.warmup),
                                "-n",
                                std::to_string(sweep.iters),
                                "-d",
                                sweep.dtype,
                                "-o",
                                sweep.redop,
                                "-c",
                                sweep.check ? "1" : "0",
                                "--log-level",
                                options.log_level};
  if (!phase.json_path.empty()) {
    args.push_back("--json");
    args.push_back(phase.json_path);
  }
  if (!phase.metrics.empty()) {
    std::string list;
    for (size_t i = 0; i < phase.metrics.size(); ++i) list += (i ? "," : "") + phase.metrics[i];
    args.push_back("--reducer-metrics");
    args.push_back(list);
  }
  auto reducer_cpu = [&]() -> std::optional<double> {
    if (!local) return std::nullopt;
    double total = 0;
    for (uint32_t s = 0; s < local->addresses().size(); ++s) {
      auto c = process_cpu_seconds(local->reducer(s).pid());
      if (!c) return std::nullopt;
      total += *c;
    }
    return total;
  };
  const auto reducers_before = reducer_cpu();
  const double workers_before = children_cpu_seconds();
  std::vector<Process> procs;
  for (uint32_t r = 0; r < workers; ++r) {
    ProcessSpec spec;
    spec.path = self_dir() + "/tally-bench";
    spec.args = args;
    spec.env = {{"TALLY_POOL", options.pool},
                {"TALLY_JOB", phase.job},
                {"TALLY_RANK", std::to_string(r)},
                {"TALLY_WORLD_SIZE", std::to_string(workers)},
                {"TALLY_GROUPS", std::to_string(options.groups)},
                {"TALLY_CHUNK_BYTES", std::to_string(options.chunk_bytes)},
                {"TALLY_OP_TIMEOUT_MS", std::to_string(options.op_timeout_ms)},
                {"TALLY_TRANSPORT", phase.transport}};
    if (!options.fabric_provider.empty())
      spec.env["TALLY_FABRIC_PROVIDER"] = options.fabric_provider;
    auto p = Process::spawn(spec);
    if (!p) {
      spdlog::error("{}", p.status().to_string());
      return 2;
    }
    procs.push_back(std::move(*p));
  }
  int result = 0;
  std::vector<bool> finished(procs.size(), false);
  size_t left = procs.size();
  while (left > 0) {
    for (size_t r = 0; r < procs.size(); ++r) {
      if (finished[r]) continue;
      if (auto st = procs[r].wait_for(std::chrono::milliseconds(0))) {
        finished[r] = true;
        --left;
        if (*st != 0) {
          spdlog::error("worker rank {} exited with status {}", r, *st);
          if (result == 0) result = *st == 3 ? 3 : 1;
        }
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > options.deadline) {
      spdlog::error("the run passed its --timeout-s deadline; stopping the workers");
      for (auto& p : procs) p.terminate(std::chrono::milliseconds(2000));
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // CPU per byte: what each side spent on the data it moved, whole sweep
  // (checks and warm-up included), so transports compare on equal work.
  const double gb = bytes_per_worker(sweep) * workers / 1e9;
  const double worker_cpu = children_cpu_seconds() - workers_before;
  const auto reducers_after = reducer_cpu();
  if (reducers_before && reducers_after) {
    const double rc = *reducers_after - *reducers_before;
    std::printf(
        "# cpu transport=%s: reducers %.2f s = %.2f s/GB received, workers %.2f s = %.2f s/GB sent "
        "(%.2f GB)\n#\n",
        phase.transport.c_str(), rc, rc / gb, worker_cpu, worker_cpu / gb, gb);
  } else {
    std::printf(
        "# cpu transport=%s: workers %.2f s = %.2f s/GB sent (%.2f GB); reducers not local\n#\n",
        phase.transport.c_str(), worker_cpu, worker_cpu / gb, gb);
  }
  std::fflush(stdout);
  return result;
}

}  // namespace
}  // namespace tally::bench

int main(int argc, char** argv) {
  using namespace tally;
  using namespace tally::bench;
  SweepOptions sweep;
  bool worker = false;
  std::string pool;
  uint32_t reducers = 2;
  uint32_t groups = 1;
  uint32_t workers = 4;
  size_t chunk_bytes = 1u << 20;
  std::string job;
  std::string log_level = "warn";
  uint32_t io_threads = 2;
  size_t memory_budget = 256u << 20;
  int64_t op_timeout_ms = 60000;
  int64_t timeout_s = 900;
  std::string transport_list = "tcp";
  std::string fabric_provider;

  CLI::App app{"tally-bench: all-reduce bandwidth sweeps through a tally reducer pool"};
  app.add_option("-b,--minbytes", sweep.min_bytes, "smallest size")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-e,--maxbytes", sweep.max_bytes, "largest size")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-f,--stepfactor", sweep.factor,
                 "multiply the size by this each step (1: add one byte)")
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", sweep.warmup, "untimed iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_option("-n,--iters", sweep.iters, "timed iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("-d,--datatype", sweep.dtype, "float, double, int32, int64")
      ->capture_default_str();
  app.add_option("-o,--op", sweep.redop, "sum or avg")->capture_default_str();
  app.add_option("-c,--check", sweep.check, "check results (1) or not (0)")->capture_default_str();
  app.add_option("--json", sweep.json_path, "also write the table as JSON here");
  app.add_option("--pool", pool,
                 "use this pool (host:port,... in (group, shard) order) instead of a local one");
  app.add_option("-r,-S,--reducers,--shards", reducers,
                 "shards of the local pool (reducers per group)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("-G,--groups", groups,
                 "replica groups of the pool (the local one has shards x groups reducers)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option(
         "--reducer-metrics", sweep.reducer_metrics,
         "worker mode: reducers' HTTP host:port in (group, shard) order (the driver sets it)")
      ->delimiter(',');
  std::string metrics_list;
  app.add_option(
      "--metrics", metrics_list,
      "with --pool: the reducers' --http-listen host:port, in the pool's order (a pattern "
      "like --pool's), to report bytes per reducer from their /metrics");
  app.add_option("-W,--workers", workers, "worker processes to start")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--chunk-bytes", chunk_bytes, "chunk size")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--io-threads", io_threads, "I/O threads per local reducer")
      ->capture_default_str();
  app.add_option("--memory-budget", memory_budget, "chunk memory per local reducer")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--op-timeout-ms", op_timeout_ms, "reducers fail an op not complete by then")
      ->capture_default_str();
  app.add_option("--timeout-s", timeout_s, "the whole run's deadline")->capture_default_str();
  app.add_option("--transport", transport_list,
                 "tcp, fabric, or tcp,fabric to run both side by side against one pool")
      ->capture_default_str();
  app.add_option("--fabric-provider", fabric_provider,
                 "libfabric provider (default: the reducers' and workers' own)");
  app.add_option("--job", job, "job name (default: bench-<pid>)");
  app.add_option("--log-level", log_level, "log level of bench and local reducers")
      ->capture_default_str();
  app.add_flag("--worker", worker,
               "run as one rank, configured by TALLY_* (used by the driver and by launchers)");
  CLI11_PARSE(app, argc, argv);

  spdlog::set_default_logger(spdlog::stderr_color_mt("tally-bench"));
  spdlog::set_level(spdlog::level::from_str(log_level));
  if (sweep.min_bytes == 0 || sweep.min_bytes > sweep.max_bytes) {
    spdlog::error("need 0 < minbytes <= maxbytes");
    return 2;
  }
  if (worker) return run_worker(sweep);
  std::vector<std::string> transports;
  for (std::string_view rest = transport_list; !rest.empty();) {
    const auto comma = rest.find(',');
    std::string t(rest.substr(0, comma));
    if (t != "tcp" && t != "fabric") {
      spdlog::error("--transport takes tcp, fabric or tcp,fabric, not '{}'", transport_list);
      return 2;
    }
    transports.push_back(t);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  const bool any_fabric =
      std::find(transports.begin(), transports.end(), "fabric") != transports.end();

  std::unique_ptr<LocalPool> local;
  if (pool.empty()) {
    LocalPoolOptions lo;
    lo.shards = reducers;
    lo.groups = groups;
    lo.http = true;
    const size_t max_chunk = std::max<size_t>(4u << 20, (chunk_bytes + 4095) / 4096 * 4096);
    // Room for three jobs' reservations whatever the chunk size: with the
    // reducers' default window of 8, a job needs 8 x (1 + 2F) + 2 buffers,
    // F = 2 log2(P) + (1 if G > P) partials received per chunk (P: largest
    // power of two <= G; F = 0 with one group).
    const size_t receives = butterfly_max_receives(groups);
    const size_t per_job = 8 * (1 + 2 * receives) + 2;
    const size_t budget = std::max(memory_budget, std::max<size_t>(32, 3 * per_job) * max_chunk);
    lo.extra_args = {"--io-threads",      std::to_string(io_threads),
                     "--memory-budget",   std::to_string(budget),
                     "--log-level",       log_level,
                     "--max-chunk-bytes", std::to_string(max_chunk)};
    // A fabric pool serves tcp workers too: one pool for a side-by-side run.
    if (any_fabric) lo.extra_args.insert(lo.extra_args.end(), {"--transport", "fabric"});
    if (!fabric_provider.empty())
      lo.extra_args.insert(lo.extra_args.end(), {"--fabric-provider", fabric_provider});
    auto started = LocalPool::start(lo);
    if (!started) {
      spdlog::error("cannot start the local pool: {}", started.status().to_string());
      return 2;
    }
    local = std::move(*started);
    pool = local->pool_string();
  }
  std::vector<std::string> metrics = local ? local->http_addresses() : std::vector<std::string>{};
  if (!metrics_list.empty()) {
    auto expanded = expand_pool_pattern(metrics_list);
    if (!expanded) {
      spdlog::error("--metrics: {}", expanded.status().to_string());
      return 2;
    }
    metrics = *expanded;
  }
  if (job.empty()) job = "bench-" + std::to_string(getpid());
  PhaseOptions phase_options;
  phase_options.sweep = sweep;
  phase_options.pool = pool;
  phase_options.workers = workers;
  phase_options.groups = groups;
  phase_options.chunk_bytes = chunk_bytes;
  phase_options.op_timeout_ms = op_timeout_ms;
  phase_options.fabric_provider = fabric_provider;
  phase_options.log_level = log_level;
  phase_options.local = local.get();
  phase_options.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int result = 0;
  for (const std::string& transport : transports) {
    Phase phase;
    phase.transport = transport;
    phase.job = transports.size() > 1 ? job + "-" + transport : job;
    phase.json_path = sweep.json_path;
    phase.metrics = metrics;
    if (transports.size() > 1 && !phase.json_path.empty()) {
      const auto dot = phase.json_path.rfind('.');
      phase.json_path.insert(dot == std::string::npos ? phase.json_path.size() : dot,
                             "." + transport);
    }
    const int r = run_phase(phase, phase_options);
    if (r != 0 && result == 0) result = r;
    if (r == 1 || r == 2) break;  // a failed run, not wrong numbers: stop here
  }
  return result;
}
