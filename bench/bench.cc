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
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include "bare_stream.h"
#include "cli.h"
#include "compare.h"
#include "driver_options.h"
#include "launch.h"
#include "load.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/netlab.h"
#include "tally/bench/process.h"
#include "tally/client/client.h"
#include "tally/protocol/pool_pattern.h"
#include "tally/protocol/version.h"
#include "tally/reducer/butterfly.h"
#include "worker.h"

namespace tally::bench {
namespace {

// The largest tensor the CPU lines' bare streams move (Driver::set_up).
constexpr uint64_t kCpuFloorSpanMost = uint64_t{64} << 20;

struct Phase {
  std::string transport;
  std::string job;
  std::string json_path;
  std::vector<std::string> metrics;  // the reducers' HTTP host:port, for --reducer-metrics
  std::string stdout_path;           // rank 0's table goes here (for --compare); empty: stdout
};

// What every phase of a driver run shares: the pool, how the workers are
// started, and the run's deadline.
struct PhaseOptions {
  SweepOptions sweep;
  std::string pool;  // TALLY_POOL for the workers
  uint32_t workers = 4;
  uint32_t groups = 1;
  size_t chunk_bytes = 0;      // 0: the automatic plan
  std::string wire_dtype;      // TALLY_WIRE_DTYPE for the workers; empty: native
  std::string wire_result;     // TALLY_WIRE_RESULT for the workers; empty: unset
  bool deterministic = false;  // TALLY_DETERMINISTIC=1 for the workers
  int64_t op_timeout_ms = 60000;
  std::string fabric_provider;  // empty: the workers' default
  std::string log_level = "warn";
  LocalPool* local = nullptr;   // the pool this driver started, if any (not owned)
  const Netlab* lab = nullptr;  // --netlab: worker r runs on host r (not owned)
  std::string secret_file;      // the local pool's job secret (TALLY_JOB_SECRET_FILE), if any
  std::string tcp_congestion;   // TALLY_TCP_CONGESTION for the workers, if set
  std::string link_rate;        // TALLY_LINK_RATE for the workers, if set
  // The bare streams behind sweep.cpu_floor_s_per_gb (their median), if measured.
  std::optional<CpuFloor> cpu_floor;
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

// The command line of a worker of this phase (tally-bench --worker ...).
std::vector<std::string> worker_args(const Phase& phase, const PhaseOptions& options) {
  const SweepOptions& sweep = options.sweep;
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
  if (sweep.cpu_floor_s_per_gb > 0) {
    args.push_back("--cpu-floor");
    args.push_back(std::to_string(sweep.cpu_floor_s_per_gb));
  }
  if (!phase.metrics.empty()) {
    std::string list;
    for (size_t i = 0; i < phase.metrics.size(); ++i) list += (i ? "," : "") + phase.metrics[i];
    args.push_back("--reducer-metrics");
    args.push_back(list);
  }
  return args;
}

// Rank r of this phase: tally-bench in worker mode, configured by TALLY_*
// as a training process is, on its host of the lab if there is one.
ProcessSpec worker_spec(const Phase& phase, const PhaseOptions& options, uint32_t r,
                        const std::vector<std::string>& args) {
  ProcessSpec spec;
  spec.path = self_dir() + "/tally-bench";
  spec.args = args;
  spec.env = {{"TALLY_POOL", options.pool},
              {"TALLY_JOB", phase.job},
              {"TALLY_RANK", std::to_string(r)},
              {"TALLY_WORLD_SIZE", std::to_string(options.workers)},
              {"TALLY_GROUPS", std::to_string(options.groups)},
              {"TALLY_CHUNK_BYTES", std::to_string(options.chunk_bytes)},
              {"TALLY_WIRE_DTYPE", options.wire_dtype},
              {"TALLY_WIRE_RESULT", options.wire_result},
              {"TALLY_DETERMINISTIC", options.deterministic ? "1" : ""},
              {"TALLY_OP_TIMEOUT_MS", std::to_string(options.op_timeout_ms)},
              {"TALLY_TRANSPORT", phase.transport}};
  if (!options.fabric_provider.empty()) spec.env["TALLY_FABRIC_PROVIDER"] = options.fabric_provider;
  if (!options.secret_file.empty()) spec.env["TALLY_JOB_SECRET_FILE"] = options.secret_file;
  if (!options.tcp_congestion.empty()) spec.env["TALLY_TCP_CONGESTION"] = options.tcp_congestion;
  if (!options.link_rate.empty()) spec.env["TALLY_LINK_RATE"] = options.link_rate;
  if (r == 0) spec.stdout_path = phase.stdout_path;
  if (options.lab) options.lab->place(r, spec);
  return spec;
}

// The CPU seconds the local pool's reducers have used; none without one.
std::optional<double> local_reducer_cpu(LocalPool* local) {
  if (!local) return std::nullopt;
  double total = 0;
  for (uint32_t s = 0; s < local->addresses().size(); ++s) {
    auto c = process_cpu_seconds(local->reducer(s).pid());
    if (!c) return std::nullopt;
    total += *c;
  }
  return total;
}

// The reference beside the reducers' CPU: a bare TCP stream's send plus receive
// per GB on this machine, and the reducers' as a multiple of it (each
// reducer's bytes cross its stack twice, in and out, as a bare stream's
// cross the sender's and the receiver's; rank 0 prints the workers').
void print_cpu_floor(const std::optional<CpuFloor>& floor, double reducers_s_per_gb) {
  if (!floor || floor->median <= 0) return;
  std::printf(
      "# cpu of a bare TCP stream here: %.2f s/GB (send plus receive, loopback, %s); reducers "
      "%.2fx of it\n",
      floor->median, floor->spread().c_str(), reducers_s_per_gb / floor->median);
}

int run_phase(const Phase& phase, const PhaseOptions& options) {
  const std::vector<std::string> args = worker_args(phase, options);
  const auto reducers_before = local_reducer_cpu(options.local);
  const double workers_before = rusage_cpu_seconds(RUSAGE_CHILDREN);
  std::vector<Process> procs;
  for (uint32_t r = 0; r < options.workers; ++r) {
    auto p = Process::spawn(worker_spec(phase, options, r, args));
    if (!p) {
      spdlog::error("{}", p.status().to_string());
      return 2;
    }
    procs.push_back(std::move(*p));
  }
  int result = 0;
  // Rank 0's table, shown as it comes when it also goes to a file.
  FileEcho echo(phase.stdout_path);
  const WaitAll waited = wait_all(procs, options.deadline, &g_stop, [&] {
    if (!phase.stdout_path.empty()) echo.poll();
  });
  if (waited.stopped) {
    spdlog::error("interrupted; stopping the workers");
    return 1;
  }
  if (waited.timed_out) {
    spdlog::error("the run passed its --timeout-s deadline; stopping the workers");
    return 1;
  }
  if (!waited.ok()) {
    spdlog::error("worker rank {} exited with status {}", waited.first_failed, waited.status);
    result = waited.status == 3 ? 3 : 1;
  }
  // CPU per byte: what each side spent on the data it moved, whole sweep
  // (checks and warm-up included), so transports compare on equal work.
  const double gb = bytes_per_worker(options.sweep) * options.workers / 1e9;
  const double worker_cpu = rusage_cpu_seconds(RUSAGE_CHILDREN) - workers_before;
  const auto reducers_after = local_reducer_cpu(options.local);
  if (reducers_before && reducers_after) {
    const double rc = *reducers_after - *reducers_before;
    std::printf(
        "# cpu transport=%s: reducers %.2f s = %.2f s/GB received, workers %.2f s = %.2f s/GB sent "
        "(%.2f GB)\n",
        phase.transport.c_str(), rc, rc / gb, worker_cpu, worker_cpu / gb, gb);
    print_cpu_floor(options.cpu_floor, rc / gb);
    std::printf("#\n");
  } else {
    std::printf(
        "# cpu transport=%s: workers %.2f s = %.2f s/GB sent (%.2f GB); reducers not local\n#\n",
        phase.transport.c_str(), worker_cpu, worker_cpu / gb, gb);
  }
  std::fflush(stdout);
  return result;
}

// The pool a driver without --pool starts, run as a pool should: jobs
// authenticate with a job secret made for this run (the handshake is
// timed outside the sweep), in the lab when there is one.
Result<std::unique_ptr<LocalPool>> start_local_pool(const DriverOptions& o,
                                                    const std::string& secret_file,
                                                    const Netlab* lab) {
  LocalPoolOptions lo;
  lo.shards = o.reducers;
  lo.groups = o.groups;
  lo.http = true;
  const size_t max_chunk = std::max<size_t>(4u << 20, (o.chunk_bytes + 4095) / 4096 * 4096);
  // Room for three jobs' reservations whatever the chunk size: with the
  // reducers' default window of 8, a job needs 8 x (1 + 2F) + 2 buffers,
  // F = 2 log2(P) + (1 if G > P) partials received per chunk (P: largest
  // power of two <= G; F = 0 with one group).
  const size_t receives = butterfly_max_receives(o.groups);
  const size_t per_job = 8 * (1 + 2 * receives) + 2;
  const size_t budget = std::max(o.memory_budget, std::max<size_t>(32, 3 * per_job) * max_chunk);
  lo.extra_args = {"--io-threads",      std::to_string(o.io_threads),
                   "--memory-budget",   std::to_string(budget),
                   "--log-level",       o.log_level,
                   "--max-chunk-bytes", std::to_string(max_chunk)};
  if (Status st = lo.require_secret(secret_file); !st) return st;
  if (!o.tcp_congestion.empty()) {
    lo.extra_args.insert(lo.extra_args.end(), {"--tcp-congestion", o.tcp_congestion});
  }
  if (!o.link_rate.empty()) lo.extra_args.insert(lo.extra_args.end(), {"--link-rate", o.link_rate});
  // A fabric pool serves tcp workers too: one pool for a side-by-side run.
  const bool any_fabric =
      std::find(o.transports.begin(), o.transports.end(), "fabric") != o.transports.end();
  if (any_fabric) lo.extra_args.insert(lo.extra_args.end(), {"--transport", "fabric"});
  if (!o.fabric_provider.empty()) {
    lo.extra_args.insert(lo.extra_args.end(), {"--fabric-provider", o.fabric_provider});
  }
  if (lab) lo.place_in(*lab, o.workers);  // reducer i on host W + i
  return LocalPool::start(lo);
}

PhaseOptions phase_options_of(const DriverOptions& o, const std::string& pool, LocalPool* local,
                              const Netlab* lab, const std::string& secret_file) {
  PhaseOptions p;
  p.sweep = o.sweep;
  p.pool = pool;
  p.workers = o.workers;
  p.groups = o.groups;
  p.chunk_bytes = o.chunk_bytes;
  p.wire_dtype = o.wire_dtype;
  p.wire_result = o.wire_result;
  p.deterministic = o.deterministic;
  p.op_timeout_ms = o.op_timeout_ms;
  p.fabric_provider = o.fabric_provider;
  p.log_level = o.log_level;
  p.local = local;
  p.lab = lab;
  p.secret_file = secret_file;
  p.tcp_congestion = o.tcp_congestion;
  p.link_rate = o.link_rate;
  p.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout_s);
  return p;
}

// The lab's hosts by role, for its drop report: workers first, then reducers.
std::vector<std::string> lab_roles(const DriverOptions& o) {
  std::vector<std::string> roles;
  for (uint32_t r = 0; r < o.workers; ++r) roles.push_back("worker " + std::to_string(r));
  for (uint32_t i = 0; i < o.reducers * o.groups; ++i) {
    roles.push_back("reducer " + std::to_string(i));
  }
  return roles;
}

// A driver run: its lab and pool, each transport's phase, then the peers.
class Driver {
 public:
  Driver(const DriverOptions& o, const ScratchDir& scratch) : o_(o), scratch_(scratch) {}

