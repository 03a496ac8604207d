#include "load.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

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
#include "hostiles.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/netlab.h"
#include "tally/bench/process.h"
#include "tally/bench/table.h"
#include "tally/client/client.h"

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

// What the chaos schedule did when a kill was due.
enum class Kill {
  kDone,      // killed (and restarted, for a reducer), or nothing left to kill
  kDeferred,  // the worker's round has not completed an op yet: tried again at the next tick
  kFailed,    // a reducer could not be restarted
};

// One load or chaos run: its lab and pool, the jobs' rounds of workers,
// the kills, and the totals.
class LoadRun {
 public:
  LoadRun(const LoadOptions& o, const ScratchDir& scratch)
      : o_(o),
        scratch_(scratch),
        pool_(o.pool),
        secret_file_(o.secret_file),
        prefix_(o.job.empty() ? "load-" + std::to_string(getpid()) : o.job),
        jobs_(o.jobs) {
    for (uint32_t j = 0; j < o.jobs; ++j) jobs_[j].index = j;
  }

  // The lab (with its slow links) and the local pool; false once said why.
  bool set_up();
  // Runs the jobs until --seconds pass; the exit code (0, 1, 3 or 130).
  int run();

 private:
  // --netlab: worker r of job j on host j x W + r, reducer i on host J x W + i.
  uint32_t worker_hosts() const { return o_.jobs * o_.workers; }
  bool slow_links();
  bool start_round(JobRun& job);
  ProcessSpec round_worker(const JobRun& job, uint32_t r, double left) const;
  void reap(JobRun& job);
  Kill kill_one();
  void report(double elapsed, const std::vector<ReducerSample>& before,
              const std::vector<ReducerSample>& after);

  const LoadOptions& o_;
  const ScratchDir& scratch_;
  std::unique_ptr<Netlab> lab_;
  std::unique_ptr<LocalPool> local_;
  std::unique_ptr<Hostiles> hostiles_;  // a local pool on loopback only
  std::string pool_;
  std::string secret_file_;
  const std::string prefix_;
  std::vector<JobRun> jobs_;
  Totals totals_;
  Clock::time_point end_;
  uint64_t kills_ = 0;
  std::vector<uint32_t> restarts_;
};

bool LoadRun::slow_links() {
  // The last worker of each even-numbered job is on a link of half the
  // rate: results reach it after the others, as they reach a straggler,
  // so a reducer killed at any moment leaves chunks whose results some
  // ranks hold and others do not (the replays a restart has to get
  // right). The odd-numbered jobs' links are all alike: their results
  // arrive in step, and a kill leaves every rank part-way through the
  // same result, with no rank to replay it.
  const uint64_t half = lab_->rate_bps() / 2;
  for (uint32_t j = 0; j < o_.jobs && o_.workers > 1; j += 2) {
    if (Status st = lab_->set_rate(j * o_.workers + o_.workers - 1, std::to_string(half) + "bit");
        !st) {
      spdlog::error("--netlab: {}", st.to_string());
      return false;
    }
  }
  return true;
}

bool LoadRun::set_up() {
  if (!o_.netlab_rate.empty()) {
    auto made = Netlab::for_run(worker_hosts() + o_.shards * o_.groups, o_.netlab_rate);
    if (!made) {
      spdlog::error("--netlab: {}", made.status().to_string());
      return false;
    }
    lab_ = std::move(*made);
    if (!slow_links()) return false;
  }
  if (pool_.empty()) {
    secret_file_ = scratch_.path() + "/job.secret";
    LocalPoolOptions lo;
    lo.shards = o_.shards;
    lo.groups = o_.groups;
    lo.log_dir = scratch_.path();
    lo.extra_args = {"--log-level", o_.log_level};
    lo.http = !lab_;  // probed from here (hostiles.h)
    if (Status st = lo.require_secret(secret_file_); !st) {
      spdlog::error("{}", st.to_string());
      return false;
    }
    if (lab_) lo.place_in(*lab_, worker_hosts());
    auto started = LocalPool::start(lo);
    if (!started) {
      spdlog::error("cannot start the local pool: {}", started.status().to_string());
      return false;
    }
    local_ = std::move(*started);
    pool_ = local_->pool_string();
    if (!lab_) {
      HostileOptions ho;
      ho.liar = o_.liar;
      ho.slow_http = o_.slow_http;
      ho.op_timeout_ms = static_cast<uint32_t>(o_.op_timeout_ms);
      ho.job_prefix = prefix_;
      ho.secret_file = secret_file_;
      ho.limit = std::chrono::seconds(static_cast<int64_t>(o_.seconds) + 600);
      auto hostiles = Hostiles::start(ho, *local_);
      if (!hostiles) {
        spdlog::error("{}", hostiles.status().to_string());
        return false;
      }
      hostiles_ = std::move(*hostiles);
    }
  }
  restarts_.assign(local_ ? local_->addresses().size() : 0, 0);
  return true;
}

