// The other replicas of this reducer's shard, as a job sees them, and the
// messages every part of the reducer sends about replicas. A replica is
// another reducer serving the same shard for another replica group
// (docs/architecture.md, Replica groups).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"
#include "tally/reducer/slab_pool.h"

namespace tally {

namespace wire {
class Control;
class Error;
}  // namespace wire

// Sends to the other replicas of this reducer's shard. Groups are replica
// group indices. Thread-safe; no method blocks or calls back into the
// caller before returning.
class ReplicaMesh {
 public:
  using SendDone = std::function<void(const Status&)>;
  virtual ~ReplicaMesh() = default;
  // Sends a partial frame whose payload is header.length bytes of `slab` at
  // `byte_offset`; `slab` is held until `done`, which runs once, later, on
  // some I/O thread (also when `deadline` passes before the replica is
  // first reachable, or at once while it is lost). A send that waits, for
  // the first connection or behind other sends, goes only if `current()`
  // still holds then (its chunk was not dropped meanwhile); otherwise
  // `done` gets kCancelled.
  virtual void send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                            size_t byte_offset, std::chrono::steady_clock::time_point deadline,
                            std::function<bool()> current, SendDone done) = 0;
  virtual void send_control(uint32_t group, std::shared_ptr<const wire::Control> message) = 0;
  // Why that replica cannot be used now (it was lost and is not back).
  virtual std::optional<Status> lost(uint32_t group) const = 0;
  // "replica (shard 1, group 2) at host:port", for messages.
  virtual std::string describe(uint32_t group) const = 0;
};

// "replica (shard S, group G)": how every message names a replica.
std::string replica_name(uint32_t shard, uint32_t group);
// What a replica link's MACs cover besides the nonces: the shard, and the
// dialling and the accepting group.
std::string replica_identity(uint32_t shard, uint32_t shard_count, uint32_t from_group,
                             uint32_t to_group, uint32_t group_count);

// A ReplicaError about job `job` carrying `status` (for op `op` when set).
// With `JobEnded::kYes` it says the sender's job has ended (its workers
// left): the receiver fails only the ops still needing a partial from it.
enum class JobEnded { kNo, kYes };
std::shared_ptr<const wire::Control> replica_error_message(
    const std::string& job, const Status& status, std::optional<uint64_t> op = std::nullopt,
    const std::vector<uint32_t>& ranks = {}, JobEnded ended = JobEnded::kNo);
// The same around an Error message already built (resent as it is).
std::shared_ptr<const wire::Control> replica_error_message(const std::string& job,
                                                           const wire::Error& error,
                                                           JobEnded ended = JobEnded::kNo);

// The error for a partial or message of job `job` that this replica no
// longer has: "replica (shard S, group G) no longer has job 'NAME': WHY".
// kMaybeRefused when the job may also have been refused here on arrival.
enum class JobGone { kEnded, kMaybeRefused };
Status job_gone_here(uint32_t shard, uint32_t group, const std::string& job, const std::string& why,
                     JobGone how = JobGone::kEnded);

}  // namespace tally
