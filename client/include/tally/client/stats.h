// What a Client has done since it connected (Client::stats()): its ops,
// their bytes and times, and how often it had to reconnect and resend. Each
// counter only grows; a snapshot may be taken from any thread. The C API
// (tally_client_stats) and Python (tally.Client.stats()) give the same
// numbers, described here once.
#pragma once

#include <array>
#include <cstdint>

namespace tally {

// Upper bounds, in seconds, of the op-time histogram's buckets (a last
// bucket holds the ops slower than every bound): 100 us to 10 s, about
// 2.5x apart, which spans a 4 KiB op on loopback to a large op on a slow link.
inline constexpr std::array<double, 15> kOpSecondsBounds{0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                                                         0.005,  0.01,    0.025,  0.05,  0.1,
                                                         0.25,   0.5,     1.0,    2.5,   10.0};

struct ClientStats {
  // Ops that ended well, and ops that ended with an error (those cancelled
  // when the client closed included). A fused call counts each of its ops.
  uint64_t ops_completed = 0;
  uint64_t ops_failed = 0;
  // Payload bytes sent to the reducers (contributions, and results replayed
  // after a reconnect) and result payload bytes received, as on the wire.
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // Reducer streams reopened after a loss (a reducer restart, a cut link).
  uint64_t reconnects = 0;
  // Chunks sent again on a reopened stream: contributions whose results had
  // not come, and results replayed for ranks that lacked them.
  uint64_t replays = 0;
  // Every op that ended, from the call that started it to its end: the sum
  // and the largest, in seconds, and how many ended within each bound of
  // kOpSecondsBounds (bucket i: over bound i-1, up to bound i; not
  // cumulative), the last bucket over every bound.
  double op_seconds_sum = 0;
  double op_seconds_max = 0;
  std::array<uint64_t, kOpSecondsBounds.size() + 1> op_seconds_buckets{};

  // The bound within which a fraction `q` (0 to 1) of the ops ended: the
  // upper bound of the bucket where that op falls (op_seconds_max for the
  // last), or 0 with no op.
  double op_seconds_quantile(double q) const;
};

}  // namespace tally
