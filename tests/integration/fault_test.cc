// Failures through real processes: a killed worker, a killed reducer, a
// straggler, mismatched contributions, refused joins and connects. Each
// asserts the error the survivors see and how long they took to see it.
// The ones that move data run over both transports (TransportFault; names
// end in /Tcp and /Fabric); the ones about joining stay on TCP. Faults with
// replica groups are in groups_fault_test.cc, hostile bytes on a reducer's
// stream in hostile_input_test.cc, memory quotas in memory_test.cc.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include "harness.h"
#include "raw_peer.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

// tally-test-worker's "error after N ms <status>" line, or "" if none.
std::string error_line(const std::string& out) {
  const auto at = out.find("error after ");
  if (at == std::string::npos) return "";
  return out.substr(at, out.find('\n', at) - at);
}

// The N of that line, or -1.
long long error_ms(const std::string& out) {
  const std::string line = error_line(out);
  return line.empty() ? -1 : std::stoll(line.substr(12));
}

// Fault tests that move data: value-parametrised over the transport.
class TransportFault : public ::testing::TestWithParam<std::string> {
 protected:
  PoolSpec pool(uint32_t shards) const {
    PoolSpec spec;
    spec.shards = shards;
    spec.transport = GetParam();
    return spec;
  }
};

TEST_P(TransportFault, KilledWorkerFailsTheOthersWithinTheDeadline) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto op_timeout = 4000ms;
  WorkerGroup workers(cluster, "w", unique_job("kill"), 3,
                      [](uint32_t) {
                        return Args{"--count", "9477", "--ops", "200000"};
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(1), "op 20 ok"); }, 30s))
      << workers.stdout_of(1);
  workers.process(1).signal(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  for (uint32_t r : {0u, 2u}) {
    auto out = workers.wait(r, 2 * op_timeout);
    const auto took = std::chrono::steady_clock::now() - killed;
    EXPECT_EQ(out.exit_code, 3) << out.out;
    EXPECT_TRUE(contains(out.out, "rank 1")) << out.out;
    EXPECT_LT(took, 2 * op_timeout) << out.out;
  }
  EXPECT_EQ(workers.process(1).wait_for(1s).value_or(-1), 128 + SIGKILL);
  // The pool survives and serves a new job.
  for (uint32_t s = 0; s < 2; ++s) EXPECT_FALSE(cluster.reducer(s).wait_for(0ms).has_value());
  expect_allreduce_works(cluster, 2, "after-kill");
}

TEST_P(TransportFault, KilledReducerFailsEveryWorker) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto op_timeout = 4000ms;
  WorkerGroup workers(cluster, "w", unique_job("reducer-kill"), 2,
                      [](uint32_t) {
                        return Args{"--count", "9477", "--ops", "200000"};
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(0), "op 20 ok"); }, 30s))
      << workers.stdout_of(0);
  cluster.kill_reducer(1, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = workers.wait(r, 2 * op_timeout);
    const auto took = std::chrono::steady_clock::now() - killed;
    EXPECT_EQ(out.exit_code, 3) << out.out;
    // The error itself, not the warning logged on the loss, names the reducer.
    const std::string error = error_line(out.out);
    ASSERT_FALSE(error.empty()) << out.out;
    EXPECT_TRUE(contains(error, "lost reducer " + cluster.addresses()[1] + " (shard 1)")) << error;
    // The workers tried to reconnect for the op timeout (it never came
    // back), unless shard 0's op timeout, as long, ended the op first: a
    // rank still waiting for shard 1 never sent it the next op's chunks.
    EXPECT_TRUE(contains(error, "did not come back within 4000 ms") ||
                (contains(error, "timed out after 4000 ms on shard 0 waiting for ranks [") &&
                 contains(error, "; at the time this worker was reconnecting after: lost ")))
        << error;
    EXPECT_LT(took, 2 * op_timeout) << out.out;
  }
  // The surviving shard is still up.
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value());
}

