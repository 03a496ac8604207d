// The libfabric data path beyond the all-reduce sweep: start-up and connect
// errors for a provider that does not exist or a transport the pool does not
// serve; hostile frames on the data path (sent through the transport library
// by a raw peer); one pool serving tcp and fabric workers at once; memory
// registration forced on both sides. Tests that need libfabric skip, with the
// reason, where this machine has no usable provider. The pool reached off
// loopback, through network namespaces, is in netns_test.cc.
#include <gtest/gtest.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "raw_peer.h"
#include "tally.pb.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// ---------------------------------------------------------------------------
// Start-up and connect errors

// A reducer asked for a provider this machine lacks stops at once, naming it
// and how to list the ones there are; it never listens.
TEST(Fabric, UnknownProviderStopsTheReducerAtStartup) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  struct Variant {
    std::string name;
    Args args;
    Env env;
  };
  const std::vector<Variant> variants = {
      {"flag", {"--fabric-provider", "no-such-provider"}, {}},
      // libfabric's own variable is the fallback default.
      {"fi-provider", {}, {{"FI_PROVIDER", "no-such-provider"}}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const std::string ready = dir.path() + "/" + v.name + ".ready";
    Args args{"--listen", "127.0.0.1:0", "--transport", "fabric", "--ready-file", ready};
    args.insert(args.end(), v.args.begin(), v.args.end());
    const auto t0 = Clock::now();
    Child reducer = spawn_child(dir.path(), v.name, TALLY_REDUCER_PATH, args, v.env);
    std::string log;
    auto st = reducer.wait(10s, &log);
    ASSERT_TRUE(st.has_value()) << "still running after 10 s:\n" << log;
    EXPECT_NE(*st, 0) << log;
    EXPECT_LT(since(t0), 5s) << log;
    EXPECT_TRUE(contains(log, "cannot start")) << log;
    EXPECT_TRUE(contains(log, "'no-such-provider'")) << log;
    EXPECT_TRUE(contains(log, "fi_info")) << log;
    EXPECT_FALSE(fs::exists(ready)) << "it listened";
  }
}

// A worker asking for the fabric data path from a pool that serves only tcp
// is refused at connect with what to change; the pool keeps serving tcp.
TEST(Fabric, FabricWorkerAgainstATcpPoolFailsAtConnect) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto t0 = Clock::now();
  auto out = run_one(cluster, {{"TALLY_TRANSPORT", "fabric"}}, 15s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "--transport fabric")) << out.out;
  EXPECT_TRUE(contains(out.out, "serves only tcp")) << out.out;
  EXPECT_LT(since(t0), 5s) << out.out;
  for (uint32_t s = 0; s < 2; ++s) EXPECT_FALSE(cluster.reducer(s).wait_for(0ms).has_value());
  expect_allreduce_works(cluster, 2, "tcp-after");
}

// A worker whose provider does not exist fails at connect naming it, from
// TALLY_FABRIC_PROVIDER or from FI_PROVIDER; the pool is untouched.
TEST(Fabric, UnknownProviderOnAWorkerFailsAtConnect) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  for (const char* variable : {"TALLY_FABRIC_PROVIDER", "FI_PROVIDER"}) {
    SCOPED_TRACE(variable);
    const auto t0 = Clock::now();
    auto out = run_one(cluster, {{variable, "no-such-provider"}}, 15s);
    EXPECT_EQ(out.exit_code, 2) << out.out;
    EXPECT_TRUE(contains(out.out, "'no-such-provider'")) << out.out;
    EXPECT_TRUE(contains(out.out, "fi_info")) << out.out;
    EXPECT_LT(since(t0), 5s) << out.out;
  }
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value());
  expect_allreduce_works(cluster, 2, "after-bad-provider");
}

