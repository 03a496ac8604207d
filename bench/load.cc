#include "load.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "compare.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/netlab.h"
#include "tally/bench/process.h"
#include "tally/bench/table.h"
#include "tally/client/client.h"
#include "tally/protocol/log_level.h"

namespace tally::bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Clock::duration seconds_of(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

namespace {

// What one round of one rank wrote (run_load_worker's file).
struct RankReport {
  std::map<uint64_t, std::string> outcome;  // op -> "ok", "wrong" or the error code's name
  std::vector<uint32_t> latency_us;         // of its ok ops
  std::string error;                        // the "# ..." line, if any
  std::string connect_error;                // "# connect ...": it never joined
  std::string wrong;                        // "# wrong op ...": what a wrong result was
};

RankReport read_report(const std::string& path) {
  RankReport report;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# connect ", 0) == 0) {
      report.connect_error = line.substr(10);
      continue;
    }
    if (line.rfind("# wrong ", 0) == 0) {
      report.wrong = line.substr(2);
      continue;
    }
    if (line.rfind("# ", 0) == 0) {
      report.error = line.substr(2);
      continue;
    }
    std::istringstream fields(line);
    uint64_t op = 0;
    std::string what;
    uint64_t us = 0;
    if (!(fields >> op >> what >> us)) continue;  // a line cut by a kill
    report.outcome[op] = what;
    if (what == "ok") report.latency_us.push_back(static_cast<uint32_t>(us));
  }
  return report;
}

struct Totals {
  uint64_t completed = 0;  // ops every rank that reports them finished ok
  uint64_t failed = 0;     // ops every rank that reports them failed, with an error
  uint64_t split = 0;      // ops ok on some ranks and failed on others
  uint64_t wrong = 0;      // ops some rank got a wrong result for
  std::vector<uint32_t> latency_us;
  std::map<std::string, uint64_t> errors;       // error code -> rank-ops; "connect": joins
  std::map<std::string, std::string> examples;  // error code -> one such error, quoted
  std::vector<std::string> wrongs;              // each wrong rank-op, explained
  uint64_t rounds = 0;
  uint64_t unexpected_exits = 0;  // a worker that exited with neither 0, 3, 4 nor our kill
};

struct JobRun {
  uint32_t index = 0;
  uint32_t round = 0;
  uint64_t next_op = 0;
  bool running = false;
  bool done = false;
  std::vector<Process> workers;
  std::vector<std::string> outputs;
  std::vector<bool> killed;  // by the chaos schedule, this round
  std::vector<bool> reaped;  // its exit status has been seen, this round
};

struct ReducerSample {
  std::optional<uint64_t> rss;
  std::optional<uint32_t> fds;
};

std::vector<ReducerSample> sample(LocalPool* pool) {
  std::vector<ReducerSample> out;
  if (!pool) return out;
  for (uint32_t i = 0; i < pool->addresses().size(); ++i) {
    const pid_t pid = pool->reducer(i).pid();
    out.push_back({process_rss_bytes(pid), process_open_fds(pid)});
  }
  return out;
}

std::string percentile_ms(std::vector<uint32_t>& v, double q) {
  if (v.empty()) return "-";
  // Nearest rank: the smallest value with at least q of the samples at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  const size_t k = std::min(v.size() - 1, rank > 0 ? rank - 1 : 0);
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(k), v.end());
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v[k] / 1000.0);
  return buf;
}

// Folds a finished round of one job into the totals; returns the op after
// the last one any rank reached.
uint64_t collect(JobRun& job, Totals& totals) {
  std::map<uint64_t, std::vector<std::string>> by_op;
  uint64_t next = job.next_op;
  for (size_t rank = 0; rank < job.outputs.size(); ++rank) {
    RankReport r = read_report(job.outputs[rank]);
    if (!r.wrong.empty()) {
      totals.wrongs.push_back("job " + std::to_string(job.index) + " round " +
                              std::to_string(job.round) + " rank " + std::to_string(rank) + ": " +
                              r.wrong);
    }
    if (!r.connect_error.empty()) {
      totals.errors["connect"]++;
      if (!totals.examples.count("connect")) totals.examples["connect"] = r.connect_error;
    }
    for (auto& [op, what] : r.outcome) {
      by_op[op].push_back(what);
      next = std::max(next, op + 1);
      if (what != "ok" && what != "wrong") {
        totals.errors[what]++;
        if (!r.error.empty() && !totals.examples.count(what)) totals.examples[what] = r.error;
      }
    }
    totals.latency_us.insert(totals.latency_us.end(), r.latency_us.begin(), r.latency_us.end());
  }
  for (auto& [op, outcomes] : by_op) {
    const auto oks = std::count(outcomes.begin(), outcomes.end(), "ok");
    const auto wrongs = std::count(outcomes.begin(), outcomes.end(), "wrong");
    if (wrongs > 0) {
      totals.wrong++;
    } else if (oks == static_cast<ptrdiff_t>(outcomes.size())) {
      totals.completed++;
    } else if (oks == 0) {
      totals.failed++;
    } else {
      totals.split++;
    }
  }
  return next;
}