// Shard 0 times an op out waiting for a rank that is stalled, while rank 0
// is reconnecting to a lost shard 1: rank 0's error is shard 0's timeout,
// and it names the lost reducer too (the stalled rank may be waiting for it).
TEST(Fault, AnOpTimedOutWhileAReducerIsLostNamesThatReducer) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("timeout-while-lost"), 2,
                      [](uint32_t r) {
                        Args args{"--count", "9477", "--ops", "8"};
                        if (r == 1)
                          args.insert(args.end(), {"--stall-ms", "6000", "--stall-op", "5"});
                        return args;
                      },
                      {{"TALLY_OP_TIMEOUT_MS", "4000"}});
  // Half of shard 0's op timeout has passed on op 5: it has 2 s left, rank
  // 0's reconnecting will have 4 s.
  ASSERT_TRUE(eventually(
      [&] { return contains(cluster.reducer_log(0), "op 5 chunk 0: still waiting for ranks [1]"); },
      30s))
      << cluster.reducer_log(0);
  cluster.kill_reducer(1, SIGKILL);
  auto out = workers.wait(0, 10s);
  EXPECT_EQ(out.exit_code, 3) << out.out;
  EXPECT_TRUE(contains(out.out,
                       "timed out after 4000 ms on shard 0 waiting for ranks [1]; at the "
                       "time this worker was reconnecting after: lost reducer " +
                           cluster.addresses()[1] + " (shard 1)"))
      << out.out;
  EXPECT_EQ(workers.wait(1, 15s).exit_code, 3);
}

TEST_P(TransportFault, StragglerTimesOutNamingTheRank) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(1));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto op_timeout = 1000ms;
  WorkerGroup workers(cluster, "w", unique_job("straggler"), 2,
                      [](uint32_t r) {
                        Args args{"--count", "1009", "--ops", "2"};
                        if (r == 1) args.insert(args.end(), {"--stall-ms", "4000"});
                        return args;
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  auto out0 = workers.wait(0, 10s);
  EXPECT_EQ(out0.exit_code, 3) << out0.out;
  EXPECT_TRUE(contains(out0.out, "timeout")) << out0.out;
  EXPECT_TRUE(contains(out0.out, "waiting for ranks [1]")) << out0.out;
  EXPECT_GE(error_ms(out0.out), op_timeout.count() - 100) << out0.out;
  EXPECT_LT(error_ms(out0.out), 2 * op_timeout.count()) << out0.out;
  // The straggler's late op is refused, not summed with nothing.
  auto out1 = workers.wait(1, 15s);
  EXPECT_EQ(out1.exit_code, 3) << out1.out;
  EXPECT_TRUE(contains(cluster.reducer_log(0), "still waiting for ranks [1]"))
      << cluster.reducer_log(0);
}

TEST_P(TransportFault, MismatchedSizesFailEveryRankNamingThem) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto op_timeout = 2000ms;
  WorkerGroup workers(cluster, "w", unique_job("mismatch"), 3,
                      [](uint32_t r) {
                        Args args{"--count", "1009"};
                        if (r == 2) args.insert(args.end(), {"--count-override", "1010"});
                        return args;
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  // Every rank fails with the mismatch in its message: directly, or (for a
  // rank that joined after the others had failed and left) as the reason
  // its op timed out.
  for (uint32_t r = 0; r < 3; ++r) {
    auto out = workers.wait(r, 3 * op_timeout);
    EXPECT_EQ(out.exit_code, 3) << out.out;
    EXPECT_TRUE(contains(out.out, "mismatch: ")) << out.out;
    EXPECT_TRUE(contains(out.out, "disagree")) << out.out;
    EXPECT_TRUE(contains(out.out, "rank 2 sent count=1010")) << out.out;
    EXPECT_LT(error_ms(out.out), 2 * op_timeout.count()) << out.out;
  }
}

TEST_P(TransportFault, MismatchedDtypeFailsEveryRank) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(1));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("dtype"), 2, [](uint32_t r) {
    return Args{"--count", "512", "--dtype", r == 0 ? "float" : "int32"};
  });
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = workers.wait(r, 15s);
    EXPECT_EQ(out.exit_code, 3) << out.out;
    EXPECT_TRUE(contains(out.out, "float")) << out.out;
    EXPECT_TRUE(contains(out.out, "int32")) << out.out;
  }
}

