// A warning that can repeat once per connection or per failed call (a
// stream refused or closed before its hello, an accept that failed, a
// connection over the limit) is said at most `burst` times per interval,
// the first line of the next interval saying how many went unlogged: a
// flood of hostile connections then costs a few lines per interval, not
// megabytes, and a handful of different failures are each still seen.
// Thread-safe: one limiter per kind of warning, shared by every I/O thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>

namespace tally {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::duration kEvery = std::chrono::seconds(10);
  static constexpr uint64_t kBurst = 10;
  explicit LogLimiter(Clock::duration every = kEvery, uint64_t burst = kBurst)
      : every_(every), burst_(burst) {}

  // Counts one occurrence. When it may be logged now: how many occurrences
  // went unlogged before this one (the caller says so in the line); else
  // nullopt.
  std::optional<uint64_t> allow(Clock::time_point now = Clock::now()) {
    std::lock_guard lock(mu_);
    if (!started_ || now - window_start_ >= every_) {
      started_ = true;
      window_start_ = now;
      logged_ = 0;
    }
    if (logged_ >= burst_) {
      ++unlogged_;
      return std::nullopt;
    }
    ++logged_;
    const uint64_t before = unlogged_;
    unlogged_ = 0;
    return before;
  }

 private:
  const Clock::duration every_;
  const uint64_t burst_;
  std::mutex mu_;
  bool started_ = false;
  Clock::time_point window_start_{};
  uint64_t logged_ = 0;    // in this window
  uint64_t unlogged_ = 0;  // since the last line
};

}  // namespace tally
