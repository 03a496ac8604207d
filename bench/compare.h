// tally-bench --compare and --netlab, driver side: running the peers
// (tally-peer-gloo, tally-peer-mpi) on the same sweep, workers' hosts and
// deadline as tally's workers, the ratio table, and the lab's per-link
// counters. Private to tally-bench.
#pragma once

#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "tally/bench/netlab.h"
#include "tally/bench/table.h"
#include "worker.h"

namespace tally::bench {

// Set by the driver's SIGINT/SIGTERM handler: every wait stops, the
// children are terminated and everything made is removed.
extern volatile int g_stop;
// Installs the handler that sets g_stop on SIGINT, SIGTERM and SIGHUP.
void stop_on_signals();

// The peers --compare knows, in the order they run.
const std::vector<std::string>& known_peers();

struct PeerContext {
  SweepOptions sweep;
  uint32_t workers = 4;
  const Netlab* lab = nullptr;  // null: loopback; else rank r runs on host r
  std::string dir;              // scratch (outputs, Gloo's rendezvous)
  // How the peers carry the float32 tensor: "float32", or "float16" beside
  // tally's bfloat16 wire (Gloo only: MPI has no 16-bit float type).
  std::string wire = "float32";
  std::chrono::steady_clock::time_point deadline;
};

struct PeerResult {
  std::string peer;         // "gloo", "mpi"
  std::string unavailable;  // why it did not run (or failed), "" when it ran
  std::vector<NamedTable> tables;
};

// Runs one peer's sweep with ctx.workers ranks, echoing rank 0's tables to
// stdout; never fails the bench (a peer that cannot run says why).
PeerResult run_peer(const std::string& peer, const PeerContext& ctx);

// The ratio table: per size, each tally table's and each peer table's
// algbw, the best peer, and tally / best (the first tally table). `what`
// says what was summed ("float32 sum").
void print_comparison(const std::vector<NamedTable>& tally, const std::vector<PeerResult>& peers,
                      uint32_t workers, const std::string& what, const std::string& where);

// Per-link packets and drops between two Netlab::link_stats() snapshots;
// role[i] names host i ("worker 0", "reducer 1").
void print_link_drops(const std::string& phase, const std::vector<Netlab::LinkStats>& before,
                      const std::vector<Netlab::LinkStats>& after,
                      const std::vector<std::string>& role);

}  // namespace tally::bench