// Checks the output of a --keep-going worker that ran `ops` ops: op `failed`,
// and only it, failed with `why` in its message; every other op was exact.
void expect_only_op_failed(const WorkerOutput& out, int ops, int failed, const std::string& why) {
  EXPECT_EQ(out.exit_code, 0) << out.out;
  for (int op = 0; op < ops; ++op) {
    const std::string ok = "op " + std::to_string(op) + " ok hash ";
    const std::string error = "op " + std::to_string(op) + " error after ";
    if (op == failed) {
      const auto at = out.out.find(error);
      ASSERT_NE(at, std::string::npos) << out.out;
      EXPECT_TRUE(contains(out.out.substr(at, out.out.find('\n', at) - at), why)) << out.out;
      EXPECT_FALSE(contains(out.out, ok)) << out.out;
    } else {
      EXPECT_TRUE(contains(out.out, ok)) << out.out;
      EXPECT_FALSE(contains(out.out, error)) << out.out;
    }
  }
  EXPECT_TRUE(contains(out.out, "\nok\n")) << out.out;
}

// An op failed on a mismatch does not poison the streams: the failed op's
// contributions still in flight are dropped by the reducers, its result
// receives are cancelled on the workers, and the next ops on the same
// clients are exact.
TEST_P(TransportFault, OpsAfterAMismatchedOpAreExact) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("mismatch-then-ok"), 3,
                      [](uint32_t r) {
                        return Args{"--counts",
                                    r == 2 ? "9478,1009,9477,1,9477" : "9477,1009,9477,1,9477",
                                    "--ops", "5", "--keep-going"};
                      },
                      {{"TALLY_OP_TIMEOUT_MS", "4000"}});
  for (uint32_t r = 0; r < 3; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_only_op_failed(workers.wait(r, 30s), 5, 0, "disagree");
  }
}

