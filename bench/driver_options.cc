#include "driver_options.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <string_view>

#include "cli.h"
#include "compare.h"
#include "tally/bench/netlab.h"
#include "tally/protocol/link_rate.h"
#include "tally/protocol/log_level.h"
#include "tally/protocol/split.h"

namespace tally::bench {
namespace {

// What each size does: its bounds, steps, iterations, type and check.
void add_sweep_flags(CLI::App& app, DriverOptions& o) {
  app.add_option("-b,--minbytes", o.sweep.min_bytes, "smallest size")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-e,--maxbytes", o.sweep.max_bytes, "largest size")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-f,--stepfactor", o.sweep.factor,
                 "multiply the size by this each step (1: add one byte)")
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", o.sweep.warmup, "untimed iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_option("-n,--iters", o.sweep.iters, "timed iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("-d,--datatype", o.sweep.dtype, "float, double, int32, int64")
      ->capture_default_str();
  app.add_option("-o,--op", o.sweep.redop, "sum or avg")->capture_default_str();
  app.add_option("-c,--check", o.sweep.check, "check results (1) or not (0)")
      ->capture_default_str();
  app.add_option("--json", o.sweep.json_path, "also write the table as JSON here");
}

// The pool: given, or local and how it is made; the workers; the deadlines.
void add_pool_flags(CLI::App& app, DriverOptions& o) {
  app.add_option("--pool", o.pool,
                 "use this pool (host:port,... in (group, shard) order) instead of a local one");
  app.add_option("-r,-S,--reducers,--shards", o.reducers,
                 "shards of the local pool (reducers per group)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("-G,--groups", o.groups,
                 "replica groups of the pool (the local one has shards x groups reducers)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option(
         "--reducer-metrics", o.sweep.reducer_metrics,
         "worker mode: reducers' HTTP host:port in (group, shard) order (the driver sets it)")
      ->delimiter(',');
  app.add_option("--cpu-floor", o.sweep.cpu_floor_s_per_gb,
                 "worker mode: a bare TCP stream's CPU s/GB here, shown beside the workers' "
                 "(the driver sets it)");
  app.add_option(
      "--metrics", o.metrics_list,
      "with --pool: the reducers' --http-listen host:port, in the pool's order (a pattern "
      "like --pool's), to report bytes per reducer from their /metrics");
  app.add_option("-W,--workers", o.workers, "worker processes to start")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--io-threads", o.io_threads, "I/O threads per local reducer")
      ->capture_default_str();
  app.add_option("--memory-budget", o.memory_budget, "chunk memory per local reducer")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--op-timeout-ms", o.op_timeout_ms, "reducers fail an op not complete by then")
      ->capture_default_str();
  app.add_option("--timeout-s", o.timeout_s, "the whole run's deadline")->capture_default_str();
}

// What travels and how: chunks, the wire's dtype, congestion control,
// pacing, the transports.
void add_wire_flags(CLI::App& app, DriverOptions& o) {
  app.add_option(
         "--chunk-bytes", o.chunk_bytes,
         "chunk size, overriding the automatic chunk plan (TALLY_CHUNK_BYTES); 0: automatic")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--wire-dtype", o.wire_dtype,
                 "bfloat16: float32 tensors travel as bfloat16 (TALLY_WIRE_DTYPE); unset: native")
      ->check(CLI::IsMember({"bfloat16"}));
  app.add_option("--wire-result", o.wire_result,
                 "with --wire-dtype bfloat16: results as float32 (the reducers' sums, "
                 "TALLY_WIRE_RESULT) or bfloat16 (the default)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_flag("--deterministic", o.deterministic,
               "reproducible sums: the workers set TALLY_DETERMINISTIC=1");
  app.add_option("--tcp-congestion", o.tcp_congestion,
                 "TCP congestion control of tally's streams, local reducers' and workers' (e.g. "
                 "cubic; default: the system's). The peers keep the system's");
  app.add_option("--link-rate", o.link_rate,
                 "pace tally's streams to this link rate, local reducers' and workers' (tc's "
                 "units, e.g. 10gbit; with --netlab its rate unless 'off'; default: not paced)");
  app.add_option("--transport", o.transport_list,
                 "tcp, fabric, or tcp,fabric to run both side by side against one pool")
      ->capture_default_str();
  app.add_option("--fabric-provider", o.fabric_provider,
                 "libfabric provider (default: the reducers' and workers' own)");
}

}  // namespace

void add_driver_options(CLI::App& app, DriverOptions& o) {
  add_sweep_flags(app, o);
  add_pool_flags(app, o);
  add_wire_flags(app, o);
  app.add_option("--job", o.job, "job name (default: bench-<pid>)");
  app.add_option("--log-level", o.log_level, "log level of bench and local reducers")
      ->capture_default_str()
      ->check(CLI::IsMember(log_level_names()));
  app.add_option("--compare", o.compare_list,
                 "also run the sweep with these peers (gloo, mpi) on the same workers' hosts and "
                 "print tally's algbw over the best peer's, per size (float sum only)");
  app.add_option("--netlab", o.netlab_rate,
                 "root only: run every worker, reducer and peer rank in its own network namespace "
                 "behind one bridge, each host's link capped both ways at this rate (tc htb, e.g. "
                 "1gbit), and print each link's drops");
  app.add_flag("--bytes", o.bytes_report,
               "also print the payload bytes per op at each reducer, from their /metrics (local "
               "pool; with --pool, --metrics implies it)");
  app.add_flag("--worker", o.worker,
               "run as one rank, configured by TALLY_* (used by the driver and by launchers)");
}

int resolve_driver_options(DriverOptions& o) {
  // --netlab is refused before anything is made.
  if (!o.netlab_rate.empty()) {
    if (netlab_refused()) return 2;
    if (auto rate = parse_link_rate(o.netlab_rate); !rate) {
      std::fprintf(stderr, "tally-bench: --netlab: %s\n", rate.status().message().c_str());
      return 2;
    }
    // Each host's link is capped at the lab's rate, and a deployment that
    // knows its links' rate says so (docs/benchmarking.md, "Capped links").
    if (o.link_rate.empty()) o.link_rate = o.netlab_rate;
    if (!o.pool.empty()) {
      std::fprintf(stderr, "tally-bench: --netlab starts its own pool in the lab; drop --pool\n");
      return 2;
    }
  }
  if (o.link_rate == "off") o.link_rate.clear();
  if (!o.link_rate.empty()) {
    if (auto rate = parse_link_rate(o.link_rate); !rate) {
      std::fprintf(stderr, "tally-bench: --link-rate: %s\n", rate.status().message().c_str());
      return 2;
    }
  }
  for (std::string_view name : split_list(o.compare_list)) {
    const auto& known = known_peers();
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      spdlog::error("--compare takes gloo, mpi or gloo,mpi, not '{}'", o.compare_list);
      return 2;
    }
    o.peers.emplace_back(name);
  }
  if (!o.peers.empty() && (o.sweep.dtype != "float" || o.sweep.redop != "sum")) {
    spdlog::error("--compare runs float sum only (the peers do not do -d {} -o {})", o.sweep.dtype,
                  o.sweep.redop);
    return 2;
  }
  for (std::string_view t : split_list(o.transport_list)) {
    if (t != "tcp" && t != "fabric") {
      spdlog::error("--transport takes tcp, fabric or tcp,fabric, not '{}'", o.transport_list);
      return 2;
    }
    o.transports.emplace_back(t);
  }
  return 0;
}

}  // namespace tally::bench