  // Makes the lab and the local pool as the options say; 0 or an exit code.
  int set_up();
  // Each transport's sweep; the first failure's exit code, 0, or 3 (wrong).
  int run_phases();
  void run_peers();
  // Stops the pool and removes the lab; false when the lab stays.
  bool tear_down();

 private:
  std::vector<Netlab::LinkStats> links() const {
    if (!lab_) return {};
    auto stats = lab_->link_stats();
    if (!stats) spdlog::warn("cannot read the links' counters: {}", stats.status().to_string());
    return stats ? *stats : std::vector<Netlab::LinkStats>{};
  }

  const DriverOptions& o_;
  const ScratchDir& scratch_;
  std::unique_ptr<Netlab> lab_;
  std::vector<std::string> roles_;
  std::unique_ptr<LocalPool> local_;
  std::string secret_file_;
  PhaseOptions phase_options_;
  std::vector<NamedTable> tally_tables_;
};

int Driver::set_up() {
  if (!o_.netlab_rate.empty()) {
    auto made = Netlab::for_run(o_.workers + o_.reducers * o_.groups, o_.netlab_rate);
    if (!made) {
      spdlog::error("--netlab: {}", made.status().to_string());
      return 2;
    }
    lab_ = std::move(*made);
    roles_ = lab_roles(o_);
    if (g_stop) return 130;
  }
  std::string pool = o_.pool;
  if (pool.empty()) {
    secret_file_ = scratch_.path() + "/job.secret";
    auto started = start_local_pool(o_, secret_file_, lab_.get());
    if (!started) {
      spdlog::error("cannot start the local pool: {}", started.status().to_string());
      return 2;
    }
    local_ = std::move(*started);
    pool = local_->pool_string();
  }
  phase_options_ = phase_options_of(o_, pool, local_.get(), lab_.get(), secret_file_);
  // The CPU lines' reference, measured before the sweeps over a tensor of
  // the largest size swept; past the last-level cache every size costs the
  // same per byte, so no larger than kCpuFloorSpanMost.
  if (auto floor = bare_stream_floor(std::min<uint64_t>(o_.sweep.max_bytes, kCpuFloorSpanMost))) {
    phase_options_.cpu_floor = *floor;
    phase_options_.sweep.cpu_floor_s_per_gb = floor->median;
  } else {
    spdlog::warn("the CPU lines go without a bare TCP stream beside them: {}",
                 floor.status().to_string());
  }
  return 0;
}

int Driver::run_phases() {
  std::vector<std::string> metrics =
      local_ && o_.bytes_report ? local_->http_addresses() : std::vector<std::string>{};
  if (!o_.metrics_list.empty()) {
    auto expanded = expand_pool_pattern(o_.metrics_list);
    if (!expanded) {
      spdlog::error("--metrics: {}", expanded.status().to_string());
      return 2;
    }
    metrics = *expanded;
  }
  const std::string job = o_.job.empty() ? "bench-" + std::to_string(getpid()) : o_.job;
  int result = 0;
  for (const std::string& transport : o_.transports) {
    Phase phase;
    phase.transport = transport;
    phase.job = o_.transports.size() > 1 ? job + "-" + transport : job;
    phase.json_path = o_.sweep.json_path;
    phase.metrics = metrics;
    if (!o_.peers.empty()) phase.stdout_path = scratch_.path() + "/tally-" + transport + ".out";
    if (o_.transports.size() > 1 && !phase.json_path.empty()) {
      const auto dot = phase.json_path.rfind('.');
      phase.json_path.insert(dot == std::string::npos ? phase.json_path.size() : dot,
                             "." + transport);
    }
    const auto before = links();
    const int r = run_phase(phase, phase_options_);
    if (lab_) print_link_drops("tally transport=" + transport, before, links(), roles_);
    if (!phase.stdout_path.empty()) {
      std::ifstream in(phase.stdout_path);
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      for (NamedTable& t :
           parse_tables(text, transport == "tcp" ? "tally" : "tally:" + transport)) {
        tally_tables_.push_back(std::move(t));
      }
    }
    if (r != 0 && result == 0) result = r;
    if (r == 1 || r == 2) break;  // a failed run, not wrong numbers: stop here
  }
  return result;
}

void Driver::run_peers() {
  // The tally pool sits idle (its CPU is not in the peers' way).
  std::vector<PeerResult> results;
  PeerContext ctx;
  ctx.sweep = o_.sweep;
  ctx.workers = o_.workers;
  ctx.lab = lab_.get();
  ctx.dir = scratch_.path();
  ctx.deadline = phase_options_.deadline;
  // Beside tally's bfloat16 wire, the peers carry 16 bits too.
  const bool sixteen = o_.wire_dtype == "bfloat16";
  ctx.wire = sixteen ? "float16" : "float32";
  for (const std::string& peer : o_.peers) {
    const auto before = links();
    results.push_back(run_peer(peer, ctx));
    if (lab_ && results.back().unavailable.empty()) {
      print_link_drops(peer, before, links(), roles_);
    }
    if (g_stop) break;
  }
  const std::string where = lab_ ? "--netlab " + o_.netlab_rate +
                                       " (every process on its own host, links capped both ways)"
                                 : "loopback";
  print_comparison(
      tally_tables_, results, o_.workers,
      sixteen ? "float32 sum carried in 16 bits (tally bfloat16, peers float16)" : "float32 sum",
      where);
}

bool Driver::tear_down() {
  local_.reset();  // the reducers exit before their namespaces go
  if (!lab_) return true;
  if (Status st = lab_->remove(); !st) {
    spdlog::error("removing the lab: {}", st.to_string());
    return false;
  }
  return true;
}

}  // namespace
}  // namespace tally::bench

