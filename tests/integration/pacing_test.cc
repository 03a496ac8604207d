// What the streams of a pool carry besides the sums: pacing to a told link
// rate (each stream's SO_MAX_PACING_RATE, read with ss), chunks cut by the
// slowest reducer's link, and the receive budget (each stream's window
// clamp, read from the process that holds the socket), on tcp pools and on
// a fabric pool's tcp workers. Real reducer processes, in-process clients
// and real worker processes; the sums are checked exactly.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "clients.h"
#include "harness.h"
#include "tally/bench/pattern.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::testing {
namespace {

// The first group of `pattern` in each established TCP socket that `ss
// <options>` shows for `filter`, as numbers.
std::vector<uint64_t> ss_numbers(const std::string& options, const std::string& filter,
                                 const std::regex& pattern) {
  std::vector<uint64_t> numbers;
  const std::string command =
      "ss " + options + " state established '( " + filter + " )' 2>/dev/null";
  FILE* ss = ::popen(command.c_str(), "r");
  if (!ss) return numbers;
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, ss)) > 0;) out.append(buf, n);
  ::pclose(ss);
  for (std::sregex_iterator it(out.begin(), out.end(), pattern), end; it != end; ++it) {
    numbers.push_back(std::stoull((*it)[1]));
  }
  return numbers;
}

// The maximum pacing rates, in bytes per second, of the sockets that
// `filter` selects (those that have one).
std::vector<uint64_t> max_pacing_rates(const std::string& filter) {
  static const std::regex rate(R"(pacing_rate \d+bps/(\d+)bps)");
  std::vector<uint64_t> rates = ss_numbers("-tinH", filter, rate);
  for (uint64_t& r : rates) r /= 8;
  return rates;
}

// The port a one-reducer pool listens on.
uint16_t cluster_port(TestCluster& cluster) {
  const std::string pool = cluster.pool_string();
  return static_cast<uint16_t>(std::stoi(pool.substr(pool.rfind(':') + 1)));
}

// The window clamp (TCP_WINDOW_CLAMP) of each established TCP stream that
// process `pid` holds whose peer's port (or, with `local`, its own) is
// `port`, in ascending order: a bounded stream's is its bound
// (Connection::bound_receive_window); an unbounded one's follows the
// kernel's autotuning. The sockets are duplicated from the process
// (pidfd_getfd; Debian 12's header for it lacks C linkage, so the system
// calls), as a debugger would; the test's own process works too.
std::vector<uint64_t> window_clamps(pid_t pid, uint16_t port, bool local) {
  std::vector<uint64_t> clamps;
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  EXPECT_GE(pidfd, 0) << "pidfd_open(" << pid << "): " << std::strerror(errno);
  if (pidfd < 0) return clamps;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec);
    if (ec || !target.string().starts_with("socket:")) continue;
    const int fd = static_cast<int>(
        ::syscall(SYS_pidfd_getfd, pidfd, std::stoi(entry.path().filename().string()), 0));
    if (fd < 0) continue;  // closed since the listing
    sockaddr_storage address{};
    socklen_t length = sizeof address;
    tcp_info info{};
    socklen_t info_length = sizeof info;
    int clamp = 0;
    socklen_t clamp_length = sizeof clamp;
    const bool stream =
        (local ? ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length)
               : ::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length)) == 0 &&
        (address.ss_family == AF_INET || address.ss_family == AF_INET6) &&
        ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &info_length) == 0 &&
        info.tcpi_state == TCP_ESTABLISHED &&
        ::getsockopt(fd, IPPROTO_TCP, TCP_WINDOW_CLAMP, &clamp, &clamp_length) == 0;
    const uint16_t port_seen =
        ntohs(address.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&address)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
    if (stream && port_seen == port) clamps.push_back(static_cast<uint64_t>(clamp));
    ::close(fd);
  }
  ::close(pidfd);
  std::sort(clamps.begin(), clamps.end());
  return clamps;
}

// The window clamp the kernel gives a fresh loopback stream that nobody
// bounds: what a stream left out of the receive budget starts with.
uint64_t unbounded_window_clamp() {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::address_v4::loopback(), 0});
  asio::ip::tcp::socket client(io);
  client.connect(acceptor.local_endpoint());
  asio::ip::tcp::socket server = acceptor.accept();
  int clamp = 0;
  socklen_t length = sizeof clamp;
  EXPECT_EQ(::getsockopt(server.native_handle(), IPPROTO_TCP, TCP_WINDOW_CLAMP, &clamp, &length),
            0);
  return static_cast<uint64_t>(clamp);
}

