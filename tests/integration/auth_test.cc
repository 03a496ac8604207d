// Authenticated jobs and replica links (HMAC-SHA256 challenge-response with
// a shared secret): real reducers, real workers, and raw strangers on
// loopback. Strangers who join jobs and who impersonate replicas are tried
// here and shown refused.
#include "tally/protocol/auth.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "raw_peer.h"
#include "tally.pb.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

constexpr const char* kSecret = "3f7c1e0a9b2d4c6e8f0a1b2c3d4e5f60";
constexpr const char* kOtherSecret = "0000111122223333444455556666777788";

std::string write_secret(const TempDir& dir, const std::string& name, const std::string& secret) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path) << secret << "\n";
  chmod(path.c_str(), 0600);  // a secret file others may read is refused
  return path;
}

struct AuthPool {
  TempDir dir;
  std::string secret_file;
  std::unique_ptr<TestCluster> cluster;

  explicit AuthPool(PoolSpec spec, bool require = true, const std::string& secret = kSecret) {
    secret_file = write_secret(dir, "job.secret", secret);
    spec.reducer_args.insert(spec.reducer_args.end(), {"--job-secret-file", secret_file});
    if (require) spec.reducer_args.push_back("--require-auth");
    cluster = std::make_unique<TestCluster>(spec);
  }
  // Rank `rank`'s environment, with the job secret.
  std::map<std::string, std::string> worker_env(const std::string& job, uint32_t rank,
                                                uint32_t world) const {
    auto env = cluster->worker_env(job, rank, world);
    env["TALLY_JOB_SECRET_FILE"] = secret_file;
    return env;
  }
};

TEST(Auth, WorkersWithTheSecretRunAndTheReducerProvesItToo) {
  PoolSpec spec;
  spec.shards = 2;
  AuthPool pool(spec);
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  expect_allreduce_works(*pool.cluster, 3, "auth-ok",
                         {{"TALLY_JOB_SECRET_FILE", pool.secret_file}});
  expect_allreduce_works(*pool.cluster, 2, "auth-env", {{"TALLY_JOB_SECRET", kSecret}});
  // The secret is never logged.
  EXPECT_FALSE(contains(pool.cluster->reducer_log(0), kSecret));
}

TEST(Auth, AWrongSecretIsRefusedNamingTheCause) {
  AuthPool pool(PoolSpec{});
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  auto out = run_one(*pool.cluster, {{"TALLY_JOB_SECRET", kOtherSecret}}, 20s);
  EXPECT_EQ(out.exit_code, 2) << out.out;  // connect failed
  EXPECT_TRUE(contains(out.out, "unauthenticated")) << out.out;
  EXPECT_TRUE(contains(out.out, "its job secret is not this reducer's")) << out.out;
  EXPECT_FALSE(contains(out.out, kOtherSecret)) << out.out;
  EXPECT_FALSE(contains(pool.cluster->reducer_log(0), kOtherSecret));
  EXPECT_FALSE(contains(pool.cluster->reducer_log(0), kSecret));
}

// What `tally-reducer --print-job-secret JOB` prints under the master in `file`.
std::string printed_job_secret(const std::string& file, const std::string& job) {
  const std::string command =
      std::string(TALLY_REDUCER_PATH) + " --job-secret-file " + file + " --print-job-secret " + job;
  FILE* p = popen(command.c_str(), "r");
  if (!p) return "";
  char line[256] = {};
  const bool read = fgets(line, sizeof line, p) != nullptr;
  const int status = pclose(p);
  if (!read || status != 0) return "";
  std::string s(line);
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

// Per-job secrets: the reducers hold a master, each job only its own
// secret (printed by tally-reducer --print-job-secret). A job's secret lets
// its workers in; it opens no other job, nor does the master itself.
TEST(Auth, PerJobSecretsAdmitEachJobWithItsOwnSecretOnly) {
  PoolSpec spec;
  spec.shards = 2;
  spec.reducer_args = {"--per-job-secrets"};
  AuthPool pool(spec);
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  EXPECT_TRUE(contains(pool.cluster->reducer_log(0), "per-job secrets"));
  const std::string a = printed_job_secret(pool.secret_file, "job-a");
  const std::string b = printed_job_secret(pool.secret_file, "job-b");
  ASSERT_EQ(a.size(), 64u) << a;
  EXPECT_NE(a, b);
  EXPECT_EQ(a, derive_job_secret(Secret(kSecret), "job-a").bytes());
  auto run = [&](const std::string& tag, const std::string& job, uint32_t world,
                 const std::string& secret) {
    WorkerGroup group(*pool.cluster, tag, job, world,
                      [](uint32_t) {
                        return Args{"--count", "1009", "--ops", "3"};
                      },
                      {{"TALLY_JOB_SECRET", secret}});
    std::vector<WorkerOutput> outs;
    for (uint32_t r = 0; r < world; ++r) outs.push_back(group.wait(r, 30s));
    return outs;
  };
  for (const auto& out : run("a", "job-a", 2, a)) EXPECT_EQ(out.exit_code, 0) << out.out;
  for (const std::string& wrong : {a, std::string(kSecret)}) {
    auto outs = run("b-wrong", "job-b", 1, wrong);
    EXPECT_EQ(outs[0].exit_code, 2) << outs[0].out;
    EXPECT_TRUE(contains(outs[0].out, "unauthenticated")) << outs[0].out;
  }
  for (const auto& out : run("b", "job-b", 1, b)) EXPECT_EQ(out.exit_code, 0) << out.out;
  EXPECT_FALSE(contains(pool.cluster->reducer_log(0), a));
}

TEST(Auth, RequireAuthRefusesWorkersWithoutASecret) {
  AuthPool pool(PoolSpec{});
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  auto out = run_one(*pool.cluster, {}, 20s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "serves authenticated jobs only")) << out.out;
}

