// tally-test-worker: one rank of an integration test. Configured by TALLY_*
// like a training process; runs --ops all-reduces of --count elements with
// the closed-form pattern of tally/bench/pattern.h and checks every result.
//
// stdout gets one line per op ("op N ok") and a last line "ok" or
// "error <code name>: <message>". Exit status: 0 all ops correct,
// 1 a wrong result, 2 could not connect, 3 an op failed.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "tally/bench/pattern.h"
#include "tally/client/client.h"

namespace {

using tally::Status;

template <typename T>
int run(tally::Client& client, tally::DType dtype, tally::RedOp redop, uint64_t count, int ops,
        int stall_ms) {
  std::vector<T> data(count);
  for (int op = 0; op < ops; ++op) {
    if (stall_ms > 0 && op == ops - 1) std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    tally::bench::fill_pattern(data.data(), count, client.rank());
    const auto t0 = std::chrono::steady_clock::now();
    Status s = client.allreduce(data.data(), count, dtype, redop);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - t0).count();
    if (!s) {
      std::printf("error after %lld ms %s\n", static_cast<long long>(ms), s.to_string().c_str());
      std::fflush(stdout);
      return 3;
    }
    size_t wrong = tally::bench::count_wrong(data.data(), count, client.world_size(),
                                             redop == tally::RedOp::kAverage);
    if (wrong) {
      std::printf("wrong op %d: %zu of %llu elements\n", op, wrong, static_cast<unsigned long long>(count));
      std::fflush(stdout);
      return 1;
    }
    std::printf("op %d ok\n", op);
    std::fflush(stdout);
  }
  std::printf("ok\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t count = 0;
  int64_t count_override = -1;
  std::string dtype_name = "float";
  std::string redop_name = "sum";
  int ops = 1;
  int stall_ms = 0;
  CLI::App app{"tally-test-worker"};
  app.add_option("--count", count, "elements per op");
  app.add_option("--count-override", count_override, "use this count instead (a mismatching rank)");
  app.add_option("--dtype", dtype_name);
  app.add_option("--op", redop_name);
  app.add_option("--ops", ops, "how many all-reduces");
  app.add_option("--stall-ms", stall_ms, "sleep this long before the last op (a straggler)");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
  if (count_override >= 0) count = static_cast<uint64_t>(count_override);

  auto options = tally::client_options_from_env();
  if (!options) {
    std::printf("error %s\n", options.status().to_string().c_str());
    return 2;
  }
  auto dtype = tally::parse_dtype(dtype_name);
  auto redop = tally::parse_redop(redop_name);
  if (!dtype || !redop) {
    std::printf("error bad dtype or op\n");
    return 2;
  }
  auto client = tally::Client::connect(*options);
  if (!client) {
    std::printf("error %s\n", client.status().to_string().c_str());
    return 2;
  }
  std::printf("connected rank %u pid %d\n", (*client)->rank(), static_cast<int>(getpid()));
  std::fflush(stdout);
  switch (*dtype) {
    case tally::DType::kFloat32: return run<float>(**client, *dtype, *redop, count, ops, stall_ms);
    case tally::DType::kFloat64: return run<double>(**client, *dtype, *redop, count, ops, stall_ms);
    case tally::DType::kInt32: return run<int32_t>(**client, *dtype, *redop, count, ops, stall_ms);
    case tally::DType::kInt64: return run<int64_t>(**client, *dtype, *redop, count, ops, stall_ms);
    default: {
      // 16-bit types: the pattern is checked by the reducer's refusal only.
      std::vector<uint16_t> data(count);
      Status s = (*client)->allreduce(data.data(), count, *dtype, *redop);
      std::printf("%s\n", s ? "ok" : ("error after 0 ms " + s.to_string()).c_str());
      return s ? 0 : 3;
    }
  }
}