ProcessSpec LoadRun::round_worker(const JobRun& job, uint32_t r, double left) const {
  ProcessSpec spec;
  // Its ops file's name, with .log for its stderr.
  const std::string out = job.outputs[r];
  const std::string log = out.substr(0, out.size() - 4) + ".log";
  spec.path = self_dir() + "/tally-bench";
  spec.args = {"load",        "--worker",
               "-b",          std::to_string(o_.bytes),
               "--first",     std::to_string(job.next_op),
               "--seconds",   std::to_string(left),
               "--max-ops",   std::to_string(o_.max_ops),
               "--out",       job.outputs[r],
               "--redop",     o_.redops,
               "--inflight",  std::to_string(o_.inflight),
               "--buckets",   std::to_string(o_.buckets),
               "--log-level", o_.log_level};
  spec.env = {
      {"TALLY_POOL", pool_},
      {"TALLY_JOB", prefix_ + "-j" + std::to_string(job.index) + "-r" + std::to_string(job.round)},
      {"TALLY_RANK", std::to_string(r)},
      {"TALLY_WORLD_SIZE", std::to_string(o_.workers)},
      {"TALLY_GROUPS", std::to_string(o_.groups)},
      {"TALLY_OP_TIMEOUT_MS", std::to_string(o_.op_timeout_ms)}};
  if (!secret_file_.empty()) spec.env["TALLY_JOB_SECRET_FILE"] = secret_file_;
  spec.stderr_path = log;
  if (lab_) lab_->place(job.index * o_.workers + r, spec);
  return spec;
}

bool LoadRun::start_round(JobRun& job) {
  const double left = std::chrono::duration<double>(end_ - Clock::now()).count();
  if (left < 0.1) {  // too little for a round (and below --seconds' range)
    job.done = true;
    return true;
  }
  job.workers.clear();
  job.outputs.clear();
  job.killed.assign(o_.workers, false);
  job.reaped.assign(o_.workers, false);
  for (uint32_t r = 0; r < o_.workers; ++r) {
    const std::string tag = "j" + std::to_string(job.index) + "-r" + std::to_string(job.round) +
                            "-w" + std::to_string(r);
    job.outputs.push_back(scratch_.path() + "/" + tag + ".ops");
    auto p = Process::spawn(round_worker(job, r, left));
    if (!p) {
      spdlog::error("{}", p.status().to_string());
      return false;
    }
    job.workers.push_back(std::move(*p));
  }
  job.running = true;
  totals_.rounds++;
  return true;
}

// Sees which of a running round's workers have exited; ends the round
// (its ops counted) when all have.
void LoadRun::reap(JobRun& job) {
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
      totals_.unexpected_exits++;
      spdlog::error("job {} rank {} exited with status {} (log: {})", job.index, r, *st,
                    job.outputs[r]);
    }
  }
  if (exited) {
    job.running = false;
    job.next_op = collect(job, totals_);
    job.round++;
    if (time_up || Clock::now() >= end_) job.done = true;
  }
}

// The chaos schedule's next kill: a reducer (restarted at once) or a
// worker still running, in turn.
Kill LoadRun::kill_one() {
  if (o_.kill == "reducer" && local_) {
    const uint32_t i = static_cast<uint32_t>(kills_ % local_->addresses().size());
    local_->reducer(i).signal(SIGKILL);
    kills_++;
    if (Status st = local_->restart(i); !st) {
      spdlog::error("restarting reducer {}: {}", i, st.to_string());
      return Kill::kFailed;
    }
    restarts_[i]++;
    if (hostiles_) hostiles_->restarted(i);
  } else if (o_.kill == "worker") {
    JobRun& job = jobs_[kills_ % jobs_.size()];
    const uint32_t r = static_cast<uint32_t>(kills_ / jobs_.size() % o_.workers);
    // Only a worker still running: one that has exited is not killed,
    // and its own exit status still counts. And only once its round has
    // completed an op: a rank killed before it joins leaves the others
    // waiting out their op timeout, and a schedule faster than a round's
    // start (a loaded machine, a sanitized build) would then complete
    // nothing at all.
    if (job.running && !job.workers[r].wait_for(milliseconds(0))) {
      if (ok_lines(job.outputs[0]) == 0) return Kill::kDeferred;
      job.killed[r] = true;
      job.workers[r].signal(SIGKILL);
      kills_++;
    }
  }
  return Kill::kDone;
}

