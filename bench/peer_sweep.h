// What tally-peer-gloo and tally-peer-mpi share: the sweep loop, timed as
// tally-bench's worker times tally (a check outside the timed loop, warm-up,
// then the timed loop; time is the mean over ranks of each rank's loop time
// / iterations), and rank 0's table in tally-bench's row format
// (tally/bench/table.h), which the driver parses back for --compare.
// float32 tensors, sum only (a peer may carry them in another type:
// `relative_error`). Private to the peers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace CLI {
class App;
}

namespace tally::bench {

struct PeerSweep {
  size_t min_bytes = 4096;
  size_t max_bytes = 64u << 20;
  size_t factor = 2;
  int warmup = 5;
  int iters = 20;
  bool check = true;
};

// Adds -b -e -f -w -n -c (as tally-bench spells them) to `app`.
void add_sweep_options(CLI::App& app, PeerSweep& sweep);

struct PeerComm {
  uint32_t rank = 0;
  uint32_t world = 1;
  // In-place float32 sum all-reduce of `count` elements; false on failure
  // (with the reason in *error).
  std::function<bool(float* data, size_t count, std::string* error)> allreduce;
  // In-place float64 sum of `count` elements over ranks (for the times).
  std::function<bool(double* data, size_t count, std::string* error)> sum;
  // How far a result may be from the exact sum, relative to it: 0 for a
  // float32 all-reduce (pattern.h's sums are exact), more for one that
  // carries the tensor in 16 bits.
  double relative_error = 0;
};

// Runs the sweep; rank 0 prints "# table NAME ..." and the rows. `busbw`
// is the algorithm's bus factor (2(W-1)/W for a ring). Returns the exit
// code: 0, 1 (an all-reduce failed), 3 (a wrong result).
int run_peer_sweep(const PeerSweep& sweep, const PeerComm& comm, const std::string& name,
                   double busbw);

}  // namespace tally::bench
