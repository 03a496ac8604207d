// tally-bench --netlab end to end (label e2e; root, ip and tc): every
// worker, reducer and peer rank in its own namespace behind a bridge, links
// capped both ways; the table, the per-link drop lines, and nothing left
// behind after a normal exit or a SIGINT in the middle of the sweep.
#include "tally/bench/netlab.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <thread>

#include "harness.h"
#include "tally/bench/table.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

// The namespaces bench `pid` made that still exist.
std::vector<std::string> namespaces_of(pid_t pid) {
  const std::string prefix = "tally-bench-" + std::to_string(pid) + "-";
  std::vector<std::string> left;
  for (const std::string& name : bench::netns_list()) {
    if (name.rfind(prefix, 0) == 0) left.push_back(name);
  }
  return left;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (auto& n : names) s += n + " ";
  return s;
}

TEST(Netlab, BenchRunsInTheLabWithPeersAndRemovesIt) {
  if (std::string why = bench::netlab_refusal(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  bench::ProcessSpec spec;
  spec.path = TALLY_BENCH_PATH;
  spec.args = {"--netlab", "1gbit", "--compare", "gloo,mpi", "-W", "2",  "-r", "2",  "-b",
               "16K",      "-e",    "64K",       "-f",       "4",  "-w", "1",  "-n", "2"};
  spec.env = {{"TALLY_REDUCER", TALLY_REDUCER_PATH}};
  spec.stdout_path = dir + "/stdout";
  spec.stderr_path = dir + "/stderr";
  auto p = bench::Process::spawn(spec);
  ASSERT_TRUE(p) << p.status().to_string();
  auto st = p->wait_for(90s);
  const std::string out = read_file(dir + "/stdout");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(*st, 0) << out << read_file(dir + "/stderr");
  EXPECT_TRUE(contains(out, "transport=tcp W=2 S=2 G=1")) << out;
  // tally's streams are paced to the lab's rate (the workers' TALLY_LINK_RATE).
  EXPECT_TRUE(contains(out, "link-rate=1gbit")) << out;
  const auto tables = bench::parse_tables(out, "tally");
  ASSERT_FALSE(tables.empty()) << out;
  EXPECT_EQ(tables.front().name, "tally");
  EXPECT_EQ(tables.front().rows.size(), 2u) << out;
  // A drop line per host (2 workers, 2 reducers) after each phase that ran.
  for (const char* phase : {"tally transport=tcp", "gloo", "mpi"}) {
    const auto at = out.find(std::string("# links during ") + phase + " ");
    ASSERT_NE(at, std::string::npos) << phase << "\n" << out;
    const std::string block = out.substr(at, out.find("\n#\n", at) - at);
    for (const char* role : {"worker 0", "worker 1", "reducer 0", "reducer 1"}) {
      EXPECT_TRUE(contains(block, role)) << phase << " " << role << "\n" << out;
    }
  }
  EXPECT_TRUE(contains(out, "--netlab 1gbit")) << out;
  EXPECT_FALSE(contains(out, "unavailable")) << out;
  EXPECT_TRUE(namespaces_of(p->pid()).empty()) << joined(namespaces_of(p->pid()));
}

TEST(Netlab, InterruptedBenchRemovesEverything) {
  if (std::string why = bench::netlab_refusal(); !why.empty()) GTEST_SKIP() << why;
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  bench::ProcessSpec spec;
  spec.path = TALLY_BENCH_PATH;
  // A sweep far longer than the test waits: it is stopped in the middle.
  spec.args = {"--netlab", "100mbit", "-W",  "2",  "-r", "2",  "-b",
               "4K",       "-e",      "64M", "-f", "2",  "-n", "20"};
  spec.env = {{"TALLY_REDUCER", TALLY_REDUCER_PATH}};
  spec.stdout_path = dir + "/stdout";
  spec.stderr_path = dir + "/stderr";
  auto p = bench::Process::spawn(spec);
  ASSERT_TRUE(p) << p.status().to_string();
  // Wait (bounded) until the workers print their first row.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (bench::parse_rows(read_file(dir + "/stdout")).empty()) {
    ASSERT_FALSE(p->wait_for(0ms).has_value()) << read_file(dir + "/stderr");
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << read_file(dir + "/stderr");
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(namespaces_of(p->pid()).empty());
  p->signal(SIGINT);
  auto st = p->wait_for(30s);
  ASSERT_TRUE(st.has_value()) << "the bench did not exit after SIGINT";
  EXPECT_EQ(*st, 130) << read_file(dir + "/stderr");
  EXPECT_TRUE(namespaces_of(p->pid()).empty()) << joined(namespaces_of(p->pid()));
}

}  // namespace
}  // namespace tally::testing
