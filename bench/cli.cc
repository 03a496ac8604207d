#include "cli.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>

#include "tally/bench/netlab.h"

namespace tally::bench {

std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

void log_to_stderr(const std::string& level) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("tally-bench"));
  spdlog::set_level(spdlog::level::from_str(level));
}

bool netlab_refused() {
  const std::string why = netlab_refusal();
  if (why.empty()) return false;
  std::fprintf(stderr, "tally-bench: %s\n", why.c_str());
  return true;
}

}  // namespace tally::bench
