// The state of one job on one reducer: its members (one stream per rank),
// the chunks being summed (chunk.h), and the failures it has told its
// members about.
//
// Replica groups: the job's workers are split into groups, and this reducer
// serves one of them. Its chunk sum is then a partial over the group's
// `local_size` ranks, which the participants (replicas of this shard with
// workers in the job) combine in each chunk's butterfly. Partials from other
// replicas land in slabs of the same quota; a partial that arrives before
// this reducer has a chunk for it waits in `early_`. An op failure found
// here is forwarded to the other replicas. The round, the early partials
// and the groups that left are classes of their own (job_replica_state.h).
//
// Locking: Job::mu_ guards the member table and the chunk map; each chunk
// has its own lock for the adds. Order: job, then chunk, then quota. No lock
// is held across I/O: members post their sends to their own thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"
#include "tally/protocol/transport.h"
#include "tally/reducer/butterfly.h"
#include "tally/reducer/chunk.h"
#include "tally/reducer/job_replica_state.h"
#include "tally/reducer/op_memory.h"
#include "tally/reducer/reducer_counters.h"
#include "tally/reducer/release_marks.h"
#include "tally/reducer/replica_mesh.h"
#include "tally/reducer/slab_pool.h"

namespace tally {

// Ranks as errors list them: "0,3,7", at most 16, then "and N more".
std::string ranks_string(const std::vector<uint32_t>& ranks);

namespace wire {
class Control;
class Error;
class ReplicaJob;
}  // namespace wire

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
  // Tells the worker why (an Error) and closes its stream.
  virtual void close(const Status& why) = 0;
};

struct JobSettings {
  std::string name;
  uint32_t world_size = 1;
  uint32_t shard = 0;
  // This reducer's replica group, and the workers of the job in each group
  // (empty: one group of world_size).
  uint32_t group = 0;
  std::vector<uint32_t> group_sizes;
  // Groups were set per rank (TALLY_GROUP), so which ranks form a group is
  // known only as they join; otherwise they are the contiguous blocks.
  bool groups_explicit = false;
  std::chrono::milliseconds op_timeout{60000};
  // Bytes of one chunk buffer (the reducer's max_chunk_bytes): bounds the
  // elements of a chunk whose accumulator is wider than its payload.
  size_t max_chunk_bytes = 0;
  // Why ranks of an earlier job of the same name left (rank -> reason), to
  // explain a timeout to a worker that joined after they were gone.
  std::map<uint32_t, std::string> history;
  // Its members proved they hold the job secret; every later one must too.
  bool authenticated = false;
  // The round it starts in (ReplicaJob.round): 0, or the round of the
  // replica whose ReplicaJob created it.
  uint64_t round = 0;
  // Reproducible sums (Hello.deterministic): each chunk sums its ranks in
  // the sum tree of sum_tree.h; with replica groups, the groups are the
  // contiguous blocks (JobTable::admit).
  bool deterministic = false;
  // Chunks in flight per stream its workers are told (Welcome); 0: the
  // reducer's window. Set for reproducible sums (Job::deterministic_window).
  uint32_t window_chunks = 0;
};

// What a replica's stream keeps between a partial's header and its payload.
struct PendingPartial {
  std::shared_ptr<Slab> slab;
  uint32_t from_group = 0;
  uint64_t round = 0;  // the job's round it was taken in
};

// What a member keeps between a contribution's header and its payload.
struct PendingContribution {
  std::shared_ptr<Chunk> chunk;
  std::shared_ptr<Slab> slab;
  SlabRole role = SlabRole::kStaging;
  void reset() { *this = {}; }
};

// How a member left: with a goodbye (its stated reason), lost (its stream
// closed, reset or broke the protocol), or stalled (its stream went quiet
// past the peer timeout: it may be paused or cut off, and resume).
enum class Departure { kGoodbye, kLost, kStalled };
// How a member came: a worker's first hello (a new Client, with no
// results yet), or a hello with resume set (it reconnects with ops and
// results it may need to send again).
enum class Arrival { kFresh, kResuming };

