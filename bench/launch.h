// tally-bench run: a command run as W ranks the way torchrun starts them,
// beside a local pool, on loopback or each rank and reducer on a host of
// its own in a network lab (netlab.h). The step-time benchmark of
// examples/train_ddp.py runs through it (docs/pytorch.md). Private to
// tally-bench.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tally::bench {

struct LaunchOptions {
  uint32_t workers = 4;
  uint32_t shards = 4;
  uint32_t groups = 1;
  std::string netlab_rate;  // empty: loopback
  std::string link_rate;    // told to the reducers and the ranks; empty: not told
  int64_t timeout_s = 3600;
  std::string log_level = "warn";
  std::vector<std::string> command;  // each rank's argv
};

// `tally-bench run ...` (argv[0] is "run"): parses the flags and runs.
// Exit: the first failing rank's status as 1, 2 for bad flags, 130 when
// interrupted, 0 when every rank exits 0.
int launch_main(int argc, char** argv);
int run_launch(const LaunchOptions& options);

}  // namespace tally::bench
