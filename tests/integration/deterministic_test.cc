// Reproducible sums (TALLY_DETERMINISTIC, docs/architecture.md
// "Determinism"): the same inputs give the same bits whatever the timing
// (a rank held back, a reducer killed and restarted mid-op), the number of
// shards and the transport; and a job that cannot have them is refused at
// connect, saying why.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "harness.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kWorld = 4;
constexpr int kOps = 8;
// Order-sensitive inputs (float sums of fractions): one tensor of many
// chunks (the test pool's are 4 KiB) and one of a single short chunk.
const Args kWork{"--counts", "9001,1009", "--ops", std::to_string(kOps), "--pattern", "noisy"};
// The same in bfloat16 (always noisy): each rank's payload is widened, the
// tree sums float32, and the root is rounded once.
const Args kWork16{"--counts", "9001,1009", "--ops", std::to_string(kOps), "--dtype", "bfloat16"};

// Runs one deterministic job of kWorld ranks doing `work` on `cluster`;
// rank 0 gets `rank0` after it, and `meanwhile` runs once the job has
// started. Returns the results' hashes, checked the same on every rank.
std::map<int, std::string> run_job(TestCluster& cluster, const std::string& tag,
                                   const Args& rank0 = {},
                                   const std::function<void(WorkerGroup&)>& meanwhile = {},
                                   const Args& work = kWork) {
  WorkerGroup workers(cluster, tag, unique_job(tag), kWorld,
                      [&](uint32_t r) {
                        Args args = work;
                        if (r == 0) args.insert(args.end(), rank0.begin(), rank0.end());
                        return args;
                      },
                      {{"TALLY_DETERMINISTIC", "1"}});
  if (meanwhile) meanwhile(workers);
  std::map<int, std::string> reference;
  for (uint32_t r = 0; r < kWorld; ++r) {
    WorkerOutput out = workers.wait(r, 90s);
    EXPECT_EQ(out.exit_code, 0) << tag << " rank " << r << ":\n" << out.out;
    auto hashes = hashes_of(out.out);
    EXPECT_EQ(hashes.size(), static_cast<size_t>(kOps)) << tag << ":\n" << out.out;
    if (r == 0) reference = hashes;
    EXPECT_EQ(hashes, reference) << tag << " rank " << r;
  }
  return reference;
}

PoolSpec shape(uint32_t shards, uint32_t groups = 1, const std::string& transport = "tcp") {
  PoolSpec spec;
  spec.shards = shards;
  spec.groups = groups;
  spec.transport = transport;
  return spec;
}

// Kills reducer `index` once every rank has printed op 4's result (rank 0,
// told to stall before op 5, is then held back while the others have sent
// op 5), and starts it again at its address.
std::function<void(WorkerGroup&)> restart_during_op_5(TestCluster& cluster, uint32_t index) {
  return [&cluster, index](WorkerGroup& workers) {
    ASSERT_TRUE(eventually(
        [&] {
          for (uint32_t r = 0; r < kWorld; ++r) {
            if (!contains(workers.stdout_of(r), "op 4 ok hash")) return false;
          }
          return true;
        },
        60s));
    cluster.kill_reducer(index, SIGKILL);
    ASSERT_TRUE(cluster.restart_reducer(index).is_ok());
  };
}

const Args kStallBeforeOp5{"--stall-op", "5", "--stall-ms", "1500"};

