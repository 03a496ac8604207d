// One chunk (op, chunk) of a job being summed on this reducer: the adds of
// its ranks' payloads and, with replica groups, its butterfly between the
// replicas of the shard.
//
// Terms: the first rank whose header arrives makes its slab the
// accumulator (its payload lands there, no copy); every other rank's
// payload lands in a staging slab and is added in as soon as the
// accumulator holds data (it is parked in `pending_` while the first
// payload is still arriving). Once every rank of this reducer's group has
// been added, the chunk holds the group's partial sum. With one participant
// it is then finished. Otherwise the participants (replicas of this shard
// with workers in the job) combine their partials in the butterfly of
// butterfly.h: step i sends a range of the accumulator to a partner and
// adds (or copies) the range the partner sends back; the chunk is finished
// when every step is done and every send has completed.
//
// Reproducible sums (a job's `deterministic` setting, docs/architecture.md
// "Determinism"): every rank's payload lands in a slab of its own, widened
// like an accumulator, and the slabs combine in the sum tree of
// sum_tree.h, a node as soon as both its children are complete. The tree,
// not the arrival order, decides every addition, so a result's bits depend
// only on the inputs. With replica groups there is no butterfly: once every
// rank of this group is in, each node of the group's cover is sent whole to
// every other participant (the tag is its first rank), theirs are filed
// beside this group's, and once every node has come and every send has
// completed, all are added up the tree, the same on every replica.
//
// Locking: each chunk has its own mutex, taken inside every method, so
// different chunks sum in parallel on different I/O threads. It is a leaf
// under the job's lock (job, then chunk, then quota). Which ranks have been
// accepted (seen) changes only under the job's lock, so the job may read it
// and then accept without holding the chunk's lock in between.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"
#include "tally/reducer/butterfly.h"
#include "tally/reducer/replica_mesh.h"
#include "tally/reducer/slab_pool.h"
#include "tally/reducer/sum_tree.h"

namespace tally {

class Chunk;
class JobMember;

// What a chunk's butterfly needs from its job. Lives as long as the job.
struct ButterflyContext {
  // Groups with workers in the job, in order; steps name partners by index.
  const std::vector<uint32_t>& participants;
  ReplicaMesh* mesh = nullptr;  // null with one participant
  std::atomic<uint64_t>& replica_bytes_sent;
  // Why the replica of `group` has ended the job, if it has.
  std::function<std::optional<Status>(uint32_t group)> left;
  // The completion of one partial send of `chunk`.
  std::function<ReplicaMesh::SendDone(std::shared_ptr<Chunk> chunk)> on_sent;
  // Reproducible sums with more than one participant: by participant
  // index, the cover of its group's ranks (sum_tree.h); empty otherwise.
  const std::vector<std::vector<TreeNode>>& tree_covers;
  uint32_t self = 0;  // this replica's participant index
};

// What a contribution's slab is to its chunk: the accumulator (the first
// rank's payload lands there), a staging slab added into it, or a replayed
// result (kReplay frames, protocol.md "Resuming").
enum class SlabRole { kStaging, kAccumulator, kReplay };

// "count=N float32 sum chunk@OFFSET+LENGTH", for mismatch messages.
std::string chunk_shape(const FrameHeader& header);

class Chunk : public std::enable_shared_from_this<Chunk> {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Progress { kWaiting, kDone, kFailed };

  // `first` is the first rank's header: what every other rank must match.
  // `steps` is this replica's butterfly schedule (empty with one group).
  // `round` is the job's round it belongs to, which its partials carry.
  // `deterministic`: the ranks' payloads are summed in the fixed tree.
  Chunk(const FrameHeader& first, Clock::time_point created, Clock::time_point deadline,
        uint32_t world_size, std::vector<ButterflyStep> steps, uint64_t round = 0,
        bool deterministic = false);

  uint64_t op() const { return meta_.op; }
  uint32_t index() const { return meta_.chunk; }
  const FrameHeader& meta() const { return meta_; }
  Clock::time_point created() const { return created_; }

  // Whether `rank`'s header has been accepted.
  bool seen(uint32_t rank) const;
  // Accepts `rank`'s header; its payload goes to `slab`, whose role this
  // returns (kReplay for a replayed result, `replay`; kAccumulator for
  // every contribution of a deterministic chunk). `member` is compared,
  // never dereferenced.
  SlabRole accept(uint32_t rank, const JobMember* member, std::shared_ptr<Slab> slab,
                  bool replay = false);
  // Whether the chunk's result is known (a rank's replay was accepted, or
  // another replica's final taken): later payloads are counted without
  // being read (skip).
  bool result_known() const;
  // Counts `rank` as contributed without its payload (after a replay).
  Progress skip(uint32_t rank, const JobMember* member, uint32_t local_size,
                const ButterflyContext& context, Status& why);
  // The payload of `rank` accepted into `slab` has arrived. kDone when the
  // chunk is finished, kFailed with `why`.
  Progress add(uint32_t rank, SlabRole role, std::shared_ptr<Slab> slab, uint32_t local_size,
               const ButterflyContext& context, Status& why);
  // Files a partial from the replica of `from_group` under its butterfly
  // step. Errors: kMismatch naming the replica.
  Status place(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
               const ButterflyContext& context);
  // A partial arrived for this chunk: place it and run the butterfly on.
  Progress on_partial(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                      const ButterflyContext& context, Status& why);
  // A replica's final result of this chunk (a kFrameFlagFinal partial,
  // protocol.md "Resuming with replica groups"): it stands for the
  // butterfly, as a worker's replay does. kDone once every rank of this
  // group is in too; kFailed with `why` when it does not fit the chunk.
  Progress on_final(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                    uint32_t local_size, const ButterflyContext& context, Status& why);
  // The header of this chunk's final result for the other replicas, and the
  // result, the first time it is asked after a replay has arrived here;
  // null after that (and before).
  std::shared_ptr<Slab> final_to_send(FrameHeader& header);
  // Every rank of the job has every result of this chunk's op (Released):
  // the chunk ends now with the replayed result it has (true), answering
  // the ranks that sent theirs; false without one, or when it has ended.
  bool end_released();
  // Whether the chunk was dropped (failed, or its round ended).
  bool dropped() const;
  // A partial send of this chunk completed with `status`.
  Progress on_sent(const Status& status, const ButterflyContext& context, Status& why);
  // The replica of `group` has ended the job: kFailed when a step still
  // waits for its partial, which will never come.
  Progress on_replica_left(uint32_t group, const ButterflyContext& context, const Status& why,
                           Status& failed);
  // Gives every buffer back; later calls do nothing.
  void fail();

