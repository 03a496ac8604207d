// A chunk's result that some ranks hold and others do not when its reducer
// is killed: the ranks that hold it replay it to the restarted reducer, and
// the others must get exactly those bytes back, for every reduction, dtype,
// wire format, pool shape and transport. Rank 0 is a Client (it replays
// what it kept); rank 1 is a raw peer that never read its result the first
// time and contributes other values after the restart, so the bytes it gets
// tell a replay from a new sum, and a replay applied twice (an average
// divided again, 16-bit results narrowed again) from the replay itself.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "clients.h"
#include "cut_link.h"
#include "harness.h"
#include "raw_peer.h"
#include "tally.pb.h"
#include "tally/client/client.h"
#include "tally/protocol/control.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/kernels.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

struct ReplayCase {
  std::string transport;
  uint32_t groups = 1;
  RedOp redop = RedOp::kSum;
  DType dtype = DType::kFloat32;
  // The bfloat16 wire (float32 tensors only), and its float32 results.
  bool bf16_wire = false;
  bool wide_result = false;
};

std::string case_name(const ::testing::TestParamInfo<ReplayCase>& info) {
  const ReplayCase& c = info.param;
  std::string name = std::string(c.transport == "fabric" ? "Fabric" : "Tcp") + "_G" +
                     std::to_string(c.groups) + "_" + std::string(redop_name(c.redop)) + "_" +
                     (c.dtype == DType::kFloat32 ? "f32" : std::string(dtype_name(c.dtype)));
  if (c.bf16_wire) name += c.wide_result ? "_bf16wire_f32results" : "_bf16wire";
  return name;
}

// What the wire carries for `c`'s tensors.
DType wire_dtype(const ReplayCase& c) { return c.bf16_wire ? DType::kBFloat16 : c.dtype; }

