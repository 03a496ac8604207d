// Failures through real processes: a killed worker, a killed reducer, a
// straggler, mismatched contributions, hostile bytes, refused joins. Each
// asserts the error the survivors see and how long they took to see it.
// The ones that move data run over both transports (TransportFault,
// TransportMemory; names end in /Tcp and /Fabric); the ones about TCP framing
// or joining stay on TCP.
#include <gtest/gtest.h>
#include <signal.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <filesystem>
#include <thread>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "tally.pb.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::testing {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

// Milliseconds printed by tally-test-worker in "error after N ms ...".
long long error_ms(const std::string& out) {
  auto at = out.find("error after ");
  if (at == std::string::npos) return -1;
  return std::stoll(out.substr(at + 12));
}

// A raw TCP peer speaking (or not speaking) the protocol to a reducer.
class RawPeer {
 public:
  explicit RawPeer(const std::string& address) : socket_(io_) {
    auto hp = parse_host_port(address);
    tcp::resolver resolver(io_);
    asio::connect(socket_, resolver.resolve(hp->host, std::to_string(hp->port)));
  }
  void send(const void* data, size_t n) { asio::write(socket_, asio::buffer(data, n)); }
  void send_frame(const FrameHeader& h, const std::string& payload) {
    auto bytes = encode_header(h);
    send(bytes.data(), bytes.size());
    if (!payload.empty()) send(payload.data(), payload.size());
  }
  void send_control(const wire::Control& message) {
    std::string payload = message.SerializeAsString();
    FrameHeader h;
    h.kind = FrameKind::kControl;
    h.length = payload.size();
    send_frame(h, payload);
  }
  // Reads until the reducer closes the stream or `timeout` passes; returns
  // whether it closed, and what it sent in `received`.
  bool closed_within(std::chrono::milliseconds timeout, std::string* received = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    socket_.non_blocking(true);
    char buf[4096];
    while (std::chrono::steady_clock::now() < deadline) {
      boost::system::error_code ec;
      size_t n = socket_.read_some(asio::buffer(buf), ec);
      if (ec == asio::error::would_block) {
        std::this_thread::sleep_for(5ms);
        continue;
      }
      if (ec) return true;  // eof or reset
      if (received) received->append(buf, n);
    }
    return false;
  }

 private:
  asio::io_context io_;
  tcp::socket socket_;
};

wire::Control hello(const std::string& job, uint32_t rank, uint32_t world, uint32_t version = kProtocolVersion) {
  wire::Control m;
  auto* h = m.mutable_hello();
  h->set_protocol_version(version);
  h->set_job(job);
  h->set_rank(rank);
  h->set_world_size(world);
  h->set_op_timeout_ms(5000);
  return m;
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
                      [](uint32_t) { return Args{"--count", "9477", "--ops", "200000"}; },
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
                      [](uint32_t) { return Args{"--count", "9477", "--ops", "200000"}; },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(0), "op 20 ok"); }, 30s))
      << workers.stdout_of(0);
  cluster.kill_reducer(1, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = workers.wait(r, 2 * op_timeout);
    const auto took = std::chrono::steady_clock::now() - killed;
    EXPECT_EQ(out.exit_code, 3) << out.out;
    EXPECT_TRUE(contains(out.out, "lost reducer " + cluster.addresses()[1])) << out.out;
    EXPECT_TRUE(contains(out.out, "shard 1")) << out.out;
    EXPECT_LT(took, 2 * op_timeout) << out.out;
  }
  // The surviving shard is still up.
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value());
}