// With a link rate the reducer paces each of a job's worker streams to its
// share (--link-rate) and tells the worker that share in its Welcome; a
// worker paces each stream to its own share (TALLY_LINK_RATE) or the
// reducer's, whichever is less. At 16 Mbit/s the reducer's two worker
// streams get 950 kB/s each, below the workers' 12 Mbit/s (1.425 MB/s), so
// 2 MiB each way take at least 2.2 s, where unpaced loopback takes
// milliseconds. The sums stay exact.
TEST(Pacing, StreamsArePacedToTheirShareOfTheLinkRate) {
  if (auto paced = paced_congestion_control(""); !paced) {
    GTEST_SKIP() << "no congestion control to pace with here: " << paced.status().to_string();
  }
  PoolSpec spec;
  spec.reducer_args.insert(spec.reducer_args.end(), {"--link-rate", "16mbit"});
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const auto start = std::chrono::steady_clock::now();
  WorkerGroup workers(cluster, "w", unique_job("paced"), 2,
                      [](uint32_t) {
                        return Args{"--count", std::to_string(512 * 1024)};
                      },
                      {{"TALLY_CHUNK_BYTES", "4096"}, {"TALLY_LINK_RATE", "12mbit"}});
  // While the op runs: the reducer's side of each worker stream, and the
  // workers' side.
  const std::string port = cluster.pool_string().substr(cluster.pool_string().rfind(':') + 1);
  const std::vector<uint64_t> share{950000, 950000};
  std::vector<uint64_t> reducer_side, worker_side;
  for (auto deadline = start + std::chrono::seconds(20);
       std::chrono::steady_clock::now() < deadline &&
       (reducer_side != share || worker_side != share);
       std::this_thread::sleep_for(std::chrono::milliseconds(20))) {
    // The last look that found both streams.
    if (auto r = max_pacing_rates("sport = :" + port); r.size() == 2) reducer_side = r;
    if (auto w = max_pacing_rates("dport = :" + port); w.size() == 2) worker_side = w;
  }
  EXPECT_EQ(reducer_side, share);
  EXPECT_EQ(worker_side, share) << "the workers' own share is 1425000";
  for (uint32_t r = 0; r < 2; ++r) {
    WorkerOutput out = workers.wait(r, std::chrono::seconds(60));
    EXPECT_EQ(out.exit_code, 0) << "rank " << r << ":\n" << out.out;
    EXPECT_NE(out.out.find("\nok\n"), std::string::npos) << out.out;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 1.8) << "2 MiB each way per worker at 950 kB/s";
}

// The Welcome carries each reducer's link rate, and the workers cut by the
// slowest: on a pool at 500 Mbit/s a 4 MiB op over 2 shards gets chunks of
// about 3 ms of a stream's share (84 KiB, max(S, W) = 2 streams sharing a
// link), where an unpaced pool keeps the 256 KiB ceiling. The floor is the
// same with or without a rate. The sums stay exact either way.
TEST(Pacing, WorkersCutChunksByTheSlowestReducerLink) {
  if (auto paced = paced_congestion_control(""); !paced) {
    GTEST_SKIP() << "no congestion control to pace with here: " << paced.status().to_string();
  }
  for (const std::string rate : {"500mbit", "off"}) {
    SCOPED_TRACE("--link-rate " + rate);
    PoolSpec spec{.shards = 2};
    spec.reducer_args = {"--max-chunk-bytes", "1MiB", "--memory-budget", "16MiB",
                         "--log-level",       "info"};
    if (rate != "off") spec.reducer_args.insert(spec.reducer_args.end(), {"--link-rate", rate});
    TestCluster cluster(spec);
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    constexpr uint32_t kWorld = 2;
    auto clients = connect_all(cluster, unique_job("cut"), kWorld,
                               [](ClientOptions& o, uint32_t) { o.chunk_bytes = 0; });
    ASSERT_EQ(clients.size(), kWorld);
    const ChunkPlan plan = clients[0]->plan(256 * 1024, DType::kFloat32, 0);
    EXPECT_EQ(plan.full_chunk_bytes(), kPlanChunkFloorBytes);
    const ChunkPlan large = clients[0]->plan(4 << 20, DType::kFloat32, 1);
    EXPECT_EQ(large.full_chunk_bytes(), rate == "off" ? kPlanChunkCeilingBytes : 84 * 1024);
    on_every_rank(kWorld, [&](uint32_t r) {
      std::vector<float> data(256 * 1024);
      bench::fill_pattern(data.data(), data.size(), r, 2);  // op 2: after the two plans' ops
      Status s = clients[r]->allreduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_EQ(bench::count_wrong(data.data(), data.size(), kWorld, RedOp::kSum, 2), 0u);
    });
  }
}

