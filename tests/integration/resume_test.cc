// Surviving a reducer restart (docs/protocol.md, "Resuming"): workers that
// lose a reducer reconnect and send their ops in flight again, replaying
// the results they already have, against real reducer processes that are
// killed and restarted at their addresses.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "clients.h"
#include "cut_link.h"
#include "harness.h"
#include "raw_peer.h"
#include "tally.pb.h"
#include "tally/bench/explain.h"
#include "tally/bench/pattern.h"
#include "tally/client/client.h"
#include "tally/protocol/frame.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

std::string bytes_of(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

wire::Control received(uint64_t op_below) {
  wire::Control m;
  m.mutable_received()->set_op_below(op_below);
  return m;
}

// Reducers with room for 4 MiB chunks, for ops large enough to be held.
PoolSpec large_ops_pool(uint32_t shards) {
  PoolSpec spec{.shards = shards};
  spec.reducer_args = {"--max-chunk-bytes", "4MiB", "--memory-budget", "64MiB",
                       "--io-threads",      "2",    "--log-level",     "info"};
  return spec;
}

// Kills shard 0's reducer, restarts it, and resumes rank 1 (a raw peer) as
// a resuming worker does: Hello, its Received mark (it has finished no op),
// and, once the reducer's Released says no op is released, its chunk again
// (sending it at once is the same to the reducer). Null if no restart.
std::unique_ptr<RawPeer> restart_and_resume(TestCluster& cluster, wire::Control hello,
                                            const FrameHeader& h, const std::vector<float>& y) {
  cluster.kill_reducer(0, SIGKILL);
  if (!cluster.restart_reducer(0).is_ok()) return nullptr;
  auto peer = std::make_unique<RawPeer>(cluster.addresses()[0]);
  hello.mutable_hello()->set_resume(true);
  peer->send_control(hello);
  peer->send_control(received(0));
  peer->send_frame(h, bytes_of(y));
  return peer;
}

// Every rank keeps `depth` ops in flight the way DDP does, op i of
// `floats(i)` elements in buffer i mod 2 x depth (reused), summed when i is
// even and averaged when odd, while the reducers are SIGKILLed and
// restarted `kills` times (spread over the ops, taking `victims` (pool
// indices) in turn): every op must end well with its own exact result, and
// a reducer must have logged a resume.
void train_through_kills(TestCluster& cluster, std::vector<std::unique_ptr<Client>>& clients,
                         int ops, size_t depth, const std::function<size_t(int)>& floats, int kills,
                         const std::vector<uint32_t>& victims = {0, 1}) {
  const uint32_t world = static_cast<uint32_t>(clients.size());
  std::atomic<int> finished{0};  // rank 0's ops that have ended
  std::thread killer([&] {
    for (int k = 0; k < kills; ++k) {
      const int at = (k + 1) * ops / (kills + 1);
      if (!eventually([&] { return finished.load() >= at; }, 60s)) return;
      const uint32_t victim = victims[k % victims.size()];
      cluster.kill_reducer(victim, SIGKILL);
      EXPECT_TRUE(cluster.restart_reducer(victim).is_ok());
    }
  });
  auto redop_of = [](uint64_t i) { return i % 2 ? RedOp::kAverage : RedOp::kSum; };
  on_every_rank(world, [&](uint32_t r) {
    std::vector<std::vector<float>> buffers(2 * depth);
    std::deque<std::pair<uint64_t, OpHandle>> inflight;  // (op, its handle)
    auto end_oldest = [&] {
      auto& [i, handle] = inflight.front();
      const auto s = handle.wait_for(30s);
      ASSERT_TRUE(s.has_value()) << "op " << i << " still in flight";
      EXPECT_TRUE(s->is_ok()) << "op " << i << ": " << s->to_string();
      const std::vector<float>& data = buffers[i % buffers.size()];
      EXPECT_EQ(
          bench::explain_wrong(data.data(), data.size(), {r, world, redop_of(i), i}, 4, redop_of),
          "")
          << "op " << i;
      inflight.pop_front();
      if (r == 0) finished++;
    };
    for (uint64_t i = 0; i < static_cast<uint64_t>(ops); ++i) {
      std::vector<float>& data = buffers[i % buffers.size()];
      data.resize(floats(static_cast<int>(i)));
      bench::fill_pattern(data.data(), data.size(), r, i);
      inflight.emplace_back(
          i, clients[r]->allreduce_async(data.data(), data.size(), DType::kFloat32, redop_of(i)));
      if (inflight.size() >= depth) end_oldest();
    }
    while (!inflight.empty()) end_oldest();
  });
  killer.join();
  // Each rank counted its reconnects and what it sent again (ClientStats).
  for (uint32_t r = 0; r < world; ++r) {
    const ClientStats s = clients[r]->stats();
    EXPECT_EQ(s.ops_completed, static_cast<uint64_t>(ops)) << "rank " << r;
    EXPECT_EQ(s.ops_failed, 0u) << "rank " << r;
    EXPECT_GE(s.reconnects, static_cast<uint64_t>(kills)) << "rank " << r;
    EXPECT_GT(s.replays, 0u) << "rank " << r;
  }
  std::string logs;
  for (uint32_t i = 0; i < cluster.addresses().size(); ++i) logs += cluster.reducer_log(i);
  EXPECT_TRUE(contains(logs, "resumed"));
  if (::testing::Test::HasFailure()) ADD_FAILURE() << "reducer logs:\n" << logs;
}

// Reducers are SIGKILLed and restarted at their addresses while every rank
// keeps several ops in flight: every op completes, and every sum is exact.
TEST(Resume, KilledReducerRestartedMidOpsCompletesEveryOpExactly) {
  TestCluster cluster(PoolSpec{.shards = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, unique_job("resume-kill"), 3);
  ASSERT_EQ(clients.size(), 3u);
  // 1 to 16 chunks on each shard (1 KiB chunks).
  train_through_kills(
      cluster, clients, 400, 4, [](int i) { return 1 + (i % 8) * 1000; }, 3);
}

// The same in a pool of 2 shards x 2 replica groups (docs/protocol.md,
// "Resuming with replica groups"): the killed reducer's replica starts a
// new round of the job, every group's workers send their ops in flight
// again, and a result some rank already had comes back to the others as
// those bytes, whichever group had it.
TEST(Resume, KilledReplicaRestartedMidOpsCompletesEveryOpExactly) {
  PoolSpec spec{.shards = 2};
  spec.groups = 2;
  // A window of 8 rather than the harness's 4: with 4 (14 buffers a job),
  // 1 run in about 25 under a parallel load stalled a round until the op
  // timeout (architecture.md, "Surviving a reducer restart", the gap noted
  // under item 6).
  spec.reducer_args = {"--max-chunk-bytes", "4096", "--memory-budget", "4MiB", "--window", "8",
                       "--io-threads",      "2",    "--log-level",     "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, unique_job("resume-groups"), 4,
                             [](ClientOptions& o, uint32_t) { o.groups = 2; });
  ASSERT_EQ(clients.size(), 4u);
  // (group 0, shard 1) and (group 1, shard 0) in turn.
  train_through_kills(cluster, clients, 400, 4, [](int i) { return 1 + (i % 8) * 1000; }, 4,
                      {1, 2});
  std::string logs;
  for (uint32_t i = 0; i < 4; ++i) logs += cluster.reducer_log(i);
  EXPECT_TRUE(contains(logs, "starts round")) << logs;
}

// Ops of 4 MiB and more are not copied when they end: each ends once a
// reducer has released it, its results still in the caller's buffer for
// replays. With room for no copy at all (TALLY_RESUME_BYTES of 1 byte),
// they survive kills all the same.
TEST(Resume, LargeOpsHeldUntilReleasedSurviveKillsWithoutCopies) {
  TestCluster cluster(large_ops_pool(2));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto clients = connect_all(cluster, unique_job("resume-held"), 3, [](ClientOptions& o, uint32_t) {
    o.chunk_bytes = 0;  // the automatic plan: 64 KiB to 256 KiB chunks
    o.resume_bytes = 1;
  });
  ASSERT_EQ(clients.size(), 3u);
  train_through_kills(
      cluster, clients, 24, 2, [](int i) { return (1 << 20) + (i % 3) * 100003; }, 2);
}

// The rank that has a chunk's result replays it, and the rank that does not
// gets exactly those bytes from the restarted reducer: not a new sum, which
// could no longer be formed (the first rank's buffer holds the result now).
// Rank 1 is a raw peer that never reads its result, and it contributes
// other values after the restart to show which bytes come back.
TEST(Resume, ARankWithoutTheResultGetsTheReplayedBytes) {
  TestCluster cluster(PoolSpec{.shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("resume-replay");
  const std::string address = cluster.addresses()[0];
  constexpr uint64_t kCount = 200;  // one 800-byte chunk
  std::vector<float> a(kCount), x(kCount), y(kCount, -7.0f);
  for (uint64_t i = 0; i < kCount; ++i) {
    a[i] = static_cast<float>(i);
    x[i] = static_cast<float>(1000 + i);
  }
  const FrameHeader h = whole_op_contribution(job, 1, kCount);

  // The Hello a client of a one-group pool sends: one group of 2.
  wire::Control hello = raw_hello(job, 1, 2);
  hello.mutable_hello()->add_group_sizes(2);
  RawPeer first(address);
  first.send_control(hello);
  first.send_frame(h, bytes_of(x));
  auto client = connect_all(cluster, job, 1, [](ClientOptions& o, uint32_t) { o.world_size = 2; });
  ASSERT_EQ(client.size(), 1u);
  ASSERT_TRUE(client[0]->allreduce(a.data(), kCount, DType::kFloat32, RedOp::kSum).is_ok());
  const std::string sum = bytes_of(a);  // a + x
  std::string got;
  ASSERT_TRUE(first.received_within(sum, 5s, &got));

  // Rank 0 has finished op 0; rank 1 is taken to have lost its result.
  auto again = restart_and_resume(cluster, hello, h, y);
  ASSERT_TRUE(again);
  std::string after;
  EXPECT_TRUE(again->received_within(sum, 10s, &after)) << after.size() << " bytes came";
  EXPECT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "resumed"); }, 5s));
}