// Both sides must use the same provider: a worker on another one that does
// exist here is refused naming both.
TEST(Fabric, ProviderMismatchIsRefusedNamingBoth) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  FabricOptions sockets;
  sockets.provider = "sockets";
  if (auto f = Fabric::open(sockets); !f) {
    GTEST_SKIP() << "needs a second provider ('sockets') here: " << f.status().to_string();
  }
  PoolSpec spec;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto out = run_one(cluster, {{"TALLY_FABRIC_PROVIDER", "sockets"}}, 15s);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_TRUE(contains(out.out, "provider mismatch")) << out.out;
  EXPECT_TRUE(contains(out.out, "'sockets'")) << out.out;
  EXPECT_TRUE(contains(out.out, "ofi_rxm")) << out.out;
  expect_allreduce_works(cluster, 2, "after-mismatch");
}

// ---------------------------------------------------------------------------
// Hostile frames on the fabric data path

// Worker streams spoken directly through the transport library, on a fabric
// of their own with one I/O thread, so a test can send over the fabric data
// path what a real client never would. Every call blocks until done on the
// I/O thread (at most `kCallTimeout`).
class RawFabricPeers {
 public:
  static constexpr auto kCallTimeout = 10s;

  // One stream: the reducer's side is driven by the handler below.
  struct Stream : FrameHandler {
    std::shared_ptr<Connection> conn;
    std::mutex mu;
    std::condition_variable cv;
    bool welcomed = false;
    std::optional<Status> closed;
    std::string error;  // an Error the reducer sent
    std::shared_ptr<std::vector<std::byte>> result;
    bool got_result = false;

    PayloadAction on_data_header(const FrameHeader& h) override {
      if (h.kind != FrameKind::kResult)
        return PayloadAction::close(Status(ErrorCode::kProtocol, "not a result"));
      result = std::make_shared<std::vector<std::byte>>(h.length);
      return PayloadAction::receive(*result, result);
    }
    void on_data(const FrameHeader&, std::span<std::byte>) override {
      std::lock_guard lock(mu);
      got_result = true;
      cv.notify_all();
    }
    void on_control(const wire::Control& m) override {
      std::lock_guard lock(mu);
      if (m.has_welcome()) {
        Status s = conn->attach_data_path(m.welcome().data_path());
        if (!s.is_ok()) error = "attach: " + s.to_string();
        welcomed = s.is_ok();
      }
      if (m.has_error()) error = m.error().message();
      cv.notify_all();
    }
    void on_closed(const Status& reason) override {
      std::lock_guard lock(mu);
      closed = reason;
      conn.reset();  // the connection holds this handler: break the cycle
      cv.notify_all();
    }
    template <typename Pred>
    bool wait(Pred pred, std::chrono::milliseconds timeout) {
      std::unique_lock lock(mu);
      return cv.wait_for(lock, timeout, [&] { return pred(); });
    }
  };

  static Result<std::unique_ptr<RawFabricPeers>> open() {
    auto fabric = Fabric::open(FabricOptions{});
    if (!fabric) return fabric.status();
    std::unique_ptr<RawFabricPeers> peers(new RawFabricPeers(*fabric));
    return peers;
  }

  ~RawFabricPeers() {
    for (auto& s : streams_) {
      run([&] {
        if (auto c = s->conn) c->close(Status(ErrorCode::kCancelled, "test over"));
      });
      s->wait([&] { return s->closed.has_value(); }, kCallTimeout);
    }
    guard_.reset();
    io_.stop();
    thread_.join();
    fabric_->close();
    streams_.clear();
  }

  // Connects a stream to `address` and says hello as rank 0 of a one-rank
  // job, offering the fabric data path; returns once the reducer welcomed it.
  Result<Stream*> connect(const std::string& address, const std::string& job,
                          uint32_t op_timeout_ms = 5000) {
    auto hp = parse_host_port(address);
    if (!hp) return hp.status();
    auto stream = std::make_shared<Stream>();
    Status status;
    run([&] {
      boost::asio::ip::tcp::socket socket(io_);
      boost::system::error_code ec;
      socket.connect({boost::asio::ip::make_address(hp->host), hp->port}, ec);
      if (ec) {
        status = Status(ErrorCode::kUnavailable, "connect: " + ec.message());
        return;
      }
      ConnectionOptions options;
      options.heartbeat_interval = 100ms;  // below any peer timeout a test gives the reducer
      stream->conn = fabric_->make_connection(std::move(socket), options);
      stream->conn->start(stream);
      wire::Control hello;
      auto* h = hello.mutable_hello();
      h->set_protocol_version(kProtocolVersion);
      h->set_job(job);
      h->set_rank(0);
      h->set_world_size(1);
      h->set_op_timeout_ms(op_timeout_ms);
      status = stream->conn->describe_data_path(h->mutable_data_path());
      if (status.is_ok()) stream->conn->send_control(hello);
    });
    if (!status.is_ok()) return status;
    streams_.push_back(stream);
    if (!stream->wait([&] { return stream->welcomed || stream->closed || !stream->error.empty(); },
                      kCallTimeout) ||
        !stream->welcomed) {
      return Status(ErrorCode::kProtocol, "no welcome: " + stream->error);
    }
    return stream.get();
  }

