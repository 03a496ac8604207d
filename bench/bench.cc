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
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "compare.h"
#include "launch.h"
#include "load.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/metrics_scrape.h"
#include "tally/bench/netlab.h"
#include "tally/bench/pattern.h"
#include "tally/bench/process.h"
#include "tally/client/client.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/groups.h"
#include "tally/protocol/link_rate.h"
#include "tally/protocol/log_level.h"
#include "tally/protocol/pool.h"
#include "tally/protocol/pool_pattern.h"
#include "tally/protocol/split.h"
#include "tally/protocol/version.h"
#include "tally/reducer/butterfly.h"
#include "worker.h"

namespace tally::bench {
namespace {

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
  size_t chunk_bytes = 0;   // 0: the automatic plan
  std::string wire_dtype;   // TALLY_WIRE_DTYPE for the workers; empty: native
  std::string wire_result;  // TALLY_WIRE_RESULT for the workers; empty: unset
  int64_t op_timeout_ms = 60000;
  std::string fabric_provider;  // empty: the workers' default
  std::string log_level = "warn";
  LocalPool* local = nullptr;   // the pool this driver started, if any (not owned)
  const Netlab* lab = nullptr;  // --netlab: worker r runs on host r (not owned)
  std::string secret_file;      // the local pool's job secret (TALLY_JOB_SECRET_FILE), if any
  std::string tcp_congestion;   // TALLY_TCP_CONGESTION for the workers, if set
  std::string link_rate;        // TALLY_LINK_RATE for the workers, if set
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
  const double workers_before = rusage_cpu_seconds(RUSAGE_CHILDREN);
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
                {"TALLY_WIRE_DTYPE", options.wire_dtype},
                {"TALLY_WIRE_RESULT", options.wire_result},
                {"TALLY_OP_TIMEOUT_MS", std::to_string(options.op_timeout_ms)},
                {"TALLY_TRANSPORT", phase.transport}};
    if (!options.fabric_provider.empty())
      spec.env["TALLY_FABRIC_PROVIDER"] = options.fabric_provider;
    if (!options.secret_file.empty()) spec.env["TALLY_JOB_SECRET_FILE"] = options.secret_file;
    if (!options.tcp_congestion.empty()) spec.env["TALLY_TCP_CONGESTION"] = options.tcp_congestion;
    if (!options.link_rate.empty()) spec.env["TALLY_LINK_RATE"] = options.link_rate;
    if (r == 0) spec.stdout_path = phase.stdout_path;
    if (options.lab) options.lab->place(r, spec);
    auto p = Process::spawn(spec);
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
  const double gb = bytes_per_worker(sweep) * workers / 1e9;
  const double worker_cpu = rusage_cpu_seconds(RUSAGE_CHILDREN) - workers_before;
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
  if (argc > 1 && (std::string_view(argv[1]) == "load" || std::string_view(argv[1]) == "chaos")) {
    return load_main(argc - 1, argv + 1);
  }
  if (argc > 1 && std::string_view(argv[1]) == "run") return launch_main(argc - 1, argv + 1);
  SweepOptions sweep;
  bool worker = false;
  std::string pool;
  uint32_t reducers = 2;
  uint32_t groups = 1;
  uint32_t workers = 4;
  size_t chunk_bytes = 0;
  std::string wire_dtype;
  std::string job;
  std::string log_level = "warn";
  uint32_t io_threads = 2;
  size_t memory_budget = 256u << 20;
  int64_t op_timeout_ms = 60000;
  int64_t timeout_s = 900;
  std::string transport_list = "tcp";
  std::string fabric_provider;
  std::string compare_list;
  std::string netlab_rate;
  bool bytes_report = false;

