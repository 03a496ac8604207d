// What one TCP stream costs this machine's CPU per byte, the floor beside
// which tally-bench shows its reducers' and workers' CPU: a sender and a
// receiver thread over loopback, 1 MiB writes and reads, nothing else.
#pragma once

#include <cstdint>

#include "tally/protocol/status.h"

namespace tally::bench {

// The two threads' CPU (getrusage RUSAGE_THREAD: send plus receive) per GB
// of `bytes` moved. Each socket call has a 10 s deadline.
Result<double> bare_stream_cpu_s_per_gb(uint64_t bytes = uint64_t{256} << 20);

}  // namespace tally::bench
