// tally-bench end to end: a sweep on a local pool (the table and --json),
// a 2 x 3 pool whose per-reducer bytes must match the formula, and driver
// mode against a pool that is already running; worker mode's --chunk-bytes.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

TEST(Bench, SweepPrintsTheTableWithNoWrongResults) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  bench::ProcessSpec spec;
  spec.path = TALLY_BENCH_PATH;
  spec.args = {"-W",  "3",      "-r",
               "2",   "-b",     "4K",
               "-e",  "256K",   "-f",
               "4",   "-w",     "1",
               "-n",  "2",      "--chunk-bytes",
               "64K", "--json", dir + "/out.json"};
  spec.env = {{"TALLY_REDUCER", TALLY_REDUCER_PATH}};
  spec.stdout_path = dir + "/stdout";
  spec.stderr_path = dir + "/stderr";
  auto p = bench::Process::spawn(spec);
  ASSERT_TRUE(p) << p.status().to_string();
  auto st = p->wait_for(60s);
  const std::string out = read_file(dir + "/stdout");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(*st, 0) << out << read_file(dir + "/stderr");
  EXPECT_TRUE(contains(out, "transport=tcp W=3 S=2 G=1 chunk=64KiB")) << out;
  EXPECT_TRUE(contains(out, "algbw(GB/s)")) << out;
  EXPECT_TRUE(contains(out, "# Out of bounds values : 0 OK")) << out;
  for (const char* size : {"4096", "16384", "65536", "262144"}) {
    EXPECT_TRUE(contains(out, std::string("  ") + size + " ")) << out;
  }
  const std::string json = read_file(dir + "/out.json");
  EXPECT_TRUE(contains(json, "\"size\": 262144")) << json;
  EXPECT_TRUE(contains(json, "\"wrong\": 0")) << json;
  EXPECT_FALSE(contains(json, "\"wrong\": 1")) << json;
}

// A local pool of 2 shards x 3 groups: the table is correct and each
// reducer's bytes per op match the formula (within the few bytes the
// barrier ops add).
TEST(Bench, GroupSweepReportsBytesPerReducer) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  bench::ProcessSpec spec;
  spec.path = TALLY_BENCH_PATH;
  spec.args = {"-W",   "6",  "-r", "2",  "-G", "3",  "-b", "64K",           "-e",
               "256K", "-f", "4",  "-w", "1",  "-n", "4",  "--chunk-bytes", "16K"};
  spec.env = {{"TALLY_REDUCER", TALLY_REDUCER_PATH}};
  spec.stdout_path = dir + "/stdout";
  spec.stderr_path = dir + "/stderr";
  auto p = bench::Process::spawn(spec);
  ASSERT_TRUE(p) << p.status().to_string();
  auto st = p->wait_for(90s);
  const std::string out = read_file(dir + "/stdout");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(*st, 0) << out << read_file(dir + "/stderr");
  EXPECT_TRUE(contains(out, "transport=tcp W=6 S=2 G=3 chunk=16KiB")) << out;
  EXPECT_TRUE(contains(out, "# Out of bounds values : 0 OK")) << out;
  // One row per size and reducer.
  const auto rows = traffic_rows(out);
  for (const TrafficRow& r : rows) {
    EXPECT_EQ(r.workers, 2u) << r.line;
    EXPECT_NEAR(r.measured[0], r.formula[0], 64) << r.line;
    EXPECT_NEAR(r.measured[1], r.formula[0], 64) << r.line;
    EXPECT_NEAR(r.measured[2], r.formula[1], 64) << r.line;
    EXPECT_NEAR(r.measured[3], r.formula[2], 64) << r.line;
    EXPECT_GT(r.formula[1], 0) << r.line;
  }
  EXPECT_EQ(rows.size(), 2u * 6u) << out;
}

// Driver mode against a pool that is already running (--pool), as on a
// cluster; the bench starts no reducers of its own.
TEST(Bench, RunsAgainstAGivenPool) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  bench::ProcessSpec run;
  run.path = TALLY_BENCH_PATH;
  run.args = {"--pool",
              cluster.pool_string(),
              "-W",
              "2",
              "-b",
              "1K",
              "-e",
              "16K",
              "-f",
              "2",
              "-w",
              "1",
              "-n",
              "2",
              "--chunk-bytes",
              "4K",
              "-d",
              "int64",
              "-o",
              "avg"};
  run.env = {{"TALLY_REDUCER", "/nonexistent"}};  // proves no local pool is started
  run.stdout_path = cluster.dir() + "/bench.out";
  run.stderr_path = cluster.dir() + "/bench.err";
  auto p = bench::Process::spawn(run);
  ASSERT_TRUE(p) << p.status().to_string();
  auto st = p->wait_for(60s);
  const std::string out = read_file(cluster.dir() + "/bench.out");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(*st, 0) << out << read_file(cluster.dir() + "/bench.err");
  EXPECT_TRUE(contains(out, "W=2 S=2 G=1 chunk=4KiB")) << out;
  EXPECT_TRUE(contains(out, "int64    avg")) << out;
  EXPECT_TRUE(contains(out, "# Out of bounds values : 0 OK")) << out;
  EXPECT_TRUE(contains(cluster.reducer_log(0), "joined")) << cluster.reducer_log(0);
}

// Worker mode (one rank, configured by TALLY_*): --chunk-bytes overrides
// TALLY_CHUNK_BYTES (it used to be ignored), and with neither the
// automatic plan is used.
TEST(Bench, WorkerModeTakesChunkBytes) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  struct Run {
    std::vector<std::string> extra;
    std::map<std::string, std::string> env;
    std::string header;
  };
  const std::vector<Run> runs = {
      {{"--chunk-bytes", "2K"}, {{"TALLY_CHUNK_BYTES", "4096"}}, "chunk=2KiB"},
      {{}, {{"TALLY_CHUNK_BYTES", "4096"}}, "chunk=4KiB"},
      {{}, {}, "chunk=auto"},
  };
  int n = 0;
  for (const Run& r : runs) {
    SCOPED_TRACE(r.header);
    bench::ProcessSpec run;
    run.path = TALLY_BENCH_PATH;
    run.args = {"--worker", "-b", "1K", "-e", "8K", "-w", "1", "-n", "2"};
    run.args.insert(run.args.end(), r.extra.begin(), r.extra.end());
    run.env = r.env;
    run.env["TALLY_POOL"] = cluster.pool_string();
    run.env["TALLY_JOB"] = unique_job("bench-worker");
    run.env["TALLY_RANK"] = "0";
    run.env["TALLY_WORLD_SIZE"] = "1";
    const std::string base = cluster.dir() + "/worker" + std::to_string(n++);
    run.stdout_path = base + ".out";
    run.stderr_path = base + ".err";
    auto p = bench::Process::spawn(run);
    ASSERT_TRUE(p) << p.status().to_string();
    auto st = p->wait_for(60s);
    const std::string out = read_file(base + ".out");
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(*st, 0) << out << read_file(base + ".err");
    EXPECT_TRUE(contains(out, "W=1 S=2 G=1 " + r.header)) << out;
  }
}

}  // namespace
}  // namespace tally::testing
