// The one list splitter: TALLY_GROUP_SIZES, pool lists and patterns, and the
// bench's comma-separated flags.
#pragma once

#include <string_view>
#include <vector>

namespace tally {

// The items of `text` between any of `separators`, as views into it:
// "a,b" -> {"a", "b"}, "a," -> {"a", ""}, "" -> {}. Items are not trimmed.
inline std::vector<std::string_view> split_list(std::string_view text,
                                                std::string_view separators = ",") {
  std::vector<std::string_view> items;
  if (text.empty()) return items;
  while (true) {
    const size_t sep = text.find_first_of(separators);
    items.push_back(text.substr(0, sep));
    if (sep == std::string_view::npos) return items;
    text.remove_prefix(sep + 1);
  }
}

}  // namespace tally
