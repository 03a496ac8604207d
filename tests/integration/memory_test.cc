// Memory quotas through real processes: back-pressure under a tiny quota
// (over both transports, and with replica groups) still gives exact sums;
// an exhausted budget refuses a new job clearly.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "harness.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

class TransportMemory : public ::testing::TestWithParam<std::string> {};

// A window of one chunk gives each job three buffers: eight workers with
// many chunks keep running out of them, so streams pause and resume all the
// time. Every sum must still be exact (no data dropped, no deadlock).
TEST_P(TransportMemory, TinyQuotaBackPressureStillGivesExactSums) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  PoolSpec spec;
  spec.shards = 2;
  spec.transport = GetParam();
  spec.reducer_args = {"--max-chunk-bytes", "4096", "--memory-budget", "12KiB", "--window", "1",
                       "--io-threads",      "2",    "--log-level",     "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("tiny"), 8,
                      [](uint32_t) {
                        return Args{"--count", "40000", "--ops", "3"};
                      },
                      {{"TALLY_CHUNK_BYTES", "4096"}});
  for (uint32_t r = 0; r < 8; ++r) {
    auto out = workers.wait(r, 60s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
  }
}

INSTANTIATE_TEST_SUITE_P(Memory, TransportMemory, ::testing::Values("tcp", "fabric"),
                         transport_name);
// The same with three groups: partials from the other replicas compete for
// the same few buffers (window 1: 1 x (1 + 2 x 3) + 2 = 9 per job), and the
// replicas' streams pause and resume too. Still exact, still no deadlock.
TEST(Memory, TinyQuotaBackPressureWithGroups) {
  PoolSpec spec;
  spec.shards = 2;
  spec.groups = 3;
  spec.reducer_args = {"--max-chunk-bytes", "4096", "--memory-budget", "36KiB", "--window", "1",
                       "--io-threads",      "2",    "--log-level",     "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("tiny-groups"), 7,
                      [](uint32_t) {
                        return Args{"--count", "40000", "--ops", "3"};
                      },
                      {{"TALLY_CHUNK_BYTES", "4096"}});
  for (uint32_t r = 0; r < 7; ++r) {
    auto out = workers.wait(r, 60s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
  }
}

// The budget holds one job's buffers: a second job is refused at connect
// with a clear error, and the first keeps working.
TEST(Memory, ExhaustedBudgetRefusesANewJobClearly) {
  PoolSpec spec;
  spec.reducer_args = {"--max-chunk-bytes", "4096", "--memory-budget", "24KiB",
                       "--window",          "4",    "--log-level",     "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string first_job = unique_job("first");
  auto first = cluster.spawn_worker("a", {"--count", "1009", "--ops", "2", "--stall-ms", "1500"},
                                    cluster.worker_env(first_job, 0, 1));
  ASSERT_TRUE(eventually([&] { return contains(cluster.worker_stdout("a"), "op 0 ok"); }, 10s));
  auto second =
      cluster.spawn_worker("b", {"--count", "10"}, cluster.worker_env(unique_job("second"), 0, 1));
  auto out = wait_worker(second, cluster, "b", 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "resource_exhausted")) << out.out;
  EXPECT_TRUE(contains(out.out, "memory budget")) << out.out;
  auto first_out = wait_worker(first, cluster, "a", 10s);
  EXPECT_EQ(first_out.exit_code, 0) << first_out.out;
}

}  // namespace
}  // namespace tally::testing