  // What a chunk past its deadline is waiting for: a replica's partial
  // (`replica`, once the group's sum is complete) or ranks of this group
  // (`seen` tells which contributed).
  struct Waiting {
    std::optional<uint32_t> replica;
    bool local_done = false;
    std::vector<bool> seen;
  };
  Waiting waiting(const ButterflyContext& context) const;

  // After kDone, once the chunk has left its job: its buffer, once. A
  // replayed result (a rank's replay or another replica's final) is final
  // as it is: averaged and narrowed already by the reducer that summed it,
  // so it is sent unchanged; only a sum made here is to be finished
  // (averaged, narrowed) before it is sent. Both come in one call, so that
  // what the buffer holds cannot be read apart from the buffer.
  struct Result {
    std::shared_ptr<Slab> slab;
    bool replayed = false;
  };
  Result take_result();
  // Whether the result is a replayed one (see Result).
  bool replayed() const;
  // Whether `member` contributed `rank` to it (a replay counts).
  bool contributed(uint32_t rank, const JobMember* member) const;

 private:
  // kDone once every rank of the group is in (or the butterfly's next
  // state); mu_ held.
  Progress completed_locked(uint32_t local_size, const ButterflyContext& context, Status& why);
  // Runs the butterfly as far as it can go; mu_ held.
  Progress advance_locked(const ButterflyContext& context, Status& why);
  Status place_locked(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                      const ButterflyContext& context);
  // Adds every node of the sum tree over the ranks that `node` completes,
  // from its parent up; the root's sum becomes the accumulator. mu_ held.
  void combine_locked(TreeNode node);
  // The tree's exchange between replicas (reproducible sums with replica
  // groups), run as far as it can go; mu_ held.
  Progress exchange_tree_locked(const ButterflyContext& context, Status& why);
  // The first participant whose cover has not all come; mu_ held.
  std::optional<uint32_t> tree_missing_locked(const ButterflyContext& context) const;
  // Files node `tag` of participant `from`'s cover; mu_ held.
  Status place_tree_part_locked(uint32_t from, const FrameHeader& header,
                                std::shared_ptr<Slab> slab, const ButterflyContext& context,
                                const std::function<Status(const std::string&)>& bad);
  // Lets go of every sum made so far (the result is known); mu_ held.
  void drop_sums_locked();
  // Bytes of this chunk's accumulator (and of a node of its sum tree).
  size_t accumulator_bytes() const;

  const FrameHeader meta_;
  const Clock::time_point created_;
  const Clock::time_point deadline_;
  const std::vector<ButterflyStep> steps_;
  const uint8_t round_;  // mod 256, as the header carries it

  mutable std::mutex mu_;
  std::shared_ptr<Slab> accumulator_;
  bool accumulator_ready_ = false;
  std::vector<std::shared_ptr<Slab>> pending_;
  // Deterministic: by rank, the slab its payload landed in, which holds the
  // sum of the ranks [rank, part_end_[rank]) once that is complete (0: not
  // yet).
  const bool deterministic_;
  std::vector<std::shared_ptr<Slab>> parts_;
  std::vector<uint32_t> part_end_;
  bool tree_sent_ = false;  // this group's cover has been sent
  // The other participants' cover nodes that have come, by first rank;
  // filed beside this group's parts only once every one has come and every
  // send has completed (a send reads this group's nodes).
  struct TreePart {
    TreeNode node;
    std::shared_ptr<Slab> slab;
  };
  std::map<uint32_t, TreePart> tree_received_;
  // The first replayed result: every replay of a chunk holds the same bytes
  // (the one sum a reducer computed before it was lost), so it is the
  // result, whatever the contributions add up to here.
  std::shared_ptr<Slab> replay_;
  bool replay_accepted_ = false;
  std::vector<bool> seen_;  // by rank: header accepted
  // By rank: the stream that contributed, so a rank that rejoined on a new
  // stream is not sent a sum it had no part in.
  std::vector<const JobMember*> contributors_;
  uint32_t added_ = 0;  // payloads summed (or parked)
  bool failed_ = false;

  std::vector<std::shared_ptr<Slab>> arrived_;  // by step: the partial received for it
  size_t step_ = 0;                             // the step being run
  bool step_sent_ = false;                      // its send has been posted
  uint32_t sends_pending_ = 0;
  bool local_done_ = false;  // every rank of this group has been added
  bool done_reported_ = false;
  bool final_sent_ = false;  // final_to_send has handed out the replay
};

// The header a final result of the chunk `meta` (its contributions' shape)
// carries between replicas, with `flags` and `length` as its result has
// them.
FrameHeader final_header(const FrameHeader& meta);

}  // namespace tally
