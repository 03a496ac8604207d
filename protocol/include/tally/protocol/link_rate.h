// A link's rate, as the reducers (--link-rate) and workers (TALLY_LINK_RATE)
// are told it, and each stream's share of it; and each stream's share of a
// receive budget (--receive-budget, TALLY_RECEIVE_BUDGET). Transport-neutral:
// the chunk plan sizes chunks from the rate, and each transport paces its
// streams by it and bounds their receive windows by the budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "tally/protocol/status.h"

namespace tally {

// A link rate as tc writes it ("1gbit", "500mbit", "100kbit", "2000000bit"),
// in bits per second. Errors: kInvalidArgument.
Result<uint64_t> parse_link_rate(const std::string& rate);

// What each of `streams` streams sharing a link of `link_rate_bits` is paced
// to, in bytes per second (Connection::pace): an equal share of 95% of the
// link, as Ethernet's framing takes 2.5% of it and streams paced to the
// whole rate would keep its queue growing. At least 1.
uint64_t paced_share(uint64_t link_rate_bits, size_t streams);

// What each of `streams` streams converging on one receiver may have in
// flight towards it (Connection::bound_receive_window, which keeps room for
// a few of the stream's segments however small the share): an equal share
// of `budget_bytes`, at least a byte. 0: not bounded (a budget of 0 turns
// the bound off).
uint64_t receive_share(uint64_t budget_bytes, size_t streams);

}  // namespace tally
