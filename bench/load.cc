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
#include "tally/bench/process.h"
#include "tally/bench/table.h"
#include "tally/client/client.h"

namespace tally::bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Rank r's element i of op g: small integers, so every sum of up to 16384
// ranks is exact in float32 and each op's result is checked element by
// element.
float element(uint32_t rank, uint64_t op, size_t i) {
  return static_cast<float>((i * 7 + op * 13 + uint64_t{rank} * 29) & 1023);
}

Clock::duration seconds_of(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

int run_load_worker(const LoadWorkerOptions& o) {
  const auto started = Clock::now();
  std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(o.out_path.c_str(), "w"), &std::fclose);
  if (!out) {
    spdlog::error("cannot write {}", o.out_path);
    return 2;
  }
  auto options = client_options_from_env();
  if (!options) {
    std::fprintf(out.get(), "# %s\n", options.status().to_string().c_str());
    return 2;
  }
  auto client = Client::connect(*options);
  if (!client) {
    // Not an op: no op was attempted (collect() counts it apart).
    std::fprintf(out.get(), "# connect %s\n", client.status().to_string().c_str());
    return 4;
  }
  const uint32_t rank = options->rank;
  const uint32_t world = options->world_size;
  // The last element is this rank's vote: 1 while its time lasts. Every rank
  // sees the same sum, so all stop after the same op.
  const size_t n = std::max<size_t>(o.bytes / sizeof(float), 2);
  std::vector<float> buf(n);
  int code = 0;
  // Flushed every 100 ms, so a worker the chaos driver kills loses at most
  // that much of its record.
  auto flushed = Clock::now();
  for (uint64_t k = 0; k < o.max_ops; ++k) {
    if (Clock::now() - flushed > std::chrono::milliseconds(100)) {
      std::fflush(out.get());
      flushed = Clock::now();
    }
    const uint64_t op = o.first + k;
    for (size_t i = 0; i + 1 < n; ++i) buf[i] = element(rank, op, i);
    buf[n - 1] = Clock::now() - started < seconds_of(o.seconds) ? 1.0f : 0.0f;
    const auto t0 = Clock::now();
    const Status s = (*client)->allreduce(buf.data(), n, DType::kFloat32, RedOp::kSum);
    const long long us =
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
    if (!s) {
      std::fprintf(out.get(), "%" PRIu64 " %s %lld\n# %s\n", op,
                   std::string(error_code_name(s.code())).c_str(), us, s.to_string().c_str());
      code = 4;
      break;
    }
    const float votes = buf[n - 1];
    bool right = votes >= 0 && votes <= static_cast<float>(world) && votes == std::floor(votes);
    for (size_t i = 0; right && i + 1 < n; ++i) {
      float want = 0;
      for (uint32_t r = 0; r < world; ++r) want += element(r, op, i);
      right = buf[i] == want;
    }
    std::fprintf(out.get(), "%" PRIu64 " %s %lld\n", op, right ? "ok" : "wrong", us);
    if (!right) {
      code = 3;
      break;  // the votes may be wrong too: stopping is the one safe move
    }
    if (votes < static_cast<float>(world)) break;
  }
  return code;
}

namespace {

// What one round of one rank wrote (run_load_worker's file).
struct RankReport {
  std::map<uint64_t, std::string> outcome;  // op -> "ok", "wrong" or the error code's name
  std::vector<uint32_t> latency_us;         // of its ok ops
  std::string error;                        // the "# ..." line, if any
  std::string connect_error;                // "# connect ...": it never joined
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
  for (const std::string& path : job.outputs) {
    RankReport r = read_report(path);
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

}  // namespace

int run_load(const LoadOptions& o) {
  stop_on_signals();
  auto scratch_dir = ScratchDir::make("tally-load-");
  if (!scratch_dir) {
    spdlog::error("{}", scratch_dir.status().to_string());
    return 1;
  }
  const ScratchDir& scratch = **scratch_dir;
  std::unique_ptr<LocalPool> local;
  std::string pool = o.pool;
  std::string secret_file = o.secret_file;
  if (pool.empty()) {
    secret_file = scratch.path() + "/job.secret";
    if (Status st = write_job_secret(secret_file); !st) {
      spdlog::error("{}", st.to_string());
      return 1;
    }
    LocalPoolOptions lo;
    lo.shards = o.shards;
    lo.groups = o.groups;
    lo.log_dir = scratch.path();
    lo.extra_args = {"--log-level", o.log_level, "--job-secret-file", secret_file,
                     "--require-auth"};
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
                   "--log-level", o.log_level};
      spec.env = {{"TALLY_POOL", pool},
                  {"TALLY_JOB",
                   prefix + "-j" + std::to_string(job.index) + "-r" + std::to_string(job.round)},
                  {"TALLY_RANK", std::to_string(r)},
                  {"TALLY_WORLD_SIZE", std::to_string(o.workers)},
                  {"TALLY_GROUPS", std::to_string(o.groups)},
                  {"TALLY_OP_TIMEOUT_MS", std::to_string(o.op_timeout_ms)}};
      if (!secret_file.empty()) spec.env["TALLY_SECRET_FILE"] = secret_file;
      spec.stderr_path = scratch.path() + "/" + tag + ".log";
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

  std::printf("# tally-bench %s: %u jobs x %u workers, %s float32 sum per op, %.0f s, pool %s\n",
              o.kill.empty() ? "load" : "chaos", o.jobs, o.workers, human_bytes(o.bytes).c_str(),
              o.seconds,
              local ? ("S=" + std::to_string(o.shards) + " x G=" + std::to_string(o.groups) +
                       " (local, authenticated)")
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
  app.add_option("-b,--bytes", o.bytes, "bytes per op (float32 elements)")
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
  app.add_option("--job", o.job, "prefix of the job names (default: load-<pid>)");
  app.add_option("--log-level", o.log_level, "log level of the workers and local reducers")
      ->capture_default_str();
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
  if (worker) {
    w.bytes = o.bytes;
    w.seconds = o.seconds;
    w.max_ops = o.max_ops;
    return run_load_worker(w);
  }
  return run_load(o);
}

}  // namespace tally::bench