void LoadRun::report(double elapsed, const std::vector<ReducerSample>& before,
                     const std::vector<ReducerSample>& after) {
  const std::string redops = o_.redops == "both" ? "sum and avg alternating" : o_.redops;
  std::printf(
      "# tally-bench %s: %u jobs x %u workers, float32 %s, %u ops in flight over %u buckets of "
      "up to %s, %.0f s, pool %s\n",
      o_.kill.empty() ? "load" : "chaos", o_.jobs, o_.workers, redops.c_str(), o_.inflight,
      o_.buckets, human_bytes(o_.bytes).c_str(), o_.seconds,
      local_ ? ("S=" + std::to_string(o_.shards) + " x G=" + std::to_string(o_.groups) +
                " (local, authenticated" +
                (lab_ ? ", in a network lab at " + o_.netlab_rate +
                            " per host, the last worker of even-numbered jobs at half of it"
                      : std::string()) +
                ")")
                   .c_str()
             : pool_.c_str());
  if (!o_.kill.empty()) {
    std::printf("# chaos: a %s killed (SIGKILL) and restarted every %.1f s: %" PRIu64 " kills\n",
                o_.kill.c_str(), o_.kill_every_s, kills_);
  }
  std::printf("# rounds %" PRIu64 " (a job's workers start again after a failed op)\n",
              totals_.rounds);
  std::printf(
      "#\n#   completed       ops/s     p50(ms)     p99(ms)     max(ms)      failed  "
      "     split       wrong\n");
  const std::string p50 = percentile_ms(totals_.latency_us, 0.50);
  const std::string p99 = percentile_ms(totals_.latency_us, 0.99);
  const std::string max = percentile_ms(totals_.latency_us, 1.0);  // nearest rank: the largest
  std::printf("  %11" PRIu64 " %11.1f %11s %11s %11s %11" PRIu64 " %11" PRIu64 " %11" PRIu64 "\n",
              totals_.completed, totals_.completed / std::max(elapsed, 1e-9), p50.c_str(),
              p99.c_str(), max.c_str(), totals_.failed, totals_.split, totals_.wrong);
  std::printf("#\n# failures by kind (rank-ops):%s\n", totals_.errors.empty() ? " none" : "");
  for (auto& [kind, count] : totals_.errors) {
    std::printf("#   %-20s %8" PRIu64 "   e.g. %s\n", kind.c_str(), count,
                totals_.examples.count(kind) ? totals_.examples[kind].c_str() : "");
  }
  for (const std::string& w : totals_.wrongs) std::printf("# %s\n", w.c_str());
  for (size_t i = 0; i < before.size() && i < after.size(); ++i) {
    auto mib = [](std::optional<uint64_t> b) -> std::string {
      if (!b) return "?";
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.1f MiB", *b / 1048576.0);
      return buf;
    };
    auto fds = [](std::optional<uint32_t> n) { return n ? std::to_string(*n) : std::string("?"); };
    std::printf(
        "# reducer %zu (%s): rss %s -> %s, open fds %s -> %s%s\n", i,
        local_->addresses()[i].c_str(), mib(before[i].rss).c_str(), mib(after[i].rss).c_str(),
        fds(before[i].fds).c_str(), fds(after[i].fds).c_str(),
        restarts_[i] ? (" (restarted " + std::to_string(restarts_[i]) + " times)").c_str() : "");
  }
  std::fflush(stdout);
}

int LoadRun::run() {
  const std::vector<ReducerSample> before = sample(local_.get());
  const auto t0 = Clock::now();
  end_ = t0 + seconds_of(o_.seconds);
  // Past this, something hangs: an op is bounded by its timeout, a connect by its own.
  const auto hard_deadline = end_ + 3 * milliseconds(o_.op_timeout_ms) + std::chrono::seconds(60);
  auto next_kill = t0 + seconds_of(o_.kill_every_s);
  auto next_progress = t0 + kProgressEvery;
  int result = 0;
  bool ok = true;
  while (ok) {
    if (g_stop) {
      spdlog::error("interrupted; stopping the workers");
      result = 130;
      break;
    }
    bool all_done = true;
    for (JobRun& job : jobs_) {
      if (job.running) reap(job);
      if (!job.running && !job.done && !start_round(job)) ok = false;
      all_done = all_done && job.done;
    }
    if (all_done) break;
    const auto now = Clock::now();
    if (now >= next_progress) {
      next_progress += kProgressEvery;
      print_progress(now - t0, jobs_, totals_, kills_);
    }
    if (hostiles_) hostiles_->probe(now);
    if (!o_.kill.empty() && now >= next_kill && now < end_) {
      const Kill kill = kill_one();
      if (kill != Kill::kDeferred) next_kill += seconds_of(o_.kill_every_s);
      if (kill == Kill::kFailed) ok = false;
    }
    if (now > hard_deadline) {
      spdlog::error("the run passed its deadline with workers still running");
      ok = false;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  for (JobRun& job : jobs_) {
    for (Process& p : job.workers) p.terminate(milliseconds(2000));
  }
  report(elapsed, before, sample(local_.get()));
  const int hostile = hostiles_ ? hostiles_->finish() : 0;
  if (result != 0) return result;
  if (totals_.wrong > 0 || hostile == 3) return 3;
  if (hostile != 0) return hostile;
  if (!ok || totals_.unexpected_exits > 0) return 1;
  return 0;
}

}  // namespace

int run_load(const LoadOptions& o) {
  stop_on_signals();
  auto scratch = ScratchDir::make("tally-load-");
  if (!scratch) {
    spdlog::error("{}", scratch.status().to_string());
    return 1;
  }
  LoadRun run(o, **scratch);
  if (!run.set_up()) return 1;
  return run.run();
}

}  // namespace tally::bench