// A rank late past the op timeout: the op fails on both ranks (the punctual
// one's times out naming the late rank, the late one's contribution is
// refused), and the next ops on the same streams are exact, though results
// of the failed op were being waited for (and their receives cancelled).
TEST_P(TransportFault, OpsAfterATimedOutOpAreExact) {
  TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
  TestCluster cluster(pool(2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto op_timeout = 2000ms;
  // Late by 1.4x the timeout: well after op 1 fails, well before op 2 would.
  WorkerGroup workers(cluster, "w", unique_job("late-then-ok"), 2,
                      [](uint32_t r) {
                        Args args{"--count", "9477", "--ops", "4", "--keep-going"};
                        if (r == 1)
                          args.insert(args.end(), {"--stall-ms", "2800", "--stall-op", "1"});
                        return args;
                      },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  {
    SCOPED_TRACE("rank 0");
    expect_only_op_failed(workers.wait(0, 30s), 4, 1, "waiting for ranks [1]");
  }
  {
    SCOPED_TRACE("rank 1");
    expect_only_op_failed(workers.wait(1, 30s), 4, 1, "timed out");
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, TransportFault, ::testing::Values("tcp", "fabric"), transport_name);

// A 16-bit chunk needs 4 bytes of reducer buffer per element (float32
// accumulators): a chunk size that fits the buffer as float32 but not as
// float16 is refused before anything is sent, naming the limit.
TEST(Fault, SixteenBitChunkBeyondTheAccumulatorIsRefusedClearly) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("half");
  auto env = cluster.worker_env(job, 0, 1);
  env["TALLY_CHUNK_BYTES"] = "4096";  // PoolSpec's --max-chunk-bytes: 2048 halves, 1024 fit
  auto p = cluster.spawn_worker("w0", {"--count", "3000", "--dtype", "half"}, env);
  auto out = wait_worker(p, cluster, "w0", 15s);
  EXPECT_EQ(out.exit_code, 3) << out.out;
  EXPECT_TRUE(contains(out.out, "invalid")) << out.out;
  EXPECT_TRUE(contains(out.out, "accumulate in float32")) << out.out;
}

// connect() fails fast on one shard's refusal while another shard is still
// being retried; closing the client must not wait for that retry loop.
TEST(Fault, FailedConnectReturnsWithoutWaitingForOtherShards) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto t0 = std::chrono::steady_clock::now();
  // Shard 0 says the pool has 1 shard; nothing listens on port 1.
  auto out = run_one(cluster,
                     {{"TALLY_POOL", cluster.addresses()[0] + ",127.0.0.1:1"},
                      {"TALLY_CONNECT_TIMEOUT_MS", "20000"}},
                     15s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "shard order")) << out.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(Fault, DuplicateRankIsRefused) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("dup");
  auto first = cluster.spawn_worker("a", {"--count", "10", "--stall-ms", "3000", "--ops", "1"},
                                    cluster.worker_env(job, 0, 2));
  ASSERT_TRUE(eventually([&] { return contains(cluster.worker_stdout("a"), "connected"); }, 10s));
  auto second = cluster.spawn_worker("b", {"--count", "10"}, cluster.worker_env(job, 0, 2));
  auto out = wait_worker(second, cluster, "b", 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "already_exists")) << out.out;
  EXPECT_TRUE(contains(out.out, "rank 0")) << out.out;
  first.terminate(100ms);
}

// Before its first frame a stream may be silent for as long as the hello
// deadline allows, not only the peer timeout: a fabric worker opens its
// endpoint between its TCP connect and its Hello and says nothing meanwhile
// (1-2.5 s under TSan). Once it has said hello, the peer timeout holds.
TEST(Fault, SilenceBeforeTheHelloIsBoundedByTheHelloDeadlineNotThePeerTimeout) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--peer-timeout-ms", "300", "--heartbeat-ms",
                                                     "100", "--hello-timeout-ms", "10000"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("slow-hello");
  RawPeer peer(cluster.addresses()[0]);
  // Four peer timeouts of silence: the condition under test, so a wait
  // that expects no event.
  std::string early;
  EXPECT_FALSE(peer.closed_within(1200ms, &early)) << early.size() << " bytes came";
  peer.send_control(raw_hello(job, 0, 1));
  EXPECT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "rank 0/1"); }, 5s))
      << cluster.reducer_log(0);
  EXPECT_TRUE(peer.closed_within(5s)) << "silent after its hello, and not closed";
  EXPECT_TRUE(
      eventually([&] { return contains(cluster.reducer_log(0), "no data or heartbeat from"); }, 5s))
      << cluster.reducer_log(0);
}

// Established TCP connections on loopback whose local port is `port` (the
// server's ends of the streams to a listener), from /proc/net/tcp.
int established_to(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // the header
  int n = 0;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string slot, local, remote, state;
    if (!(f >> slot >> local >> remote >> state)) continue;
    const auto colon = local.find(':');
    if (colon == std::string::npos) continue;
    if (std::stoi(local.substr(colon + 1), nullptr, 16) == port && state == "01") ++n;
  }
  return n;
}

