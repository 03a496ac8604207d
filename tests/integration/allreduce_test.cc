// All-reduce through real reducer processes and real worker processes,
// parametrised over workers x shards x sizes x dtypes. Every worker checks
// the closed-form sum of tally/bench/pattern.h exactly.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness.h"
#include "tally/protocol/dtype.h"

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
  uint64_t chunk_bytes = 1024;  // the workers' TALLY_CHUNK_BYTES
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
  std::string name = std::string(c.transport == "fabric" ? "Fabric" : "Tcp") + "_W" + std::to_string(c.workers) + "_S" + std::to_string(c.shards) + "_G" +
                     std::to_string(c.groups) + "_" + std::to_string(c.count * esize) + "B_" +
                     short_dtype(c.dtype);
  if (c.redop != "sum") name += "_" + c.redop;
  if (c.ops > 1) name += "_x" + std::to_string(c.ops);
  if (c.chunk_bytes != 1024) name += "_chunk" + std::to_string(c.chunk_bytes);
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
    spec.reducer_args = {"--max-chunk-bytes", std::to_string(c.chunk_bytes), "--memory-budget",
                         std::to_string(8 * (4 + 2) * c.chunk_bytes), "--window", "4", "--io-threads", "2",
                         "--log-level", "info"};
  }
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  WorkerGroup workers(
      cluster, "w", unique_job("allreduce"), c.workers,
      [&](uint32_t) {
        return Args{"--count", std::to_string(c.count), "--dtype", c.dtype, "--op", c.redop, "--ops",
                    std::to_string(c.ops)};
      },
      {{"TALLY_CHUNK_BYTES", std::to_string(c.chunk_bytes)}});
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

std::vector<Case> sweep() {
  std::vector<Case> cases;
  const std::vector<uint64_t> counts = {0, 1, kChunkElems - 1, kChunkElems + 1, 1009,
                                        37 * kChunkElems + 5};
  for (uint32_t w : {1u, 2u, 3u, 4u, 8u}) {
    for (uint32_t s : {1u, 2u, 3u}) {
      for (uint64_t n : counts) {
        Case c;
        c.workers = w;
        c.shards = s;
        c.count = n;
        cases.push_back(c);
      }
    }
  }
  return over_transports(cases);
}

INSTANTIATE_TEST_SUITE_P(Sweep, AllreduceTest, ::testing::ValuesIn(sweep()), case_name);

std::vector<Case> types_and_ops() {
  std::vector<Case> cases;
  for (std::string dtype : {"float", "double", "int32", "int64"}) {
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
  return over_transports(cases);
}

INSTANTIATE_TEST_SUITE_P(TypesAndOps, AllreduceTest, ::testing::ValuesIn(types_and_ops()), case_name);

}  // namespace
}  // namespace tally::testing