  // Sends one data frame: the header as given, a payload of any size.
  void send(Stream* stream, const FrameHeader& header, size_t payload_bytes) {
    auto payload = std::make_shared<std::vector<float>>(payload_bytes / sizeof(float), 1.0f);
    run([&] {
      if (auto c = stream->conn) {
        c->send(header, std::as_bytes(std::span(*payload)), [payload](const Status&) {});
      }
    });
  }

 private:
  explicit RawFabricPeers(std::shared_ptr<Fabric> fabric)
      : fabric_(std::move(fabric)), guard_(io_.get_executor()), thread_([this] { io_.run(); }) {}

  // Runs `f` on the I/O thread and waits for it.
  void run(const std::function<void()>& f) {
    std::promise<void> done;
    boost::asio::post(io_, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait_for(kCallTimeout);
  }

  std::shared_ptr<Fabric> fabric_;
  boost::asio::io_context io_{1};
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> guard_;
  std::thread thread_;
  std::vector<std::shared_ptr<Stream>> streams_;
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A well-formed one-chunk contribution of `count` floats from rank 0.
FrameHeader contribution(const std::string& job, uint64_t count) {
  return whole_op_contribution(job, 0, count);
}

// Frames a real client never sends, over the fabric data path: each closes
// its own stream with the reason logged, never the reducer, which then
// serves everyone else and shuts down cleanly. A well-formed frame from the
// same raw peer first shows the peer itself speaks the protocol.
TEST(Fabric, HostileFramesOnTheDataPathCloseOnlyThatStream) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto peers = RawFabricPeers::open();
  ASSERT_TRUE(peers) << peers.status().to_string();
  const std::string address = cluster.addresses()[0];
  using Stream = RawFabricPeers::Stream;

  {  // Well-formed: one chunk of 16 ones comes back summed over one rank.
    const std::string job = unique_job("raw-ok");
    auto s = (*peers)->connect(address, job);
    ASSERT_TRUE(s) << s.status().to_string();
    (*peers)->send(*s, contribution(job, 16), 64);
    Stream* st = *s;
    ASSERT_TRUE(st->wait([&] { return st->got_result || st->closed; }, 10s));
    ASSERT_TRUE(st->got_result) << (st->closed ? st->closed->to_string() : "");
    std::vector<float> sum(16);
    std::memcpy(sum.data(), st->result->data(), std::min(st->result->size(), sizeof(float) * 16));
    EXPECT_EQ(sum, std::vector<float>(16, 1.0f));
  }
  struct Hostile {
    std::string what;
    std::function<FrameHeader(const std::string& job)> header;
    size_t payload_bytes;
    std::string logged;  // in the reducer's log (lower-cased) once the stream is closed
  };
  const std::vector<Hostile> cases = {
      {"a data frame larger than the reducer's chunk limit",
       [](const std::string& job) { return contribution(job, 1u << 20); }, 0, "exceeds the limit"},
      {"a control frame on the data path",
       [](const std::string& job) {
         FrameHeader h = contribution(job, 0);
         h.kind = FrameKind::kControl;
         h.chunks_on_shard = 0;  // else decoding refuses it before the data path does
         return h;
       },
       0, "control frame on the fabric data path"},
      {"a payload longer than its header says",
       [](const std::string& job) { return contribution(job, 16); }, 4096, "truncat"},
      {"a payload shorter than its header says",
       [](const std::string& job) { return contribution(job, 1024); }, 64,
       "where 4096 were expected"},
  };
  for (const Hostile& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string job = unique_job("raw-hostile");
    auto s = (*peers)->connect(address, job);
    ASSERT_TRUE(s) << s.status().to_string();
    (*peers)->send(*s, c.header(job), c.payload_bytes);
    Stream* st = *s;
    EXPECT_TRUE(st->wait([&] { return st->closed.has_value(); }, 10s))
        << "the reducer kept the stream open";
    EXPECT_TRUE(eventually([&] { return contains(lower(cluster.reducer_log(0)), c.logged); }, 5s))
        << cluster.reducer_log(0);
    EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value()) << cluster.reducer_log(0);
  }
  expect_allreduce_works(cluster, 2, "after-hostile");
}