  CLI::App app{"tally-bench: all-reduce bandwidth sweeps through a tally reducer pool"};
  app.set_version_flag("--version", "tally-bench " + version_string());
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
  app.add_option(
         "--chunk-bytes", chunk_bytes,
         "piece size, overriding the automatic chunk plan (TALLY_CHUNK_BYTES); 0: automatic")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--wire-dtype", wire_dtype,
                 "bfloat16: float32 tensors travel as bfloat16 (TALLY_WIRE_DTYPE); unset: native")
      ->check(CLI::IsMember({"bfloat16"}));
  std::string wire_result;
  app.add_option("--wire-result", wire_result,
                 "with --wire-dtype bfloat16: results as float32 (the reducers' sums, "
                 "TALLY_WIRE_RESULT) or bfloat16 (the default)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--io-threads", io_threads, "I/O threads per local reducer")
      ->capture_default_str();
  app.add_option("--memory-budget", memory_budget, "chunk memory per local reducer")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--op-timeout-ms", op_timeout_ms, "reducers fail an op not complete by then")
      ->capture_default_str();
  app.add_option("--timeout-s", timeout_s, "the whole run's deadline")->capture_default_str();
  std::string tcp_congestion;
  app.add_option("--tcp-congestion", tcp_congestion,
                 "TCP congestion control of tally's streams, local reducers' and workers' (e.g. "
                 "cubic; default: the system's). The peers keep the system's");
  std::string link_rate;
  app.add_option("--link-rate", link_rate,
                 "pace tally's streams to this link rate, local reducers' and workers' (tc's "
                 "units, e.g. 10gbit; with --netlab its rate unless 'off'; default: not paced)");
  app.add_option("--transport", transport_list,
                 "tcp, fabric, or tcp,fabric to run both side by side against one pool")
      ->capture_default_str();
  app.add_option("--fabric-provider", fabric_provider,
                 "libfabric provider (default: the reducers' and workers' own)");
  app.add_option("--job", job, "job name (default: bench-<pid>)");
  app.add_option("--log-level", log_level, "log level of bench and local reducers")
      ->capture_default_str()
      ->check(CLI::IsMember(log_level_names()));
  app.add_option("--compare", compare_list,
                 "also run the sweep with these peers (gloo, mpi) on the same workers' hosts and "
                 "print tally's algbw over the best peer's, per size (float sum only)");
  app.add_option("--netlab", netlab_rate,
                 "root only: run every worker, reducer and peer rank in its own network namespace "
                 "behind one bridge, each host's link capped both ways at this rate (tc htb, e.g. "
                 "1gbit), and print each link's drops");
  app.add_flag("--bytes", bytes_report,
               "also print the payload bytes per op at each reducer, from their /metrics (local "
               "pool; with --pool, --metrics implies it)");
  app.add_flag("--worker", worker,
               "run as one rank, configured by TALLY_* (used by the driver and by launchers)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is 0; bad flags are 2, as documented
  }

  spdlog::set_default_logger(spdlog::stderr_color_mt("tally-bench"));
  spdlog::set_level(spdlog::level::from_str(log_level));
  if (sweep.min_bytes == 0 || sweep.min_bytes > sweep.max_bytes) {
    spdlog::error("need 0 < minbytes <= maxbytes");
    return 2;
  }
  if (worker) {
    if (app.count("--chunk-bytes") > 0) sweep.chunk_bytes = chunk_bytes;
    sweep.wire_dtype = wire_dtype;
    return run_worker(sweep);
  }
  // --netlab is refused before anything is made.
  if (!netlab_rate.empty()) {
    if (std::string why = netlab_refusal(); !why.empty()) {
      std::fprintf(stderr, "tally-bench: %s\n", why.c_str());
      return 2;
    }
    if (auto rate = parse_link_rate(netlab_rate); !rate) {
      std::fprintf(stderr, "tally-bench: --netlab: %s\n", rate.status().message().c_str());
      return 2;
    }
    // Each host's link is capped at the lab's rate, and a deployment that
    // knows its links' rate says so (docs/benchmarking.md, "Capped links").
    if (link_rate.empty()) link_rate = netlab_rate;
    if (!pool.empty()) {
      std::fprintf(stderr, "tally-bench: --netlab starts its own pool in the lab; drop --pool\n");
      return 2;
    }
  }
  if (link_rate == "off") link_rate.clear();
  if (!link_rate.empty()) {
    if (auto rate = parse_link_rate(link_rate); !rate) {
      std::fprintf(stderr, "tally-bench: --link-rate: %s\n", rate.status().message().c_str());
      return 2;
    }
  }
  std::vector<std::string> peers;
  for (std::string_view name : split_list(compare_list)) {
    const auto& known = known_peers();
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      spdlog::error("--compare takes gloo, mpi or gloo,mpi, not '{}'", compare_list);
      return 2;
    }
    peers.emplace_back(name);
  }
  if (!peers.empty() && (sweep.dtype != "float" || sweep.redop != "sum")) {
    spdlog::error("--compare runs float sum only (the peers do not do -d {} -o {})", sweep.dtype,
                  sweep.redop);
    return 2;
  }
  // Ctrl-C and SIGTERM stop every wait; the children are terminated and
  // everything made (pool, lab, scratch) is removed on the way out.
  stop_on_signals();
  auto scratch_dir = ScratchDir::make("tally-bench-");
  if (!scratch_dir) {
    spdlog::error("{}", scratch_dir.status().to_string());
    return 2;
  }
  const ScratchDir& scratch = **scratch_dir;
  std::unique_ptr<Netlab> lab;
  std::vector<std::string> roles;
  if (!netlab_rate.empty()) {
    auto made = Netlab::for_run(workers + reducers * groups, netlab_rate);
    if (!made) {
      spdlog::error("--netlab: {}", made.status().to_string());
      return 2;
    }
    lab = std::move(*made);
    for (uint32_t r = 0; r < workers; ++r) roles.push_back("worker " + std::to_string(r));
    for (uint32_t i = 0; i < reducers * groups; ++i) {
      roles.push_back("reducer " + std::to_string(i));
    }
    if (g_stop) return 130;
  }
  std::vector<std::string> transports;
  for (std::string_view t : split_list(transport_list)) {
    if (t != "tcp" && t != "fabric") {
      spdlog::error("--transport takes tcp, fabric or tcp,fabric, not '{}'", transport_list);
      return 2;
    }
    transports.emplace_back(t);
  }
  const bool any_fabric =
      std::find(transports.begin(), transports.end(), "fabric") != transports.end();

  std::unique_ptr<LocalPool> local;
  std::string secret_file;
  if (pool.empty()) {
    // The local pool runs as a pool should: jobs authenticate with a job
    // secret made for this run (the handshake is timed outside the sweep).
    secret_file = scratch.path() + "/job.secret";
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
    if (Status st = lo.require_secret(secret_file); !st) {
      spdlog::error("{}", st.to_string());
      return 2;
    }
    if (!tcp_congestion.empty()) {
      lo.extra_args.insert(lo.extra_args.end(), {"--tcp-congestion", tcp_congestion});
    }
    if (!link_rate.empty()) lo.extra_args.insert(lo.extra_args.end(), {"--link-rate", link_rate});
    // A fabric pool serves tcp workers too: one pool for a side-by-side run.
    if (any_fabric) lo.extra_args.insert(lo.extra_args.end(), {"--transport", "fabric"});
    if (!fabric_provider.empty())
      lo.extra_args.insert(lo.extra_args.end(), {"--fabric-provider", fabric_provider});
    if (lab) lo.place_in(*lab, workers);  // reducer i on host W + i
    auto started = LocalPool::start(lo);
    if (!started) {
      spdlog::error("cannot start the local pool: {}", started.status().to_string());
      return 2;
    }
    local = std::move(*started);
    pool = local->pool_string();
  }
  std::vector<std::string> metrics =
      local && bytes_report ? local->http_addresses() : std::vector<std::string>{};
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
  phase_options.wire_dtype = wire_dtype;
  phase_options.wire_result = wire_result;
  phase_options.op_timeout_ms = op_timeout_ms;
  phase_options.fabric_provider = fabric_provider;
  phase_options.log_level = log_level;
  phase_options.local = local.get();
  phase_options.lab = lab.get();
  phase_options.secret_file = secret_file;
  phase_options.tcp_congestion = tcp_congestion;
  phase_options.link_rate = link_rate;
  phase_options.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int result = 0;
  std::vector<NamedTable> tally_tables;
  auto links = [&]() -> std::vector<Netlab::LinkStats> {
    if (!lab) return {};
    auto stats = lab->link_stats();
    if (!stats) spdlog::warn("cannot read the links' counters: {}", stats.status().to_string());
    return stats ? *stats : std::vector<Netlab::LinkStats>{};
  };
  for (const std::string& transport : transports) {
    Phase phase;
    phase.transport = transport;
    phase.job = transports.size() > 1 ? job + "-" + transport : job;
    phase.json_path = sweep.json_path;
    phase.metrics = metrics;
    if (!peers.empty()) phase.stdout_path = scratch.path() + "/tally-" + transport + ".out";
    if (transports.size() > 1 && !phase.json_path.empty()) {
      const auto dot = phase.json_path.rfind('.');
      phase.json_path.insert(dot == std::string::npos ? phase.json_path.size() : dot,
                             "." + transport);
    }
    const auto before = links();
    const int r = run_phase(phase, phase_options);
    if (lab) print_link_drops("tally transport=" + transport, before, links(), roles);
    if (!phase.stdout_path.empty()) {
      std::ifstream in(phase.stdout_path);
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      for (NamedTable& t :
           parse_tables(text, transport == "tcp" ? "tally" : "tally:" + transport)) {
        tally_tables.push_back(std::move(t));
      }
    }
    if (r != 0 && result == 0) result = r;
    if (r == 1 || r == 2) break;  // a failed run, not wrong numbers: stop here
  }
  if (!peers.empty() && (result == 0 || result == 3) && !g_stop) {
    // The tally pool sits idle (its CPU is not in the peers' way).
    std::vector<PeerResult> results;
    PeerContext ctx;
    ctx.sweep = sweep;
    ctx.workers = workers;
    ctx.lab = lab.get();
    ctx.dir = scratch.path();
    ctx.deadline = phase_options.deadline;
    for (const std::string& peer : peers) {
      const auto before = links();
      results.push_back(run_peer(peer, ctx));
      if (lab && results.back().unavailable.empty()) print_link_drops(peer, before, links(), roles);
      if (g_stop) break;
    }
    const std::string where =
        lab ? "--netlab " + netlab_rate + " (every process on its own host, links capped both ways)"
            : "loopback";
    print_comparison(tally_tables, results, workers, where);
  }
  local.reset();  // the reducers exit before their namespaces go
  if (lab) {
    if (Status st = lab->remove(); !st) {
      spdlog::error("removing the lab: {}", st.to_string());
      if (result == 0) result = 1;
    }
  }
  if (g_stop) return 130;
  return result;
}
