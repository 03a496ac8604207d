// The jobs of one reducer, by name, and what it remembers of recently ended
// ones. Jobs are created by the first worker's Hello (or by another
// replica's ReplicaJob announcement), joined by later ranks, and erased
// once their last member has left.
//
// Locking: JobTable::mu_ is above every Job's lock (table, then job, then
// chunk, then quota). It is taken when a stream joins or leaves and by the
// sweep's snapshot, never on the data path. Thread-safe; nothing blocks
// beyond its own short critical sections.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tally/protocol/status.h"
#include "tally/reducer/job.h"
#include "tally/reducer/reducer_options.h"
#include "tally/reducer/replica_mesh.h"
#include "tally/reducer/slab_pool.h"

namespace tally {

namespace wire {
class Control;
class Hello;
class ReplicaJob;
}  // namespace wire

// Job names are identifiers, not payloads.
inline constexpr size_t kMaxJobNameBytes = 256;

class JobTable {
 public:
  // `replicas` may be null with one group.
  JobTable(const ReducerOptions& options, std::shared_ptr<SlabPool> pool, ReducerCounters& counters,
           std::shared_ptr<ReplicaMesh> replicas);

  // A worker's Hello: finds its job (checking that the world size and
  // groups agree) or creates it, and joins `member` to it. Errors:
  // kInvalidArgument (a bad Hello), kMismatch, kResourceExhausted (no
  // memory for another job), and Job::join's.
  Result<std::shared_ptr<Job>> admit(const wire::Hello& hello, bool authenticated,
                                     const std::shared_ptr<JobMember>& member);
  // A job the replica of `from_group` announced: found and checked, or
  // created. Errors: kInvalidArgument, kMismatch, kUnavailable (stopping).
  Result<std::shared_ptr<Job>> admit_replica_job(const wire::ReplicaJob& announced,
                                                 uint32_t from_group);
  std::shared_ptr<Job> find(const std::string& name) const;
  // `member`'s stream closed: it leaves `job`, which is erased once it has
  // no member left.
  void leave(const std::shared_ptr<Job>& job, const JobMember* member, const Status& why,
             Departure how);
  // ReplicaJob messages of the live jobs `group` takes part in, for a new
  // stream to that replica.
  std::vector<std::shared_ptr<const wire::Control>> announcements(uint32_t group) const;
  // The replica of `group` was lost: logged; its jobs wait for it.
  void on_replica_lost(uint32_t group, const Status& why);
  // Both streams to the replica of `group` are up again after a loss.
  void on_replica_back(uint32_t group);
  // Fails timed-out ops and drops jobs a replica announced whose workers
  // never came here.
  void sweep(Job::Clock::time_point now);
  // "its workers have left (rank 1: ...)": why an ended job's workers left.
  std::string ended_job_note(const std::string& name) const;
  // No new job from other replicas from now on; losses are no longer
  // reported (every stream is closing anyway).
  void stop();
  // Whether stop() has been called (admissions are refused from then on).
  bool stopping() const;
  size_t size() const;
  // After the I/O threads are joined: drops every job.
  void clear();

 private:
  struct Tombstone {
    std::chrono::steady_clock::time_point ended;
    std::map<uint32_t, std::string> departures;
  };

  // Creates a job and tells the other participants; mu_ held.
  Result<std::shared_ptr<Job>> create_locked(JobSettings settings);
  // Takes `job` out of the table and tells the other replicas; mu_ held.
  void erase_locked(const std::shared_ptr<Job>& job);
  std::string ended_job_note_locked(const std::string& name) const;
  // Keeps why `job`'s ranks left (unless all left cleanly) for its
  // successor of the same name; mu_ held.
  void remember_departures_locked(const Job& job);
  // Every job, or nothing once stopping.
  std::optional<std::vector<std::shared_ptr<Job>>> snapshot() const;

  const ReducerOptions options_;
  const std::shared_ptr<SlabPool> pool_;
  ReducerCounters& counters_;
  const std::shared_ptr<ReplicaMesh> replicas_;

  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Job>> jobs_;
  // Why the ranks of recently ended jobs left, by job name (bounded).
  std::map<std::string, Tombstone> tombstones_;
  bool stopping_ = false;
};

}  // namespace tally