class Job : public std::enable_shared_from_this<Job> {
 public:
  using Clock = std::chrono::steady_clock;

  // `mesh` is needed when more than one group has workers.
  Job(JobSettings settings, std::shared_ptr<SlabQuota> quota, ReducerCounters& counters,
      std::shared_ptr<ReplicaMesh> mesh = nullptr);
  ~Job();

  const std::string& name() const { return settings_.name; }
  uint64_t id() const { return id_; }
  const JobSettings& settings() const { return settings_; }
  // Groups with workers in this job, in order.
  const std::vector<uint32_t>& participants() const { return participants_; }
  // Workers of this reducer's group.
  uint32_t local_size() const { return local_size_; }
  // Slabs a job needs so that no stream can wait forever for memory
  // (docs/architecture.md, Memory): window x (1 + 2F) + 2, F the most
  // partials a participant receives per chunk.
  static size_t quota_slabs(uint32_t window, size_t participants);
  // With reproducible sums: window x (L + 2R) + 2, an unfinished chunk
  // holding a slab per rank of the group (L = `local`) and up to R =
  // `received` nodes of the other groups' covers.
  static size_t deterministic_quota_slabs(uint32_t window, uint32_t local, size_t received);
  // The window (chunks in flight per stream) of a job with reproducible
  // sums, on a reducer whose window is `window` and whose pool has
  // `free_slabs` free: the widest, up to `window`, whose quota
  // (deterministic_quota_slabs) they hold; 1 when none does (its
  // reservation then fails).
  static uint32_t deterministic_window(uint32_t window, uint32_t local, size_t received,
                                       size_t free_slabs);
  // The window this job's workers are told, on a reducer whose window is
  // `window` (JobSettings::window_chunks).
  uint32_t window_chunks(uint32_t window) const;
  // Another replica's description of the job: the same world size and group
  // sizes, or kMismatch naming both.
  Status check_replica_settings(const wire::ReplicaJob& replica, const std::string& who) const;
  // This job as a ReplicaJob message for the other replicas.
  std::shared_ptr<const wire::Control> replica_job_message() const;

  // Adds a member for its rank. A fresh one has every result it will ever
  // need replayed, none: its Received mark is 0 from the start, so the ranks
  // that resume beside it are released without waiting for a mark it has
  // no reason to send. Errors: kAlreadyExists (rank taken), kUnavailable
  // (the job has failed since a rank was lost).
  Status join(const std::shared_ptr<JobMember>& member, Arrival arrival);
  // Removes a member whose stream closed. A member lost without a goodbye
  // fails every unfinished chunk and the job itself, for the members that
  // remain (like an aborted NCCL communicator). A member that said goodbye
  // (`why` is then its stated reason) only fails the chunks still waiting
  // for it, and later ops until its rank joins again.
  void leave(const JobMember* member, const Status& why, Departure how);

