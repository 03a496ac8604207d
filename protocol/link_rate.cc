#include "tally/protocol/link_rate.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace tally {

Result<uint64_t> parse_link_rate(const std::string& rate) {
  size_t digits = 0;
  while (digits < rate.size() &&
         (std::isdigit(static_cast<unsigned char>(rate[digits])) || rate[digits] == '.')) {
    ++digits;
  }
  const std::string unit = rate.substr(digits);
  double scale = 0;
  if (unit == "bit") scale = 1;
  if (unit == "kbit") scale = 1e3;
  if (unit == "mbit") scale = 1e6;
  if (unit == "gbit") scale = 1e9;
  if (unit == "tbit") scale = 1e12;
  const double value = digits ? std::atof(rate.substr(0, digits).c_str()) : 0;
  if (scale == 0 || value * scale < 8000) {
    return Status(ErrorCode::kInvalidArgument,
                  "rate '" + rate +
                      "': want at least 8kbit, as a number and bit, kbit, mbit, gbit or tbit "
                      "(tc's units), e.g. 1gbit");
  }
  return static_cast<uint64_t>(value * scale);
}

uint64_t paced_share(uint64_t link_rate_bits, size_t streams) {
  const double bytes =
      static_cast<double>(link_rate_bits) / 8 * 0.95 / std::max<size_t>(1, streams);
  return std::max<uint64_t>(1, static_cast<uint64_t>(bytes));
}

uint64_t receive_share(uint64_t budget_bytes, size_t streams) {
  if (budget_bytes == 0) return 0;
  return std::max<uint64_t>(1, budget_bytes / std::max<size_t>(1, streams));
}

}  // namespace tally
