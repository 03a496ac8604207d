// What an OpHandle shares with the I/O thread: the end of one or more ops
// (several for a fused call), the staged copies of fused buffers, and the
// callback. Private to libtally.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "tally/client/client.h"

namespace tally {

struct OpHandle::State {
  // A fused group's staging copy and where each part goes back on success.
  struct Staged {
    std::vector<std::byte> bytes;
    std::vector<std::pair<std::byte*, size_t>> parts;  // (caller's buffer, nbytes), in order
  };

  std::optional<uint64_t> first_op;  // set before the handle is returned
  // How long wait() may take before it calls the wait a tally bug.
  std::chrono::milliseconds wait_limit{0};
  std::vector<Staged> staged;  // touched by the thread that ends the last op only

  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;  // ops not ended yet
  bool done = false;
  Status status;        // the first failure, else ok
  OpCallback callback;  // taken by the thread that ends the last op

  // One of the ops has ended with `s`. The last one copies staged parts back
  // (when every op succeeded), runs the callback, then marks the handle done
  // and wakes the waiters, in that order, on the calling thread.
  void end_one(const Status& s);
  // A handle that ended without any op in flight (refused, or nothing to do).
  static OpHandle ended(Status s, OpCallback callback);
};

}  // namespace tally
