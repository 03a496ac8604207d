#include "peer_sweep.h"

#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "tally/bench/pattern.h"
#include "tally/bench/table.h"

namespace tally::bench {

void add_sweep_options(CLI::App& app, PeerSweep& sweep) {
  app.add_option("-b,--minbytes", sweep.min_bytes, "smallest size")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("-e,--maxbytes", sweep.max_bytes, "largest size")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("-f,--stepfactor", sweep.factor, "multiply the size by this each step");
  app.add_option("-w,--warmup_iters", sweep.warmup, "untimed iterations per size");
  app.add_option("-n,--iters", sweep.iters, "timed iterations per size")
      ->check(CLI::Range(1, 1000000));
  app.add_option("-c,--check", sweep.check, "check results (1) or not (0)");
}

int run_peer_sweep(const PeerSweep& sweep, const PeerComm& comm, const std::string& name,
                   double busbw) {
  // One buffer for the whole sweep, in huge pages, touched once up front,
  // as tally-bench's worker has.
  const size_t capacity = (sweep.max_bytes + 4095) / 4096 * 4096 + 4096;
  void* mem = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::fprintf(stderr, "%s: cannot map %zu bytes\n", name.c_str(), capacity);
    return 2;
  }
  madvise(mem, capacity, MADV_HUGEPAGE);
  std::memset(mem, 0, capacity);
  float* data = static_cast<float*>(mem);
  const bool leader = comm.rank == 0;
  if (leader) {
    std::printf("# table %s W=%u\n", name.c_str(), comm.world);
    std::printf(
        "# warm-up %d, timed %d iterations; time is the mean over ranks; busbw = %.3f x algbw\n",
        sweep.warmup, sweep.iters, busbw);
    std::fputs(table_header().c_str(), stdout);
    std::fflush(stdout);
  }
  int exit_code = 0;
  std::string error;
  uint64_t row = 0;
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes;
       bytes = sweep.factor > 1 ? bytes * sweep.factor : bytes + 1) {
    const size_t count = bytes / sizeof(float);
    if (count == 0) continue;
    const uint64_t seed = row++;  // the row's checked op's inputs (pattern.h)
    bool ok = true;
    size_t wrong = 0;
    if (sweep.check) {
      fill_pattern(data, count, comm.rank, seed);
      ok = comm.allreduce(data, count, &error);
      if (ok) {
        wrong = count_wrong(data, count, comm.world, RedOp::kSum, seed, comm.relative_error);
      }
    }
    for (int i = 0; ok && i < sweep.warmup; ++i) ok = comm.allreduce(data, count, &error);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; ok && i < sweep.iters; ++i) ok = comm.allreduce(data, count, &error);
    const auto t1 = std::chrono::steady_clock::now();
    double stats[2] = {
        std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(1, sweep.iters),
        static_cast<double>(wrong)};
    if (ok) ok = comm.sum(stats, 2, &error);
    if (!ok) {
      std::fprintf(stderr, "%s rank %u: all-reduce of %zu bytes failed: %s\n", name.c_str(),
                   comm.rank, bytes, error.c_str());
      munmap(mem, capacity);
      return 1;
    }
    if (stats[1] > 0) exit_code = 3;
    if (leader) {
      TableRow row;
      row.bytes = count * sizeof(float);
      row.count = count;
      row.type = "float";
      row.redop = "sum";
      row.time_us = stats[0] / comm.world;
      row.algbw = row.time_us > 0 ? static_cast<double>(row.bytes) / row.time_us / 1e3 : 0;
      row.busbw = row.algbw * busbw;
      row.wrong = stats[1];
      std::fputs(format_row(row).c_str(), stdout);
      std::fflush(stdout);
    }
    if (sweep.factor <= 1 && bytes == sweep.max_bytes) break;
  }
  if (leader) {
    std::printf("# Out of bounds values : %s\n#\n", exit_code == 0 ? "0 OK" : "FAILED");
    std::fflush(stdout);
  }
  munmap(mem, capacity);
  return exit_code;
}

}  // namespace tally::bench
