// tally-test-worker: one rank of an integration test. Configured by TALLY_*
// like a training process; runs --ops all-reduces of --count elements with
// the closed-form pattern of tally/bench/pattern.h (seeded by the op's
// number) and checks every result.
//
// --counts cycles op sizes over one buffer (op i uses the (i mod n)-th), so
// the same memory carries ops of several sizes. With --keep-going a failed
// op is reported ("op N error after M ms <status>") and the next one runs on
// the same client; the exit status then counts wrong results only.
// --stop-file ends a long run on every rank at the same op: after each op
// the ranks sum a one-element flag (1 where the file exists) and all stop
// once it is non-zero. With --pattern noisy (float types), inputs are
// fractions that float addition cannot sum exactly, so the result depends
// on the order of summation: it is checked against the exact sum within a
// tolerance, and the result's hash lets the test check that every rank got
// the same bits. float16 and bfloat16 always use the noisy inputs, checked
// per element against a float64 reference within their error bound, and so
// do float32 ops on the bfloat16 wire (TALLY_WIRE_DTYPE=bfloat16).
//
// stdout gets one line per op ("op N ok hash H", H the FNV-1a 64 of the
// result bytes) and a last line "ok" or "error <code name>: <message>".
// Exit status: 0 all ops correct, 1 a wrong result, 2 could not connect,
// 3 an op failed.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "tally/bench/explain.h"
#include "tally/bench/pattern.h"
#include "tally/client/client.h"
#include "tally/protocol/kernels.h"

