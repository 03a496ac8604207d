// What tally-bench's modes (the sweep driver, load and chaos, run) do alike
// on their command lines. Private to tally-bench.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

namespace tally::bench {

// Parses argv into `app`. Returns nullopt when the program goes on, else
// its exit code: 0 after --help or --version, 2 for bad flags (as
// docs/configuration.md says).
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv);

// tally-bench's own log lines: on stderr, at `level` (log_level_names()).
void log_to_stderr(const std::string& level);

// --netlab where this process cannot make a lab: says why on stderr and
// returns true (the caller exits 2 before making anything).
bool netlab_refused();

}  // namespace tally::bench