// A data path that stops between a frame's header and its payload (a
// rendezvous stalled by a fabric partition, while the TCP control stream and
// its heartbeats stay up) must be noticed as on TCP, where a stream that
// stops mid-frame delivers nothing and the peer timeout closes it naming the
// peer: the stream is closed within about the peer timeout, and the op fails
// naming the rank whose payload never came (the op timeout is 2 s here,
// well after the stall is noticed).
TEST(Fabric, PayloadThatNeverFollowsItsHeaderIsNoticedAsOnTcp) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  const auto peer_timeout = 800ms;
  PoolSpec spec;
  spec.transport = "fabric";
  spec.reducer_args.insert(
      spec.reducer_args.end(),
      {"--peer-timeout-ms", std::to_string(peer_timeout.count()), "--heartbeat-ms", "200"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  auto peers = RawFabricPeers::open();
  ASSERT_TRUE(peers) << peers.status().to_string();
  const std::string job = unique_job("no-payload");
  auto s = (*peers)->connect(cluster.addresses()[0], job, /*op_timeout_ms=*/2000);
  ASSERT_TRUE(s) << s.status().to_string();
  RawFabricPeers::Stream* st = *s;
  // A header announcing 64 bytes, and no payload message.
  (*peers)->send(st, contribution(job, 16), 0);
  const auto t0 = Clock::now();
  const bool closed = st->wait([&] { return st->closed.has_value(); }, 3 * peer_timeout);
  EXPECT_TRUE(closed) << "the stream is still open " << since(t0).count() << " ms later\n"
                      << cluster.reducer_log(0);
  // As a stream silent on TCP: the rank stalled, and is awaited until the
  // op timeout (2 s); the job then fails, naming it.
  ASSERT_TRUE(eventually([&] { return contains(cluster.reducer_log(0), "did not resume"); }, 5s))
      << cluster.reducer_log(0);
  const std::string log = cluster.reducer_log(0);
  EXPECT_TRUE(contains(log, "stalled (the payload of")) << log;
  EXPECT_TRUE(contains(log, "did not resume within 2000 ms")) << log;
  EXPECT_FALSE(contains(log, "waiting for ranks []")) << log;
  EXPECT_FALSE(cluster.reducer(0).wait_for(0ms).has_value()) << log;
}

// ---------------------------------------------------------------------------
// Serving both transports, and forced registration

// Workers print "fabric endpoint open" at info level when they open one.
constexpr const char* kEndpointLine = "fabric endpoint open";

// A fabric pool serves a tcp job and a fabric job at the same time: both
// run many ops until the test has seen each in flight, then stop together
// (--stop-file) with every sum exact. Memory is registered only where the
// provider asks (tcp;ofi_rxm does not).
TEST(Fabric, OnePoolServesTcpAndFabricJobsAtOnce) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.shards = 2;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string stop = cluster.dir() + "/stop";
  auto args = [&](uint32_t) {
    return Args{"--counts",    "9477,1,1009", "--ops",       "100000",
                "--stop-file", stop,          "--log-level", "info"};
  };
  WorkerGroup tcp_job(cluster, "t", unique_job("tcp"), 2, args, {{"TALLY_TRANSPORT", "tcp"}});
  WorkerGroup fabric_job(cluster, "f", unique_job("fabric"), 2, args,
                         {{"TALLY_TRANSPORT", "fabric"}});
  const bool both_running = eventually(
      [&] {
        for (uint32_t r = 0; r < 2; ++r) {
          if (!contains(tcp_job.stdout_of(r), "op 5 ok") ||
              !contains(fabric_job.stdout_of(r), "op 5 ok")) {
            return false;
          }
        }
        return true;
      },
      30s);
  std::ofstream(stop) << "stop\n";
  EXPECT_TRUE(both_running) << "tcp:\n"
                            << tcp_job.stdout_of(0) << "fabric:\n"
                            << fabric_job.stdout_of(0);
  for (uint32_t r = 0; r < 2; ++r) {
    auto t = tcp_job.wait(r, 30s);
    EXPECT_EQ(t.exit_code, 0) << "tcp rank " << r << ":\n" << t.out;
    EXPECT_TRUE(contains(t.out, "\nok\n")) << t.out;
    EXPECT_FALSE(contains(t.out, kEndpointLine)) << "a tcp worker opened a fabric endpoint:\n"
                                                 << t.out;
    auto f = fabric_job.wait(r, 30s);
    EXPECT_EQ(f.exit_code, 0) << "fabric rank " << r << ":\n" << f.out;
    EXPECT_TRUE(contains(f.out, "\nok\n")) << f.out;
    EXPECT_TRUE(contains(f.out, kEndpointLine)) << f.out;
    EXPECT_TRUE(contains(f.out, "registration off")) << f.out;
  }
  EXPECT_TRUE(contains(cluster.reducer_log(0), "memory registration off"))
      << cluster.reducer_log(0);
}

