// The other replicas of this reducer's shard (docs/architecture.md, Replica
// groups). To each one this reducer dials an outbound stream (a
// ReplicaLink) on which it sends everything it has for that replica
// (ReplicaJob, partials, ReplicaError); it receives on the inbound stream
// that replica dials here (a ReplicaSession). A replica is usable while both
// are up. Once both had been up, losing either one stalls the chunks that
// need it (what is sent to it meanwhile is dropped) until both are up
// again, when its jobs start a new round (docs/protocol.md, "Resuming with
// replica groups"), or until their ops time out naming it.
#pragma once

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/status.h"
#include "tally/protocol/tcp_transport.h"
#include "tally/reducer/reducer_options.h"
#include "tally/reducer/replica_mesh.h"

namespace tally {

class ReplicaLink;

// Reads the pool list of ReducerOptions::pool ("@PATH" or the list itself)
// and checks that it names S x G reducers. Errors: kUnavailable (the file is
// not there yet), kInvalidArgument.
Result<std::vector<HostPort>> read_pool_list(const ReducerOptions& options);

// What the replicas need from the rest of the reducer.
struct ReplicaCallbacks {
  // ReplicaJob messages of the live jobs `group` takes part in, for a new
  // stream to it (the replica's session for the old one has forgotten them).
  std::function<std::vector<std::shared_ptr<const wire::Control>>(uint32_t group)> announcements;
  // The replica of `group` was lost (`why` names it).
  std::function<void(uint32_t group, const Status& why)> on_lost;
  // Both streams to the replica of `group` are up again after a loss.
  std::function<void(uint32_t group)> on_back;
};

// Which of the two streams to a replica.
enum class StreamDirection { kOutbound, kInbound };

// Thread-safe.
class Replicas final : public ReplicaMesh, public std::enable_shared_from_this<Replicas> {
 public:
  // `fabric` (with --transport fabric) carries the outbound streams' data.
  Replicas(ReducerOptions options, std::shared_ptr<Fabric> fabric);
  ~Replicas() override;
  // Before start().
  void set_callbacks(ReplicaCallbacks callbacks);
  // Dials every other replica, each link on one of `contexts`.
  void start(const std::vector<boost::asio::io_context*>& contexts);
  void stop();
  // After the I/O threads are joined: drops the links (they hold this).
  void release();

  // ReplicaMesh
  void send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                    size_t byte_offset, std::chrono::steady_clock::time_point deadline,
                    std::function<bool()> current, SendDone done) override;
  void send_control(uint32_t group, std::shared_ptr<const wire::Control> message) override;
  std::optional<Status> lost(uint32_t group) const override;
  std::string describe(uint32_t group) const override;

  // The address of `group`'s replica, reading the pool list if needed.
  Result<HostPort> address_of(uint32_t group);
  // One stream to the replica of `group` is up, or went down for `why`.
  // An inbound stream comes with the replica's incarnation (ReplicaHello):
  // a new one means it was restarted.
  void stream_up(uint32_t group, StreamDirection direction,
                 std::optional<uint64_t> incarnation = std::nullopt);
  void stream_down(uint32_t group, StreamDirection direction, const Status& why);
  std::vector<std::shared_ptr<const wire::Control>> announcements(uint32_t group) const;
  // Replicas of this shard with both streams up, and how many there are
  // (group count - 1), for /metrics and /readyz. Lock-free.
  size_t links_up() const { return links_up_.load(std::memory_order_relaxed); }
  size_t links_expected() const { return options_.group_count - 1; }
  // This reducer's incarnation, for its ReplicaHellos.
  uint64_t incarnation() const { return incarnation_; }
  // With --transport fabric: the outbound streams' data path; else null.
  const std::shared_ptr<Fabric>& fabric() const { return fabric_; }

 private:
  struct Replica {
    bool out_up = false;
    // Inbound streams up from this replica: a second one (a restarted
    // replica's, or a stranger's without a pool secret) does not make the
    // first one's state, and its end does not mark a live replica lost.
    uint32_t in_up = 0;
    std::optional<Status> lost;
    std::string address;
    std::optional<uint64_t> incarnation;  // from its last inbound stream
  };

  const ReducerOptions options_;
  const std::shared_ptr<Fabric> fabric_;
  const uint64_t incarnation_;
  ReplicaCallbacks callbacks_;
  std::vector<std::shared_ptr<ReplicaLink>> links_;  // by group; null for our own
  // Recounts links_up_ after a stream came up or went down; mu_ held.
  void count_links_locked();

  mutable std::mutex mu_;
  std::vector<Replica> replicas_;  // by group
  std::atomic<size_t> links_up_{0};
};

}  // namespace tally
