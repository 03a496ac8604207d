// All-reduce through real reducer processes and real worker processes,
// parametrised over workers x shards x sizes x dtypes. Every worker checks
// the closed-form sum of tally/bench/pattern.h exactly.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "clients.h"
#include "harness.h"
#include "tally/bench/pattern.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::testing {
namespace {

// The workers use 1024-byte chunks (TALLY_CHUNK_BYTES in harness.cc):
// 256 float32 elements.
constexpr uint64_t kChunkElems = 256;

struct Case {
  std::string transport = "tcp";
  uint32_t workers = 1;
  uint32_t shards = 1;
  uint32_t groups = 1;
  uint64_t count = 0;  // elements
  std::string dtype = "float";
  std::string redop = "sum";
  int ops = 1;
  uint64_t chunk_bytes = 1024;  // the workers' TALLY_CHUNK_BYTES; 0: the automatic plan
  uint64_t ingress_window = 0;  // the reducers' --ingress-window; 0: their default
  std::string wire_dtype;       // the workers' TALLY_WIRE_DTYPE; empty: unset
  std::string wire_result;      // the workers' TALLY_WIRE_RESULT; empty: unset
};

std::string short_dtype(const std::string& d) {
  if (d == "float") return "f32";
  if (d == "double") return "f64";
  if (d == "int32") return "i32";
  if (d == "int64") return "i64";
  return d;
}

std::string name_of(const Case& c) {
  const size_t esize = dtype_size(*parse_dtype(c.dtype));
  std::string name = std::string(c.transport == "fabric" ? "Fabric" : "Tcp") + "_W" +
                     std::to_string(c.workers) + "_S" + std::to_string(c.shards) + "_G" +
                     std::to_string(c.groups) + "_" + std::to_string(c.count * esize) + "B_" +
                     short_dtype(c.dtype);
  if (c.redop != "sum") name += "_" + c.redop;
  if (c.ops > 1) name += "_x" + std::to_string(c.ops);
  if (c.chunk_bytes == 0) name += "_autoplan";
  if (c.chunk_bytes != 1024 && c.chunk_bytes != 0) name += "_chunk" + std::to_string(c.chunk_bytes);
  if (c.ingress_window) name += "_ingress" + std::to_string(c.ingress_window);
  if (!c.wire_dtype.empty()) name += "_wire" + c.wire_dtype;
  if (!c.wire_result.empty()) name += "_" + c.wire_result + "results";
  return name;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); }

void PrintTo(const Case& c, std::ostream* os) { *os << name_of(c); }

class AllreduceTest : public ::testing::TestWithParam<Case> {};

TEST_P(AllreduceTest, EveryWorkerGetsTheExactSum) {
  const Case& c = GetParam();
  TALLY_SKIP_UNLESS_TRANSPORT(c.transport);
  PoolSpec spec;
  spec.shards = c.shards;
  spec.transport = c.transport;
  if (c.chunk_bytes > 4096) {
    // Chunks this large need a larger limit; the budget holds eight jobs'
    // worth of buffers (window + 2 each), so the three workers never wait.
    spec.reducer_args = {"--max-chunk-bytes", std::to_string(c.chunk_bytes),
                         "--memory-budget",   std::to_string(8 * (4 + 2) * c.chunk_bytes),
                         "--window",          "4",
                         "--io-threads",      "2",
                         "--log-level",       "info"};
  }
  if (c.ingress_window) {
    spec.reducer_args.insert(spec.reducer_args.end(),
                             {"--ingress-window", std::to_string(c.ingress_window)});
  }
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(cluster, "w", unique_job("allreduce"), c.workers,
                      [&](uint32_t) {
                        return Args{
                            "--count", std::to_string(c.count), "--dtype", c.dtype, "--op", c.redop,
                            "--ops",   std::to_string(c.ops)};
                      },
                      {{"TALLY_CHUNK_BYTES", std::to_string(c.chunk_bytes)},
                       {"TALLY_WIRE_DTYPE", c.wire_dtype},
                       {"TALLY_WIRE_RESULT", c.wire_result}});
  for (uint32_t r = 0; r < c.workers; ++r) {
    WorkerOutput out = workers.wait(r, std::chrono::seconds(60));
    EXPECT_EQ(out.exit_code, 0) << "rank " << r << ":\n" << out.out;
    EXPECT_NE(out.out.find("\nok\n"), std::string::npos) << out.out;
  }
}

