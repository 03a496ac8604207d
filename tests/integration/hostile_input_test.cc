// Hostile input on a reducer's TCP stream, sent by a raw peer: garbage and
// hostile frames, a stalled or silent peer, another protocol version, a huge
// world size, peers that do not read. Each closes only that connection, with
// the reason logged, the reducer serves everyone else, and its peak memory
// stays within its budget plus the documented overhead. (The same on the
// fabric data path is in fabric_test.cc.)
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "raw_peer.h"
#include "tally.pb.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/log_limiter.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::testing {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

TEST(Fault, GarbageAndHostileFramesCloseOnlyThatConnection) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--peer-timeout-ms", "800", "--heartbeat-ms",
                                                     "200", "--hello-timeout-ms", "1500"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string address = cluster.addresses()[0];

  // A peer that has spoken (a heartbeat) and stalls halfway through its
  // next header is dropped by the peer timeout (before its first frame the
  // hello timeout bounds its silence: Fault.SilenceBeforeTheHello...).
  RawPeer stalled(address);
  wire::Control first;
  first.mutable_heartbeat()->set_sequence(1);
  stalled.send_control(first);
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
  {  // A Hello whose job name is not UTF-8 (a proto3 string): refused by the
     // parser, and libprotobuf's own complaint stays out of the log.
    RawPeer peer(address);
    std::string bytes = raw_hello("job-QQQQ", 0, 1).SerializeAsString();
    const auto at = bytes.find("QQQQ");
    ASSERT_NE(at, std::string::npos);
    bytes.replace(at, 4, "\xff\xfe\xfd\xfc");
    FrameHeader h;
    h.kind = FrameKind::kControl;
    h.length = bytes.size();
    peer.send_frame(h, bytes);
    EXPECT_TRUE(peer.closed_within(5s));
  }
  {  // Data before hello.
    RawPeer peer(address);
    FrameHeader h;
    h.kind = FrameKind::kContribution;
    h.count = 16;
    h.chunks_on_shard = 1;
    h.length = 64;
    peer.send_frame(h, std::string(64, '\0'));
    EXPECT_TRUE(peer.closed_within(5s));
  }
  {  // Hello, then a contribution that claims another rank, larger than the buffers.
    RawPeer peer(address);
    const std::string job = unique_job("hostile");
    peer.send_control(raw_hello(job, 0, 2));
    FrameHeader h;
    h.kind = FrameKind::kContribution;
    h.job = job_id(job);
    h.rank = 1;
    h.count = 1u << 20;
    h.chunks_on_shard = 1;
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
  expect_peak_rss_within_overhead(cluster, 0, 12);
  const std::string log = cluster.reducer_log(0);
  EXPECT_TRUE(contains(log, "bad frame magic")) << log;
  EXPECT_TRUE(contains(log, "exceeds the limit")) << log;
  EXPECT_TRUE(contains(log, "malformed control message")) << log;
  EXPECT_TRUE(contains(log, "before its hello")) << log;
  EXPECT_TRUE(contains(log, "no data or heartbeat")) << log;
  EXPECT_TRUE(contains(log, "no hello from")) << log;
  EXPECT_FALSE(contains(log, "libprotobuf")) << log;
}

TEST(Fault, OtherProtocolVersionGetsAClearError) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  // The version after this one (a version-1 peer is refused the same way).
  const uint32_t other = kProtocolVersion + 1;
  const std::string named = "version " + std::to_string(other);
  {  // Another version in the Hello: the reducer answers with an Error, then closes.
    RawPeer peer(cluster.addresses()[0]);
    peer.send_control(raw_hello(unique_job("vnext"), 0, 1, other));
    std::string received;
    EXPECT_TRUE(peer.closed_within(5s, &received));
    ASSERT_GE(received.size(), kFrameHeaderBytes);
    auto h =
        decode_header(std::span<const std::byte, kFrameHeaderBytes>(
                          reinterpret_cast<const std::byte*>(received.data()), kFrameHeaderBytes),
                      FrameLimits{});
    ASSERT_TRUE(h) << h.status().to_string();
    wire::Control reply;
    ASSERT_TRUE(
        reply.ParseFromArray(received.data() + kFrameHeaderBytes, static_cast<int>(h->length)));
    ASSERT_TRUE(reply.has_error());
    EXPECT_EQ(reply.error().code(), wire::VERSION_MISMATCH);
    EXPECT_TRUE(contains(reply.error().message(), named)) << reply.error().message();
  }
  {  // Another version in the frame header itself.
    RawPeer peer(cluster.addresses()[0]);
    auto bytes = encode_header(FrameHeader{});
    bytes[4] = static_cast<std::byte>(other);
    peer.send(bytes.data(), bytes.size());
    EXPECT_TRUE(peer.closed_within(5s));
  }
  EXPECT_TRUE(contains(cluster.reducer_log(0), "protocol " + named)) << cluster.reducer_log(0);
}