// One job whose ranks use different data paths: the reducer sums per job,
// whatever each stream rides on.
TEST(Fabric, OneJobMixingTransportsGetsExactSums) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.shards = 2;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("mixed");
  constexpr uint32_t kWorld = 4;
  std::vector<bench::Process> procs;
  for (uint32_t r = 0; r < kWorld; ++r) {
    auto env = cluster.worker_env(job, r, kWorld);
    env["TALLY_TRANSPORT"] = r % 2 ? "tcp" : "fabric";
    procs.push_back(cluster.spawn_worker("m" + std::to_string(r),
                                         {"--counts", "1,257,9477,37893", "--ops", "8"}, env));
  }
  for (uint32_t r = 0; r < kWorld; ++r) {
    auto out = wait_worker(procs[r], cluster, "m" + std::to_string(r), 60s);
    EXPECT_EQ(out.exit_code, 0) << "rank " << r << ":\n" << out.out;
    EXPECT_TRUE(contains(out.out, "\nok\n")) << out.out;
  }
}

// --fabric-force-registration / TALLY_FABRIC_FORCE_REGISTRATION=1 make both
// sides register every buffer although tcp;ofi_rxm does not ask. Two jobs at
// once, each cycling op sizes over one worker buffer: one in 4 KiB chunks (a
// 4 MB op is a thousand chunks, more registrations than the cache keeps, so
// entries are evicted and re-registered), one in 1 MiB chunks (registrations
// of many pages, messages large enough for the provider's rendezvous). The
// reducer reuses its chunk buffers across ops and jobs: the cache's hits,
// misses and evictions all carry data that must come out exact.
TEST(Fabric, ForcedRegistrationOnBothSidesGivesExactSums) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.shards = 2;
  spec.transport = "fabric";
  spec.reducer_args = {"--max-chunk-bytes",
                       "1MiB",
                       "--memory-budget",
                       "32MiB",
                       "--window",
                       "4",
                       "--io-threads",
                       "2",
                       "--log-level",
                       "info",
                       "--fabric-force-registration"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const Args args{"--counts", "1,9477,1000003,0,1009,1000003", "--ops", "6", "--log-level", "info"};
  WorkerGroup small(cluster, "s", unique_job("registered-4k"), 4, [&](uint32_t) { return args; },
                    {{"TALLY_FABRIC_FORCE_REGISTRATION", "1"}, {"TALLY_CHUNK_BYTES", "4096"}});
  WorkerGroup large(cluster, "l", unique_job("registered-1m"), 2, [&](uint32_t) { return args; },
                    {{"TALLY_FABRIC_FORCE_REGISTRATION", "1"}, {"TALLY_CHUNK_BYTES", "1048576"}});
  for (auto [group, world] : {std::pair{&small, 4u}, std::pair{&large, 2u}}) {
    for (uint32_t r = 0; r < world; ++r) {
      auto out = group->wait(r, 60s);
      EXPECT_EQ(out.exit_code, 0) << group->name(r) << ":\n" << out.out;
      EXPECT_TRUE(contains(out.out, "op 5 ok hash ") && contains(out.out, "\nok\n")) << out.out;
      EXPECT_TRUE(contains(out.out, "registration on")) << out.out;
    }
  }
  for (uint32_t s = 0; s < 2; ++s) {
    EXPECT_TRUE(contains(cluster.reducer_log(s), "memory registration on"))
        << cluster.reducer_log(s);
  }
}

