// Private to libtally: the stream to one reducer of the client's group
// (its handshake, its send window, its loss and reopening). It talks to
// the client that owns it through LinkOwner only, as the reducer's sessions
// talk to their job through JobMember. Lives on the client's I/O thread.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tally/client/client.h"
#include "tally/protocol/address.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/transport.h"

namespace tally {

namespace wire {
class Welcome;
}
namespace client_internal {
struct Op;
}
using client_internal::Op;
class Fabric;
class ShardLink;

// What a ShardLink tells the client that owns it, and the one thing it asks
// of it. Called on the client's I/O thread.
class LinkOwner {
 public:
  virtual ~LinkOwner() = default;
  // A result arrived whole in the receive posted for it (each contribution
  // sent posts one).
  virtual void on_result(ShardLink& link, const FrameHeader& h) = 0;
  // A result with no receive posted for it: whether it is the answer to a
  // replay (this worker has its bytes already) or a late one of a failed op,
  // whose payload is then dropped. False: the reducer sent what was not
  // asked for, and the stream closes.
  virtual bool on_unposted_result(ShardLink& link, const FrameHeader& h) = 0;
  // The reducer's Released mark, and an op's Error.
  virtual void on_released(uint32_t shard, uint64_t op_below) = 0;
  virtual void on_op_error(ShardLink& link, uint64_t op, const Status& status) = 0;
  // The stream was lost and is being reopened; it is open again; it is
  // gone for good (`why`).
  virtual void on_link_lost(uint32_t shard) = 0;
  virtual void on_link_resumed(uint32_t shard) = 0;
  virtual void on_link_closed(uint32_t shard, const Status& why) = 0;
  // The highest Released mark of any of the owner's reducers (a Received
  // carries it).
  virtual uint64_t released_below() const = 0;
};

// What every link of a client says and connects with, fixed for its life.
struct LinkSettings {
  const ClientOptions& options;
  boost::asio::io_context& io;
  std::shared_ptr<Fabric> fabric;  // null: TCP
  uint32_t group = 0;
  std::vector<uint32_t> group_sizes;  // as sent in the Hello
  uint32_t shard_count = 0;           // the reducers of the group
};

// What one stream may send: the windows its Welcome gave (chunks and
// bytes) against what it has sent without an answer, and the chunks
// waiting their turn, in (op, chunk) order: contributions, or replays of
// results this worker has (after a reconnect). A replay is answered like
// a contribution, so it takes its place in both windows.
class SendWindow {
 public:
  struct Queued {
    std::shared_ptr<Op> op;
    uint32_t index = 0;
    bool replay = false;
  };

  // The Welcome's windows; what is in flight is kept.
  void open(uint32_t chunks, uint64_t bytes) {
    chunks_ = chunks;
    bytes_ = bytes;
  }
  // A chunk may go out and one waits.
  bool ready() const { return inflight_ < chunks_ && !queue_.empty(); }
  // Whether `bytes` more fit in the byte window: one chunk may always be
  // in flight, so a chunk larger than the window still moves.
  bool fits(uint64_t bytes) const { return inflight_ == 0 || inflight_bytes_ + bytes <= bytes_; }
  void sent(uint64_t bytes) {
    inflight_++;
    inflight_bytes_ += bytes;
  }
  void answered(uint32_t chunks, uint64_t bytes) {
    inflight_ -= chunks;
    inflight_bytes_ -= bytes;
  }
  // The stream is lost: nothing sent on it will be answered, nothing
  // queued will go.
  void reset() {
    inflight_ = 0;
    inflight_bytes_ = 0;
    queue_.clear();
  }

  void push(Queued q) { queue_.push_back(std::move(q)); }
  const Queued& front() const { return queue_.front(); }
  void pop() { queue_.pop_front(); }
  // Drops `op`'s chunks that wait their turn.
  void drop(const std::shared_ptr<Op>& op) {
    std::erase_if(queue_, [&](const Queued& q) { return q.op == op; });
  }

