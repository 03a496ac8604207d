// tally-bench load and tally-bench chaos: many jobs' workers doing checked
// all-reduces for a bounded time against one pool, with (chaos) reducers or
// workers killed and restarted on a schedule. Private to tally-bench;
// docs/benchmarking.md ("Load and chaos") has the design and the runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "tally/protocol/dtype.h"

namespace tally::bench {

struct LoadOptions {
  uint32_t jobs = 2;
  uint32_t workers = 4;  // per job
  double seconds = 10;   // the run's length; every op started before it ends counts
  size_t bytes = 1u << 20;
  uint32_t shards = 2;  // of the local pool
  uint32_t groups = 1;
  std::string pool;         // empty: a local pool
  std::string secret_file;  // with --pool: the job secret the workers use
  // Chaos: "reducer" or "worker" killed (SIGKILL) every kill_every_s and
  // restarted at once (a reducer at its address; a worker with its job).
  std::string kill;
  double kill_every_s = 10;
  int64_t op_timeout_ms = 10000;
  uint64_t max_ops = 10'000'000;  // per worker and round: the count bound of the loop
  // The shape of a worker's ops (LoadWorkerOptions).
  std::string redops = "both";
  uint32_t inflight = 4;
  uint32_t buckets = 8;
  std::string log_level = "warn";
  std::string job;  // prefix of the job names; empty: load-<pid>
  // A network lab (netlab.h) at this rate, every process on its own host;
  // empty: loopback.
  std::string netlab_rate;
  // Chaos beside the jobs, on loopback (hostiles.h): a job with a lying
  // rank, and slow HTTP clients dripping to the reducers.
  bool liar = false;
  uint32_t slow_http = 0;
};

// `tally-bench load ...` and `tally-bench chaos ...` (argv[0] is "load" or
// "chaos"): parses the flags and runs the driver or, with --worker, a rank.
int load_main(int argc, char** argv);

// Runs the driver; returns the exit code: 0, 1 (the run could not be done),
// 3 (a wrong result), 130 (interrupted). load_main returns 2 for bad flags.
int run_load(const LoadOptions& options);

// Worker mode (`tally-bench load --worker`): one rank configured by TALLY_*,
// doing float32 ops `first`, `first` + 1, ... the way DDP does: `inflight`
// at a time, op k in bucket k mod `buckets` (each bucket a buffer of its own
// size, reused by every op of its bucket), each op's inputs the pattern of
// pattern.h with the op's number as its seed, until the time votes say stop.
// It writes one line per op to `out_path` ("<op> ok|wrong|<error code>
// <microseconds>"), then after a wrong result "# wrong op <op> (...): <what
// it is instead>" (explain.h), after a failure "# <the error>". Exit: 0
// (time is up), 3 (a wrong result), 4 (an op or the connect failed).
struct LoadWorkerOptions {
  size_t bytes = 1u << 20;  // the largest bucket's
  uint64_t first = 0;       // this round's first op number of the run
  double seconds = 10;      // this rank votes to stop once this much time has passed
  uint64_t max_ops = 10'000'000;
  std::string redops = "both";  // "sum", "avg", or "both" (load_redop)
  uint32_t inflight = 4;        // at most `buckets`
  uint32_t buckets = 8;
  std::string out_path;
};
int run_load_worker(const LoadWorkerOptions& options);

// The reduction of op `op` under `redops`: "sum", "avg", or "both" (even
// ops sum, odd ones average).
RedOp load_redop(const std::string& redops, uint64_t op);

}  // namespace tally::bench
