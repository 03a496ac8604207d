#include "logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <mutex>

namespace tally::client_internal {

void log_to_stderr() {
  // spdlog makes its registry on first use, in libspdlog (which sanitizers
  // do not see into): made once here, before any client's I/O thread can
  // log, every thread that logs is ordered after it.
  static std::once_flag once;
  std::call_once(once, [] {
    auto current = spdlog::default_logger();
    const auto& sinks = current->sinks();
    if (!current->name().empty() || sinks.size() != 1 ||
        !dynamic_cast<spdlog::sinks::stdout_color_sink_mt*>(sinks[0].get())) {
      return;
    }
    auto logger = std::make_shared<spdlog::logger>(
        "", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    logger->set_level(current->level());
    spdlog::set_default_logger(std::move(logger));
  });
}

}  // namespace tally::client_internal
