// A pool of real tally-reducer processes on loopback, for the bench and the
// tests: started on free ports, torn down (SIGTERM, then SIGKILL) on
// destruction.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tally/bench/netlab.h"
#include "tally/bench/process.h"

namespace tally::bench {

struct LocalPoolOptions {
  uint32_t shards = 2;
  // Replica groups: the pool has shards x groups reducers.
  uint32_t groups = 1;
  // Give each reducer --stats-file (stats_path()).
  bool stats = false;
  // Give each reducer --http-listen 127.0.0.1:0 (http_addresses()).
  bool http = false;
  std::string reducer_path;  // empty: tally-reducer beside this executable, then ../reducer/
  std::vector<std::string> extra_args;  // passed to every reducer
  std::string
      log_dir;  // reducer stdout and stderr go to log_dir/reducer-<index>.log; empty: inherit
  std::chrono::milliseconds start_timeout{15000};
  // Reducer i listens (and serves HTTP) on hosts[i]; empty: 127.0.0.1.
  std::vector<std::string> hosts;
  // If set, called on each reducer's spec before it starts (e.g. to run it
  // inside a network namespace: Netlab::place).
  std::function<void(uint32_t index, ProcessSpec& spec)> place;

  // Reducer i on `lab`'s host first_host + i, listening (and serving HTTP)
  // there; `lab` must outlive the pool.
  void place_in(const Netlab& lab, uint32_t first_host);
  // Writes a fresh random job secret (hex, mode 0600) to `path` and makes
  // every reducer require it (--job-secret-file, --require-auth), and
  // another to `path`.pool for the replica links (--pool-secret-file): a
  // local pool runs as a pool should, on any address. Its workers take
  // `path` as TALLY_JOB_SECRET_FILE.
  Status require_secret(const std::string& path);
};

class LocalPool {
 public:
  // Starts every reducer and waits until each listens. Reducers are indexed
  // in (group, shard) order: index = group x shards + shard. With groups,
  // each reducer gets --peers @FILE, and the file (the pool list) is
  // written once every reducer listens. Errors: kUnavailable (binary
  // missing, a reducer exited early), kTimeout.
  static Result<std::unique_ptr<LocalPool>> start(const LocalPoolOptions& options);
  // Stops every reducer (SIGTERM, then SIGKILL after `grace`) and returns
  // their exit statuses, by index; 0 is a clean shutdown.
  std::vector<int> stop(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));
  ~LocalPool();

  // "host:port" of each reducer, by index ((group, shard) order).
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Comma-separated, as TALLY_POOL wants it.
  std::string pool_string() const;
  Process& reducer(uint32_t index) { return processes_[index]; }
  // "host:port" of each reducer's /metrics, /healthz and /readyz (with
  // options.http), by index.
  const std::vector<std::string>& http_addresses() const { return http_addresses_; }
  // Where reducer `index` writes its counters (with options.stats).
  std::string stats_path(uint32_t index) const {
    return scratch_->path() + "/stats-" + std::to_string(index);
  }
  // Starts reducer `index` again, on the address it had (after it was
  // killed), with the same arguments, and waits until it listens; its log
  // (with log_dir) is reducer-<index>.log.<n> for the n-th restart.
  // Errors: as start().
  Status restart(uint32_t index,
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(15000));
  uint32_t shards() const { return shards_; }
  uint32_t groups() const { return groups_; }

 private:
  LocalPool() = default;
  std::unique_ptr<ScratchDir> scratch_;  // ready files, the pool file, stats
  uint32_t shards_ = 1;
  uint32_t groups_ = 1;
  std::vector<Process> processes_;
  std::vector<ProcessSpec> specs_;
  std::vector<uint32_t> restarts_;  // by index: how often restart() started it again
  std::vector<std::string> addresses_;
  std::vector<std::string> http_addresses_;
};

// Finds tally-reducer: $TALLY_REDUCER, beside this executable, or the build
// tree's reducer/ folder next to it.
std::string find_reducer_binary();

}  // namespace tally::bench