// A Hello is untrusted: a huge world size must be refused, not allocated.
TEST(Fault, HugeWorldSizeIsRefused) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  RawPeer peer(cluster.addresses()[0]);
  peer.send_control(raw_hello(unique_job("huge"), 0, 4294967295u));
  std::string received;
  EXPECT_TRUE(peer.closed_within(5s, &received));
  EXPECT_TRUE(contains(received, "exceeds this reducer's maximum")) << received;
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value());
  expect_allreduce_works(cluster, 2, "after-huge");
  expect_peak_rss_within_overhead(cluster, 0, 3);
}

// A stranger's job of world 65536 with a 1 ms op timeout: its timeout error
// lists the first missing ranks and a count, so it fits a control frame and
// reaches the worker (it named all 65535 before: 562 KB, over the client's
// limit), and the sweep over it stays linear, so another job still works.
TEST(Fault, HugeJobTimeoutErrorIsBoundedAndDeliverable) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("huge-timeout");
  RawPeer peer(cluster.addresses()[0]);
  wire::Control h = raw_hello(job, 0, 65536);
  h.mutable_hello()->set_op_timeout_ms(1);
  peer.send_control(h);
  std::string received;
  FrameHeader c;
  c.kind = FrameKind::kContribution;
  c.rank = 0;
  c.job = job_id(job);
  c.op = 0;
  c.count = 2;
  c.offset = 0;
  c.chunk = 0;
  c.chunks_on_shard = 1;
  c.length = 8;
  peer.send_frame(c, std::string(8, '\0'));
  ASSERT_TRUE(peer.received_within("more", 20s, &received)) << received.size();
  EXPECT_TRUE(contains(received,
                       "waiting for ranks [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 and "
                       "65519 more]"))
      << received.substr(0, 2000);
  EXPECT_LT(received.size(), kMaxControlBytes);
  expect_allreduce_works(cluster, 2, "beside-huge");
  expect_peak_rss_within_overhead(cluster, 0, 3);
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Out of descriptors (the reducer runs with 64; 100 sockets wait): the
// accept loop backs off and warns once per 10 s instead of spinning a core
// and writing millions of warnings, and serves again once descriptors free.
TEST(Fault, AcceptBacksOffWhenOutOfDescriptors) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizer runtimes open files of their own (to report, to read
  // /proc/self/maps): out of descriptors they fail, not the reducer.
  GTEST_SKIP() << "not under a sanitizer: its runtime needs descriptors too";
#endif
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);  // the reducer inherits it
  auto cluster = std::make_unique<TestCluster>(PoolSpec{});
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(cluster->ok()) << cluster->error();
  {
    std::vector<std::unique_ptr<RawPeer>> peers;
    for (int i = 0; i < 100; ++i) {
      peers.push_back(std::make_unique<RawPeer>(cluster->addresses()[0]));
    }
    ASSERT_TRUE(eventually([&] { return contains(cluster->reducer_log(0), "accept failed"); }, 10s))
        << cluster->reducer_log(0);
    // A spinning loop wrote millions of lines in this time; a backing-off
    // one writes its first warning only.
    std::this_thread::sleep_for(1s);
    const std::string log = cluster->reducer_log(0);
    EXPECT_EQ(count_of(log, "accept failed"), 1u) << log.substr(0, 4000);
    EXPECT_TRUE(contains(log, "Too many open files")) << log.substr(0, 4000);
  }
  expect_allreduce_works(*cluster, 2, "after-emfile");
  expect_peak_rss_within_overhead(*cluster, 0, 64);
}

