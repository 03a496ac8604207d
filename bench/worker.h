// tally-bench's worker mode: one rank's sweep (warm-up, timed loop, check,
// and rank 0's table, JSON and per-reducer byte report). Private to
// tally-bench.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace tally::bench {

struct SweepOptions {
  size_t min_bytes = 4096;
  size_t max_bytes = 64u << 20;
  size_t factor = 2;
  int warmup = 5;
  int iters = 20;
  std::string dtype = "float";
  std::string redop = "sum";
  std::string json_path;
  bool check = true;
  // Reducers' HTTP host:port (--http-listen), by index ((group, shard) order).
  std::vector<std::string> reducer_metrics;
  // --chunk-bytes: overrides TALLY_CHUNK_BYTES when set (0: the automatic plan).
  std::optional<size_t> chunk_bytes;
  // --wire-dtype: overrides TALLY_WIRE_DTYPE when non-empty.
  std::string wire_dtype;
  // --cpu-floor: a bare TCP stream's CPU per GB on this machine (the driver
  // measures it, bare_stream.h), shown beside the workers'; 0: not known.
  double cpu_floor_s_per_gb = 0;
};

// Runs the sweep as the rank TALLY_* configures; returns the process exit
// code (0, 1 when a result is wrong, 2 on errors). Blocks.
int run_worker(const SweepOptions& sweep);

}  // namespace tally::bench