TEST(Auth, AWorkerWithASecretRefusesAReducerWithout) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto out = run_one(cluster, {{"TALLY_JOB_SECRET", kSecret}}, 20s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "unauthenticated")) << out.out;
  EXPECT_TRUE(contains(out.out, "this reducer has none")) << out.out;
}

// The finding: a stranger who guessed a running job's name took a free rank
// (and got rank 0's input, or poisoned the sum). Now, before it proves the
// secret, it learns nothing about the job (not its world size, not its
// members) and takes no rank; the job runs on untouched.
TEST(Auth, AStrangerLearnsNothingAndTakesNoRank) {
  AuthPool pool(PoolSpec{});
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  const std::string job = unique_job("victim");
  TestCluster& cluster = *pool.cluster;
  auto env_of = [&](uint32_t rank) { return pool.worker_env(job, rank, 2); };
  const Args args{"--count", "1009", "--ops", "3"};
  // Rank 0 joins; rank 1's slot stays free while the stranger tries it.
  bench::Process rank0 = cluster.spawn_worker("v0", args, env_of(0));
  ASSERT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "rank 0/2"); }, 20s))
      << cluster.reducer_log(0);
  for (uint32_t world : {2u, 3u}) {  // the job's world size, and another one
    RawPeer s(cluster.addresses()[0]);
    s.send_control(raw_hello(job, 1, world));
    std::string got;
    EXPECT_TRUE(s.closed_within(5s, &got));
    EXPECT_TRUE(contains(got, "serves authenticated jobs only")) << got;
    EXPECT_FALSE(contains(got, "world size")) << got;
    EXPECT_FALSE(contains(got, "127.0.0.1")) << got;
  }
  bench::Process rank1 = cluster.spawn_worker("v1", args, env_of(1));
  auto out0 = wait_worker(rank0, cluster, "v0", 30s);
  auto out1 = wait_worker(rank1, cluster, "v1", 30s);
  EXPECT_EQ(out0.exit_code, 0) << out0.out;
  EXPECT_EQ(out1.exit_code, 0) << out1.out;
}

// A mixed pool (a job secret, --require-auth off): a stranger who says a
// job's name first, without authenticating, does not keep that job out. The
// authenticated workers' Hello ends the squatter's job, telling it why, and
// their job runs.
TEST(Auth, AnUnauthenticatedSquatterDoesNotKeepAnAuthenticatedJobOut) {
  AuthPool pool(PoolSpec{}, /*require=*/false);
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  TestCluster& cluster = *pool.cluster;
  const std::string job = unique_job("squatted");
  RawPeer squatter(cluster.addresses()[0]);
  squatter.send_control(raw_hello(job, 0, 2));
  ASSERT_TRUE(eventually(
      [&] { return contains(cluster.reducer_log(0), "rank 0/2 of job '" + job + "' joined"); },
      10s))
      << cluster.reducer_log(0);
  auto env_of = [&](uint32_t rank) { return pool.worker_env(job, rank, 2); };
  const Args args{"--count", "1009", "--ops", "3"};
  bench::Process rank0 = cluster.spawn_worker("a0", args, env_of(0));
  bench::Process rank1 = cluster.spawn_worker("a1", args, env_of(1));
  auto out0 = wait_worker(rank0, cluster, "a0", 30s);
  auto out1 = wait_worker(rank1, cluster, "a1", 30s);
  EXPECT_EQ(out0.exit_code, 0) << out0.out;
  EXPECT_EQ(out1.exit_code, 0) << out1.out;
  std::string got;
  EXPECT_TRUE(squatter.closed_within(5s, &got));
  EXPECT_TRUE(contains(got, "gives the name to the authenticated job")) << got;
}

