// What a job holds of its replica groups beside its members and chunks
// (job.h): its round (JobRound), the partials that came before a chunk of
// theirs (EarlyPartials), and the groups whose replica has ended the job
// (LeftGroups). JobRound and EarlyPartials are plain data that Job holds
// under its mutex; LeftGroups has its own lock, because the butterfly asks
// it under a chunk's lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"
#include "tally/reducer/slab_pool.h"

namespace tally {

using ChunkKey = std::pair<uint64_t, uint32_t>;  // (op, chunk)

// The job's round (docs/protocol.md, "Resuming with replica groups"): every
// replica drops its ops in flight and asks its workers to rejoin when a
// replica is back after a loss, and partials carry their round so that one
// from before is never added to a sum of after.
class JobRound {
 public:
  using Clock = std::chrono::steady_clock;
  explicit JobRound(uint64_t number = 0) : number_(number) {}

  uint64_t number() const { return number_; }
  // The round a partial's header names (its 8 bits, the sender's round mod
  // 256) as a full round number, this one or later; nullopt for an earlier
  // one. Rounds of two replicas differ by far less than 128, so the bits
  // tell earlier from later.
  std::optional<uint64_t> of_wire(uint8_t wire) const;
  // Starts round `number` (> number()): the ranks asked to rejoin, with
  // those still due back from before, keep the job from counting as empty
  // until they are back or `until` passes.
  // Forgets the finished finals of the round before.
  void start(uint64_t number, std::set<uint32_t> asked, Clock::time_point until);
  // Moves to `number` without asking anyone back (the job has failed or
  // left the table: it only answers in the round it was told).
  void skip_to(uint64_t number) { number_ = number; }
  // `rank` joined again.
  void rejoined(uint32_t rank) { rejoining_.erase(rank); }
  // Whether a rank asked to rejoin is still due back at `now`.
  bool awaiting_rejoin(Clock::time_point now) const;

  // A chunk finished here with a final result (a replay's or another
  // replica's): a final for it that arrives later is dropped, not kept
  // waiting for a chunk that will not come again.
  void finished_final(const ChunkKey& key) { finished_finals_.insert(key); }
  bool final_finished(const ChunkKey& key) const { return finished_finals_.count(key) > 0; }
  // Every rank of the group has the results of the ops below `op`.
  void forget_finals_below(uint64_t op);

 private:
  uint64_t number_;
  Clock::time_point rejoin_until_{};
  std::set<uint32_t> rejoining_;
  std::set<ChunkKey> finished_finals_;
};

// Partials (and finals) from other replicas for chunks that have no state
// here yet: no rank of this group has contributed to them.
class EarlyPartials {
 public:
  using Clock = std::chrono::steady_clock;
  struct Partial {
    uint32_t from_group = 0;
    FrameHeader header;  // kFrameFlagFinal: a final result
    std::shared_ptr<Slab> slab;
    Clock::time_point arrived;
  };

  void add(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
           Clock::time_point now);
  // The partials of chunk `key`, in arrival order, taken out.
  std::vector<Partial> take(const ChunkKey& key);
  void drop_op(uint64_t op);
  // Drops the partials of the ops below `op`.
  void drop_below(uint64_t op);
  void clear() { partials_.clear(); }
  bool empty() const { return partials_.empty(); }
  // The ops with a partial here.
  std::set<uint64_t> ops() const;
  // The ops with a chunk whose first partial has waited longer than `timeout`.
  std::set<uint64_t> overdue(Clock::time_point now, Clock::duration timeout) const;

 private:
  std::map<ChunkKey, std::vector<Partial>> partials_;
};

// The groups whose replica has ended the job, and why. Thread-safe.
class LeftGroups {
 public:
  void add(uint32_t group, const Status& why);
  std::optional<Status> find(uint32_t group) const;

 private:
  mutable std::mutex mu_;
  std::map<uint32_t, Status> left_;
};

}  // namespace tally
