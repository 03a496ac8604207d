// What tally-bench chaos runs beside its honest jobs, on a local pool on
// loopback: a job with a lying rank (--liar, liar.h), slow HTTP clients
// dripping requests to every reducer's HTTP port (--slow-http N,
// slow_http.h), and a liveness probe of each reducer's /healthz every
// second, the way a kubelet probes a pod (1 s timeout; 3 unanswered in a
// row and it would restart the reducer).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "liar.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/slow_http.h"

namespace tally::bench {

struct HostileOptions {
  bool liar = false;
  uint32_t slow_http = 0;  // slow clients, over the reducers
  uint32_t op_timeout_ms = 10000;
  std::string job_prefix;
  std::string secret_file;           // the job secret the liar holds
  std::chrono::seconds limit{3600};  // the slow clients stop by then
};

class Hostiles {
 public:
  // Starts the liar and the slow clients against `pool`, which must
  // outlive this; errors: the secret file's.
  static Result<std::unique_ptr<Hostiles>> start(const HostileOptions& options, LocalPool& pool);

  // Probes every reducer's /healthz once a second (call it often).
  void probe(std::chrono::steady_clock::time_point now);
  // Reducer `index` was restarted (its HTTP port is new, and the probe's
  // count of failures in a row starts again).
  void restarted(uint32_t index);
  // Stops the liar and the slow clients, prints what they and the probes
  // saw, and says whether the run failed: 3 (a wrong result for the liar),
  // 1 (the liar's job completed no op or an op of it waited in vain, or a
  // reducer went 3 probes in a row unanswered), else 0.
  int finish();

 private:
  Hostiles(const HostileOptions& options, LocalPool& pool) : options_(options), pool_(pool) {}

  const HostileOptions options_;
  LocalPool& pool_;
  std::unique_ptr<Liar> liar_;
  std::unique_ptr<SlowHttpClients> slow_;
  std::chrono::steady_clock::time_point next_probe_{};
  uint64_t probes_ = 0;
  uint64_t unanswered_ = 0;
  std::vector<uint32_t> in_a_row_;  // by reducer
  uint32_t most_in_a_row_ = 0;
  std::string last_unanswered_;
};

}  // namespace tally::bench
