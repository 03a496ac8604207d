#include "harness.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "tally/bench/process.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/transport.h"

namespace tally::testing {

namespace fs = std::filesystem;

// A reducer's memory outside its --memory-budget, as docs/architecture.md
// ("Memory outside the budget") gives it: the process at start; the control
// frames queued for all streams (kReducerControlBudgetBytes, reducer.cc),
// which the allocator may keep per I/O thread once freed (PoolSpec runs 2);
// and per open stream its control floor and a control frame being read.
constexpr uint64_t kReducerBaseOverheadBytes = (16u << 20) + 2 * (32u << 20);
constexpr uint64_t kStreamOverheadBytes = kControlBytesFloor + kMaxControlBytes;

std::chrono::milliseconds since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

TempDir::TempDir() {
  char tmpl[] = "/tmp/tally-test-XXXXXX";
  if (mkdtemp(tmpl)) path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) fs::remove_all(path_, ec);
}

TestCluster::TestCluster(const PoolSpec& spec) {
  if (!dir_.ok()) {
    error_ = "mkdtemp failed";
    return;
  }
  bench::LocalPoolOptions options;
  options.shards = spec.shards;
  options.groups = spec.groups;
  groups_ = spec.groups;
  options.reducer_path = TALLY_REDUCER_PATH;
  options.extra_args = spec.reducer_args;
  transport_ = spec.transport;
  if (spec.transport != "tcp") {
    options.extra_args.insert(options.extra_args.end(), {"--transport", spec.transport});
  }
  options.log_dir = dir_.path();
  auto pool = bench::LocalPool::start(options);
  if (!pool) {
    error_ = pool.status().to_string();
    return;
  }
  pool_ = std::move(*pool);
}

TestCluster::~TestCluster() {
  if (pool_) {
    // A reducer killed on purpose by the test is exempt; every other one
    // must shut down cleanly (sanitizer reports make the exit status non-zero).
    std::vector<int> statuses = pool_->stop();
    for (size_t s = 0; s < statuses.size(); ++s) {
      if (killed_.count(static_cast<uint32_t>(s))) continue;
      EXPECT_EQ(statuses[s], 0) << "reducer " << s << " did not shut down cleanly:\n"
                                << reducer_log(static_cast<uint32_t>(s));
    }
    pool_.reset();
  }
  // Keep the logs of a failed test for the person reading CI output.
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info && info->result()->Failed()) {
    for (uint32_t s = 0; s < 64; ++s) {
      std::string log = read_file(dir_.path() + "/reducer-" + std::to_string(s) + ".log");
      if (log.empty()) break;
      std::cerr << "---- reducer " << s << " log ----\n"
                << log.substr(log.size() > 4000 ? log.size() - 4000 : 0);
    }
  }
}

std::string TestCluster::reducer_log(uint32_t shard) const {
  // The first incarnation's log, then each restart's (LocalPool::restart).
  const std::string first = dir_.path() + "/reducer-" + std::to_string(shard) + ".log";
  std::string log = read_file(first);
  for (int n = 1; access((first + "." + std::to_string(n)).c_str(), F_OK) == 0; ++n) {
    log += read_file(first + "." + std::to_string(n));
  }
  return log;
}

std::map<std::string, std::string> TestCluster::worker_env(const std::string& job, uint32_t rank,
                                                           uint32_t world) const {
  return {{"TALLY_POOL", pool_string()},
          {"TALLY_JOB", job},
          {"TALLY_RANK", std::to_string(rank)},
          {"TALLY_WORLD_SIZE", std::to_string(world)},
          {"TALLY_GROUPS", std::to_string(groups_)},
          {"TALLY_CHUNK_BYTES", "1024"},
          {"TALLY_OP_TIMEOUT_MS", "20000"},
          {"TALLY_CONNECT_TIMEOUT_MS", "10000"},
          {"TALLY_TRANSPORT", transport_}};
}

std::string transport_unavailable(const std::string& transport) {
  if (transport != "fabric") return "";
  // fi_getinfo once per test process: it takes a good part of a second.
  static const std::string why = [] {
    auto fabric = Fabric::open(FabricOptions{});
    return fabric ? std::string() : "fabric transport unavailable: " + fabric.status().to_string();
  }();
  return why;
}

bench::Process TestCluster::spawn_worker(const std::string& name,
                                         const std::vector<std::string>& args,
                                         const std::map<std::string, std::string>& env) {
  return spawn_logged(TALLY_TEST_WORKER_PATH, dir_.path(), name, args, env);
}

bench::Process spawn_logged(const std::string& path, const std::string& dir,
                            const std::string& name, const std::vector<std::string>& args,
                            const std::map<std::string, std::string>& env) {
  bench::ProcessSpec spec;
  spec.path = path;
  spec.args = args;
  spec.env = env;
  spec.stdout_path = dir + "/" + name + ".out";
  spec.stderr_path = dir + "/" + name + ".err";
  auto p = bench::Process::spawn(spec);
  if (!p) {
    ADD_FAILURE() << p.status().to_string();
    std::abort();
  }
  return std::move(*p);
}

std::string Child::out() const { return read_file(dir + "/" + name + ".out"); }

std::string Child::err() const { return read_file(dir + "/" + name + ".err"); }

std::optional<int> Child::wait(std::chrono::milliseconds timeout, std::string* output) {
  auto st = process->wait_for(timeout);
  if (!st) process->terminate(std::chrono::milliseconds(100));
  if (output) *output = out() + err();
  return st;
}

