// Failures with replica groups, through real processes: a killed replica
// (over both transports), a restarted replica, a worker lost in one group,
// a group or pool list the pool does not match; and explicit group
// placement. Each fault asserts the error every survivor sees and how long
// it took to see it.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "raw_peer.h"
#include "tally.pb.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

// A pool of 2 shards x 3 groups and 6 workers (groups {0,1}, {2,3}, {4,5}).
// Killing the reducer of shard 1 in group 2 for good fails every worker of
// every group within the deadline: group 2's workers lose their stream to
// it and it does not come back; the other replicas of shard 1 wait for it
// until the op times out, and name it. The op stalls on shard 0 too, whose
// reducers time out at about the same moment naming only the partner they
// wait for: a worker that gets that error first names the lost replica
// from what its shard-1 replica told it (ReplicaLost; protocol.md,
// "Resuming with replica groups").
void killed_replica_fails_every_worker_of_every_group(const std::string& transport) {
  PoolSpec spec;
  spec.transport = transport;
  spec.shards = 2;
  spec.groups = 3;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  // Every reducer's links to the 2 other replicas of its shard are up
  // before the job starts: under the sanitizers, setting up fabric links
  // can take longer than the short op timeout this test uses.
  ASSERT_TRUE(eventually(
      [&] {
        for (uint32_t i = 0; i < 6; ++i) {
          const std::string log = cluster.reducer_log(i);
          size_t links = 0;
          for (auto at = log.find("connected to replica"); at != std::string::npos;
               at = log.find("connected to replica", at + 1)) {
            ++links;
          }
          if (links < 2) return false;
        }
        return true;
      },
      60s))
      << cluster.reducer_log(0);
  // Fabric links connect lazily on their first partial (rxm), which under
  // TSan on 2 cores can take seconds: a longer deadline there.
  const auto op_timeout = transport == "fabric" ? 12000ms : 4000ms;
  WorkerGroup workers(cluster, "w", unique_job("replica-kill"), 6,
                      [](uint32_t) {
                        return Args{"--count", "9477", "--ops", "200000"};
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(0), "op 20 ok"); }, 30s))
      << workers.stdout_of(0);
  // The replica links carry partials on the pool's transport.
  EXPECT_TRUE(contains(cluster.reducer_log(0), "replica link to (shard 0, group 1) at " +
                                                   cluster.addresses()[2] + ": data path " +
                                                   transport))
      << cluster.reducer_log(0);
  const uint32_t victim = 2 * 2 + 1;  // (group 2, shard 1)
  cluster.kill_reducer(victim, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < 6; ++r) {
    auto out = workers.wait(r, 2 * op_timeout);
    const auto took = std::chrono::steady_clock::now() - killed;
    EXPECT_EQ(out.exit_code, 3) << "rank " << r << ":\n" << out.out;
    // Every error names the lost reducer: as "lost reducer" where a worker
    // lost its own stream to it, as "replica ... lost" where a reducer
    // lost it; either first hand, or quoted from the goodbye of a worker
    // that failed because of it (whichever failure reaches a worker first).
    const std::string address = cluster.addresses()[victim];
    EXPECT_TRUE(contains(out.out, "replica (shard 1, group 2) at " + address + " lost") ||
                contains(out.out, "lost reducer " + address + " (shard 1)"))
        << "rank " << r << ":\n"
        << out.out;
    EXPECT_LT(took, 2 * op_timeout) << out.out;
  }
  // The other reducers survive.
  for (uint32_t i = 0; i < 6; ++i) {
    if (i == victim) continue;
    EXPECT_FALSE(cluster.reducer(i).wait_for(0ms).has_value()) << "reducer " << i;
  }
}

TEST(Fault, KilledReplicaFailsEveryWorkerOfEveryGroup) {
  killed_replica_fails_every_worker_of_every_group("tcp");
}

// The same with the replica links (and the workers) on the libfabric data
// path: losing a replica's fabric peer fails every group the same way.
TEST(Fault, KilledReplicaOverFabricFailsEveryWorkerOfEveryGroup) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  killed_replica_fails_every_worker_of_every_group("fabric");
}

// A replica that is killed and started again on its address is redialled
// by the others, and the pool serves a new job across all groups.
TEST(Fault, RestartedReplicaIsReconnected) {
  PoolSpec spec;
  spec.shards = 1;
  spec.groups = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  expect_allreduce_works(cluster, 4, "before-restart");
  cluster.kill_reducer(1, SIGKILL);
  ASSERT_TRUE(eventually(
      [&] {
        return contains(cluster.reducer_log(0), "group 1) at " + cluster.addresses()[1] + " lost");
      },
      10s))
      << cluster.reducer_log(0);
  ASSERT_TRUE(cluster.restart_reducer(1).is_ok());
  // Reducer 0 dials it again; it dials reducer 0.
  ASSERT_TRUE(eventually(
      [&] {
        const std::string log = cluster.reducer_log(0);
        size_t n = 0;
        for (size_t at = log.find("connected to replica"); at != std::string::npos;
             at = log.find("connected to replica", at + 1))
          ++n;
        return n >= 2 &&
               contains(log.substr(log.rfind("lost")), "inbound stream of replica group 1");
      },
      10s))
      << cluster.reducer_log(0);
  expect_allreduce_works(cluster, 4, "after-restart");
}