// Every case runs over both transports.
std::vector<Case> over_transports(const std::vector<Case>& tcp_cases) {
  std::vector<Case> cases = tcp_cases;
  for (Case c : tcp_cases) {
    c.transport = "fabric";
    cases.push_back(c);
  }
  return cases;
}

std::vector<Case> types_and_ops() {
  std::vector<Case> cases;
  // float16 and bfloat16 accumulate in float32 on the reducers; the worker
  // checks each element against its error bound (test_worker.cc).
  for (std::string dtype : {"float", "double", "int32", "int64", "half", "bfloat16"}) {
    for (std::string redop : {"sum", "avg"}) {
      Case c;
      c.workers = 3;
      c.shards = 2;
      c.count = 5 * kChunkElems + 3;
      c.dtype = dtype;
      c.redop = redop;
      cases.push_back(c);
    }
  }
  // Many ops back to back on one connection set, and a large tensor.
  Case many;
  many.workers = 4;
  many.shards = 2;
  many.count = 3 * kChunkElems + 1;
  many.ops = 50;
  cases.push_back(many);
  Case large;
  large.workers = 4;
  large.shards = 3;
  large.count = 1000003;
  cases.push_back(large);
  // Large chunks: single messages far past the provider's eager size
  // (rendezvous on tcp;ofi_rxm), with a chunk that ends short.
  for (uint64_t chunk : {uint64_t{256} << 10, uint64_t{1} << 20}) {
    Case big = large;
    big.workers = 3;
    big.shards = 2;
    big.count = 1000003;
    big.ops = 2;
    big.chunk_bytes = chunk;
    cases.push_back(big);
  }
  // The automatic plan (chunks of ~83 KiB over 3 shards), with the default
  // byte window and with one of a single byte: then each stream has one
  // chunk out at a time, which must still finish.
  for (uint64_t window : {uint64_t{0}, uint64_t{1}}) {
    Case autoplan = large;
    autoplan.chunk_bytes = 0;
    autoplan.ops = 3;
    autoplan.ingress_window = window;
    cases.push_back(autoplan);
  }
  // float32 on the bfloat16 wire: each element within bfloat16's bound of
  // the float64 sum of its bfloat16-rounded inputs (test_worker.cc); fixed
  // chunks, the automatic plan (sized on 2-byte elements), and a float64 op
  // on the same setting (it travels as float64, exact).
  for (std::string redop : {"sum", "avg"}) {
    Case wire;
    wire.workers = 3;
    wire.shards = 2;
    wire.count = 5 * kChunkElems + 3;
    wire.redop = redop;
    wire.ops = 2;
    wire.wire_dtype = "bfloat16";
    cases.push_back(wire);
    // The same with the reducers' float32 sums coming back (kFrameFlagWideResult).
    wire.wire_result = "float32";
    cases.push_back(wire);
  }
  Case wire_auto = large;
  wire_auto.chunk_bytes = 0;
  wire_auto.ops = 2;
  wire_auto.wire_dtype = "bfloat16";
  cases.push_back(wire_auto);
  Case wire_double = wire_auto;
  wire_double.dtype = "double";
  wire_double.count = 1009;
  cases.push_back(wire_double);
  return over_transports(cases);
}

INSTANTIATE_TEST_SUITE_P(TypesAndOps, AllreduceTest, ::testing::ValuesIn(types_and_ops()),
                         case_name);

