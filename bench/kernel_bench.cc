// tally-kernel-bench: Google Benchmark micro-benchmarks of the element
// kernels (tally/protocol/kernels.h) at every ISA level this CPU runs, on
// buffers that stay in cache (1 MiB) and on buffers that stream from memory
// (64 MiB), next to memcpy on the same buffers.
//
// Every benchmark of size S handles S / 4 elements: memcpy copies S bytes
// of float32, sum_f32 adds S bytes into S bytes, the 16-bit kernels read or
// write S / 2 bytes of 16-bit values against S bytes of float32. Each
// iteration first copies S bytes with memcpy between the same buffers, then
// runs the kernel, and times both (the machine is shared and noisy: the
// ratio compares the two side by side, in the same moments). Reported:
//   time, bytes_per_second  the kernel's alone (manual timing), S per second;
//   x_memcpy                memcpy's total time over the kernel's (1.0 = as
//                           fast as memcpy on the same bytes).
//
//   tally-kernel-bench                                   # everything
//   tally-kernel-bench --benchmark_filter='1MiB'         # in cache only
//   tally-kernel-bench --benchmark_filter='sum_f32|memcpy'
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tally/protocol/kernels.h"

namespace {

using tally::KernelIsa;
using tally::KernelTable;

// The buffers of one size, filled once with finite values (no NaN or
// denormal slow paths): two float32 arrays and one 16-bit array.
struct Buffers {
  std::vector<float> dst;
  std::vector<float> src;
  std::vector<uint16_t> half;
};

Buffers& buffers(size_t bytes) {
  static std::map<size_t, std::unique_ptr<Buffers>> all;
  auto& b = all[bytes];
  if (b) return *b;
  b = std::make_unique<Buffers>();
  const size_t n = bytes / sizeof(float);
  b->dst.resize(n);
  b->src.resize(n);
  b->half.resize(n);
  for (size_t i = 0; i < n; ++i) {
    b->src[i] = 0.5f + static_cast<float>(i % 1021) * 0.001f;
    b->dst[i] = 1.0f;
    b->half[i] = tally::float_to_half(b->src[i]);
  }
  return *b;
}

enum class Kernel {
  kMemcpy,
  kSumF32,
  kAccF16,
  kAccBF16,
  kWidenF16,
  kWidenBF16,
  kNarrowF16,
  kNarrowBF16
};

const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::kMemcpy:
      return "memcpy";
    case Kernel::kSumF32:
      return "sum_f32";
    case Kernel::kAccF16:
      return "accumulate_f16";
    case Kernel::kAccBF16:
      return "accumulate_bf16";
    case Kernel::kWidenF16:
      return "widen_f16";
    case Kernel::kWidenBF16:
      return "widen_bf16";
    case Kernel::kNarrowF16:
      return "narrow_f16";
    case Kernel::kNarrowBF16:
      return "narrow_bf16";
  }
  return "?";
}

void run(benchmark::State& state, Kernel kernel, const KernelTable* table, size_t bytes) {
  Buffers& b = buffers(bytes);
  const size_t n = bytes / sizeof(float);
  float* dst = b.dst.data();
  const float* src = b.src.data();
  uint16_t* half = b.half.data();
  using Clock = std::chrono::steady_clock;
  double memcpy_seconds = 0;
  double kernel_seconds = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    std::memcpy(dst, src, bytes);  // also resets the accumulators
    benchmark::ClobberMemory();
    const auto t1 = Clock::now();
    switch (kernel) {
      case Kernel::kMemcpy:
        std::memcpy(dst, src, bytes);
        break;
      case Kernel::kSumF32:
        table->sum_f32(dst, src, n);
        break;
      case Kernel::kAccF16:
        table->accumulate_f16(dst, half, n);
        break;
      case Kernel::kAccBF16:
        table->accumulate_bf16(dst, half, n);
        break;
      case Kernel::kWidenF16:
        table->widen_f16(dst, half, n);
        break;
      case Kernel::kWidenBF16:
        table->widen_bf16(dst, half, n);
        break;
      case Kernel::kNarrowF16:
        table->narrow_f16(half, src, n);
        break;
      case Kernel::kNarrowBF16:
        table->narrow_bf16(half, src, n);
        break;
    }
    benchmark::ClobberMemory();
    const auto t2 = Clock::now();
    const double kernel_time = std::chrono::duration<double>(t2 - t1).count();
    memcpy_seconds += std::chrono::duration<double>(t1 - t0).count();
    kernel_seconds += kernel_time;
    state.SetIterationTime(kernel_time);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.counters["x_memcpy"] = kernel_seconds > 0 ? memcpy_seconds / kernel_seconds : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::pair<size_t, const char*> sizes[] = {{size_t{1} << 20, "1MiB"},
                                                  {size_t{64} << 20, "64MiB"}};
  for (auto [bytes, size_name] : sizes) {
    benchmark::RegisterBenchmark((std::string("memcpy/") + size_name).c_str(), run, Kernel::kMemcpy,
                                 nullptr, bytes)
        ->UseManualTime();
    for (KernelIsa isa : tally::available_kernel_isas()) {
      const KernelTable* table = &tally::kernel_table(isa);
      for (Kernel k : {Kernel::kSumF32, Kernel::kAccF16, Kernel::kAccBF16, Kernel::kWidenF16,
                       Kernel::kWidenBF16, Kernel::kNarrowF16, Kernel::kNarrowBF16}) {
        const std::string name = std::string(kernel_name(k)) + "/" +
                                 std::string(tally::kernel_isa_name(isa)) + "/" + size_name;
        benchmark::RegisterBenchmark(name.c_str(), run, k, table, bytes)->UseManualTime();
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
