// tally-bench load and chaos: the command line.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <string_view>

#include "cli.h"
#include "load.h"
#include "tally/bench/netlab.h"
#include "tally/protocol/log_level.h"

namespace tally::bench {
namespace {

// The run's size and the pool's: jobs, workers, time, bytes, a local pool.
void add_size_options(CLI::App& app, LoadOptions& o) {
  app.add_option("-J,--jobs", o.jobs, "concurrent jobs")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("-W,--workers", o.workers, "workers per job")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("-T,--seconds", o.seconds, "how long the run lasts (ops start until then)")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 86400.0));
  app.add_option("-b,--bytes", o.bytes, "bytes of the largest bucket (float32 elements)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("-S,--shards", o.shards, "shards of the local pool")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("-G,--groups", o.groups, "replica groups of the local pool")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  app.add_option("--op-timeout-ms", o.op_timeout_ms, "TALLY_OP_TIMEOUT_MS of the workers")
      ->capture_default_str();
}

// What each worker does, and how the run is named, logged and placed.
void add_work_options(CLI::App& app, LoadOptions& o) {
  app.add_option("--max-ops", o.max_ops, "at most this many ops per worker and round")
      ->capture_default_str();
  app.add_option("--redop", o.redops, "the ops' reduction: sum, avg, or both (alternating)")
      ->capture_default_str()
      ->check(CLI::IsMember({"sum", "avg", "both"}));
  app.add_option("--inflight", o.inflight, "ops each worker keeps in flight (at most --buckets)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--buckets", o.buckets,
                 "buffers each worker reuses, op k in bucket k mod B, of sizes from half of -b "
                 "up to -b")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--job", o.job, "prefix of the job names (default: load-<pid>)");
  app.add_option("--log-level", o.log_level, "log level of the workers and local reducers")
      ->capture_default_str()
      ->check(CLI::IsMember(log_level_names()));
  app.add_option("--netlab", o.netlab_rate,
                 "run every worker and reducer on a host of its own in a network lab, each "
                 "link capped both ways at RATE (tc units, e.g. 1gbit; root), the last worker "
                 "of each even-numbered job at half of it: results then take milliseconds to "
                 "reach the workers (and reach that one later), as on a real network; -J 2 "
                 "runs a job of each kind");
}

// chaos: what is killed and how often; load: a given pool instead.
void add_chaos_options(CLI::App& app, LoadOptions& o, bool chaos) {
  if (chaos) {
    app.add_option("--kill", o.kill, "what is killed and restarted: reducer or worker")
        ->capture_default_str()
        ->check(CLI::IsMember({"reducer", "worker"}));
    app.add_option("-K,--kill-every", o.kill_every_s, "seconds between kills")
        ->capture_default_str()
        ->check(CLI::Range(0.1, 3600.0));
    app.add_flag("--liar", o.liar,
                 "also run a job whose rank 0 says after every op that every rank has the "
                 "results below 2^40; its ops must still complete exactly");
    app.add_option("--slow-http", o.slow_http,
                   "also drip requests a byte at a time to the reducers' HTTP ports from N "
                   "slow clients; the reducers' /healthz must still answer")
        ->capture_default_str()
        ->check(CLI::Range(0, 4096));
  } else {
    app.add_option("--pool", o.pool, "use this pool (host:port,...) instead of a local one");
    app.add_option("--secret-file", o.secret_file, "with --pool: the job secret's file");
  }
}

// The flags together; 0, or 2 once it has said why.
int check_load_options(const LoadOptions& o, bool worker) {
  if (!o.netlab_rate.empty() && !worker) {
    if (netlab_refused()) return 2;
    if (o.liar || o.slow_http > 0) {
      std::fprintf(stderr, "tally-bench: --liar and --slow-http run on loopback; drop --netlab\n");
      return 2;
    }
    if (!o.pool.empty()) {
      std::fprintf(stderr, "tally-bench: --netlab starts its own pool in the lab; drop --pool\n");
      return 2;
    }
  }
  if (o.inflight > o.buckets) {
    std::fprintf(stderr,
                 "--inflight %u needs as many buckets (--buckets %u): an op's bucket is "
                 "reused only once it has ended\n",
                 o.inflight, o.buckets);
    return 2;
  }
  return 0;
}

}  // namespace

int load_main(int argc, char** argv) {
  const bool chaos = std::string_view(argv[0]) == "chaos";
  LoadOptions o;
  LoadWorkerOptions w;
  bool worker = false;
  if (chaos) {
    o.jobs = 1;
    o.seconds = 60;
    o.kill = "reducer";
  }
  CLI::App app{chaos ? "tally-bench chaos: checked all-reduces while a reducer or a worker is "
                       "killed and restarted every K seconds; every op is checked exactly"
                     : "tally-bench load: J jobs x W workers doing checked all-reduces for T "
                       "seconds against one pool"};
  add_size_options(app, o);
  add_work_options(app, o);
  add_chaos_options(app, o, chaos);
  app.add_flag("--worker", worker, "run as one rank, configured by TALLY_* (the driver uses it)");
  app.add_option("--first", w.first, "worker: the round's first op number");
  app.add_option("--out", w.out_path, "worker: where the ops are written");
  if (auto code = parse_command_line(app, argc, argv)) return *code;
  log_to_stderr(o.log_level);
  if (int refused = check_load_options(o, worker); refused != 0) return refused;
  if (worker) {
    w.bytes = o.bytes;
    w.seconds = o.seconds;
    w.max_ops = o.max_ops;
    w.redops = o.redops;
    w.inflight = o.inflight;
    w.buckets = o.buckets;
    return run_load_worker(w);
  }
  return run_load(o);
}

}  // namespace tally::bench
