// Reading a reducer's /metrics from the bench and the tests: one HTTP GET
// with a deadline, and the samples of the Prometheus text format by series.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <string_view>

#include "tally/protocol/status.h"

namespace tally::bench {

// GET http://`host_port``target`; the body of a 200 answer. Blocks up to
// `timeout` (connect, write and read together). Errors: kUnavailable
// (cannot connect, or a status other than 200, named), kTimeout.
Result<std::string> http_get(const std::string& host_port, const std::string& target,
                             std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));

// Every sample of a Prometheus text exposition by its series as written,
// e.g. `tally_payload_bytes_received_total{peer="worker"}` -> 4096. Comment
// lines and lines that do not parse are skipped. Pure.
std::map<std::string, double> parse_metrics(std::string_view text);

}  // namespace tally::bench
