// All-reduce through real reducer processes and real worker processes,
// parametrised over workers x shards x sizes x dtypes. Every worker checks
// the closed-form sum of tally/bench/pattern.h exactly.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <map>
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

}  // namespace
}  // namespace tally::testing