namespace {

using tally::Status;

// A wrong float32 result is compared with the results of this many ops
// either side of its own (tally/bench/explain.h).
constexpr uint64_t kExplainWindow = 16;

struct Plan {
  std::vector<uint64_t> counts;  // op i: counts[i % size]
  int ops = 1;
  int stall_ms = 0;
  int stall_op = -1;  // the op the stall comes before; -1: the last
  bool keep_going = false;
  std::string stop_file;
  bool noisy = false;
  // float32 ops on the bfloat16 wire (TALLY_WIRE_DTYPE=bfloat16): noisy
  // inputs, checked per element like bfloat16's (count_16bit_wrong).
  bool wire_bf16 = false;
  // ... with TALLY_WIRE_RESULT=float32: the results are the reducers'
  // float32 sums, not rounded to bfloat16.
  bool wire_float32_results = false;
};

// Whether any rank has seen the stop file (a one-element all-reduce, so
// every rank gets the same answer after the same op).
tally::Result<bool> agree_to_stop(tally::Client& client, const std::string& stop_file) {
  int32_t flag = access(stop_file.c_str(), F_OK) == 0 ? 1 : 0;
  Status s = client.allreduce(&flag, 1, tally::DType::kInt32, tally::RedOp::kSum);
  if (!s) return s;
  return flag > 0;
}

// A fraction unique per rank and element, and different from op to op
// (97 is prime: any 97 consecutive ops differ at every element), so that a
// result left from another op does not pass; 1/(1 + k) for k < 97 is not
// exact in binary, so sums depend on their order.
double noisy_value(uint32_t rank, uint64_t op, uint64_t i) {
  return 1.0 / static_cast<double>(1 + (uint64_t{rank} * 131 + i * 7 + op * 11) % 97) +
         static_cast<double>(rank % 5);
}

// Elements that are off from the exact sum by more than rounding allows.
template <typename T>
size_t count_noisy_wrong(const T* data, uint64_t count, uint32_t world, bool average, uint64_t op) {
  size_t wrong = 0;
  for (uint64_t i = 0; i < count; ++i) {
    double exact = 0;
    for (uint32_t r = 0; r < world; ++r) exact += static_cast<T>(noisy_value(r, op, i));
    if (average) exact /= world;
    const double tolerance =
        std::abs(exact) * world * 4 * std::numeric_limits<T>::epsilon() + 1e-30;
    if (std::abs(static_cast<double>(data[i]) - exact) > tolerance) ++wrong;
  }
  return wrong;
}

// 16-bit types: inputs are noisy_value rounded to the type; the reducer sums
// in float32 and rounds the result once (docs/architecture.md, "16-bit
// types"). Each element is checked against the float64 sum of the inputs it
// was given: |got - exact| <= u * |exact| + (1 + u) * e32 + d, where u is the
// type's unit roundoff (2^-11 float16, 2^-8 bfloat16), e32 = W * 2^-24 *
// sum |x_r| bounds the float32 accumulation (and the average's division),
// and d is half the type's smallest denormal.
struct SixteenBit {
  bool bf16 = false;
  uint16_t narrow(float f) const {
    return bf16 ? tally::float_to_bfloat16(f) : tally::float_to_half(f);
  }
  double widen(uint16_t h) const {
    return bf16 ? tally::bfloat16_to_float(h) : tally::half_to_float(h);
  }
  double unit_roundoff() const { return bf16 ? 0x1p-8 : 0x1p-11; }
  double half_denormal() const { return bf16 ? 0x1p-134 : 0x1p-25; }
};

// `result(i)`: element i of the result as a double. The same bound holds for
// float32 tensors on the bfloat16 wire: the client rounds each input to
// bfloat16 as a bfloat16 tensor's caller would, and widens the bfloat16
// result exactly.
template <typename Result>
size_t count_16bit_wrong(Result result, uint64_t count, uint32_t world, bool average, uint64_t op,
                         const SixteenBit& t) {
  size_t wrong = 0;
  for (uint64_t i = 0; i < count; ++i) {
    double exact = 0;
    double magnitude = 0;
    for (uint32_t r = 0; r < world; ++r) {
      const double x = t.widen(t.narrow(static_cast<float>(noisy_value(r, op, i))));
      exact += x;
      magnitude += std::abs(x);
    }
    if (average) {
      exact /= world;
      magnitude /= world;
    }
    const double e32 = (world + 1) * 0x1p-24 * magnitude;
    const double u = t.unit_roundoff();
    const double bound = u * std::abs(exact) + (1 + u) * e32 + t.half_denormal();
    if (!(std::abs(result(i) - exact) <= bound)) ++wrong;
  }
  return wrong;
}

uint64_t fnv1a(const void* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<const unsigned char*>(data)[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

template <typename T>
int run(tally::Client& client, tally::DType dtype, tally::RedOp redop, const Plan& plan) {
  uint64_t largest = 0;
  for (uint64_t c : plan.counts) largest = std::max(largest, c);
  std::vector<T> data(largest);
  const SixteenBit sixteen{dtype == tally::DType::kBFloat16 || plan.wire_bf16};
  const int ops = plan.ops;
  const int stall_ms = plan.stall_ms;
  const int stall_op = plan.stall_op >= 0 ? plan.stall_op : ops - 1;
  for (int op = 0; op < ops; ++op) {
    const uint64_t count = plan.counts[static_cast<size_t>(op) % plan.counts.size()];
    if (stall_ms > 0 && op == stall_op)
      std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    if constexpr (std::is_same_v<T, uint16_t>) {
      for (uint64_t i = 0; i < count; ++i)
        data[i] = sixteen.narrow(static_cast<float>(noisy_value(client.rank(), op, i)));
    } else if (plan.noisy || plan.wire_bf16) {
      for (uint64_t i = 0; i < count; ++i) {
        data[i] = static_cast<T>(noisy_value(client.rank(), op, i));
      }
    } else {
      tally::bench::fill_pattern(data.data(), count, client.rank(), op);
    }
    const auto t0 = std::chrono::steady_clock::now();
    Status s = client.allreduce(data.data(), count, dtype, redop);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    if (!s && plan.keep_going) {
      std::printf("op %d error after %lld ms %s\n", op, static_cast<long long>(ms),
                  s.to_string().c_str());
      std::fflush(stdout);
      continue;
    }
    if (!s) {
      std::printf("error after %lld ms %s\n", static_cast<long long>(ms), s.to_string().c_str());
      std::fflush(stdout);
      return 3;
    }
    const bool average = redop == tally::RedOp::kAverage;
    size_t wrong = 0;
    if constexpr (std::is_same_v<T, uint16_t>) {
      wrong = count_16bit_wrong([&](uint64_t i) { return sixteen.widen(data[i]); }, count,
                                client.world_size(), average, op, sixteen);
    } else if (plan.wire_bf16) {
      wrong = count_16bit_wrong([&](uint64_t i) { return static_cast<double>(data[i]); }, count,
                                client.world_size(), average, op, sixteen);
      // A bfloat16 result has its low 16 bits zero; the float32 sums of
      // noisy inputs have them set in most elements.
      if constexpr (std::is_same_v<T, float>) {
        uint64_t low_bits_set = 0;
        for (uint64_t i = 0; i < count; ++i) {
          uint32_t bits = 0;
          std::memcpy(&bits, &data[i], sizeof bits);
          low_bits_set += (bits & 0xFFFFu) != 0;
        }
        if (!plan.wire_float32_results) {
          wrong += low_bits_set;
        } else if (count >= 16 && low_bits_set < count / 2) {
          wrong += count - low_bits_set;  // rounded to bfloat16 after all
        }
      }
    } else {
      wrong = plan.noisy
                  ? count_noisy_wrong(data.data(), count, client.world_size(), average, op)
                  : tally::bench::count_wrong(data.data(), count, client.world_size(), redop, op);
    }
    if (wrong) {
      // How many are wrong, and for pattern ops what they are instead.
      std::string what = std::to_string(wrong) + " of " + std::to_string(count) + " elements";
      if constexpr (std::is_same_v<T, float>) {
        if (!plan.noisy && !plan.wire_bf16) {
          const tally::bench::PatternOp checked{client.rank(), client.world_size(), redop,
                                                static_cast<uint64_t>(op)};
          std::string explained = tally::bench::explain_wrong(
              data.data(), count, checked, kExplainWindow, [&](uint64_t) { return redop; });
          if (!explained.empty()) what = std::move(explained);
        }
      }
      std::printf("wrong op %d: %s\n", op, what.c_str());
      std::fflush(stdout);
      return 1;
    }
    std::printf("op %d ok hash %016llx\n", op,
                static_cast<unsigned long long>(fnv1a(data.data(), count * sizeof(T))));
    std::fflush(stdout);
    if (!plan.stop_file.empty()) {
      auto stop = agree_to_stop(client, plan.stop_file);
      if (!stop) {
        std::printf("error after 0 ms %s\n", stop.status().to_string().c_str());
        std::fflush(stdout);
        return 3;
      }
      if (*stop) break;
    }
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
  Plan plan;
  std::string log_level = "warn";
  CLI::App app{"tally-test-worker"};
  app.add_option("--count", count, "elements per op");
  app.add_option("--counts", plan.counts,
                 "elements of op i: the (i mod n)-th of these (instead of --count)")
      ->delimiter(',');
  app.add_option("--stop-file", plan.stop_file,
                 "all ranks stop after the first op where one sees this file");
  app.add_option("--log-level", log_level, "the client library's log level (stderr)");
  std::string pattern = "exact";
  app.add_option("--pattern", pattern, "exact (closed-form integer sums) or noisy (fractions)");
  app.add_option("--count-override", count_override, "use this count instead (a mismatching rank)");
  app.add_option("--dtype", dtype_name);
  app.add_option("--op", redop_name);
  app.add_option("--ops", plan.ops, "how many all-reduces (at most, with --stop-file)");
  app.add_option("--stall-ms", plan.stall_ms, "sleep this long before the last op (a straggler)");
  app.add_option("--stall-op", plan.stall_op, "stall before this op instead of the last");
  app.add_flag("--keep-going", plan.keep_going, "report a failed op and run the next one");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(log_level));
  if (count_override >= 0) count = static_cast<uint64_t>(count_override);
  if (plan.counts.empty()) plan.counts = {count};
  plan.noisy = pattern == "noisy";

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
  plan.wire_bf16 =
      *dtype == tally::DType::kFloat32 && options->wire_dtype == tally::DType::kBFloat16;
  plan.wire_float32_results = plan.wire_bf16 && options->wire_result == tally::DType::kFloat32;
  auto client = tally::Client::connect(*options);
  if (!client) {
    std::printf("error %s\n", client.status().to_string().c_str());
    return 2;
  }
  std::printf("connected rank %u group %u pid %d\n", (*client)->rank(), (*client)->group(),
              static_cast<int>(getpid()));
  std::fflush(stdout);
  switch (*dtype) {
    case tally::DType::kFloat32:
      return run<float>(**client, *dtype, *redop, plan);
    case tally::DType::kFloat64:
      return run<double>(**client, *dtype, *redop, plan);
    case tally::DType::kInt32:
      return run<int32_t>(**client, *dtype, *redop, plan);
    case tally::DType::kInt64:
      return run<int64_t>(**client, *dtype, *redop, plan);
    case tally::DType::kFloat16:
    case tally::DType::kBFloat16:
      return run<uint16_t>(**client, *dtype, *redop, plan);
  }
}