int main(int argc, char** argv) {
  using namespace tally;
  using namespace tally::bench;
  if (argc > 1 && (std::string_view(argv[1]) == "load" || std::string_view(argv[1]) == "chaos")) {
    return load_main(argc - 1, argv + 1);
  }
  if (argc > 1 && std::string_view(argv[1]) == "run") return launch_main(argc - 1, argv + 1);
  DriverOptions o;
  CLI::App app{"tally-bench: all-reduce bandwidth sweeps through a tally reducer pool"};
  app.set_version_flag("--version", "tally-bench " + version_string());
  add_driver_options(app, o);
  if (auto code = parse_command_line(app, argc, argv)) return *code;
  log_to_stderr(o.log_level);
  if (o.sweep.min_bytes == 0 || o.sweep.min_bytes > o.sweep.max_bytes) {
    spdlog::error("need 0 < minbytes <= maxbytes");
    return 2;
  }
  if (o.worker) {
    if (app.count("--chunk-bytes") > 0) o.sweep.chunk_bytes = o.chunk_bytes;
    o.sweep.wire_dtype = o.wire_dtype;
    return run_worker(o.sweep);
  }
  if (int refused = resolve_driver_options(o); refused != 0) return refused;
  // Ctrl-C and SIGTERM stop every wait; the children are terminated and
  // everything made (pool, lab, scratch) is removed on the way out.
  stop_on_signals();
  auto scratch = ScratchDir::make("tally-bench-");
  if (!scratch) {
    spdlog::error("{}", scratch.status().to_string());
    return 2;
  }
  Driver driver(o, **scratch);
  int result = driver.set_up();
  if (result == 0) {
    result = driver.run_phases();
    if (!o.peers.empty() && (result == 0 || result == 3) && !g_stop) driver.run_peers();
  }
  if (!driver.tear_down() && result == 0) result = 1;
  if (g_stop) return 130;
  return result;
}