std::string released_payload(uint64_t op_below) {
  wire::Control m;
  m.mutable_released()->set_op_below(op_below);
  return m.SerializeAsString();
}

// An op of 4 MiB or more is held, not copied: it ends only once a reducer
// has released it, and until then its results in the caller's buffer are
// what a replay sends. Here rank 1 is a raw peer that never says it has the
// result of op 0, so rank 0 (a Client with room for no copy: 1 byte) holds
// it; each test then ends the hold its own way.
class HeldOp : public ::testing::Test {
 protected:
  static constexpr uint64_t kCount = uint64_t{1} << 20;  // 4 MiB: one chunk of the whole

  void SetUp() override {
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    for (uint64_t i = 0; i < kCount; ++i) {
      a[i] = static_cast<float>(i % 4096);
      x[i] = static_cast<float>(1000 + i % 1024);
      expect[i] = a[i] + x[i];
    }
    sum = bytes_of(expect);
    hello.mutable_hello()->add_group_sizes(2);
    peer.emplace(address);
    peer->send_control(hello);
    peer->send_frame(h, bytes_of(x));
    client = connect_all(cluster, job, 1, [](ClientOptions& o, uint32_t) {
      o.world_size = 2;
      o.chunk_bytes = kCount * sizeof(float);
      o.resume_bytes = 1;
    });
    ASSERT_EQ(client.size(), 1u);
    op = client[0]->allreduce_async(a.data(), kCount, DType::kFloat32, RedOp::kSum);
    std::string got;
    ASSERT_TRUE(peer->received_within(sum, 10s, &got));
    // Rank 0 has the result too (the reducer sent both), but rank 1 has not
    // said so: the op is held. Counted, not read: the buffer of an op in
    // flight is the I/O thread's until the op ends (each test reads it then).
    ASSERT_TRUE(eventually(
        [&] { return client[0]->stats().bytes_received == kCount * sizeof(float); }, 5s));
    ASSERT_FALSE(op.wait_for(200ms).has_value()) << "the op ended before it was released";
  }