Child spawn_child(const std::string& dir, const std::string& name, const std::string& path,
                  const Args& args, const Env& env) {
  Child c{name, dir, std::nullopt};
  c.process.emplace(spawn_logged(path, dir, name, args, env));
  return c;
}

WorkerOutput run_one(TestCluster& cluster, const std::map<std::string, std::string>& env,
                     std::chrono::milliseconds timeout) {
  WorkerGroup one(
      cluster, "solo", unique_job("solo"), 1,
      [](uint32_t) {
        return Args{"--count", "10"};
      },
      env);
  return one.wait(0, timeout);
}

std::string TestCluster::worker_stdout(const std::string& name) const {
  return read_file(dir_.path() + "/" + name + ".out");
}

std::string WorkerGroup::stderr_of(uint32_t rank) const {
  return read_file(cluster_.dir() + "/" + name(rank) + ".err");
}

WorkerGroup::WorkerGroup(TestCluster& cluster, const std::string& prefix, const std::string& job,
                         uint32_t world, const std::function<Args(uint32_t)>& args_for,
                         const std::map<std::string, std::string>& env)
    : cluster_(cluster), prefix_(prefix) {
  for (uint32_t r = 0; r < world; ++r) {
    auto full_env = cluster.worker_env(job, r, world);
    for (auto& [k, v] : env) full_env[k] = v;
    procs_.push_back(cluster.spawn_worker(name(r), args_for(r), full_env));
  }
}

WorkerOutput WorkerGroup::wait(uint32_t rank, std::chrono::milliseconds timeout) {
  return wait_worker(procs_.at(rank), cluster_, name(rank), timeout);
}

WorkerOutput wait_worker(bench::Process& p, const TestCluster& cluster, const std::string& name,
                         std::chrono::milliseconds timeout) {
  WorkerOutput out;
  auto st = p.wait_for(timeout);
  if (!st) {
    p.terminate(std::chrono::milliseconds(100));
    out.exit_code = -1;
  } else {
    out.exit_code = *st;
  }
  out.out = cluster.worker_stdout(name) + read_file(cluster.dir() + "/" + name + ".err");
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

std::string transport_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param == "fabric" ? "Fabric" : "Tcp";
}

std::string unique_job(const std::string& hint) {
  static std::atomic<int> n{0};
  return hint + "-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

std::map<int, std::string> hashes_of(const std::string& worker_out) {
  std::map<int, std::string> hashes;
  std::istringstream in(worker_out);
  std::string line;
  while (std::getline(in, line)) {
    int op = 0;
    char hash[32] = {};
    if (std::sscanf(line.c_str(), "op %d ok hash %31s", &op, hash) == 2) hashes[op] = hash;
  }
  return hashes;
}

BenchRun run_bench(const std::string& dir, const Args& args, std::chrono::milliseconds timeout) {
  bench::ProcessSpec spec;
  spec.path = TALLY_BENCH_PATH;
  spec.args = args;
  spec.env = {{"TALLY_REDUCER", TALLY_REDUCER_PATH}};
  spec.stdout_path = dir + "/stdout";
  spec.stderr_path = dir + "/stderr";
  auto p = bench::Process::spawn(spec);
  EXPECT_TRUE(p) << p.status().to_string();
  BenchRun run;
  if (p) run.status = p->wait_for(timeout);
  run.out = read_file(dir + "/stdout");
  run.err = read_file(dir + "/stderr");
  return run;
}

void expect_allreduce_works(TestCluster& cluster, uint32_t workers, const std::string& tag,
                            const std::map<std::string, std::string>& env) {
  WorkerGroup group(
      cluster, tag, unique_job(tag), workers,
      [](uint32_t) {
        return Args{"--count", "1009", "--ops", "3"};
      },
      env);
  for (uint32_t r = 0; r < workers; ++r) {
    auto out = group.wait(r, std::chrono::seconds(30));
    EXPECT_EQ(out.exit_code, 0) << tag << " rank " << r << ":\n" << out.out;
  }
}

std::vector<TrafficRow> traffic_rows(const std::string& bench_output) {
  std::vector<TrafficRow> rows;
  std::istringstream in(bench_output);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    TrafficRow r;
    std::string bar;
    double* m = r.measured;
    double* f = r.formula;
    if (!(fields >> r.size >> r.shard >> r.group >> r.workers >> m[0] >> m[1] >> m[2] >> m[3] >>
          bar >> f[0] >> f[1] >> f[2]) ||
        bar != "|") {
      continue;
    }
    r.line = line;
    rows.push_back(std::move(r));
  }
  return rows;
}

void expect_peak_rss_within_overhead(TestCluster& cluster, uint32_t index, uint32_t streams,
                                     uint64_t budget) {
  const auto peak = bench::process_peak_rss_bytes(cluster.reducer(index).pid());
  ASSERT_TRUE(peak.has_value());
  const uint64_t bound =
      budget + kReducerBaseOverheadBytes + uint64_t{streams} * kStreamOverheadBytes;
  std::printf("reducer %u: peak rss %.1f MiB (bound %.1f MiB)\n", index, *peak / 1048576.0,
              bound / 1048576.0);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  EXPECT_LE(*peak, bound) << "reducer " << index << " peak rss";
#endif
}

}  // namespace tally::testing
