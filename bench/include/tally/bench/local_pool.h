// A pool of real tally-reducer processes on loopback, for the bench and the
// tests: started on free ports, torn down (SIGTERM, then SIGKILL) on
// destruction.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tally/bench/process.h"

namespace tally::bench {

struct LocalPoolOptions {
  uint32_t shards = 2;
  std::string reducer_path;  // empty: tally-reducer beside this executable, then ../reducer/
  std::vector<std::string> extra_args;  // passed to every reducer
  std::string log_dir;       // reducer stderr goes to log_dir/reducer-<shard>.log; empty: inherit
  std::chrono::milliseconds start_timeout{15000};
};

class LocalPool {
 public:
  // Starts every reducer and waits until each listens. Errors: kUnavailable
  // (binary missing, a reducer exited early), kTimeout.
  static Result<std::unique_ptr<LocalPool>> start(const LocalPoolOptions& options);
  // Stops every reducer (SIGTERM, then SIGKILL after `grace`) and returns
  // their exit statuses, in shard order; 0 is a clean shutdown.
  std::vector<int> stop(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));
  ~LocalPool();

  // "host:port" of each shard, in shard order.
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Comma-separated, as TALLY_POOL wants it.
  std::string pool_string() const;
  Process& reducer(uint32_t shard) { return processes_[shard]; }

 private:
  LocalPool() = default;
  std::string dir_;
  std::vector<Process> processes_;
  std::vector<std::string> addresses_;
};

// Finds tally-reducer: $TALLY_REDUCER, beside this executable, or the build
// tree's reducer/ folder next to it.
std::string find_reducer_binary();

}  // namespace tally::bench