// The size x shape sweep: S shards x G groups of reducers, W workers split
// into G groups (contiguous blocks; with W = 2G + 1 they are of unequal
// size). One pool and one set of workers per case runs every size in turn
// (op k uses the k-th size), so the sweep stays affordable under the
// sanitizers: a case per size, each on a fresh pool, made the one-group
// sweep 180 cases, a third of the plain build's test time (opening the
// fabric endpoints costs each process 0.2-1 s).
struct GroupCase {
  std::string transport = "tcp";  // between workers and reducers; replicas talk TCP
  uint32_t workers = 1;
  uint32_t shards = 1;
  uint32_t groups = 1;
  std::vector<uint64_t> counts;
  std::string dtype = "float";
  std::string redop = "sum";
  std::string pattern = "exact";  // or "noisy": order-dependent floats
  std::string wire_dtype;         // the workers' TALLY_WIRE_DTYPE; empty: unset
  std::string wire_result;        // the workers' TALLY_WIRE_RESULT; empty: unset
};

std::string group_case_name(const ::testing::TestParamInfo<GroupCase>& info) {
  const GroupCase& c = info.param;
  std::string name = std::string(c.transport == "fabric" ? "Fabric" : "Tcp") + "_W" +
                     std::to_string(c.workers) + "_S" + std::to_string(c.shards) + "_G" +
                     std::to_string(c.groups);
  const size_t esize = dtype_size(*parse_dtype(c.dtype));
  for (uint64_t n : c.counts) name += "_" + std::to_string(n * esize) + "B";
  name += "_" + short_dtype(c.dtype);
  if (c.redop != "sum") name += "_" + c.redop;
  if (c.pattern != "exact") name += "_" + c.pattern;
  if (!c.wire_dtype.empty()) name += "_wire" + c.wire_dtype;
  if (!c.wire_result.empty()) name += "_" + c.wire_result + "results";
  return name;
}

void PrintTo(const GroupCase& c, std::ostream* os) {
  *os << group_case_name(::testing::TestParamInfo<GroupCase>(c, 0));
}

class GroupsTest : public ::testing::TestWithParam<GroupCase> {};

TEST_P(GroupsTest, EveryWorkerOfEveryGroupGetsTheSameExactSum) {
  const GroupCase& c = GetParam();
  TALLY_SKIP_UNLESS_TRANSPORT(c.transport);
  PoolSpec spec;
  spec.shards = c.shards;
  spec.groups = c.groups;
  spec.transport = c.transport;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  std::string counts;
  for (uint64_t n : c.counts) counts += (counts.empty() ? "" : ",") + std::to_string(n);
  WorkerGroup workers(cluster, "w", unique_job("groups"), c.workers,
                      [&](uint32_t) {
                        return Args{"--counts",  counts,   "--ops", std::to_string(c.counts.size()),
                                    "--dtype",   c.dtype,  "--op",  c.redop,
                                    "--pattern", c.pattern};
                      },
                      {{"TALLY_WIRE_DTYPE", c.wire_dtype}, {"TALLY_WIRE_RESULT", c.wire_result}});
  std::map<int, std::string> reference;
  for (uint32_t r = 0; r < c.workers; ++r) {
    WorkerOutput out = workers.wait(r, std::chrono::seconds(90));
    EXPECT_EQ(out.exit_code, 0) << "rank " << r << ":\n" << out.out;
    EXPECT_NE(out.out.find("\nok\n"), std::string::npos) << out.out;
    auto hashes = hashes_of(out.out);
    EXPECT_EQ(hashes.size(), c.counts.size()) << out.out;
    if (r == 0) {
      reference = hashes;
    } else {
      // Bitwise the same result, whatever the group.
      EXPECT_EQ(hashes, reference) << "rank " << r << " (group " << r * c.groups / c.workers << ")";
    }
  }
}

