// Helpers for tests that run real tally-reducer and worker processes on
// loopback: a pool per test, workers with TALLY_* set, bounded waits, and
// each process's output kept in the test's temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tally/bench/local_pool.h"
#include "tally/bench/process.h"

namespace tally::testing {

using Args = std::vector<std::string>;
using Env = std::map<std::string, std::string>;
using Clock = std::chrono::steady_clock;

// Milliseconds from `t0` to now.
std::chrono::milliseconds since(Clock::time_point t0);

// A temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct PoolSpec {
  uint32_t shards = 1;
  // "tcp", or "fabric": reducers serve the libfabric data path and workers
  // ask for it (TALLY_TRANSPORT).
  std::string transport = "tcp";
  uint32_t groups = 1;
  // Small buffers so a few KiB already make many chunks.
  std::vector<std::string> reducer_args{"--max-chunk-bytes", "4096", "--memory-budget", "1MiB",
                                        "--window",          "4",    "--io-threads",    "2",
                                        "--log-level",       "info"};
};

struct WorkerOutput {
  int exit_code = -1;  // -1: still running at the deadline (then killed)
  std::string out;
};

class TestCluster {
 public:
  // Starts the pool in a fresh temporary directory. Fails the test (ASSERT)
  // through the returned null pointer's message on error.
  explicit TestCluster(const PoolSpec& spec);
  ~TestCluster();

  bool ok() const { return pool_ != nullptr; }
  const std::string& error() const { return error_; }
  std::string pool_string() const { return pool_->pool_string(); }
  const std::vector<std::string>& addresses() const { return pool_->addresses(); }
  // Reducers by index: group x shards + shard.
  bench::Process& reducer(uint32_t index) { return pool_->reducer(index); }
  // Kills a reducer; its exit status is then not checked at teardown.
  void kill_reducer(uint32_t index, int sig) {
    killed_.insert(index);
    pool_->reducer(index).signal(sig);
  }
  // Starts a killed reducer again on its address; it is checked at teardown again.
  Status restart_reducer(uint32_t index) {
    killed_.erase(index);
    return pool_->restart(index);
  }
  // Reducer `index`'s log: every incarnation's, in order.
  std::string reducer_log(uint32_t index) const;
  uint32_t groups() const { return groups_; }
  const std::string& dir() const { return dir_.path(); }

  // Environment for rank `rank` of a `world`-sized job on this pool.
  std::map<std::string, std::string> worker_env(const std::string& job, uint32_t rank,
                                                uint32_t world) const;
  // Starts tally-test-worker with `args`; stdout goes to dir/<name>.out.
  bench::Process spawn_worker(const std::string& name, const std::vector<std::string>& args,
                              const std::map<std::string, std::string>& env);
  std::string worker_stdout(const std::string& name) const;

 private:
  TempDir dir_;
  std::string error_;
  std::string transport_;
  uint32_t groups_ = 1;
  std::set<uint32_t> killed_;
  std::unique_ptr<bench::LocalPool> pool_;
};

// Ranks 0..world-1 of one job, as tally-test-worker processes named
// "<prefix><rank>": each gets args_for(rank) and the job's environment with
// `env` applied on top (for every rank).
class WorkerGroup {
 public:
  WorkerGroup(TestCluster& cluster, const std::string& prefix, const std::string& job,
              uint32_t world, const std::function<Args(uint32_t)>& args_for,
              const std::map<std::string, std::string>& env = {});
  bench::Process& process(uint32_t rank) { return procs_.at(rank); }
  std::string name(uint32_t rank) const { return prefix_ + std::to_string(rank); }
  std::string stdout_of(uint32_t rank) const { return cluster_.worker_stdout(name(rank)); }
  // The client library's log lines (stderr).
  std::string stderr_of(uint32_t rank) const;
  // Waits for rank's exit (killing it at the deadline) and returns its output.
  WorkerOutput wait(uint32_t rank, std::chrono::milliseconds timeout);

 private:
  TestCluster& cluster_;
  std::string prefix_;
  std::vector<bench::Process> procs_;
};

