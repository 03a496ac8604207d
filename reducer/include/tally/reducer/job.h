// The state of one job on one reducer: its members (one stream per rank),
// the chunks being summed, and the failures it has told its members about.
//
// Terms: a chunk (op, chunk) is summed over the job's `world_size` ranks. The
// first rank whose header arrives makes its slab the accumulator (its
// payload lands there, no copy); every other rank's payload lands in a
// staging slab and is added in as soon as the accumulator holds data (it is
// parked in `pending` while the first payload is still arriving). When every
// rank's payload has been added, the chunk is finished: scaled for averages
// and sent to every member, and the accumulator slab returns to the quota
// when the last send completes.
//
// Locking: Job::mu_ guards the member table and the chunk map; each chunk has
// its own mutex for the adds, so different chunks sum in parallel on
// different I/O threads. Order: job, then chunk, then quota. No lock is held
// across I/O: members post their sends to their own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"
#include "tally/protocol/transport.h"
#include "tally/reducer/slab_pool.h"

namespace tally {

namespace wire {
class Control;
}

// A job's view of one worker stream. Implementations are thread-safe: every
// method may be called from any I/O thread and must not block.
class JobMember {
 public:
  virtual ~JobMember() = default;
  virtual uint32_t rank() const = 0;
  virtual const std::string& peer() const = 0;
  // Sends a finished chunk; `slab` is held until the send completes.
  virtual void send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) = 0;
  virtual void send_control(std::shared_ptr<const wire::Control> message) = 0;
  // A slab may be free again: retry the contribution that paused.
  virtual void wake() = 0;
};

struct JobSettings {
  std::string name;
  uint32_t world_size = 1;
  uint32_t shard = 0;
  std::chrono::milliseconds op_timeout{60000};
  // Why ranks of an earlier job of the same name left (rank -> reason), to
  // explain a timeout to a worker that joined after they were gone.
  std::map<uint32_t, std::string> history;
};

struct ChunkState;

// What a member keeps between a contribution's header and its payload.
struct PendingContribution {
  std::shared_ptr<ChunkState> chunk;
  std::shared_ptr<Slab> slab;
  bool owner = false;
  void reset() { *this = {}; }
};

// Counters of one reducer, shared by its jobs.
struct ReducerCounters {
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> chunks_finished{0};
  std::atomic<uint64_t> ops_failed{0};
};

class Job {
 public:
  using Clock = std::chrono::steady_clock;

  Job(JobSettings settings, std::shared_ptr<SlabQuota> quota, ReducerCounters& counters);
  ~Job();

  const std::string& name() const { return settings_.name; }
  uint64_t id() const { return id_; }
  const JobSettings& settings() const { return settings_; }

  // Adds a member for its rank. Errors: kAlreadyExists (rank taken),
  // kUnavailable (the job has failed since a rank was lost).
  Status join(const std::shared_ptr<JobMember>& member);
  // Removes a member whose stream closed. A member lost without a goodbye
  // fails every unfinished chunk and the job itself, for the members that
  // remain (like an aborted NCCL communicator). A member that said goodbye
  // (`why` is then its stated reason) only fails the chunks still waiting
  // for it, and later ops until its rank joins again.
  void leave(const JobMember* member, const Status& why, bool goodbye);

  // A contribution's header from `member`: where its payload goes. Fills
  // `pending` on kReceive; kPause after registering the member's wake-up.
  PayloadAction on_contribution_header(const std::shared_ptr<JobMember>& member,
                                       const FrameHeader& header, PendingContribution& pending);
  // The payload named by `pending` has arrived.
  void on_contribution_payload(const FrameHeader& header, PendingContribution& pending);
  // Fails chunks older than the op timeout (naming the missing ranks) and
  // logs stragglers past half of it.
  void sweep(Clock::time_point now);
  // Whether no member is connected.
  bool empty() const;
  // Why ranks left this job (goodbye reasons and losses), for the next job
  // of the same name.
  std::map<uint32_t, std::string> departures() const;

 private:
  using ChunkKey = std::pair<uint64_t, uint32_t>;  // (op, chunk)

  // Fails `op` for every member; mu_ held.
  void fail_op_locked(uint64_t op, const Status& status, const std::vector<uint32_t>& ranks);
  void finish(const std::shared_ptr<ChunkState>& chunk);
  std::vector<std::shared_ptr<JobMember>> members_locked() const;
  // " (rank 0 left earlier: ...)" for the ranks with a known reason.
  std::string history_of(const std::vector<uint32_t>& ranks) const;

  const JobSettings settings_;
  const uint64_t id_;
  std::shared_ptr<SlabQuota> quota_;
  ReducerCounters& counters_;

  mutable std::mutex mu_;
  std::vector<std::shared_ptr<JobMember>> members_;  // by rank
  std::optional<Status> lost_;                       // why the job failed for good
  uint32_t lost_rank_ = 0;
  std::map<uint32_t, std::string> departed_;         // ranks that said goodbye, and why
  std::map<ChunkKey, std::shared_ptr<ChunkState>> chunks_;
  // Ops already failed here, with the error every member was sent, so a
  // late contribution is answered with the same error instead of summed.
  std::unordered_map<uint64_t, std::shared_ptr<const wire::Control>> failed_ops_;
  std::deque<uint64_t> failed_order_;
  std::set<uint64_t> straggler_logged_;
};

}  // namespace tally
