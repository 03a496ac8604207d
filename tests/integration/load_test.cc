// tally-bench load and chaos end to end: jobs on a local pool for a bounded
// time with every op checked, then with reducers and workers killed and
// restarted: ops fail cleanly (the in-flight op of each round), none is
// wrong, and the reducers' memory and descriptors are reported.
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <sstream>
#include <string>

#include "harness.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

// The row under the "#   completed ..." header.
struct LoadRow {
  uint64_t completed = 0, failed = 0, split = 0, wrong = 0;
  double ops_per_s = 0;
  bool found = false;
};

LoadRow load_row(const std::string& out) {
  LoadRow row;
  std::istringstream in(out);
  std::string line;
  bool next = false;
  while (std::getline(in, line)) {
    if (next) {
      std::istringstream f(line);
      std::string p50, p99, max;
      row.found = static_cast<bool>(f >> row.completed >> row.ops_per_s >> p50 >> p99 >> max >>
                                    row.failed >> row.split >> row.wrong);
      break;
    }
    next = line.rfind("#   completed", 0) == 0;
  }
  return row;
}

uint64_t kills(const std::string& out) {
  std::smatch m;
  static const std::regex line(R"(# chaos: .* every [0-9.]+ s: ([0-9]+) kills)");
  return std::regex_search(out, m, line) ? std::stoull(m[1]) : 0;
}

TEST(BenchLoad, JobsRunForTheirTimeWithEveryOpCheckedAndReducerResourcesReported) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const BenchRun run =
      run_bench(tmp.path(), {"load", "-J", "2", "-W", "2", "-T", "2", "-b", "16K"}, 60s);
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << run.out << run.err;
  const LoadRow row = load_row(run.out);
  ASSERT_TRUE(row.found) << run.out;
  EXPECT_GT(row.completed, 0u) << run.out;
  EXPECT_EQ(row.failed, 0u) << run.out;
  EXPECT_EQ(row.split, 0u) << run.out;
  EXPECT_EQ(row.wrong, 0u) << run.out;
  EXPECT_NE(run.out.find("failures by kind (rank-ops): none"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("# reducer 1 (127.0.0.1:"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("open fds"), std::string::npos) << run.out;
}

// A reducer is SIGKILLed and restarted at its address every second: the
// workers resume (docs/protocol.md, "Resuming"), so every op completes,
// none is split between ranks, and none has a wrong result.
TEST(BenchChaos, KilledReducersAreResumedAndNoResultIsWrong) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const BenchRun run =
      run_bench(tmp.path(), {"chaos", "-W", "3", "-T", "5", "-K", "1", "-b", "64K"}, 120s);
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << run.out << run.err;
  const LoadRow row = load_row(run.out);
  ASSERT_TRUE(row.found) << run.out;
  EXPECT_GE(kills(run.out), 3u) << run.out;
  EXPECT_GT(row.completed, 0u) << run.out;
  EXPECT_EQ(row.failed, 0u) << run.out;
  EXPECT_EQ(row.split, 0u) << run.out;
  EXPECT_EQ(row.wrong, 0u) << run.out;
  EXPECT_NE(run.out.find("rounds 1 "), std::string::npos) << run.out;  // never started again
  EXPECT_NE(run.out.find("restarted"), std::string::npos) << run.out;
}

// The same with a worker killed: its job's other ranks fail naming it.
TEST(BenchChaos, KilledWorkersFailTheirJobCleanlyAndNoResultIsWrong) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const BenchRun run =
      run_bench(tmp.path(),
                {"chaos", "--kill", "worker", "-W", "3", "-T", "4", "-K", "1", "-b", "64K"}, 120s);
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << run.out << run.err;
  const LoadRow row = load_row(run.out);
  ASSERT_TRUE(row.found) << run.out;
  EXPECT_GE(kills(run.out), 2u) << run.out;
  EXPECT_GT(row.completed, 0u) << run.out;
  EXPECT_GT(row.failed, 0u) << run.out;
  EXPECT_EQ(row.wrong, 0u) << run.out;
  EXPECT_NE(run.out.find("was lost"), std::string::npos) << run.out;
}

// Beside a job whose reducers are killed: a job whose rank 0 says after
// every op that every rank has the results below 2^40 (each reducer bounds
// that by what it knows, so the job's ops complete exactly), and 32 slow
// HTTP clients dripping requests to every reducer (the /healthz probes are
// still answered).
TEST(BenchChaos, ALyingRankAndSlowHttpClientsDisturbNeitherTheJobsNorTheProbes) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const BenchRun run = run_bench(tmp.path(),
                                 {"chaos", "-W", "2", "-S", "1", "-G", "2", "-T", "5", "-K", "2",
                                  "-b", "64K", "--liar", "--slow-http", "32"},
                                 120s);
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << run.out << run.err;
  const LoadRow row = load_row(run.out);
  ASSERT_TRUE(row.found) << run.out;
  EXPECT_GT(row.completed, 0u) << run.out;
  EXPECT_EQ(row.failed, 0u) << run.out;
  EXPECT_EQ(row.wrong, 0u) << run.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      run.out, m,
      std::regex(R"(# liar: .*groups 0 and 1\), ([0-9]+) ops exact, .*; ([0-9]+) wrong)")))
      << run.out;
  EXPECT_GT(std::stoull(m[1]), 0u) << run.out;
  EXPECT_EQ(std::stoull(m[2]), 0u) << run.out;
  ASSERT_TRUE(std::regex_search(run.out, m, std::regex(R"(# probes: ([0-9]+) of /healthz)")))
      << run.out;
  EXPECT_GT(std::stoull(m[1]), 0u) << run.out;
  EXPECT_NE(run.out.find("# slow HTTP clients: 32 dripping"), std::string::npos) << run.out;
}

}  // namespace
}  // namespace tally::testing