// A peer that sends but never reads: a world-1 job whose contributions
// complete at once, so results pile up unread until the job's buffers are
// all waiting to be written and the reducer stops reading too. The write
// deadline closes the stream (before, it stayed paused for ever, holding
// the job's buffers), and the reducer serves everyone else.
TEST(Fault, APeerThatDoesNotReadIsCutOff) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(),
                           {"--peer-timeout-ms", "1000", "--heartbeat-ms", "100"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("no-reader");
  RawPeer peer(cluster.addresses()[0]);
  peer.send_control(raw_hello(job, 0, 1));
  const std::string payload(4096, '\0');
  bool cut = false;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  for (uint64_t op = 0; !cut && std::chrono::steady_clock::now() < deadline; ++op) {
    FrameHeader c;
    c.kind = FrameKind::kContribution;
    c.job = job_id(job);
    c.op = op;
    c.count = 1024;
    c.chunks_on_shard = 1;
    c.length = payload.size();
    cut = !peer.try_send_frame(c, payload, deadline);
  }
  EXPECT_TRUE(cut) << "the reducer kept a stream that never reads";
  EXPECT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "has not read for"); }, 10s))
      << cluster.reducer_log(0);
  expect_allreduce_works(cluster, 2, "after-no-reader");
  expect_peak_rss_within_overhead(cluster, 0, 3);
}

// At --max-connections open streams, a new one cuts the oldest stream not
// yet admitted (silent ones here, oldest first, without a word), and the
// others are kept.
TEST(Fault, ConnectionsBeyondTheCapCutTheOldestNotYetAdmitted) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--max-connections", "8"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < 8; ++i) silent.push_back(std::make_unique<RawPeer>(cluster.addresses()[0]));
  RawPeer extra(cluster.addresses()[0]);  // accepted after the 8, in arrival order
  std::string received;
  EXPECT_TRUE(silent[0]->closed_within(5s, &received));
  EXPECT_TRUE(received.empty()) << received;
  EXPECT_FALSE(silent[1]->closed_within(300ms));
  EXPECT_FALSE(extra.closed_within(300ms));
  EXPECT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "--max-connections"); }, 5s))
      << cluster.reducer_log(0);
  silent.clear();
  expect_allreduce_works(cluster, 2, "after-cap");
  expect_peak_rss_within_overhead(cluster, 0, 10);
}

// When every open stream has joined a job, a stream beyond
// --max-connections is closed as soon as it is accepted, and the slots come
// back when the job's streams go.
TEST(Fault, ConnectionsBeyondTheCapOfJoinedStreamsAreClosedAtOnce) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--max-connections", "4"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  {
    const std::string job = unique_job("cap-joined");
    std::vector<std::unique_ptr<RawPeer>> joined;
    for (uint32_t r = 0; r < 4; ++r) {
      joined.push_back(std::make_unique<RawPeer>(cluster.addresses()[0]));
      joined.back()->send_control(raw_hello(job, r, 4));
      auto welcome = joined.back()->read_frame(10s);
      ASSERT_TRUE(welcome) << "rank " << r << "\n" << cluster.reducer_log(0);
    }
    RawPeer extra(cluster.addresses()[0]);
    std::string received;
    EXPECT_TRUE(extra.closed_within(5s, &received));
    EXPECT_TRUE(received.empty()) << received;
    EXPECT_TRUE(
        eventually([&] { return contains(cluster.reducer_log(0), "every one joined"); }, 5s))
        << cluster.reducer_log(0);
  }
  // The reducer frees the slots as it reads the job's streams' ends.
  EXPECT_TRUE(eventually(
      [&] { return contains(cluster.reducer_log(0), "has no workers left on shard 0"); }, 10s))
      << cluster.reducer_log(0);
  expect_allreduce_works(cluster, 2, "after-cap");
}

// One source address holds at most --max-pending-per-source streams not
// yet admitted: more from it are closed as they are accepted, while
// another source is served.
TEST(Fault, OneSourceHoldsAtMostItsShareOfStreamsNotYetAdmitted) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--max-pending-per-source", "4"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < 5; ++i) {
    silent.push_back(std::make_unique<RawPeer>(cluster.addresses()[0], "127.0.0.2"));
  }
  std::string received;
  EXPECT_TRUE(silent[4]->closed_within(5s, &received));
  EXPECT_TRUE(received.empty()) << received;
  EXPECT_FALSE(silent[0]->closed_within(300ms));
  EXPECT_TRUE(eventually(
      [&] { return contains(cluster.reducer_log(0), "--max-pending-per-source limit"); }, 5s))
      << cluster.reducer_log(0);
  // Workers from 127.0.0.1 are served meanwhile.
  expect_allreduce_works(cluster, 2, "beside-a-full-source");
}