// TALLY_FABRIC_FORCE_REGISTRATION is one switch read by both programs: a
// value that reads as false leaves registration to the provider on a worker
// as it does on the reducer (CLI11 reads "false", "off" and "no" as false).
TEST(Fabric, ForceRegistrationSwitchReadsFalseAsOffOnBothSides) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  // The reducer, with the switch in its environment.
  const std::string ready = cluster.dir() + "/ready-false";
  Child reducer =
      spawn_child(cluster.dir(), "r-false", TALLY_REDUCER_PATH,
                  {"--listen", "127.0.0.1:0", "--transport", "fabric", "--ready-file", ready},
                  {{"TALLY_FABRIC_FORCE_REGISTRATION", "false"}});
  // Workers, one job each, at the same time.
  const std::vector<std::string> values = {"false", "off", "no"};
  std::vector<std::unique_ptr<WorkerGroup>> workers;
  for (const std::string& value : values) {
    workers.push_back(std::make_unique<WorkerGroup>(
        cluster, "w-" + value, unique_job("switch"), 1,
        [](uint32_t) {
          return Args{"--count", "1009", "--log-level", "info"};
        },
        Env{{"TALLY_FABRIC_FORCE_REGISTRATION", value}}));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    SCOPED_TRACE("worker with TALLY_FABRIC_FORCE_REGISTRATION=" + values[i]);
    auto out = workers[i]->wait(0, 15s);
    EXPECT_EQ(out.exit_code, 0) << out.out;
    EXPECT_TRUE(contains(out.out, "registration off")) << out.out;
  }
  EXPECT_TRUE(eventually(
      [&] { return fs::exists(ready) || reducer.process->wait_for(0ms).has_value(); }, 15s));
  EXPECT_EQ(reducer.process->terminate(5000ms), 0) << reducer.err();
  EXPECT_TRUE(contains(reducer.err(), "memory registration off")) << reducer.err();
}

// Workers leave a fabric pool without leaking anything: in the sanitizer
// builds a leak at exit makes a worker's exit status non-zero, so this test
// has its teeth there (in a plain build it checks clean exits only). Eight
// one-rank jobs on one shard: the race below shows in most runs.
//
// The race it guards: ~Client stops its io_context as soon as the goodbyes
// are written, while each FabricConnection may still wait for its
// cancelled receives; Fabric::close() must then break the ShardLink <->
// FabricConnection <-> TcpConnection cycles it leaves behind.
TEST(Fabric, WorkersShutDownWithoutLeaks) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  PoolSpec spec;
  spec.shards = 1;
  spec.transport = "fabric";
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  std::vector<std::unique_ptr<WorkerGroup>> jobs;
  for (int j = 0; j < 8; ++j) {
    jobs.push_back(std::make_unique<WorkerGroup>(cluster, "j" + std::to_string(j) + "-",
                                                 unique_job("leave"), 1, [](uint32_t) {
                                                   return Args{"--count", "1009"};
                                                 }));
  }
  for (auto& job : jobs) {
    auto out = job->wait(0, 30s);
    EXPECT_EQ(out.exit_code, 0) << job->name(0) << ":\n" << out.out.substr(0, 3000);
    EXPECT_TRUE(contains(out.out, "\nok\n")) << out.out.substr(0, 3000);
  }
}

}  // namespace
}  // namespace tally::testing
