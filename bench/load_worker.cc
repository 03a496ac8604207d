// One rank of tally-bench load and chaos (load.h): ops in flight the way DDP
// issues them, every result checked exactly against the op's own pattern.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <deque>
#include <memory>
#include <vector>

#include "load.h"
#include "tally/bench/explain.h"
#include "tally/bench/pattern.h"
#include "tally/client/client.h"

namespace tally::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Past twice the op timeout and this after an op's start, its handle is
// asked no longer: the client's own backstop ends every op before (client.h).
constexpr std::chrono::seconds kOpWaitMargin{30};
// A wrong op's explanation compares it with the results of this many ops
// on either side.
constexpr uint64_t kExplainWindow = 16;

// Elements of bucket b: from half the largest up to the largest, all
// different, so that a result landing in another bucket does not fit it.
size_t bucket_elements(size_t largest, uint32_t buckets, uint32_t b) {
  const size_t n = largest / 2 + (largest - largest / 2) * (b + 1) / buckets;
  return std::max<size_t>(n - (buckets - 1 - b), 2);
}

struct InFlight {
  uint64_t op = 0;
  uint32_t bucket = 0;
  RedOp redop = RedOp::kSum;
  Clock::time_point started;
  OpHandle handle;
};

// The last element of an op is its ranks' vote: 1 from a rank whose time
// lasts. True when every rank voted to go on; `valid` says whether the
// element is a vote at all.
bool unanimous(RedOp redop, float votes, uint32_t world, bool& valid) {
  // A sum counts the ranks that voted 1; an average is that count over W.
  const float n = redop == RedOp::kAverage ? std::round(votes * static_cast<float>(world)) : votes;
  const float expect = redop == RedOp::kAverage ? n / static_cast<float>(world) : n;
  valid = n >= 0 && n <= static_cast<float>(world) && n == std::floor(n) && votes == expect;
  return n == static_cast<float>(world);
}

}  // namespace

RedOp load_redop(const std::string& redops, uint64_t op) {
  if (redops == "sum") return RedOp::kSum;
  if (redops == "avg") return RedOp::kAverage;
  return op % 2 ? RedOp::kAverage : RedOp::kSum;  // both, alternating
}

namespace {

// What is wrong with op f's result in buf ("" when it is exact), and
// whether the ranks voted to go on.
std::string check_result(const std::vector<float>& buf, const InFlight& f, uint32_t rank,
                         uint32_t world, const std::string& redops, bool& go_on) {
  bool valid_votes = false;
  go_on = unanimous(f.redop, buf.back(), world, valid_votes);
  const PatternOp checked{rank, world, f.redop, f.op};
  std::string wrong = explain_wrong(buf.data(), buf.size() - 1, checked, kExplainWindow,
                                    [&](uint64_t op) { return load_redop(redops, op); });
  if (wrong.empty() && !valid_votes) wrong = "the vote element is " + std::to_string(buf.back());
  return wrong;
}

}  // namespace

int run_load_worker(const LoadWorkerOptions& o) {
  const auto started = Clock::now();
  std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(o.out_path.c_str(), "w"), &std::fclose);
  if (!out) {
    spdlog::error("cannot write {}", o.out_path);
    return 2;
  }
  // Before the client: ops still in flight when it goes (after a failed or
  // wrong op) write into these until its destructor returns.
  const size_t largest = std::max<size_t>(o.bytes / sizeof(float), 2);
  std::vector<std::vector<float>> buckets(o.buckets);
  for (uint32_t b = 0; b < o.buckets; ++b) {
    buckets[b].resize(bucket_elements(largest, o.buckets, b));
  }
  auto options = client_options_from_env();
  if (!options) {
    std::fprintf(out.get(), "# %s\n", options.status().to_string().c_str());
    return 2;
  }
  auto client = Client::connect(*options);
  if (!client) {
    // Not an op: no op was attempted (the driver counts it apart).
    std::fprintf(out.get(), "# connect %s\n", client.status().to_string().c_str());
    return 4;
  }
  const uint32_t rank = options->rank;
  const uint32_t world = options->world_size;
  // Every rank reads the same result, so all issue the same ops: op k + D
  // only while op k's vote is unanimous.
  auto issue = [&](uint64_t op) {
    InFlight f{op, static_cast<uint32_t>(op % o.buckets), load_redop(o.redops, op), Clock::now(),
               OpHandle()};
    std::vector<float>& buf = buckets[f.bucket];
    fill_pattern(buf.data(), buf.size() - 1, rank, op);
    buf.back() = Clock::now() - started < std::chrono::duration<double>(o.seconds) ? 1.0f : 0.0f;
    f.handle = (*client)->allreduce_async(buf.data(), buf.size(), DType::kFloat32, f.redop);
    return f;
  };
  // Flushed every 100 ms, so a worker the chaos driver kills loses at most
  // that much of its record.
  auto flushed = Clock::now();
  std::deque<InFlight> inflight;
  uint64_t next = o.first;
  bool stopping = false;
  int code = 0;
  while (true) {
    while (!stopping && inflight.size() < o.inflight && next < o.first + o.max_ops) {
      inflight.push_back(issue(next++));
    }
    if (inflight.empty()) break;
    InFlight& f = inflight.front();
    const auto ended = f.handle.wait_until(f.started + 2 * options->op_timeout + kOpWaitMargin);
    const Status s = ended ? *ended : Status(ErrorCode::kInternal, "the op never ended");
    const long long us =
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - f.started).count();
    if (!s) {
      std::fprintf(out.get(), "%" PRIu64 " %s %lld\n# %s\n", f.op,
                   std::string(error_code_name(s.code())).c_str(), us, s.to_string().c_str());
      code = 4;
      break;
    }
    const std::vector<float>& buf = buckets[f.bucket];
    bool go_on = false;
    const std::string wrong = check_result(buf, f, rank, world, o.redops, go_on);
    std::fprintf(out.get(), "%" PRIu64 " %s %lld\n", f.op, wrong.empty() ? "ok" : "wrong", us);
    if (!wrong.empty()) {
      std::fprintf(out.get(), "# wrong op %" PRIu64 " (bucket %u, %s, %zu floats): %s\n", f.op,
                   f.bucket, std::string(redop_name(f.redop)).c_str(), buf.size(), wrong.c_str());
      code = 3;
      break;  // the votes may be wrong too: stopping is the one safe move
    }
    if (!go_on) stopping = true;
    inflight.pop_front();
    if (Clock::now() - flushed > std::chrono::milliseconds(100)) {
      std::fflush(out.get());
      flushed = Clock::now();
    }
  }
  return code;
}

}  // namespace tally::bench