TEST(Deterministic, TheSameBitsUnderOtherTimingRestartsAndOtherPoolShapes) {
  std::map<int, std::string> base, base16;
  {
    TestCluster cluster(shape(1));
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    base = run_job(cluster, "plain");
    base16 = run_job(cluster, "plain16", {}, {}, kWork16);
    // Rank 0 is held back before op 3: its contributions come last.
    EXPECT_EQ(run_job(cluster, "late", {"--stall-op", "3", "--stall-ms", "300"}), base);
    // The reducer is killed while rank 0 is held back before op 5 and the
    // others have sent theirs, and restarted: every rank sends op 5 again.
    EXPECT_EQ(run_job(cluster, "restart", kStallBeforeOp5, restart_during_op_5(cluster, 0)), base);
    // The ranks that had sent op 5 went on with it on the restarted reducer.
    EXPECT_TRUE(contains(cluster.reducer_log(0), "' resumed from")) << cluster.reducer_log(0);
  }
  {
    TestCluster two(shape(2));
    ASSERT_TRUE(two.ok()) << two.error();
    EXPECT_EQ(run_job(two, "two-shards"), base);
    EXPECT_EQ(run_job(two, "two-shards16", {}, {}, kWork16), base16);
  }
  // Two replica groups of two ranks: each sums its half of the tree and the
  // replicas add the halves; then a replica is killed and restarted mid-op
  // (the shard starts the op again on both groups).
  {
    TestCluster groups(shape(1, 2));
    ASSERT_TRUE(groups.ok()) << groups.error();
    EXPECT_EQ(run_job(groups, "two-groups"), base);
    EXPECT_EQ(run_job(groups, "two-groups16", {}, {}, kWork16), base16);
    EXPECT_EQ(run_job(groups, "replica-restart", kStallBeforeOp5, restart_during_op_5(groups, 1)),
              base);
  }
  // Three groups of 2, 1 and 1 ranks, over two shards.
  TestCluster three(shape(2, 3));
  ASSERT_TRUE(three.ok()) << three.error();
  EXPECT_EQ(run_job(three, "three-groups"), base);
}

// The same inputs over the libfabric data path and three shards.
TEST(Deterministic, TheSameBitsOverFabricAndThreeShards) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  std::map<int, std::string> base;
  {
    TestCluster cluster(shape(1));
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    base = run_job(cluster, "tcp");
  }
  TestCluster fabric(shape(3, 1, "fabric"));
  ASSERT_TRUE(fabric.ok()) << fabric.error();
  EXPECT_EQ(run_job(fabric, "fabric"), base);
}

// A rank that does not ask for reproducible sums is refused by a job whose
// first rank did (and the job runs on with its own), naming the setting.
TEST(Deterministic, ARankThatDisagreesIsRefusedAtConnect) {
  TestCluster cluster(shape(1));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("disagree");
  auto env = [&](uint32_t rank, const std::string& deterministic) {
    auto e = cluster.worker_env(job, rank, 2);
    e["TALLY_DETERMINISTIC"] = deterministic;
    return e;
  };
  const Args args{"--count", "1009"};
  bench::Process rank0 = cluster.spawn_worker("d0", args, env(0, "on"));
  ASSERT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "rank 0/2 of job"); }, 20s))
      << cluster.reducer_log(0);
  bench::Process rank1 = cluster.spawn_worker("d1", args, env(1, "off"));
  auto out1 = wait_worker(rank1, cluster, "d1", 30s);
  EXPECT_EQ(out1.exit_code, 2) << out1.out;
  EXPECT_TRUE(
      contains(out1.out, "does not ask for reproducible sums, and the ranks before it asks"))
      << out1.out;
  EXPECT_TRUE(contains(out1.out, "TALLY_DETERMINISTIC")) << out1.out;
  // Rank 0 still waits for a rank 1 that agrees.
  bench::Process again = cluster.spawn_worker("d1b", args, env(1, "1"));
  EXPECT_EQ(wait_worker(again, cluster, "d1b", 30s).exit_code, 0);
  EXPECT_EQ(wait_worker(rank0, cluster, "d0", 30s).exit_code, 0);
}

// With replica groups the replicas add the groups' parts of the tree by the
// ranks each holds, which only the default groups tell them: a job whose
// groups come from TALLY_GROUP is refused at connect, saying so.
TEST(Deterministic, ExplicitGroupsAreRefusedAtConnect) {
  TestCluster cluster(shape(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto env = cluster.worker_env(unique_job("explicit"), 0, 2);
  env["TALLY_DETERMINISTIC"] = "1";
  env["TALLY_GROUP"] = "0";
  env["TALLY_GROUP_SIZES"] = "1,1";
  bench::Process rank0 = cluster.spawn_worker("e0", {"--count", "10"}, env);
  WorkerOutput out = wait_worker(rank0, cluster, "e0", 30s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "need the default groups")) << out.out;
}

}  // namespace
}  // namespace tally::testing
