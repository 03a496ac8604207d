// A job with a lying rank, for tally-bench chaos --liar: two ranks spoken
// raw (no client library), one on shard 0 of each of the first two replica
// groups (both on shard 0 where the pool has one group). They hold the job
// secret, sum honestly and check every result exactly; after each op,
// rank 0 tells its reducer that every rank has the results of the ops
// below 2^40 (Received.released_below), a word a reducer must bound by
// what it knows: taken on trust, it would drop every later partial of the
// job as stale, and its ops would time out on both groups. A stream lost
// (a reducer killed) starts the job again under a new name.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tally/protocol/auth.h"

namespace tally::bench {

class Liar {
 public:
  struct Options {
    std::string rank0_address;  // shard 0 of group 0
    std::string rank1_address;  // shard 0 of group 1 (or of group 0)
    bool two_groups = false;    // the ranks are in groups 0 and 1
    Secret secret;
    std::string job_prefix;
    uint32_t op_timeout_ms = 10000;
  };
  // Starts the ranks on a thread of their own; they run until destroyed.
  explicit Liar(Options options);
  ~Liar();
  Liar(const Liar&) = delete;
  Liar& operator=(const Liar&) = delete;

  struct Counts {
    uint64_t ops = 0;    // completed with exact results, each followed by a lie
    uint64_t wrong = 0;  // results that were not the exact sum
    uint64_t jobs = 0;   // incarnations started
    // Why incarnations ended, by kind: "stream closed", "rejoin", "op
    // <error code>", "no result" (none within the op timeout and 5 s), ...
    std::map<std::string, uint64_t> failures;
    std::string example;  // the last one's message
    // Incarnations whose op waited in vain: "op timeout" or "no result".
    uint64_t stalls() const;
  };
  Counts counts() const;

 private:
  void run();
  // One incarnation of the job, until a stream fails or the liar stops:
  // why it ended (empty when stopped).
  std::string incarnation(uint64_t n);

  const Options options_;
  mutable std::mutex mu_;
  Counts counts_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tally::bench