// A pool of 2 shards x 3 groups and 6 workers (groups {0,1}, {2,3}, {4,5}).
// Killing the reducer of shard 1 in group 2 fails every worker of every
// group within the deadline: group 2's workers lose their stream to it, the
// others hear from their own reducers that the replica was lost.
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
  ASSERT_TRUE(eventually([&] {
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
  }, 60s)) << cluster.reducer_log(0);
  // Fabric links connect lazily on their first partial (rxm), which under
  // TSan on 2 cores can take seconds: a longer deadline there.
  const auto op_timeout = transport == "fabric" ? 12000ms : 4000ms;
  WorkerGroup workers(cluster, "w", unique_job("replica-kill"), 6,
                      [](uint32_t) { return Args{"--count", "9477", "--ops", "200000"}; },
                      {{"TALLY_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(0), "op 20 ok"); }, 30s))
      << workers.stdout_of(0);
  // The replica links carry partials on the pool's transport.
  EXPECT_TRUE(contains(cluster.reducer_log(0), "replica link to (shard 0, group 1) at " + cluster.addresses()[2] +
                                                   ": data path " + transport))
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
        << "rank " << r << ":\n" << out.out;
    EXPECT_LT(took, 2 * op_timeout) << out.out;
  }
  // The other reducers survive.
  for (uint32_t i = 0; i < 6; ++i) {
    if (i == victim) continue;
    EXPECT_FALSE(cluster.reducer(i).wait_for(0ms).has_value()) << "reducer " << i;
  }
}

TEST(Fault, KilledReplicaFailsEveryWorkerOfEveryGroup) { killed_replica_fails_every_worker_of_every_group("tcp"); }

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
  ASSERT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "group 1) at " + cluster.addresses()[1] + " lost"); }, 10s))
      << cluster.reducer_log(0);
  ASSERT_TRUE(cluster.restart_reducer(1).is_ok());
  // Reducer 0 dials it again; it dials reducer 0.
  ASSERT_TRUE(eventually([&] {
    const std::string log = cluster.reducer_log(0);
    size_t n = 0;
    for (size_t at = log.find("connected to replica"); at != std::string::npos; at = log.find("connected to replica", at + 1)) ++n;
    return n >= 2 && contains(log.substr(log.rfind("lost")), "inbound stream of replica group 1");
  }, 10s)) << cluster.reducer_log(0);
  expect_allreduce_works(cluster, 4, "after-restart");
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
                      [](uint32_t) { return Args{"--count", "9477", "--ops", "200000"}; },
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
  EXPECT_TRUE(contains(out.out, "rank 5 is in group 3 but the pool has 3 groups (0..2)")) << out.out;
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
  EXPECT_TRUE(contains(cluster.reducer_log(0), "still waiting for ranks [1]")) << cluster.reducer_log(0);
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
                        return Args{"--counts", r == 2 ? "9478,1009,9477,1,9477" : "9477,1009,9477,1,9477",
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
                        if (r == 1) args.insert(args.end(), {"--stall-ms", "2800", "--stall-op", "1"});
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

TEST(Fault, HalfPrecisionIsRefusedClearly) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("half");
  auto p = cluster.spawn_worker("w0", {"--count", "300", "--dtype", "half"}, cluster.worker_env(job, 0, 1));
  auto out = wait_worker(p, cluster, "w0", 15s);
  EXPECT_EQ(out.exit_code, 3) << out.out;
  EXPECT_TRUE(contains(out.out, "unimplemented")) << out.out;
}

TEST(Fault, GarbageAndHostileFramesCloseOnlyThatConnection) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--peer-timeout-ms", "800", "--heartbeat-ms", "200",
                                                     "--hello-timeout-ms", "1500"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string address = cluster.addresses()[0];

  // A stalled peer that sends half a header is dropped by the peer timeout.
  RawPeer stalled(address);
  stalled.send("TALY", 4);
  // A peer that keeps sending heartbeats but never says hello is dropped by
  // the hello timeout.
  RawPeer silent(address);
  std::thread heartbeats([&] {
    wire::Control hb;
    hb.mutable_heartbeat()->set_sequence(1);
    for (int i = 0; i < 12; ++i) {
      try {
        silent.send_control(hb);
      } catch (const std::exception&) {
        return;  // closed by the reducer, as expected
      }
      std::this_thread::sleep_for(200ms);
    }
  });

  {  // Plain garbage.
    RawPeer peer(address);
    std::string junk(64, 'A');
    peer.send(junk.data(), junk.size());
    EXPECT_TRUE(peer.closed_within(5s));
  }
  {  // A control frame claiming 1 GiB.
    RawPeer peer(address);
    FrameHeader h;
    h.kind = FrameKind::kControl;
    h.length = 1ull << 30;
    peer.send_frame(h, "");
    EXPECT_TRUE(peer.closed_within(5s));
  }
  {  // A control frame whose payload is not protobuf.
    RawPeer peer(address);
    FrameHeader h;
    h.kind = FrameKind::kControl;
    h.length = 16;
    peer.send_frame(h, std::string(16, '\xff'));
    EXPECT_TRUE(peer.closed_within(5s));
  }
  {  // Data before hello.
    RawPeer peer(address);
    FrameHeader h;
    h.kind = FrameKind::kContribution;
    h.count = 16;
    h.length = 64;
    peer.send_frame(h, std::string(64, '\0'));
    EXPECT_TRUE(peer.closed_within(5s));
  }
  {  // Hello, then a contribution that claims another rank, larger than the buffers.
    RawPeer peer(address);
    const std::string job = unique_job("hostile");
    peer.send_control(hello(job, 0, 2));
    FrameHeader h;
    h.kind = FrameKind::kContribution;
    h.job = job_id(job);
    h.rank = 1;
    h.count = 1u << 20;
    h.length = 1u << 20;
    peer.send_frame(h, "");
    EXPECT_TRUE(peer.closed_within(5s));
  }
  EXPECT_TRUE(stalled.closed_within(5s));
  heartbeats.join();
  EXPECT_TRUE(silent.closed_within(5s));
  // The daemon is up and serves everyone else.
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value());
  expect_allreduce_works(cluster, 2, "after-garbage");
  const std::string log = cluster.reducer_log(0);
  EXPECT_TRUE(contains(log, "bad frame magic")) << log;
  EXPECT_TRUE(contains(log, "exceeds the limit")) << log;
  EXPECT_TRUE(contains(log, "malformed control message")) << log;
  EXPECT_TRUE(contains(log, "before its hello")) << log;
  EXPECT_TRUE(contains(log, "no data or heartbeat")) << log;
  EXPECT_TRUE(contains(log, "no hello from")) << log;
}