  TestCluster cluster{large_ops_pool(1)};
  const std::string job = unique_job("resume-held");
  const std::string address = cluster.addresses()[0];
  std::vector<float> a = std::vector<float>(kCount), x = std::vector<float>(kCount),
                     expect = std::vector<float>(kCount);
  std::string sum;
  const FrameHeader h = whole_op_contribution(job, 1, kCount);
  wire::Control hello = raw_hello(job, 1, 2);
  std::optional<RawPeer> peer;
  std::vector<std::unique_ptr<Client>> client;
  OpHandle op;
};

// The reducer is killed: the restarted one gets the result from rank 0's
// buffer, and rank 0's op ends once rank 1 says it has it.
TEST_F(HeldOp, IsReplayedFromTheCallersBufferAndEndsWhenReleased) {
  auto again = restart_and_resume(cluster, hello, h, std::vector<float>(kCount, -7.0f));
  ASSERT_TRUE(again);
  std::string after;
  EXPECT_TRUE(again->received_within(sum, 10s, &after)) << after.size() << " bytes came";
  again->send_control(received(1));
  const auto ended = op.wait_for(5s);
  ASSERT_TRUE(ended.has_value()) << "still held after the release";
  EXPECT_TRUE(ended->is_ok()) << ended->to_string();
  EXPECT_EQ(bytes_of(a), sum);
}