// A reducer is stopped (SIGSTOP) long enough for
// its workers to give up on it (their peer timeout), the job reconnects
// under the same name, and the reducer is continued. Its old streams' ends
// and the new Hellos arrive together; the new ranks are taken once the old
// ones have left instead of being refused ("already connected", "job has
// failed").
TEST(Fault, HungReducerTakesTheReconnectingJobAtOnce) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("hung");
  const std::map<std::string, std::string> quick{{"TALLY_HEARTBEAT_MS", "100"},
                                                 {"TALLY_PEER_TIMEOUT_MS", "1000"}};
  // These give up on the hung reducer at once (they do not reconnect to it,
  // as resume_test.cc's do) and a new round of the job takes over.
  std::map<std::string, std::string> giving_up = quick;
  giving_up["TALLY_RESUME_BYTES"] = "0";
  WorkerGroup first(
      cluster, "a", job, 2,
      [](uint32_t) {
        return Args{"--count", "1009", "--ops", "1000000"};
      },
      giving_up);
  ASSERT_TRUE(eventually([&] { return contains(first.stdout_of(1), "op 5 ok"); }, 30s))
      << first.stdout_of(1);
  cluster.reducer(0).signal(SIGSTOP);
  // Continued on every way out, so a failed assertion leaves no stopped reducer.
  struct Continue {
    TestCluster& cluster;
    ~Continue() { cluster.reducer(0).signal(SIGCONT); }
  } continue_at_exit{cluster};
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = first.wait(r, 20s);
    EXPECT_NE(out.exit_code, 0) << out.out;
  }
  // The new ranks connect and say hello while the reducer is still stopped
  // (the kernel takes the connections), so it sees them with the old ends.
  WorkerGroup second(
      cluster, "b", job, 2,
      [](uint32_t) {
        return Args{"--count", "1009"};
      },
      quick);
  const std::string port = cluster.addresses()[0].substr(cluster.addresses()[0].rfind(':') + 1);
  ASSERT_TRUE(eventually([&] { return established_to(std::stoi(port)) >= 2; }, 20s));
  cluster.reducer(0).signal(SIGCONT);
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = second.wait(r, 30s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
  }
}

// A reducer that dies between taking a worker's connection and welcoming
// it (here: stopped, so the kernel takes the connection and the Hello, then
// killed, which resets them) and comes back at its address: the worker
// dials again until its connect deadline, as it does a refused connection,
// and joins. (It failed connect with "lost reducer ...: connection reset
// by peer"; tally-bench chaos hit it under ASan when a kill fell on a
// job's start.)
TEST(Fault, AReducerLostBeforeItsWelcomeIsDialledAgainWithinTheConnectTimeout) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  cluster.reducer(0).signal(SIGSTOP);
  WorkerGroup group(cluster, "w", unique_job("mid-handshake"), 2,
                    [](uint32_t) {
                      return Args{"--count", "1009", "--ops", "3"};
                    },
                    {{"TALLY_CONNECT_TIMEOUT_MS", "30000"}});
  const std::string port = cluster.addresses()[0].substr(cluster.addresses()[0].rfind(':') + 1);
  ASSERT_TRUE(eventually([&] { return established_to(std::stoi(port)) >= 2; }, 20s));
  cluster.kill_reducer(0, SIGKILL);
  ASSERT_TRUE(cluster.restart_reducer(0).is_ok());
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = group.wait(r, 30s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
  }
}

TEST(Fault, PoolListedOutOfShardOrderIsRefused) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto out = run_one(cluster,
                     {{"TALLY_POOL", cluster.addresses()[1] + "," + cluster.addresses()[0]}}, 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "shard order")) << out.out;
}

TEST(Fault, UnreachablePoolFailsWithinTheConnectTimeout) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto t0 = std::chrono::steady_clock::now();
  // Nothing listens on port 1.
  auto out =
      run_one(cluster, {{"TALLY_POOL", "127.0.0.1:1"}, {"TALLY_CONNECT_TIMEOUT_MS", "700"}}, 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "127.0.0.1:1")) << out.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(Fault, BadEnvironmentIsNamed) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto out = run_one(cluster, {{"TALLY_RANK", "three"}}, 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "TALLY_RANK")) << out.out;
}

}  // namespace
}  // namespace tally::testing