// `values` as `dtype`'s bytes (every value here is exact in every dtype).
std::string encode(const std::vector<double>& values, DType dtype) {
  std::string out(values.size() * dtype_size(dtype), '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    const float f = static_cast<float>(values[i]);
    if (dtype == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == DType::kFloat16 ? float_to_half(f) : float_to_bfloat16(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

void PrintTo(const ReplayCase& c, std::ostream* os) {
  *os << case_name(::testing::TestParamInfo<ReplayCase>(c, 0));
}

// "element 3: 8 where 32 was expected (x0.25)" for the first element of
// `dtype` where `got` and `want` differ, or "" when they are the same.
std::string first_difference(const std::string& got, const std::string& want, DType dtype) {
  if (got.size() != want.size()) {
    return std::to_string(got.size()) + " bytes where " + std::to_string(want.size()) +
           " were expected";
  }
  auto value = [dtype](const std::string& bytes, size_t i) -> double {
    if (dtype == DType::kFloat32) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return dtype == DType::kFloat16 ? half_to_float(h) : bfloat16_to_float(h);
  };
  for (size_t i = 0; i < got.size() / dtype_size(dtype); ++i) {
    const double g = value(got, i), w = value(want, i);
    if (g != w) {
      return "element " + std::to_string(i) + ": " + std::to_string(g) + " where " +
             std::to_string(w) + " was expected (x" + std::to_string(g / w) + ")";
    }
  }
  return "";
}

class ReplayedResult : public ::testing::TestWithParam<ReplayCase> {};

// The restarted reducer answers rank 1 with rank 0's replay, byte for byte:
// not a new sum of rank 1's new values, and not the replay reduced again.
TEST_P(ReplayedResult, ReachesTheRankWithoutItUnchanged) {
  const ReplayCase& c = GetParam();
  TALLY_SKIP_UNLESS_TRANSPORT(c.transport);
  PoolSpec spec{.shards = 1, .transport = c.transport, .groups = c.groups};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("replay");
  // Rank 1 is in the last group; its reducer is the one killed. With two
  // groups rank 0's reducer lives on, starts a new round once its replica
  // is back, and its rank's replay reaches rank 1 as the final result.
  const uint32_t victim = c.groups - 1;
  const std::string address = cluster.addresses()[victim];

  constexpr uint64_t kCount = 300;  // one chunk; even sums, so averages are exact too
  std::vector<double> a(kCount), x(kCount), y(kCount, -7.0), expect(kCount);
  for (uint64_t i = 0; i < kCount; ++i) {
    a[i] = 2.0 * static_cast<double>(i % 32);
    x[i] = 64.0 + 2.0 * static_cast<double>(i % 16);
    expect[i] = (a[i] + x[i]) / (c.redop == RedOp::kAverage ? 2.0 : 1.0);
  }
  const DType wire = wire_dtype(c);
  FrameHeader h = whole_op_contribution(job, 1, kCount, wire);
  h.redop = c.redop;
  h.flags = c.wide_result ? kFrameFlagWideResult : 0;
  // The result as the reducer sends it: float32 sums when asked for.
  const DType result_dtype = c.wide_result ? DType::kFloat32 : wire;
  const std::string result = encode(expect, result_dtype);

  wire::Control hello = raw_hello(job, 1, 2);
  hello.mutable_hello()->set_group(c.groups - 1);
  for (uint32_t g = 0; g < c.groups; ++g) hello.mutable_hello()->add_group_sizes(2 / c.groups);
  RawPeer first(address);
  first.send_control(hello);
  first.send_frame(h, encode(x, wire));

  auto client = connect_all(cluster, job, 1, [&](ClientOptions& o, uint32_t) {
    o.world_size = 2;
    o.groups = c.groups;
    o.transport = c.transport;
    o.chunk_bytes = 0;
    if (c.bf16_wire) o.wire_dtype = DType::kBFloat16;
    if (c.wide_result) o.wire_result = DType::kFloat32;
  });
  ASSERT_EQ(client.size(), 1u);
  std::string mine = encode(a, c.dtype);
  ASSERT_TRUE(client[0]->allreduce(mine.data(), kCount, c.dtype, c.redop).is_ok());
  EXPECT_EQ(mine, encode(expect, c.dtype)) << "rank 0's result before the restart";
  std::string got;
  ASSERT_TRUE(first.received_within(result, 5s, &got)) << "rank 1's result before the restart";

  // Rank 1 is taken to have lost its result: it resumes as a worker does
  // (Hello, its Received mark, its chunk again) with other values. With
  // two groups the reducers may start a round after it has resumed, and
  // ask it to rejoin (Rejoin): it resumes again, as a worker does.
  cluster.kill_reducer(victim, SIGKILL);
  ASSERT_TRUE(cluster.restart_reducer(victim).is_ok());
  hello.mutable_hello()->set_resume(true);
  wire::Control received;
  received.mutable_received()->set_op_below(0);
  std::optional<std::string> after;
  for (int attempt = 0; attempt < 3 && !after; ++attempt) {
    RawPeer again(address);
    again.send_control(hello);
    again.send_control(received);
    again.send_frame(h, encode(y, wire));
    while (auto frame = again.read_frame(10s)) {
      if (frame->header.kind == FrameKind::kResult) {
        after = frame->payload;
        break;
      }
      auto message = parse_control(std::as_bytes(std::span(frame->payload)));
      if (frame->header.kind == FrameKind::kControl && message && message->has_rejoin()) break;
    }
  }
  ASSERT_TRUE(after.has_value()) << "no result after the restart; reducer log:\n"
                                 << cluster.reducer_log(victim);
  EXPECT_EQ(first_difference(*after, result, result_dtype), "")
      << "rank 1 got other bytes than rank 0 replayed";
}

std::vector<ReplayCase> replay_cases() {
  std::vector<ReplayCase> out;
  for (RedOp redop : {RedOp::kSum, RedOp::kAverage}) {
    // Every element format a replay can carry, on one group over TCP.
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      out.push_back({.transport = "tcp", .redop = redop, .dtype = dtype});
    }
    out.push_back({.transport = "tcp", .redop = redop, .bf16_wire = true});
    out.push_back({.transport = "tcp", .redop = redop, .bf16_wire = true, .wide_result = true});
    // A replica's final result, and the fabric data path.
    out.push_back({.transport = "tcp", .groups = 2, .redop = redop});
    out.push_back({.transport = "tcp", .groups = 2, .redop = redop, .dtype = DType::kBFloat16});
    out.push_back({.transport = "fabric", .redop = redop});
    out.push_back({.transport = "fabric", .groups = 2, .redop = redop});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Replay, ReplayedResult, ::testing::ValuesIn(replay_cases()), case_name);

// A reducer killed while it sends a result leaves the worker with part of
// it. The worker's buffer still holds its input there (the result reaches
// it only whole), so the contribution it sends again after the restart is
// its input, and the op's result is exact. Rank 0 is a Client reaching the
// reducer through a CutLink that stops half-way through its result; rank 1,
// a raw peer, resumes without the result and contributes again.
TEST(Replay, AResultCutOffMidPayloadLeavesTheInputToSendAgain) {
  PoolSpec spec{.shards = 1};
  spec.reducer_args = {"--max-chunk-bytes", "1MiB", "--memory-budget", "16MiB",
                       "--io-threads",      "2",    "--log-level",     "info"};
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string job = unique_job("cut-result");
  const std::string address = cluster.addresses()[0];
  CutLink link(address);
  ASSERT_FALSE(link.address().empty());

  constexpr uint64_t kCount = 256 << 10;  // 1 MiB of floats: one chunk
  std::vector<double> a(kCount), x(kCount), expect(kCount);
  for (uint64_t i = 0; i < kCount; ++i) {
    a[i] = static_cast<double>(i % 1000);
    x[i] = static_cast<double>(100000 + i % 7);
    expect[i] = a[i] + x[i];
  }
  const FrameHeader h = whole_op_contribution(job, 1, kCount);
  const std::string input = encode(x, DType::kFloat32);
  wire::Control hello = raw_hello(job, 1, 2);
  hello.mutable_hello()->add_group_sizes(2);
  RawPeer first(address);
  first.send_control(hello);
  first.send_frame(h, input);

  link.arm(64 << 10);
  auto client = connect_all(cluster, job, 1, [&](ClientOptions& o, uint32_t) {
    o.pool = {link.address()};
    o.world_size = 2;
    o.chunk_bytes = kCount * sizeof(float);
  });
  ASSERT_EQ(client.size(), 1u);
  std::string mine = encode(a, DType::kFloat32);
  OpHandle op = client[0]->allreduce_async(mine.data(), kCount, DType::kFloat32, RedOp::kSum);
  ASSERT_TRUE(link.held_within(10s)) << "the result never reached the link";

  cluster.kill_reducer(0, SIGKILL);
  ASSERT_TRUE(cluster.restart_reducer(0).is_ok());
  link.cut();  // rank 0 has half its result, and loses the stream
  RawPeer again(address);
  hello.mutable_hello()->set_resume(true);
  again.send_control(hello);
  wire::Control received;
  received.mutable_received()->set_op_below(0);
  again.send_control(received);
  again.send_frame(h, input);

  const auto ended = op.wait_for(20s);
  ASSERT_TRUE(ended.has_value()) << "op 0 still in flight";
  ASSERT_TRUE(ended->is_ok()) << ended->to_string();
  const std::string sum = encode(expect, DType::kFloat32);
  EXPECT_EQ(first_difference(mine, sum, DType::kFloat32), "") << "rank 0's result";
  std::optional<RawPeer::Frame> result;
  while ((result = again.read_frame(10s)) && result->header.kind != FrameKind::kResult) {
  }
  ASSERT_TRUE(result.has_value()) << "rank 1 got no result; reducer log:\n"
                                  << cluster.reducer_log(0);
  EXPECT_EQ(first_difference(result->payload, sum, DType::kFloat32), "") << "rank 1's result";
}

}  // namespace
}  // namespace tally::testing