// Streams that announce a control frame of the largest size and then drip
// it: each holds one frame's buffer (kMaxControlBytes) until the hello
// deadline closes it, so 256 of them stay within the per-stream overhead.
TEST(Fault, DrippedControlFramesHoldOneFrameEachUntilTheHelloDeadline) {
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--hello-timeout-ms", "1000"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr int kStreams = 256;
  std::vector<std::unique_ptr<RawPeer>> drips;
  FrameHeader h;
  h.kind = FrameKind::kControl;
  h.length = kMaxControlBytes;
  for (int i = 0; i < kStreams; ++i) {
    drips.push_back(std::make_unique<RawPeer>(cluster.addresses()[0]));
    drips.back()->send_frame(h, "\x0a");
  }
  for (auto& peer : drips) EXPECT_TRUE(peer->closed_within(10s));
  expect_allreduce_works(cluster, 2, "after-drips");
  expect_peak_rss_within_overhead(cluster, 0, kStreams + 2);
}

// Peers that send but never read, each flooding the Received marks of a
// world-1 job, which the reducer answers with a Released apiece. The replies
// queued for them are charged what they cost and share one reducer-wide cap,
// so each such stream is cut off and the peak RSS stays bounded (8 of them
// took a reducer from 10 to 550 MiB when only payload bytes were counted,
// per stream).
TEST(Fault, ControlRepliesToPeersThatDoNotReadAreBounded) {
  TestCluster cluster(PoolSpec{});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr int kPeers = 16;
  std::atomic<int> cut{0};
  std::vector<std::thread> peers;
  for (int i = 0; i < kPeers; ++i) {
    peers.emplace_back([&, i] {
      RawPeer peer(cluster.addresses()[0]);
      peer.send_control(raw_hello(unique_job("flood" + std::to_string(i)), 0, 1));
      const auto deadline = std::chrono::steady_clock::now() + 30s;
      uint64_t mark = 1;
      std::string batch;
      for (int round = 0; round < 200; ++round) {
        batch.clear();
        for (int j = 0; j < 4096; ++j) {
          wire::Control m;
          m.mutable_received()->set_op_below(mark++);
          batch += control_frame(m);
        }
        if (!peer.try_send(batch, deadline)) {
          ++cut;
          return;
        }
      }
    });
  }
  for (auto& t : peers) t.join();
  EXPECT_EQ(cut.load(), kPeers);
  EXPECT_TRUE(contains(cluster.reducer_log(0), "does not read")) << cluster.reducer_log(0);
  expect_allreduce_works(cluster, 2, "after-flood");
  expect_peak_rss_within_overhead(cluster, 0, kPeers + 2);
}

}  // namespace
}  // namespace tally::testing

namespace tally::testing {
namespace {

// A flood of garbage connections (closed before their hello) and of
// refused hellos (another protocol version) costs at most a burst of log
// lines per kind and 10 s, not a line per connection (LogLimiter); the
// next line says how many went unlogged.
TEST(Fault, AFloodOfRefusedConnectionsCostsAFewLogLines) {
  PoolSpec spec;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string address = cluster.addresses()[0];
  constexpr int kFlood = 150;
  const std::string junk(64, 'A');
  for (int i = 0; i < kFlood; ++i) {
    RawPeer garbage(address);
    garbage.send(junk.data(), junk.size());
    ASSERT_TRUE(garbage.closed_within(5s)) << i;
    RawPeer refused(address);
    refused.send_control(raw_hello(unique_job("flood"), 0, 1, kProtocolVersion + 1));
    ASSERT_TRUE(refused.closed_within(5s)) << i;
  }
  const std::string log = cluster.reducer_log(0);
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
    return n;
  };
  // Within one 10 s interval (the flood takes about one), or across two.
  const size_t most = 2 * LogLimiter::kBurst;
  EXPECT_GE(count("closed before joining a job"), 1u) << log;
  EXPECT_LE(count("closed before joining a job"), most) << log;
  EXPECT_GE(count("rejecting "), 1u) << log;
  EXPECT_LE(count("rejecting "), most) << log;
}

}  // namespace
}  // namespace tally::testing
