// The log levels every tally binary's --log-level takes. spdlog reads any
// other word as "off", so a typo would silence the process: the flags
// check their value against this list first.
#pragma once

#include <string>
#include <vector>

namespace tally {

inline const std::vector<std::string>& log_level_names() {
  static const std::vector<std::string> names{"trace",   "debug", "info",     "warn",
                                              "warning", "error", "critical", "off"};
  return names;
}

}  // namespace tally