// The receive budget bounds the windows of streams nobody paces
// (architecture.md, "The receive budget"); a stream paced by its sender to
// its share of the receiver's link is left to TCP: a worker told its link
// rate says so in its Hello, and a reducer told its own leaves that
// contribution stream's buffer alone; a reducer told its rate paces its
// results, and a worker told its own leaves its result stream's buffer
// alone. Workers told a rate that the reducer was not are still bounded:
// their shares are of their own links, which W of them can overrun at one
// reducer. A bounded stream's window clamp is the bound (on loopback, room
// for its segments); an unbounded one's is the kernel's own, autotuned.
TEST(Pacing, PacedStreamsAreLeftOutOfTheReceiveBudget) {
  if (auto paced = paced_congestion_control(""); !paced) {
    GTEST_SKIP() << "no congestion control to pace with here: " << paced.status().to_string();
  }
  constexpr uint32_t kWorld = 2;
  uint64_t bounded = 0;  // what the unpaced pool's windows are clamped at
  struct Told {
    bool reducer, workers;
  };
  for (const Told told : {Told{false, false}, Told{false, true}, Told{true, true}}) {
    const bool paced = told.reducer && told.workers;
    SCOPED_TRACE(std::string("reducer ") + (told.reducer ? "told" : "not told") + ", workers " +
                 (told.workers ? "told" : "not told"));
    PoolSpec spec;
    if (told.reducer) spec.reducer_args.insert(spec.reducer_args.end(), {"--link-rate", "10gbit"});
    TestCluster cluster(spec);
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    auto clients =
        connect_all(cluster, unique_job("budget"), kWorld, [&told](ClientOptions& o, uint32_t) {
          if (told.workers) o.link_rate_bits = 10000000000;
        });
    ASSERT_EQ(clients.size(), kWorld);
    // Each stream's Welcome has been handled: both ends set their windows.
    const uint16_t port = cluster_port(cluster);
    const std::vector<uint64_t> reducer_side =
        window_clamps(cluster.reducer(0).pid(), port, /*local=*/true);
    const std::vector<uint64_t> worker_side = window_clamps(::getpid(), port, /*local=*/false);
    ASSERT_EQ(reducer_side.size(), kWorld);
    ASSERT_EQ(worker_side.size(), kWorld);
    if (!told.reducer && !told.workers) bounded = reducer_side[0];
    ASSERT_GT(bounded, 0u);
    ASSERT_NE(bounded, unbounded_window_clamp()) << "the unpaced pool bounded nothing";
    if (!paced) {
      for (uint64_t b : reducer_side) EXPECT_EQ(b, bounded);
      for (uint64_t b : worker_side) EXPECT_EQ(b, bounded);
    } else {
      for (uint64_t b : reducer_side) EXPECT_NE(b, bounded) << "the reducer bounded a paced stream";
      for (uint64_t b : worker_side) EXPECT_NE(b, bounded) << "a worker bounded paced results";
    }
    on_every_rank(kWorld, [&](uint32_t r) {
      std::vector<float> data(256 * 1024);
      bench::fill_pattern(data.data(), data.size(), r, 0);
      Status s = clients[r]->allreduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_EQ(bench::count_wrong(data.data(), data.size(), kWorld, RedOp::kSum, 0), 0u);
    });
  }
}

// A pool started with --transport fabric serves tcp workers too, whose data
// then moves on the tcp stream itself: the reducer paces and bounds it as a
// tcp pool does. Told a rate, the reducers pace each of the two worker
// streams to its share (950 kB/s of 16 Mbit/s); the workers, not told one,
// are bounded at both ends, and every window is what a tcp pool's is.
TEST(Pacing, AFabricPoolPacesAndBoundsItsTcpWorkersStreams) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  if (auto paced = paced_congestion_control(""); !paced) {
    GTEST_SKIP() << "no congestion control to pace with here: " << paced.status().to_string();
  }
  constexpr uint32_t kWorld = 2;
  std::map<std::string, std::vector<uint64_t>> reducer_side, worker_side;
  for (const std::string transport : {"tcp", "fabric"}) {
    SCOPED_TRACE("a pool of --transport " + transport);
    PoolSpec spec;
    spec.transport = transport;
    spec.reducer_args.insert(spec.reducer_args.end(), {"--link-rate", "16mbit"});
    TestCluster cluster(spec);
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    auto clients = connect_all(cluster, unique_job("mixed"), kWorld,
                               [](ClientOptions& o, uint32_t) { o.transport = "tcp"; });
    ASSERT_EQ(clients.size(), kWorld);
    on_every_rank(kWorld, [&](uint32_t r) {
      std::vector<float> data(16 * 1024);
      bench::fill_pattern(data.data(), data.size(), r, 0);
      Status s = clients[r]->allreduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_EQ(bench::count_wrong(data.data(), data.size(), kWorld, RedOp::kSum, 0), 0u);
    });
    const std::string port = cluster.pool_string().substr(cluster.pool_string().rfind(':') + 1);
    EXPECT_EQ(max_pacing_rates("sport = :" + port), (std::vector<uint64_t>{950000, 950000}));
    reducer_side[transport] =
        window_clamps(cluster.reducer(0).pid(), cluster_port(cluster), /*local=*/true);
    worker_side[transport] = window_clamps(::getpid(), cluster_port(cluster), /*local=*/false);
    ASSERT_EQ(reducer_side[transport].size(), kWorld);
    ASSERT_EQ(worker_side[transport].size(), kWorld);
  }
  const uint64_t unbounded = unbounded_window_clamp();
  for (uint64_t clamp : reducer_side["tcp"]) EXPECT_NE(clamp, unbounded);
  for (uint64_t clamp : worker_side["tcp"]) EXPECT_NE(clamp, unbounded);
  EXPECT_EQ(reducer_side["fabric"], reducer_side["tcp"])
      << "the fabric pool left a tcp stream unbounded";
  EXPECT_EQ(worker_side["fabric"], worker_side["tcp"]);
}

}  // namespace
}  // namespace tally::testing