// Replica links authenticate with the pool secret: a pool with one runs,
// and a stranger's ReplicaHello (then a hang-up, or a forged ReplicaError)
// neither marks the real replica lost nor fails a job.
// Strangers that hold every connection slot before authentication (silent
// sockets from one host, and hellos whose challenge is never answered from
// twelve others), reopening each one the reducer cuts, do not keep an
// authenticated job out: a new stream at --max-connections cuts the oldest
// one not yet admitted.
TEST(Auth, StrangersAtTheConnectionCapDoNotKeepAnAuthenticatedJobOut) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--max-connections", "16"});
  AuthPool pool(spec);
  ASSERT_TRUE(pool.cluster->ok()) << pool.cluster->error();
  const std::string address = pool.cluster->addresses()[0];
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread strangers([&] {
    std::vector<std::unique_ptr<RawPeer>> peers(24);
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (!stop && std::chrono::steady_clock::now() < until) {
      for (size_t i = 0; i < peers.size(); ++i) {
        if (peers[i] && !peers[i]->closed_within(1ms)) continue;
        const bool says_hello = i >= 12;
        peers[i] = std::make_unique<RawPeer>(
            address, says_hello ? "127.0.0." + std::to_string(i - 9) : "127.0.0.2");
        if (says_hello) {
          wire::Control hello = raw_hello(unique_job("squat"), 0, 2);
          hello.mutable_hello()->set_auth_nonce(std::string(kAuthNonceBytes, 'n'));
          peers[i]->send_control(hello);
        }
        ++opened;
      }
      std::this_thread::sleep_for(50ms);
    }
  });
  // The strangers hold the cap: they have been cut, and have come back.
  EXPECT_TRUE(eventually([&] { return opened.load() >= 48; }, 20s)) << pool.cluster->reducer_log(0);
  EXPECT_TRUE(contains(pool.cluster->reducer_log(0), "--max-connections limit"))
      << pool.cluster->reducer_log(0);
  expect_allreduce_works(*pool.cluster, 3, "at-the-cap",
                         {{"TALLY_JOB_SECRET_FILE", pool.secret_file}});
  stop = true;
  strangers.join();
}

TEST(Auth, ReplicaImpersonationIsRefused) {
  TempDir dir;
  const std::string pool_secret = write_secret(dir, "pool.secret", kOtherSecret);
  PoolSpec spec;
  spec.groups = 2;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--pool-secret-file", pool_secret});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  expect_allreduce_works(cluster, 4, "replica-auth-before");
  for (int i = 0; i < 2; ++i) {
    RawPeer s(cluster.addresses()[0]);
    s.send_control(raw_replica_hello());
    if (i == 1) {
      wire::Control forged;
      forged.mutable_replica_error()->set_job("any");
      forged.mutable_replica_error()->mutable_error()->set_code(wire::INTERNAL);
      forged.mutable_replica_error()->mutable_error()->set_message("forged by a stranger");
      s.send_control(forged);
    }
    std::string got;
    EXPECT_TRUE(s.closed_within(5s, &got));
    EXPECT_TRUE(contains(got, "does not authenticate")) << got;
  }
  expect_allreduce_works(cluster, 4, "replica-auth-after");
  EXPECT_FALSE(contains(cluster.reducer_log(0), "lost:")) << cluster.reducer_log(0);
  EXPECT_FALSE(contains(cluster.reducer_log(0), "forged by a stranger"));
}

// Without a pool secret a stranger can still say hello as a replica, but
// its hang-up no longer marks the live replica lost (the live link's state
// is its own).
TEST(Auth, AStrangersReplicaStreamDoesNotTakeOverTheLiveLink) {
  PoolSpec spec;
  spec.groups = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  expect_allreduce_works(cluster, 4, "replica-live-before");
  {
    RawPeer s(cluster.addresses()[0]);
    s.send_control(raw_replica_hello());
    // Counted up as a second inbound stream of group 1 (two "from" lines).
    ASSERT_TRUE(eventually(
        [&] {
          const std::string log = cluster.reducer_log(0);
          const std::string what = "inbound stream of replica group 1 from";
          return log.find(what) != log.rfind(what);
        },
        10s))
        << cluster.reducer_log(0);
  }
  // The stranger's stream has ended ("inbound stream of replica group 1
  // (address) closed").
  ASSERT_TRUE(eventually(
      [&] { return contains(cluster.reducer_log(0), "inbound stream of replica group 1 ("); }, 10s))
      << cluster.reducer_log(0);
  expect_allreduce_works(cluster, 4, "replica-live-after");
}

}  // namespace
}  // namespace tally::testing