// Rank 1 is lost before it says it has the result: it will never need a
// replay (the job has failed), so the reducer releases op 0 at once and
// rank 0's op ends well, its result intact; the next op names the lost rank.
TEST_F(HeldOp, EndsAtOnceWhenTheRankWithoutItsMarkIsLost) {
  peer.reset();  // closed without a goodbye
  const auto ended = op.wait_for(5s);
  ASSERT_TRUE(ended.has_value()) << "still held though rank 1 is gone";
  EXPECT_TRUE(ended->is_ok()) << ended->to_string();
  EXPECT_EQ(bytes_of(a), sum);
  const Status next = client[0]->allreduce(a.data(), 16, DType::kFloat32, RedOp::kSum);
  EXPECT_EQ(next.code(), ErrorCode::kPeerLost) << next.to_string();
  EXPECT_TRUE(contains(next.message(), "rank 1")) << next.to_string();
}

// A reducer releases the ops below the least Received mark of the job's
// ranks, and tells every rank when that mark advances.
TEST(Resume, ReleasedIsTheLeastReceivedMarkOfTheRanks) {
  TestCluster cluster(PoolSpec{.shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("resume-marks");
  RawPeer p0(cluster.addresses()[0]), p1(cluster.addresses()[0]);
  p0.send_control(raw_hello(job, 0, 2));
  p1.send_control(raw_hello(job, 1, 2));
  p0.send_control(received(5));
  p1.send_control(received(3));
  std::string got0, got1;
  EXPECT_TRUE(p0.received_within(released_payload(3), 5s, &got0));
  EXPECT_TRUE(p1.received_within(released_payload(3), 5s, &got1));
  p1.send_control(received(9));
  EXPECT_TRUE(p0.received_within(released_payload(5), 5s, &got0));
  EXPECT_TRUE(p1.received_within(released_payload(5), 5s, &got1));
  // A mark that does not advance the least one releases nothing more.
  p1.send_control(received(12));
  EXPECT_FALSE(p0.received_within(released_payload(9), 500ms, &got0));
}

// A rank that leaves counts as having every result, so the others are
// released without it; back in the job it has none until it says so.
TEST(Resume, ARankThatLeftIsReleasedWithoutItAndCountedAgainWhenBack) {
  TestCluster cluster(PoolSpec{.shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("resume-left");
  const std::string address = cluster.addresses()[0];
  RawPeer p0(address);
  std::optional<RawPeer> p1(address);
  p0.send_control(raw_hello(job, 0, 2));
  p1->send_control(raw_hello(job, 1, 2));
  p0.send_control(received(5));
  p1->send_control(received(3));
  std::string got0, got1;
  ASSERT_TRUE(p0.received_within(released_payload(3), 5s, &got0));
  // Read all it was sent, so its close is an orderly one (unread bytes
  // would make it a reset, a lost rank, which fails the job).
  ASSERT_TRUE(p1->received_within(released_payload(3), 5s, &got1));
  wire::Control bye;
  bye.mutable_goodbye()->set_reason("done");
  p1->send_control(bye);
  p1.reset();  // a client closes its stream after its goodbye
  EXPECT_TRUE(p0.received_within(released_payload(5), 5s, &got0)) << "not released without rank 1";
  p1.emplace(address);
  p1->send_control(raw_hello(job, 1, 2));
  // Rank 1 is back (its second join is logged) before rank 0's next mark:
  // the two streams are read independently.
  const std::string joined = "rank 1/2 of job '" + job + "' joined";
  ASSERT_TRUE(eventually(
      [&] {
        const std::string log = cluster.reducer_log(0);
        return log.find(joined) != log.rfind(joined);
      },
      5s))
      << cluster.reducer_log(0);
  p0.send_control(received(8));
  EXPECT_FALSE(p0.received_within(released_payload(8), 500ms, &got0))
      << "released past a rank that has said no mark since it came back";
  p1->send_control(received(7));
  EXPECT_TRUE(p0.received_within(released_payload(7), 5s, &got0));
}

// A reducer stopped (SIGSTOP) past the workers' peer timeout and then
// continued: the workers reconnect to it and go on, and every op of theirs
// completes.
TEST(Resume, HungThenContinuedReducerServesTheSameWorkersOn) {
  // Heartbeats well inside the workers' peer timeout, so that only the
  // stopped reducer goes silent.
  PoolSpec spec{.shards = 2};
  spec.reducer_args.insert(spec.reducer_args.end(), {"--heartbeat-ms", "100"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("resume-hung"), 2,
                      [](uint32_t) {
                        return Args{"--count", "30011", "--ops", "60"};
                      },
                      {{"TALLY_HEARTBEAT_MS", "100"}, {"TALLY_PEER_TIMEOUT_MS", "1000"}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(1), "op 5 ok"); }, 30s))
      << workers.stdout_of(1);
  cluster.reducer(1).signal(SIGSTOP);
  struct Continue {
    TestCluster& cluster;
    ~Continue() { cluster.reducer(1).signal(SIGCONT); }
  } continue_at_exit{cluster};
  // Past the peer timeout: both workers have closed their streams to it
  // and are reconnecting (the client library logs it).
  ASSERT_TRUE(eventually(
      [&] {
        return contains(workers.stderr_of(0), "reconnecting") &&
               contains(workers.stderr_of(1), "reconnecting");
      },
      20s))
      << workers.stderr_of(0) << workers.stderr_of(1);
  cluster.reducer(1).signal(SIGCONT);
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = workers.wait(r, 60s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
    EXPECT_TRUE(contains(out.out, "op 59 ok")) << out.out;
  }
}

// A worker stopped (SIGSTOP) past the reducer's peer timeout and then
// continued: the reducer takes it for stalled, not gone. Nothing fails; the
// other rank is asked to rejoin and sends its ops in flight again, the
// stopped one resumes once continued, and every op completes on both.
TEST(Resume, StalledThenContinuedWorkerRejoinsItsJob) {
  PoolSpec spec{.shards = 2};
  spec.reducer_args.insert(spec.reducer_args.end(),
                           {"--heartbeat-ms", "100", "--peer-timeout-ms", "600"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("worker-stalled");
  WorkerGroup workers(cluster, "w", job, 2,
                      [](uint32_t) {
                        return Args{"--count", "30011", "--ops", "40"};
                      },
                      {{"TALLY_HEARTBEAT_MS", "100"}, {"TALLY_PEER_TIMEOUT_MS", "1000"}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(1), "op 5 ok"); }, 30s))
      << workers.stdout_of(1);
  workers.process(1).signal(SIGSTOP);
  struct Continue {
    WorkerGroup& workers;
    ~Continue() { workers.process(1).signal(SIGCONT); }
  } continue_at_exit{workers};
  // Both reducers give up its streams and ask rank 0 to rejoin.
  const std::string stalled = "rank 1 (";
  ASSERT_TRUE(eventually(
      [&] {
        return contains(cluster.reducer_log(0), "stalled") &&
               contains(cluster.reducer_log(1), "stalled") &&
               contains(cluster.reducer_log(0), "asked to rejoin") &&
               contains(cluster.reducer_log(1), "asked to rejoin");
      },
      20s))
      << cluster.reducer_log(0) << cluster.reducer_log(1);
  workers.process(1).signal(SIGCONT);
  for (uint32_t r = 0; r < 2; ++r) {
    auto out = workers.wait(r, 60s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
    EXPECT_TRUE(contains(out.out, "op 39 ok")) << out.out;
  }
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(contains(cluster.reducer_log(i), "rank 1 resumed from")) << cluster.reducer_log(i);
    EXPECT_FALSE(contains(cluster.reducer_log(i), "was lost")) << cluster.reducer_log(i);
  }
}

// A worker stopped for longer than the job's op timeout: the reducer waits
// that long for it and then fails the job, naming it, as for a lost rank.
TEST(Resume, AWorkerStalledPastTheOpTimeoutFailsTheJobNamingIt) {
  PoolSpec spec{.shards = 1};
  spec.reducer_args.insert(spec.reducer_args.end(),
                           {"--heartbeat-ms", "100", "--peer-timeout-ms", "600"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("worker-gone"), 2,
                      [](uint32_t) {
                        return Args{"--count", "30011", "--ops", "1000"};
                      },
                      {{"TALLY_HEARTBEAT_MS", "100"},
                       {"TALLY_PEER_TIMEOUT_MS", "1000"},
                       {"TALLY_OP_TIMEOUT_MS", "3000"}});
  ASSERT_TRUE(eventually([&] { return contains(workers.stdout_of(1), "op 5 ok"); }, 30s))
      << workers.stdout_of(1);
  workers.process(1).signal(SIGSTOP);
  auto out = workers.wait(0, 30s);
  workers.process(1).signal(SIGKILL);
  workers.process(1).signal(SIGCONT);
  EXPECT_NE(out.exit_code, 0) << out.out;
  EXPECT_NE(out.exit_code, -1) << out.out;
  EXPECT_TRUE(contains(out.out, "rank 1")) << out.out;
  EXPECT_TRUE(contains(out.out, "did not resume within 3000 ms")) << out.out;
}

// A rank whose stream breaks while its reducer stays up, before any other
// rank has joined: the reducer sees a lost rank of a job with no other
// member, so the job's next round starts with the rank's resume, and the
// others join that round. Its op in flight completes, exactly, on every rank.
TEST(Resume, ARankCutBeforeTheOthersJoinedResumesIntoTheirRound) {
  TestCluster cluster(PoolSpec{.shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("resume-alone");
  CutLink link(cluster.addresses()[0]);
  ASSERT_FALSE(link.address().empty());
  constexpr uint32_t kWorld = 3;
  constexpr size_t kCount = 4096;
  ClientOptions first = options_for(cluster, job, 0, kWorld);
  first.pool = {link.address()};
  auto rank0 = Client::connect(first);
  ASSERT_TRUE(rank0.is_ok()) << rank0.status().to_string();
  std::vector<std::vector<float>> data(kWorld, std::vector<float>(kCount));
  for (uint32_t r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < kCount; ++i) data[r][i] = static_cast<float>(r * 1000 + i % 100);
  }
  OpHandle op0 = (*rank0)->allreduce_async(data[0].data(), kCount, DType::kFloat32, RedOp::kSum);
  link.cut();
  ASSERT_TRUE(eventually(
      [&] { return contains(cluster.reducer_log(0), "rank 0/3 of job '" + job + "' resumed"); },
      10s))
      << cluster.reducer_log(0);
  std::vector<std::unique_ptr<Client>> others;
  std::vector<OpHandle> ops;
  for (uint32_t r = 1; r < kWorld; ++r) {
    auto c = Client::connect(options_for(cluster, job, r, kWorld));
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    ops.push_back((*c)->allreduce_async(data[r].data(), kCount, DType::kFloat32, RedOp::kSum));
    others.push_back(std::move(*c));
  }
  ops.insert(ops.begin(), op0);
  std::vector<float> sum(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    sum[i] = static_cast<float>(0 + i % 100) + static_cast<float>(1000 + i % 100) +
             static_cast<float>(2000 + i % 100);
  }
  for (uint32_t r = 0; r < kWorld; ++r) {
    const auto ended = ops[r].wait_for(8s);
    ASSERT_TRUE(ended.has_value()) << "rank " << r << "'s op 0 still in flight; reducer log:\n"
                                   << cluster.reducer_log(0);
    ASSERT_TRUE(ended->is_ok()) << "rank " << r << ": " << ended->to_string();
    EXPECT_EQ(bytes_of(data[r]), bytes_of(sum)) << "rank " << r;
  }
}

}  // namespace
}  // namespace tally::testing
