// What a job on one reducer remembers about its ops apart from their chunks:
// the ops it failed (FailedOps), and when each op in flight began (OpTimings).
// Plain data, no lock: Job holds both under its mutex. Each is bounded
// whatever the workers send: past its capacity the oldest op is forgotten.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>

namespace tally {

namespace wire {
class Control;
}  // namespace wire

// The ops failed here, with the error every member was sent, so that a late
// contribution is answered with the same error instead of summed.
class FailedOps {
 public:
  static constexpr size_t kCapacity = 4096;
  explicit FailedOps(size_t capacity = kCapacity) : capacity_(capacity) {}

  // Remembers why `op` failed; false (and nothing changes) if it had.
  bool add(uint64_t op, std::shared_ptr<const wire::Control> error);
  // The error `op` failed with, or null.
  std::shared_ptr<const wire::Control> find(uint64_t op) const;
  bool contains(uint64_t op) const { return errors_.count(op) > 0; }

 private:
  size_t capacity_;
  std::unordered_map<uint64_t, std::shared_ptr<const wire::Control>> errors_;
  std::deque<uint64_t> order_;  // oldest first
};

// The ops with chunks in flight here: when the first began, who sent it,
// how many of the chunks this shard gets are finished (for the op-latency
// histogram, and the check that every rank cut the op alike), and whether
// sweep() has logged it as straggling.
class OpTimings {
 public:
  using Clock = std::chrono::steady_clock;
  // Far more ops than a worker's window of chunks can span.
  static constexpr size_t kCapacity = 4096;
  explicit OpTimings(size_t capacity = kCapacity) : capacity_(capacity) {}

  struct Op {
    Clock::time_point began;
    uint64_t expected = 0;    // the first contribution's chunks_on_shard
    uint32_t first_rank = 0;  // who sent it
    uint64_t finished = 0;
    bool straggle_logged = false;  // since its last chunk finished
  };
  // The first chunk of `op` arrived (ignored if it is tracked already). A
  // forgotten op goes unmeasured, never miscounted as failed.
  void began(uint64_t op, Clock::time_point now, uint64_t chunks_on_shard, uint32_t rank);
  // The op while it is tracked, else null.
  const Op* find(uint64_t op) const;
  // One of `op`'s chunks was finished here: when the op began, if that was
  // its last chunk (it is then forgotten).
  std::optional<Clock::time_point> chunk_finished(uint64_t op);
  // Whether a straggling chunk of `op` is the first one to log since the
  // op began or its last chunk finished (then it is not, until the next
  // chunk finishes); false for an op not tracked.
  bool first_straggle(uint64_t op);
  void forget(uint64_t op) { ops_.erase(op); }
  void clear() { ops_.clear(); }

 private:
  size_t capacity_;
  std::map<uint64_t, Op> ops_;
};

}  // namespace tally