// A line on stderr this often while a run lasts: a long run is not silent.
constexpr std::chrono::seconds kProgressEvery{10};

// Ops rank 0 of a running round has reported ok so far.
uint64_t ok_lines(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  uint64_t n = 0;
  while (std::getline(in, line)) n += line.find(" ok ") != std::string::npos;
  return n;
}

void print_progress(Clock::duration elapsed, const std::vector<JobRun>& jobs, const Totals& totals,
                    uint64_t kills) {
  uint64_t completed = totals.completed;
  for (const JobRun& job : jobs) {
    if (job.running && !job.outputs.empty()) completed += ok_lines(job.outputs[0]);
  }
  std::fprintf(stderr,
               "# %.0f s: %" PRIu64 " ops completed, %" PRIu64 " failed, %" PRIu64
               " split, %" PRIu64 " wrong, %" PRIu64 " kills\n",
               std::chrono::duration<double>(elapsed).count(), completed, totals.failed,
               totals.split, totals.wrong, kills);
}

}  // namespace

int run_load(const LoadOptions& o) {
  stop_on_signals();
  auto scratch_dir = ScratchDir::make("tally-load-");
  if (!scratch_dir) {
    spdlog::error("{}", scratch_dir.status().to_string());
    return 1;
  }
  const ScratchDir& scratch = **scratch_dir;
  // --netlab: worker r of job j on host j x W + r, reducer i on host J x W + i.
  std::unique_ptr<Netlab> lab;
  const uint32_t worker_hosts = o.jobs * o.workers;
  if (!o.netlab_rate.empty()) {
    auto made = Netlab::for_run(worker_hosts + o.shards * o.groups, o.netlab_rate);
    if (!made) {
      spdlog::error("--netlab: {}", made.status().to_string());
      return 1;
    }
    lab = std::move(*made);
    // The last worker of each even-numbered job is on a link of half the
    // rate: results reach it after the others, as they reach a straggler,
    // so a reducer killed at any moment leaves chunks whose results some
    // ranks hold and others do not (the replays a restart has to get
    // right). The odd-numbered jobs' links are all alike: their results
    // arrive in step, and a kill leaves every rank part-way through the
    // same result, with no rank to replay it.
    const uint64_t half = lab->rate_bps() / 2;
    for (uint32_t j = 0; j < o.jobs && o.workers > 1; j += 2) {
      if (Status st = lab->set_rate(j * o.workers + o.workers - 1, std::to_string(half) + "bit");
          !st) {
        spdlog::error("--netlab: {}", st.to_string());
        return 1;
      }
    }
  }
  std::unique_ptr<LocalPool> local;
  std::string pool = o.pool;
  std::string secret_file = o.secret_file;
  if (pool.empty()) {
    secret_file = scratch.path() + "/job.secret";
    LocalPoolOptions lo;
    lo.shards = o.shards;
    lo.groups = o.groups;
    lo.log_dir = scratch.path();
    lo.extra_args = {"--log-level", o.log_level};
    if (Status st = lo.require_secret(secret_file); !st) {
      spdlog::error("{}", st.to_string());
      return 1;
    }
    if (lab) lo.place_in(*lab, worker_hosts);
    auto started = LocalPool::start(lo);
    if (!started) {
      spdlog::error("cannot start the local pool: {}", started.status().to_string());
      return 1;
    }
    local = std::move(*started);
    pool = local->pool_string();
  }
  const std::vector<ReducerSample> before = sample(local.get());
  const std::string prefix = o.job.empty() ? "load-" + std::to_string(getpid()) : o.job;
  std::vector<JobRun> jobs(o.jobs);
  for (uint32_t j = 0; j < o.jobs; ++j) jobs[j].index = j;
  Totals totals;
  const auto t0 = Clock::now();
  const auto end = t0 + seconds_of(o.seconds);
  // Past this, something hangs: an op is bounded by its timeout, a connect by its own.
  const auto hard_deadline = end + 3 * milliseconds(o.op_timeout_ms) + std::chrono::seconds(60);
  auto next_kill = t0 + seconds_of(o.kill_every_s);
  auto next_progress = t0 + kProgressEvery;
  uint64_t kills = 0;
  std::vector<uint32_t> restarts(local ? local->addresses().size() : 0, 0);
  int result = 0;

  auto start_round = [&](JobRun& job) -> bool {
    const double left = std::chrono::duration<double>(end - Clock::now()).count();
    if (left < 0.1) {  // too little for a round (and below --seconds' range)
      job.done = true;
      return true;
    }
    job.workers.clear();
    job.outputs.clear();
    job.killed.assign(o.workers, false);
    job.reaped.assign(o.workers, false);
    for (uint32_t r = 0; r < o.workers; ++r) {
      const std::string tag = "j" + std::to_string(job.index) + "-r" + std::to_string(job.round) +
                              "-w" + std::to_string(r);
      job.outputs.push_back(scratch.path() + "/" + tag + ".ops");
      ProcessSpec spec;
      spec.path = self_dir() + "/tally-bench";
      spec.args = {"load",        "--worker",
                   "-b",          std::to_string(o.bytes),
                   "--first",     std::to_string(job.next_op),
                   "--seconds",   std::to_string(left),
                   "--max-ops",   std::to_string(o.max_ops),
                   "--out",       job.outputs.back(),
                   "--redop",     o.redops,
                   "--inflight",  std::to_string(o.inflight),
                   "--buckets",   std::to_string(o.buckets),
                   "--log-level", o.log_level};
      spec.env = {{"TALLY_POOL", pool},
                  {"TALLY_JOB",
                   prefix + "-j" + std::to_string(job.index) + "-r" + std::to_string(job.round)},
                  {"TALLY_RANK", std::to_string(r)},
                  {"TALLY_WORLD_SIZE", std::to_string(o.workers)},
                  {"TALLY_GROUPS", std::to_string(o.groups)},
                  {"TALLY_OP_TIMEOUT_MS", std::to_string(o.op_timeout_ms)}};
      if (!secret_file.empty()) spec.env["TALLY_JOB_SECRET_FILE"] = secret_file;
      spec.stderr_path = scratch.path() + "/" + tag + ".log";
      if (lab) lab->place(job.index * o.workers + r, spec);
      auto p = Process::spawn(spec);
      if (!p) {
        spdlog::error("{}", p.status().to_string());
        return false;
      }
      job.workers.push_back(std::move(*p));
    }
    job.running = true;
    totals.rounds++;
    return true;
  };

  bool ok = true;
  while (ok) {
    if (g_stop) {
      spdlog::error("interrupted; stopping the workers");
      result = 130;
      break;
    }
    bool all_done = true;
    for (JobRun& job : jobs) {
      if (job.running) {
        bool exited = true;
        bool time_up = true;
        for (size_t r = 0; r < job.workers.size(); ++r) {
          auto st = job.workers[r].wait_for(milliseconds(0));
          if (!st) {
            exited = false;
            continue;
          }
          if (*st != 0) time_up = false;
          if (job.reaped[r]) continue;
          job.reaped[r] = true;
          if (*st != 0 && *st != 3 && *st != 4 && !job.killed[r]) {
            totals.unexpected_exits++;
            spdlog::error("job {} rank {} exited with status {} (log: {})", job.index, r, *st,
                          job.outputs[r]);
          }
        }
        if (exited) {
          job.running = false;
          job.next_op = collect(job, totals);
          job.round++;
          if (time_up || Clock::now() >= end) job.done = true;
        }
      }
      if (!job.running && !job.done && !start_round(job)) ok = false;
      all_done = all_done && job.done;
    }
    if (all_done) break;
    const auto now = Clock::now();
    if (now >= next_progress) {
      next_progress += kProgressEvery;
      print_progress(now - t0, jobs, totals, kills);
    }
    if (!o.kill.empty() && now >= next_kill && now < end) {
      next_kill += seconds_of(o.kill_every_s);
      if (o.kill == "reducer" && local) {
        const uint32_t i = static_cast<uint32_t>(kills % local->addresses().size());
        local->reducer(i).signal(SIGKILL);
        kills++;
        if (Status st = local->restart(i); !st) {
          spdlog::error("restarting reducer {}: {}", i, st.to_string());
          ok = false;
        } else {
          restarts[i]++;
        }
      } else if (o.kill == "worker") {
        JobRun& job = jobs[kills % jobs.size()];
        const uint32_t r = static_cast<uint32_t>(kills / jobs.size() % o.workers);
        // Only a worker still running: one that has exited is not killed,
        // and its own exit status still counts.
        if (job.running && !job.workers[r].wait_for(milliseconds(0))) {
          job.killed[r] = true;
          job.workers[r].signal(SIGKILL);
          kills++;
        }
      }
    }
    if (now > hard_deadline) {
      spdlog::error("the run passed its deadline with workers still running");
      ok = false;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  for (JobRun& job : jobs) {
    for (Process& p : job.workers) p.terminate(milliseconds(2000));
  }
  const std::vector<ReducerSample> after = sample(local.get());

  const std::string redops = o.redops == "both" ? "sum and avg alternating" : o.redops;
  std::printf(
      "# tally-bench %s: %u jobs x %u workers, float32 %s, %u ops in flight over %u buckets of "
      "up to %s, %.0f s, pool %s\n",
      o.kill.empty() ? "load" : "chaos", o.jobs, o.workers, redops.c_str(), o.inflight, o.buckets,
      human_bytes(o.bytes).c_str(), o.seconds,
      local ? ("S=" + std::to_string(o.shards) + " x G=" + std::to_string(o.groups) +
               " (local, authenticated" +
               (lab ? ", in a network lab at " + o.netlab_rate +
                          " per host, the last worker of even-numbered jobs at half of it"
                    : std::string()) +
               ")")
                  .c_str()
            : pool.c_str());
  if (!o.kill.empty()) {
    std::printf("# chaos: a %s killed (SIGKILL) and restarted every %.1f s: %" PRIu64 " kills\n",
                o.kill.c_str(), o.kill_every_s, kills);
  }
  std::printf("# rounds %" PRIu64 " (a job's workers start again after a failed op)\n",
              totals.rounds);
  std::printf(
      "#\n#   completed       ops/s     p50(ms)     p99(ms)     max(ms)      failed  "
      "     split       wrong\n");
  const std::string p50 = percentile_ms(totals.latency_us, 0.50);
  const std::string p99 = percentile_ms(totals.latency_us, 0.99);
  const std::string max = percentile_ms(totals.latency_us, 1.0);  // nearest rank: the largest
  std::printf("  %11" PRIu64 " %11.1f %11s %11s %11s %11" PRIu64 " %11" PRIu64 " %11" PRIu64 "\n",
              totals.completed, totals.completed / std::max(elapsed, 1e-9), p50.c_str(),
              p99.c_str(), max.c_str(), totals.failed, totals.split, totals.wrong);
  std::printf("#\n# failures by kind (rank-ops):%s\n", totals.errors.empty() ? " none" : "");
  for (auto& [kind, count] : totals.errors) {
    std::printf("#   %-20s %8" PRIu64 "   e.g. %s\n", kind.c_str(), count,
                totals.examples.count(kind) ? totals.examples[kind].c_str() : "");
  }
  for (const std::string& w : totals.wrongs) std::printf("# %s\n", w.c_str());
  for (size_t i = 0; i < before.size() && i < after.size(); ++i) {
    auto mib = [](std::optional<uint64_t> b) -> std::string {
      if (!b) return "?";
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.1f MiB", *b / 1048576.0);
      return buf;
    };
    auto fds = [](std::optional<uint32_t> n) { return n ? std::to_string(*n) : std::string("?"); };
    std::printf(
        "# reducer %zu (%s): rss %s -> %s, open fds %s -> %s%s\n", i, local->addresses()[i].c_str(),
        mib(before[i].rss).c_str(), mib(after[i].rss).c_str(), fds(before[i].fds).c_str(),
        fds(after[i].fds).c_str(),
        restarts[i] ? (" (restarted " + std::to_string(restarts[i]) + " times)").c_str() : "");
  }
  std::fflush(stdout);
  if (result != 0) return result;
  if (totals.wrong > 0) return 3;
  if (!ok || totals.unexpected_exits > 0) return 1;
  return 0;
}

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
  if (chaos) {
    app.add_option("--kill", o.kill, "what is killed and restarted: reducer or worker")
        ->capture_default_str()
        ->check(CLI::IsMember({"reducer", "worker"}));
    app.add_option("-K,--kill-every", o.kill_every_s, "seconds between kills")
        ->capture_default_str()
        ->check(CLI::Range(0.1, 3600.0));
  } else {
    app.add_option("--pool", o.pool, "use this pool (host:port,...) instead of a local one");
    app.add_option("--secret-file", o.secret_file, "with --pool: the job secret's file");
  }
  app.add_flag("--worker", worker, "run as one rank, configured by TALLY_* (the driver uses it)");
  app.add_option("--first", w.first, "worker: the round's first op number");
  app.add_option("--out", w.out_path, "worker: where the ops are written");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is 0; bad flags are 2, as documented
  }
  spdlog::set_default_logger(spdlog::stderr_color_mt("tally-bench"));
  spdlog::set_level(spdlog::level::from_str(o.log_level));
  if (!o.netlab_rate.empty() && !worker) {
    if (std::string why = netlab_refusal(); !why.empty()) {
      std::fprintf(stderr, "tally-bench: --netlab: %s\n", why.c_str());
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
