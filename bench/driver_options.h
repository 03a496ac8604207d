// tally-bench's driver mode as its command line sets it: the flags, and
// their checks. Private to tally-bench.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "worker.h"

namespace tally::bench {

struct DriverOptions {
  SweepOptions sweep;
  bool worker = false;  // run as one rank (--worker)
  std::string pool;     // --pool; empty: a local pool
  std::string metrics_list;
  uint32_t reducers = 2;
  uint32_t groups = 1;
  uint32_t workers = 4;
  size_t chunk_bytes = 0;
  std::string wire_dtype;
  std::string wire_result;
  bool deterministic = false;  // TALLY_DETERMINISTIC=1 for the workers
  std::string job;
  std::string log_level = "warn";
  uint32_t io_threads = 2;
  size_t memory_budget = 256u << 20;
  int64_t op_timeout_ms = 60000;
  int64_t timeout_s = 900;
  std::string tcp_congestion;
  std::string link_rate;
  std::string transport_list = "tcp";
  std::string fabric_provider;
  std::string compare_list;
  std::string netlab_rate;
  bool bytes_report = false;

  // Set by resolve_driver_options: --compare's and --transport's lists.
  std::vector<std::string> peers;
  std::vector<std::string> transports;
};

void add_driver_options(CLI::App& app, DriverOptions& o);

// Checks what the flags said together, before anything is made (--netlab's
// refusal included), and completes it (the lab's rate as the link rate,
// the lists). Returns 0, or 2 once it has said why.
int resolve_driver_options(DriverOptions& o);

}  // namespace tally::bench