TEST(Fault, OtherProtocolVersionGetsAClearError) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  {  // Version 2 in the Hello: the reducer answers with an Error, then closes.
    RawPeer peer(cluster.addresses()[0]);
    peer.send_control(hello(unique_job("v2"), 0, 1, 2));
    std::string received;
    EXPECT_TRUE(peer.closed_within(5s, &received));
    ASSERT_GE(received.size(), kFrameHeaderBytes);
    auto h = decode_header(std::span<const std::byte, kFrameHeaderBytes>(
                               reinterpret_cast<const std::byte*>(received.data()), kFrameHeaderBytes),
                           FrameLimits{});
    ASSERT_TRUE(h) << h.status().to_string();
    wire::Control reply;
    ASSERT_TRUE(reply.ParseFromArray(received.data() + kFrameHeaderBytes, static_cast<int>(h->length)));
    ASSERT_TRUE(reply.has_error());
    EXPECT_EQ(reply.error().code(), wire::VERSION_MISMATCH);
    EXPECT_TRUE(contains(reply.error().message(), "version 2")) << reply.error().message();
  }
  {  // Version 2 in the frame header itself.
    RawPeer peer(cluster.addresses()[0]);
    auto bytes = encode_header(FrameHeader{});
    bytes[4] = std::byte{2};
    peer.send(bytes.data(), bytes.size());
    EXPECT_TRUE(peer.closed_within(5s));
  }
  EXPECT_TRUE(contains(cluster.reducer_log(0), "protocol version 2")) << cluster.reducer_log(0);
}

// A Hello is untrusted: a huge world size must be refused, not allocated.
TEST(Fault, HugeWorldSizeIsRefused) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  RawPeer peer(cluster.addresses()[0]);
  peer.send_control(hello(unique_job("huge"), 0, 4294967295u));
  std::string received;
  EXPECT_TRUE(peer.closed_within(5s, &received));
  EXPECT_TRUE(contains(received, "exceeds this reducer's maximum")) << received;
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value());
  expect_allreduce_works(cluster, 2, "after-huge");
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

TEST(Fault, PoolListedOutOfShardOrderIsRefused) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto out = run_one(cluster, {{"TALLY_POOL", cluster.addresses()[1] + "," + cluster.addresses()[0]}}, 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "shard order")) << out.out;
}

TEST(Fault, UnreachablePoolFailsWithinTheConnectTimeout) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto t0 = std::chrono::steady_clock::now();
  // Nothing listens on port 1.
  auto out = run_one(cluster, {{"TALLY_POOL", "127.0.0.1:1"}, {"TALLY_CONNECT_TIMEOUT_MS", "700"}}, 10s);
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
                       "--io-threads", "2", "--log-level", "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("tiny"), 8,
                      [](uint32_t) { return Args{"--count", "40000", "--ops", "3"}; },
                      {{"TALLY_CHUNK_BYTES", "4096"}});
  for (uint32_t r = 0; r < 8; ++r) {
    auto out = workers.wait(r, 60s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
  }
}

INSTANTIATE_TEST_SUITE_P(Memory, TransportMemory, ::testing::Values("tcp", "fabric"), transport_name);
// The same with three groups: partials from the other replicas compete for
// the same few buffers (window 1: 1 x (1 + 2 x 3) + 2 = 9 per job), and the
// replicas' streams pause and resume too. Still exact, still no deadlock.
TEST(Memory, TinyQuotaBackPressureWithGroups) {
  PoolSpec spec;
  spec.shards = 2;
  spec.groups = 3;
  spec.reducer_args = {"--max-chunk-bytes", "4096", "--memory-budget", "36KiB", "--window", "1",
                       "--io-threads", "2", "--log-level", "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("tiny-groups"), 7,
                      [](uint32_t) { return Args{"--count", "40000", "--ops", "3"}; },
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
  spec.reducer_args = {"--max-chunk-bytes", "4096", "--memory-budget", "24KiB", "--window", "4",
                       "--log-level", "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string first_job = unique_job("first");
  auto first = cluster.spawn_worker("a", {"--count", "1009", "--ops", "2", "--stall-ms", "1500"},
                                    cluster.worker_env(first_job, 0, 1));
  ASSERT_TRUE(eventually([&] { return contains(cluster.worker_stdout("a"), "op 0 ok"); }, 10s));
  auto second = cluster.spawn_worker("b", {"--count", "10"}, cluster.worker_env(unique_job("second"), 0, 1));
  auto out = wait_worker(second, cluster, "b", 10s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "resource_exhausted")) << out.out;
  EXPECT_TRUE(contains(out.out, "memory budget")) << out.out;
  auto first_out = wait_worker(first, cluster, "a", 10s);
  EXPECT_EQ(first_out.exit_code, 0) << first_out.out;
}

}  // namespace
}  // namespace tally::testing