  // A contribution's header from `member`: where its payload goes. Fills
  // `pending` on kReceive; kPause after registering the member's wake-up.
  PayloadAction on_contribution_header(const std::shared_ptr<JobMember>& member,
                                       const FrameHeader& header, PendingContribution& pending);
  // The payload named by `pending` has arrived.
  void on_contribution_payload(const FrameHeader& header, PendingContribution& pending);
  // `rank` has every result of the ops below `op_below` (a Received); when
  // the least mark over the group's ranks advances, every member is told
  // (Released) that no one will need those ops replayed. Once every rank
  // of the group has joined and said a mark, the least is told even
  // unchanged: resumed workers wait for it.
  // `released_below` is the highest Released the rank has had from any
  // reducer: every rank has the results below it.
  void on_received(uint32_t rank, uint64_t op_below, uint64_t released_below = 0);
  // A partial from the replica of `from_group`: where its payload goes
  // (nowhere for an earlier round than this one's, header.round; a later
  // round is started here first). kPause after registering `wake` with
  // the quota.
  PayloadAction on_partial_header(uint32_t from_group, const FrameHeader& header,
                                  PendingPartial& pending, std::function<void()> wake);
  void on_partial_payload(const FrameHeader& header, PendingPartial& pending);
  // Another replica failed an op (has_op) or the whole job; not forwarded.
  void on_replica_error(const wire::Error& error);
  // The job has ended on the replica of `group`: every op that still needs
  // a partial from it fails with `why`, now or when it gets there.
  void on_replica_left(uint32_t group, const Status& why);
  // The replica of `group` is lost (`why`): nothing fails, and the job's
  // workers are told (ReplicaLost), so that an op failing meanwhile on
  // another shard names it.
  void on_replica_lost(uint32_t group, const Status& why);
  // The replica of `group` is back after a loss (restarted, or its streams
  // reopened): the job starts a new round (docs/protocol.md, "Resuming
  // with replica groups").
  void on_replica_back(uint32_t group);
  // The replica of `group` announced the job in its `round` (a ReplicaJob)
  // with its group's least Received mark, if known: a later round than
  // this one's is started here too; an earlier one is answered with this
  // job's ReplicaJob, so that replica catches up.
  void on_replica_round(uint32_t group, uint64_t round, std::optional<uint64_t> mark);
  // The least Received mark of the replica of `group`'s ranks advanced.
  void on_replica_mark(uint32_t group, uint64_t mark);
  uint64_t round() const;
  // Taken out of the reducer's job table: partials still arriving for it
  // are answered with an error that gives `why`.
  void retire(std::string why);
  // Ends the job for good for a claim that outranks it (an authenticated
  // job asking for the name this unauthenticated one holds): its ops fail
  // with `why`, and every member is told it and closed.
  void evict(const Status& why);
  // No member, nothing in flight, and memberless for longer than the op
  // timeout (a job created by a replica whose own workers never came).
  bool abandoned(Clock::time_point now) const;
  // Fails chunks older than the op timeout (naming the missing ranks) and
  // logs stragglers past half of it. Returns how many distinct ranks are
  // being waited on past half the op timeout (for /metrics).
  size_t sweep(Clock::time_point now);
  // Whether no member is connected, nor any asked to rejoin is due back.
  bool empty() const;
  // Why ranks left this job (goodbye reasons and losses), for the next job
  // of the same name.
  std::map<uint32_t, std::string> departures() const;

 private:
  // Whether an op failure found here is told to the other replicas.
  enum class Forward { kYes, kNo };

