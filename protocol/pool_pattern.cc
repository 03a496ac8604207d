#include "tally/protocol/pool_pattern.h"

#include <charconv>

#include "tally/protocol/split.h"

namespace tally {

namespace {

Status bad(std::string_view item, const std::string& why) {
  return Status(ErrorCode::kInvalidArgument,
                "pool item '" + std::string(item) + "': " + why +
                    " (a range is written {A..B}, e.g. tally-{0..7}.tally.ns.svc:7070)");
}

// A decimal number of at most 9 digits (so B - A + 1 cannot overflow).
bool parse_bound(std::string_view text, uint64_t& out) {
  if (text.empty() || text.size() > 9) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size();
}

Status expand_item(std::string_view item, std::vector<std::string>& out) {
  const size_t open = item.find('{');
  const size_t close = item.find('}');
  if (open == std::string_view::npos && close == std::string_view::npos) {
    if (out.size() >= kMaxPoolAddresses) return bad(item, "too many addresses");
    out.emplace_back(item);
    return Status::ok();
  }
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) {
    return bad(item, "unbalanced braces");
  }
  const std::string_view prefix = item.substr(0, open);
  const std::string_view range = item.substr(open + 1, close - open - 1);
  const std::string_view suffix = item.substr(close + 1);
  if (range.find('{') != std::string_view::npos) return bad(item, "nested braces");
  if (suffix.find_first_of("{}") != std::string_view::npos) {
    return bad(item, "more than one range in one item");
  }
  const size_t dots = range.find("..");
  if (dots == std::string_view::npos) return bad(item, "the braces hold no A..B range");
  const std::string_view lo_text = range.substr(0, dots);
  const std::string_view hi_text = range.substr(dots + 2);
  uint64_t lo = 0;
  uint64_t hi = 0;
  if (!parse_bound(lo_text, lo) || !parse_bound(hi_text, hi)) {
    return bad(item, "range bounds must be decimal numbers of at most 9 digits");
  }
  if (lo > hi) return bad(item, "the range's first number is larger than its last");
  if (hi - lo + 1 > kMaxPoolAddresses - out.size()) {
    return bad(item, "expands to more than " + std::to_string(kMaxPoolAddresses) + " addresses");
  }
  const bool padded =
      (lo_text.size() > 1 && lo_text[0] == '0') || (hi_text.size() > 1 && hi_text[0] == '0');
  const size_t width = padded ? std::max(lo_text.size(), hi_text.size()) : 0;
  for (uint64_t i = lo; i <= hi; ++i) {
    std::string number = std::to_string(i);
    if (number.size() < width) number.insert(0, width - number.size(), '0');
    std::string address;
    address.reserve(prefix.size() + number.size() + suffix.size());
    address.append(prefix).append(number).append(suffix);
    out.push_back(std::move(address));
  }
  return Status::ok();
}

}  // namespace

Result<std::vector<std::string>> expand_pool_pattern(std::string_view spec) {
  std::vector<std::string> out;
  for (std::string_view item : split_list(spec, ",\n")) {
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t' || item.back() == '\r')) {
      item.remove_suffix(1);
    }
    if (!item.empty()) TALLY_RETURN_IF_ERROR(expand_item(item, out));
  }
  return out;
}

Result<std::string> expand_pool_pattern_joined(std::string_view spec) {
  auto items = expand_pool_pattern(spec);
  if (!items) return items.status();
  std::string out;
  for (size_t i = 0; i < items->size(); ++i) {
    if (i) out += ",";
    out += (*items)[i];
  }
  return out;
}

}  // namespace tally