// Runs one single-rank worker (`--count 10`) with `env` over the job's
// environment, and returns its output once it exits (or is killed at
// `timeout`).
WorkerOutput run_one(TestCluster& cluster, const std::map<std::string, std::string>& env,
                     std::chrono::milliseconds timeout);

// Starts `path` with stdout and stderr in dir/<name>.out and .err; a spawn
// failure fails the test and aborts (nothing sensible can follow).
bench::Process spawn_logged(const std::string& path, const std::string& dir,
                            const std::string& name, const std::vector<std::string>& args,
                            const std::map<std::string, std::string>& env);

// A process started from a test, its output in dir/<name>.out and .err.
struct Child {
  std::string name;
  std::string dir;
  std::optional<bench::Process> process;

  std::string out() const;
  std::string err() const;
  // Waits for the exit (killing at the deadline: nullopt) and gives stdout + stderr.
  std::optional<int> wait(std::chrono::milliseconds timeout, std::string* output = nullptr);
};

// Starts `path` as a Child (through spawn_logged).
Child spawn_child(const std::string& dir, const std::string& name, const std::string& path,
                  const Args& args, const Env& env = {});

// Waits for a process; kills it at the deadline.
WorkerOutput wait_worker(bench::Process& p, const TestCluster& cluster, const std::string& name,
                         std::chrono::milliseconds timeout);
std::string read_file(const std::string& path);
// Polls until `pred` holds or `timeout` passes; returns whether it held.
bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout);
// Why `transport` cannot run here ("" when it can): the fabric transport
// needs a libfabric build and the default provider on this machine.
std::string transport_unavailable(const std::string& transport);
// Skips the current test, with the reason, when its transport cannot run.
#define TALLY_SKIP_UNLESS_TRANSPORT(transport)                                         \
  do {                                                                                 \
    const std::string tally_why_ = ::tally::testing::transport_unavailable(transport); \
    if (!tally_why_.empty()) GTEST_SKIP() << tally_why_;                               \
  } while (0)

// "Tcp" or "Fabric": the name of a case parametrised over the transport.
std::string transport_name(const ::testing::TestParamInfo<std::string>& info);

// A job name unique to this test and process.
std::string unique_job(const std::string& hint);

bool contains(const std::string& s, const std::string& what);

// The "op K ok hash H" lines of a tally-test-worker's output: K -> H.
std::map<int, std::string> hashes_of(const std::string& worker_out);

// One row of tally-bench's per-reducer byte report: size s g w, the four
// measured bytes per op (worker in, worker out, replica in, replica out),
// '|', the formula's three (worker, replica in, replica out).
struct TrafficRow {
  std::string line;
  uint64_t size = 0, shard = 0, group = 0, workers = 0;
  double measured[4] = {};
  double formula[3] = {};
};
// Every such row of the bench's output, in order.
std::vector<TrafficRow> traffic_rows(const std::string& bench_output);

// tally-bench run to its end from a test: stdout and stderr in dir/stdout
// and dir/stderr; status nullopt when killed at the deadline.
struct BenchRun {
  std::optional<int> status;
  std::string out;
  std::string err;
};
BenchRun run_bench(const std::string& dir, const Args& args, std::chrono::milliseconds timeout);

// Runs a normal all-reduce of `workers` ranks (3 ops, multi-chunk) on the
// cluster's transport and expects every rank to finish with exact results
// within 30 s.
// `env` is applied on top of the job's environment (e.g. a job secret).
void expect_allreduce_works(TestCluster& cluster, uint32_t workers, const std::string& tag,
                            const std::map<std::string, std::string>& env = {});

// Expects reducer `index`'s peak resident memory so far (VmHWM) within
// `budget` (its --memory-budget) plus the overhead docs/architecture.md
// documents ("Memory outside the budget") for up to `streams` open streams,
// and prints it. Not checked under a sanitizer, whose runtime keeps freed
// memory in quarantine and maps shadow memory.
void expect_peak_rss_within_overhead(TestCluster& cluster, uint32_t index, uint32_t streams,
                                     uint64_t budget = 1u << 20);

}  // namespace tally::testing