  // Fails `op` for every member (and the other replicas); mu_ held.
  void fail_op_locked(uint64_t op, const Status& status, const std::vector<uint32_t>& ranks,
                      Forward forward = Forward::kYes);
  // Fails every op in flight here; mu_ held.
  void fail_all_ops_locked(const Status& status, const std::vector<uint32_t>& ranks,
                           Forward forward);
  // `rank (peer) of job 'x' was lost: why`, kPeerLost.
  Status lost_status(uint32_t rank, const std::string& peer, const std::string& why) const;
  // A rank stalled: the job starts a round without it and waits for it to
  // resume until the op timeout; mu_ held.
  void await_stalled_locked(uint32_t rank, const std::string& peer, const Status& why);
  // The job gives up on the stalled ranks whose time is up at `now`: it
  // fails as for lost ranks. Returns whether the released mark moved.
  bool give_up_stalled(Clock::time_point now);
  // Fails the job for good (lost_) for `ranks`; mu_ held. Returns whether
  // the released mark moved.
  bool lose_locked(const Status& lost, const std::vector<uint32_t>& ranks);
  // Starts round `round` (> round_): drops every chunk in flight, asks each
  // member to rejoin (Rejoin) and announces the round to the other
  // replicas; mu_ held.
  void start_round_locked(uint64_t round, const std::string& why);
  // Sends this chunk's final result (from a worker's replay) to the other
  // replicas, if it has one not sent yet; no lock held.
  void send_final(const std::shared_ptr<Chunk>& chunk);
  std::shared_ptr<const wire::Control> replica_job_message_locked() const;
  // A partial (or final) for a chunk whose result this group has: dropped.
  bool stale_partial_locked(const FrameHeader& h) const;
  // A rank's Received mark (kLeftJob: it left): when the group's mark
  // moves, the other replicas are told (ReplicaMark); returns the Released
  // to send every member, or null when the job's mark has not moved; mu_
  // held (job_marks.cc, with the next three).
  static constexpr uint64_t kLeftJob = UINT64_MAX;
  std::shared_ptr<const wire::Control> note_mark_locked(uint32_t rank, uint64_t op_below);
  // The replica of `group` said its group's mark: the Released to send, or null.
  std::shared_ptr<const wire::Control> replica_said_mark_locked(uint32_t group, uint64_t mark);
  // Where the job's mark stands as a Released, null before it is known.
  std::shared_ptr<const wire::Control> job_mark_message_locked() const;
  // After the job's least mark or this group's moved: ends what this
  // reducer holds of the ops below them, whose results this group's ranks
  // all have (a replica, or a rank that resumed from an older mark, sent
  // them again). No lock held.
  void end_released_ops();
  // leave() under mu_: whether the job's least mark moved.
  bool leave_locked(const JobMember* member, const Status& why, Departure how);
  void finish(const std::shared_ptr<Chunk>& chunk);
  // The chunk contribution `h` goes to, made (with the partials that came
  // before it) if it is the first; null if the op failed meanwhile; mu_ held.
  std::shared_ptr<Chunk> chunk_for_locked(const FrameHeader& h);
  // Whether `h` agrees with the chunk's first contribution and the op's
  // plan, and no rank the op needs has left; fails the op if not; mu_ held.
  bool agrees_locked(const Chunk& chunk, const FrameHeader& h);
  // Acts on a chunk's progress; no lock held.
  void settle(const std::shared_ptr<Chunk>& chunk, Chunk::Progress progress, const Status& why);
  // The ranks of this group missing from `seen`, and a note on group
  // members that never joined; mu_ held.
  std::vector<uint32_t> missing_locked(const std::vector<bool>& seen, std::string* note) const;
  // What a timed-out op waits for, gathered by sweep(); failing it names
  // that (job_sweep.cc, with sweep, missing_locked and history_of); mu_ held.
  struct Overdue;
  void fail_overdue_locked(uint64_t op, Overdue& overdue);
  std::string replica_name() const;
  std::vector<std::shared_ptr<JobMember>> members_locked() const;
  // " (rank 0 left earlier: ...)" for the ranks with a known reason.
  std::string history_of(const std::vector<uint32_t>& ranks) const;

  const JobSettings settings_;
  const uint64_t id_;
  std::shared_ptr<SlabQuota> quota_;
  ReducerCounters& counters_;
  const std::shared_ptr<ReplicaMesh> mesh_;
  std::vector<uint32_t> participants_;
  uint32_t my_index_ = 0;  // in participants_
  uint32_t local_size_ = 0;
  // Reproducible sums with replica groups: by participant index, the cover
  // of its group's ranks in the sum tree (empty otherwise).
  std::vector<std::vector<TreeNode>> tree_covers_;
  ButterflyContext butterfly_;

  mutable std::mutex mu_;
  std::vector<std::shared_ptr<JobMember>> members_;  // by rank
  Clock::time_point memberless_since_;
  bool retired_ = false;
  JobRound round_;
  std::string retired_why_;
  std::optional<Status> lost_;  // why the job failed for good
  std::vector<uint32_t> lost_ranks_;
  // Ranks that stalled, awaited to resume until `until`; then the job
  // fails as for a lost rank, with `lost` as the reason.
  struct Stalled {
    Status lost;
    Clock::time_point until;
  };
  std::map<uint32_t, Stalled> stalled_;
  LeftGroups left_groups_;  // its own (leaf) lock: read under a chunk's lock
  EarlyPartials early_;
  std::map<uint32_t, std::string> departed_;  // ranks that said goodbye, and why
  std::map<ChunkKey, std::shared_ptr<Chunk>> chunks_;
  FailedOps failed_ops_;
  OpTimings op_timings_;
  // Received marks, by rank and by group (the ranks that ever joined
  // here are its ranks()).
  ReleaseMarks marks_;
};

}  // namespace tally
