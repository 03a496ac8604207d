// ClientStats (stats.h) and the I/O thread's Counters behind it.
#include "tally/client/stats.h"

#include <algorithm>
#include <chrono>

#include "client_impl.h"

namespace tally {

double ClientStats::op_seconds_quantile(double q) const {
  uint64_t ops = 0;
  for (uint64_t n : op_seconds_buckets) ops += n;
  if (ops == 0) return 0;
  // The rank of the op at q, 1-based: q = 0.5 of 4 ops is the 2nd.
  const auto wanted = std::max<uint64_t>(
      1, static_cast<uint64_t>(std::clamp(q, 0.0, 1.0) * static_cast<double>(ops) + 0.5));
  uint64_t seen = 0;
  for (size_t i = 0; i < kOpSecondsBounds.size(); ++i) {
    seen += op_seconds_buckets[i];
    if (seen >= wanted) return std::min(kOpSecondsBounds[i], op_seconds_max);
  }
  return op_seconds_max;
}

namespace client_internal {

void Counters::op_ended(bool failed, std::chrono::steady_clock::duration took) {
  add(failed ? ops_failed_ : ops_completed_, 1);
  const auto nanos = static_cast<uint64_t>(
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(took).count()));
  add(op_nanos_sum_, nanos);
  // One writer (the I/O thread): a plain compare is enough.
  if (nanos > op_nanos_max_.load(std::memory_order_relaxed))
    op_nanos_max_.store(nanos, std::memory_order_relaxed);
  const double seconds = static_cast<double>(nanos) / 1e9;
  const size_t bucket =
      std::lower_bound(kOpSecondsBounds.begin(), kOpSecondsBounds.end(), seconds) -
      kOpSecondsBounds.begin();
  add(op_buckets_[bucket], 1);
}

ClientStats Counters::snapshot() const {
  auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  ClientStats s;
  s.ops_completed = get(ops_completed_);
  s.ops_failed = get(ops_failed_);
  s.bytes_sent = get(bytes_sent_);
  s.bytes_received = get(bytes_received_);
  s.reconnects = get(reconnects_);
  s.replays = get(replays_);
  s.op_seconds_sum = static_cast<double>(get(op_nanos_sum_)) / 1e9;
  s.op_seconds_max = static_cast<double>(get(op_nanos_max_)) / 1e9;
  for (size_t i = 0; i < op_buckets_.size(); ++i) s.op_seconds_buckets[i] = get(op_buckets_[i]);
  return s;
}

}  // namespace client_internal
}  // namespace tally
