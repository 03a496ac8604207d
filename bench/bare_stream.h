// What one TCP stream costs this machine's CPU per byte, the reference
// beside which tally-bench shows its reducers' and workers' CPU: a sender
// and a receiver thread over loopback, 1 MiB writes and reads, nothing else.
#pragma once

#include <cstdint>
#include <string>

#include "tally/protocol/status.h"

namespace tally::bench {

// The two threads' CPU (getrusage RUSAGE_THREAD: send plus receive) per GB
// of `bytes` moved, each thread's calls walking its own buffer of `span`
// bytes (at least 1 MiB): a tensor that size is sent from memory and
// received into it. Each socket call has a 10 s deadline.
Result<double> bare_stream_cpu_s_per_gb(uint64_t span, uint64_t bytes = uint64_t{128} << 20);

// The reference as the bench takes it: the median of `runs` bare streams
// over a `span`-byte tensor (the sweep's largest op), and their spread.
//
// Why the span: the kernel's copies cost more from and into memory than
// within the cache (0.4-0.55 against 0.25-0.4 s/GB on the lab's hosts), and the ops
// that carry a sweep's bytes are tensors of its largest size. Why the
// median: one stream's figure moves by a third between runs on a shared
// host (where the scheduler puts the two threads, what else runs).
struct CpuFloor {
  double median = 0, low = 0, high = 0;
  int runs = 0;
  uint64_t span = 0;
  // "a 64MiB tensor, median of 5: 0.43-0.78", as the CPU lines print it.
  std::string spread() const;
};
Result<CpuFloor> bare_stream_floor(uint64_t span, int runs = 5);

}  // namespace tally::bench