// A replica restarted while its old streams still look up here (a host
// gone without a FIN) is known by the new incarnation in its ReplicaHello:
// the job starts a new round on both replicas, its workers rejoin, and
// every op completes, with the same bits in both groups. (Here a raw
// stream stands for the new incarnation: this pool has no pool secret.)
TEST(Fault, ANewIncarnationOfAReplicaStartsANewRound) {
  PoolSpec spec;
  spec.groups = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr int kOps = 300;
  WorkerGroup workers(cluster, "w", unique_job("incarnation"), 4, [](uint32_t) {
    return Args{"--count", "1000", "--ops", std::to_string(kOps), "--pattern", "noisy"};
  });
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(0), "op 20 ok"); }, 30s))
      << workers.stdout_of(0);
  RawPeer stranger(cluster.addresses()[0]);
  wire::Control hello = raw_replica_hello();
  hello.mutable_replica_hello()->set_incarnation(0x5eed5eed5eed5eedULL);
  stranger.send_control(hello);
  ASSERT_TRUE(eventually(
      [&] {
        const std::string log = cluster.reducer_log(0);
        return contains(log, "(shard 0, group 1) was restarted") && contains(log, "starts round 1");
      },
      10s))
      << cluster.reducer_log(0);
  std::string last_hash;
  for (uint32_t r = 0; r < 4; ++r) {
    auto out = workers.wait(r, 60s);
    EXPECT_EQ(out.exit_code, 0) << "rank " << r << ":\n" << out.out;
    const std::string last = "op " + std::to_string(kOps - 1) + " ok hash ";
    const size_t at = out.out.find(last);
    ASSERT_NE(at, std::string::npos) << "rank " << r << ":\n" << out.out;
    const std::string hash = out.out.substr(at + last.size(), 16);
    if (r == 0) last_hash = hash;
    EXPECT_EQ(hash, last_hash) << "rank " << r;
  }
  EXPECT_TRUE(contains(cluster.reducer_log(1), "starts round 1")) << cluster.reducer_log(1);
}

// A worker lost in one group fails the op on the workers of the other
// groups too, naming the lost rank (forwarded between replicas).
TEST(Fault, KilledWorkerFailsTheOtherGroups) {
  PoolSpec spec;
  spec.shards = 1;
  spec.groups = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto op_timeout = 4000ms;
  WorkerGroup workers(cluster, "w", unique_job("kill-groups"), 4,
                      [](uint32_t) {
                        return Args{"--count", "9477", "--ops", "200000"};
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(3), "op 20 ok"); }, 30s))
      << workers.stdout_of(3);
  workers.process(1).signal(SIGKILL);  // group 0
  const auto killed = std::chrono::steady_clock::now();
  for (uint32_t r : {0u, 2u, 3u}) {
    auto out = workers.wait(r, 2 * op_timeout);
    EXPECT_EQ(out.exit_code, 3) << out.out;
    EXPECT_TRUE(contains(out.out, "rank 1")) << "rank " << r << ":\n" << out.out;
    EXPECT_LT(std::chrono::steady_clock::now() - killed, 2 * op_timeout) << out.out;
  }
}

TEST(Fault, GroupThePoolDoesNotHaveIsRefusedAtConnect) {
  PoolSpec spec;
  spec.groups = 3;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto env = cluster.worker_env(unique_job("bad-group"), 5, 6);
  env["TALLY_GROUP"] = "3";
  env["TALLY_GROUP_SIZES"] = "2,2,2";
  auto p = cluster.spawn_worker("w5", {"--count", "10"}, env);
  auto out = wait_worker(p, cluster, "w5", 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "rank 5 is in group 3 but the pool has 3 groups (0..2)"))
      << out.out;
}

TEST(Fault, PoolThatDoesNotMatchTheGroupsIsRefused) {
  PoolSpec spec;
  spec.groups = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  {  // Three addresses for two groups.
    auto out = run_one(cluster, {{"TALLY_POOL", cluster.pool_string() + ",127.0.0.1:1"}}, 10s);
    EXPECT_EQ(out.exit_code, 2) << out.out;
    EXPECT_TRUE(contains(out.out, "not a multiple of TALLY_GROUPS=2")) << out.out;
  }
  {  // A worker that does not know the pool has groups takes it for 2 shards.
    auto out = run_one(cluster, {{"TALLY_GROUPS", "1"}}, 10s);
    EXPECT_EQ(out.exit_code, 2) << out.out;
    EXPECT_TRUE(contains(out.out, "serves group 0 of 2")) << out.out;
    EXPECT_TRUE(contains(out.out, "(group, shard) order")) << out.out;
  }
}

// TALLY_GROUP places ranks explicitly (here out of block order, and in
// groups of 1 and 3); sums are exact and the same on every rank.
TEST(Groups, ExplicitGroupsOverrideTheBlocks) {
  PoolSpec spec;
  spec.shards = 2;
  spec.groups = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  for (const auto& [groups, sizes] : std::vector<std::pair<std::vector<int>, std::string>>{
           {{0, 1, 1, 0}, "2,2"}, {{1, 1, 0, 1}, "1,3"}}) {
    const std::string job = unique_job("explicit");
    std::vector<bench::Process> procs;
    for (uint32_t r = 0; r < 4; ++r) {
      auto env = cluster.worker_env(job, r, 4);
      env["TALLY_GROUP"] = std::to_string(groups[r]);
      env["TALLY_GROUP_SIZES"] = sizes;
      procs.push_back(cluster.spawn_worker(job + "-" + std::to_string(r),
                                           {"--counts", "1,257,9477", "--ops", "3"}, env));
    }
    std::string reference;
    for (uint32_t r = 0; r < 4; ++r) {
      auto out = wait_worker(procs[r], cluster, job + "-" + std::to_string(r), 30s);
      EXPECT_EQ(out.exit_code, 0) << out.out;
      EXPECT_TRUE(contains(out.out, "group " + std::to_string(groups[r]) + " ")) << out.out;
      const std::string hashes = out.out.substr(out.out.find("op 0 ok"));
      if (r == 0) reference = hashes;
      EXPECT_EQ(hashes, reference);
    }
  }
}

}  // namespace
}  // namespace tally::testing