 private:
  uint32_t chunks_ = 1;
  uint64_t bytes_ = 0;
  uint32_t inflight_ = 0;
  uint64_t inflight_bytes_ = 0;
  std::deque<Queued> queue_;
};

// The stream to one reducer.
class ShardLink final : public FrameHandler, public std::enable_shared_from_this<ShardLink> {
 public:
  // `owner` and `settings` outlive the link.
  ShardLink(LinkOwner& owner, const LinkSettings& settings, uint32_t shard, HostPort address)
      : owner_(owner), settings_(settings), shard_(shard), address_(std::move(address)) {}

  // Connects, says hello, resolves `welcomed` (I/O thread).
  void connect(std::chrono::steady_clock::time_point deadline);
  // Tells the reducer this worker has every result below `op_below`.
  void send_received(uint64_t op_below);

  std::future<Status> welcomed() { return welcomed_.get_future(); }
  void close(const Status& why);

  // Says goodbye, then closes once that is written (or at once if the
  // stream is stuck: close() drops what is queued).
  void leave(const std::string& reason, std::function<void()> done);

  // FrameHandler
  PayloadAction on_data_header(const FrameHeader& h) override;
  void on_data(const FrameHeader& h, std::span<std::byte>) override;
  void on_control(const wire::Control& message) override;
  void on_closed(const Status& status) override;

  Connection* conn() { return conn_.get(); }
  // No stream to send on or receive from: not open yet, lost (and maybe
  // being reopened), or gone.
  bool closed() const { return closed_; }
  // While the stream is being reopened: why it was lost.
  const std::optional<Status>& lost() const { return lost_; }
  // Since this stream's Welcome: what the reducer said of another replica
  // of its shard that it lost (ReplicaLost), until it asks for a rejoin.
  struct ReplicaLost {
    std::string replica;  // "replica (shard S, group G) at host:port"
    std::string reason;
  };
  const std::optional<ReplicaLost>& replica_lost() const { return replica_lost_; }
  uint32_t shard() const { return shard_; }
  // "reducer <address> (shard N)", as errors name it.
  std::string name() const;

  // What this stream may send, and what waits (its owner sends).
  SendWindow& window() { return window_; }
  // From the Welcome: the largest chunk the reducer takes, and its
  // --link-rate (0: not told).
  uint64_t max_chunk_bytes = 0;
  uint64_t link_rate_bits = 0;
  // The reducer's Released mark.
  uint64_t released_below = 0;
  // Reopened, and waiting for the reducer's first Released before it sends
  // anything (its owner's on_link_resumed sets it).
  bool resyncing = false;

 private:
  void on_connected(Result<boost::asio::ip::tcp::socket> r);
  void on_welcome(const wire::Welcome& w);
  void settle(const Status& s);
  // After a loss: the next attempt to reopen the stream, after the backoff,
  // or giving up once the resume deadline has passed.
  void retry();
  // Joining: dials again after kConnectRetry.
  void redial();
  void give_up(const Status& why);
  // Whether a stream lost with `why` is reopened.
  bool resumable(const Status& why) const;

  // Joining: the first stream, before its Welcome (connect() waits on it).
  // Live: welcomed. Resuming: lost, being reopened. Gone: for good.
  enum class Phase { kJoining, kLive, kResuming, kGone };
  Phase phase_ = Phase::kJoining;
  std::optional<Status> lost_;
  std::chrono::steady_clock::time_point connect_deadline_;  // joining
  std::chrono::steady_clock::time_point resume_deadline_;
  std::chrono::milliseconds backoff_{0};

  LinkOwner& owner_;
  const LinkSettings& settings_;
  SendWindow window_;
  const uint32_t shard_;
  const HostPort address_;
  std::shared_ptr<Connection> conn_;
  std::promise<Status> welcomed_;
  bool settled_ = false;
  bool closed_ = false;
  bool closing_ = false;  // the client is going away: open nothing new
  std::optional<Status> fatal_;
  bool rejoining_ = false;  // the reducer asked this worker to rejoin (Rejoin)
  std::optional<ReplicaLost> replica_lost_;
  // With a job secret: this side's nonce (sent in the Hello) and the
  // reducer's (from its AuthChallenge), which its Welcome's proof covers.
  std::string worker_nonce_, reducer_nonce_;
  // Who this worker says it is, as the MACs cover it (WorkerSession::identity).
  std::string identity() const;
  std::string last_error_;
};

}  // namespace tally