std::vector<GroupCase> group_sweep() {
  std::vector<GroupCase> cases;
  // None, one element, a chunk's worth less and more one, an odd count, and
  // many chunks with a short last one.
  const std::vector<uint64_t> all = {
      0, 1, kChunkElems - 1, kChunkElems + 1, 1009, 37 * kChunkElems + 5};
  const std::vector<uint64_t> few = {1, kChunkElems + 1, 37 * kChunkElems + 5};
  // One group: every shape of up to 8 workers and 3 shards, over both
  // transports.
  for (std::string transport : {"tcp", "fabric"}) {
    for (uint32_t w : {1u, 2u, 3u, 4u, 8u}) {
      for (uint32_t s : {1u, 2u, 3u}) {
        GroupCase c;
        c.transport = transport;
        c.workers = w;
        c.shards = s;
        c.counts = all;
        cases.push_back(c);
      }
    }
  }
  // Replica groups, over tcp.
  for (uint32_t g = 2; g <= 5; ++g) {
    for (uint32_t s : {1u, 2u}) {
      const std::vector<uint32_t> ws = {g, 2 * g + 1, 3 * g};
      for (uint32_t w : ws) {
        GroupCase c;
        c.workers = w;
        c.shards = s;
        c.groups = g;
        c.counts = g <= 3 ? all : few;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sweep, GroupsTest, ::testing::ValuesIn(group_sweep()), group_case_name);

// Inputs whose float sum depends on the order of addition: every rank of
// every group must still get the same bits.
std::vector<GroupCase> order_sensitive() {
  std::vector<GroupCase> cases;
  for (uint32_t g = 2; g <= 5; ++g) {
    GroupCase c;
    c.workers = 2 * g + 1;
    c.shards = 2;
    c.groups = g;
    c.counts = {1, 3, kChunkElems - 1, 1009, 37 * kChunkElems + 5};
    c.pattern = "noisy";
    cases.push_back(c);
  }
  GroupCase avg;
  avg.workers = 7;
  avg.shards = 2;
  avg.groups = 3;
  avg.counts = {1, 1009, 9477};
  avg.dtype = "double";
  avg.redop = "avg";
  avg.pattern = "noisy";
  cases.push_back(avg);
  // 16-bit types: replicas exchange float32 partials, so every group gets
  // the bits one reducer would have produced.
  for (std::string dtype : {"half", "bfloat16"}) {
    for (std::string redop : {"sum", "avg"}) {
      GroupCase c;
      c.workers = 5;
      c.shards = 2;
      c.groups = 3;
      c.counts = {1, 1009, 9477};
      c.dtype = dtype;
      c.redop = redop;
      cases.push_back(c);
    }
  }
  // float32 on the bfloat16 wire over two replica groups.
  GroupCase wire;
  wire.workers = 5;
  wire.shards = 2;
  wire.groups = 2;
  wire.counts = {1, 1009, 9477};
  wire.wire_dtype = "bfloat16";
  cases.push_back(wire);
  // Float32 results through the butterfly: every replica sends its workers
  // the float32 sums, which are the same bits in every group.
  wire.wire_result = "float32";
  cases.push_back(wire);
  for (std::string dtype : {"int32", "int64"}) {
    GroupCase ints;
    ints.workers = 5;
    ints.shards = 2;
    ints.groups = 3;
    ints.counts = {1, 1009};
    ints.dtype = dtype;
    ints.redop = "avg";
    cases.push_back(ints);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(OrderSensitive, GroupsTest, ::testing::ValuesIn(order_sensitive()),
                         group_case_name);

// Groups with the workers on the libfabric data path: a power of two, a
// fold (G = 3, unequal groups) and order-sensitive floats.
std::vector<GroupCase> groups_over_fabric() {
  std::vector<GroupCase> cases;
  for (auto [w, s, g] : {std::tuple{4u, 1u, 2u}, std::tuple{7u, 2u, 3u}}) {
    GroupCase c;
    c.transport = "fabric";
    c.workers = w;
    c.shards = s;
    c.groups = g;
    c.counts = {1, kChunkElems + 1, 1009, 37 * kChunkElems + 5};
    cases.push_back(c);
  }
  GroupCase noisy = cases.back();
  noisy.pattern = "noisy";
  cases.push_back(noisy);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fabric, GroupsTest, ::testing::ValuesIn(groups_over_fabric()),
                         group_case_name);

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
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  EXPECT_EQ(::listen(listener, 1), 0);
  EXPECT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  const int server = ::accept(listener, nullptr, nullptr);
  int clamp = 0;
  length = sizeof clamp;
  EXPECT_EQ(::getsockopt(server, IPPROTO_TCP, TCP_WINDOW_CLAMP, &clamp, &length), 0);
  for (int fd : {server, client, listener}) ::close(fd);
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
