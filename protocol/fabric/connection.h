// One peer stream of the fabric transport. Private to protocol/fabric/.
#pragma once

#include <array>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "endpoint.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"
#include "tally/protocol/transport.h"

namespace tally::fabric {

// Header receives posted ahead per stream: a worker's window of chunks can
// be in flight without waiting for a repost between headers.
constexpr size_t kHeaderSlots = 32;

// A peer stream: control on the wrapped TCP connection, data on the
// endpoint once attached. Lives on the control stream's executor; every
// method must be called there (Connection's rules).
class FabricConnection final : public Connection,
                               public RefusedPosts,
                               public std::enable_shared_from_this<FabricConnection> {
 public:
  // Opens (or reuses) the endpoint the data path uses, the first time the
  // handshake needs it. Given by the fabric, which owns the endpoints;
  // blocks up to about a second when it opens one.
  using EndpointSource = std::function<Result<std::shared_ptr<Endpoint>>()>;

  // Owns `control` (not started yet) from here on.
  FabricConnection(std::shared_ptr<Connection> control, EndpointSource endpoint_source,
                   const ConnectionOptions& options);

  asio::any_io_executor executor() override { return executor_; }

  void start(std::shared_ptr<FrameHandler> handler) override;

  void send(const FrameHeader& header, std::span<const std::byte> payload, SendDone done) override;

  void send_control(const wire::Control& message, SendDone done) override;

  void post_receive(const ReceiveKey& key, std::span<std::byte> dst) override;

  void cancel_receive(const ReceiveKey& key) override;

  void resume() override;

  void close(const Status& reason) override;

  bool is_open() const override { return !closed_; }
  bool peer_stalled() const override {
    return payload_stalled_ || (control_ && control_->peer_stalled());
  }
  const std::string& peer() const override { return peer_; }
  // A peer whose data path is tcp (attach_data_path) moves its data on the
  // control stream, which is paced and bounded as any tcp stream. On the
  // fabric path libfabric's provider owns the sockets data moves on: not
  // paced, not bounded.
  void pace(uint64_t bytes_per_second) override;
  void bound_receive_window(uint64_t bytes) override;

  Status describe_data_path(wire::DataPath* out) override;

  Status attach_data_path(const wire::DataPath& peer) override;

  // The process is shutting down and the I/O threads have stopped: forget
  // every operation and the handler without calling back, and let go of
  // the TCP side, which breaks the owner <-> connection cycles.
  void abandon();

  // Retries refused posts in order; true while some are still refused.
  bool retry_posts() override;

 private:
  enum class Mode { kUndecided, kTcp, kFabric };

  // The TCP connection's handler: control messages, and data frames while
  // the data path is still on TCP.
  class ControlSide;

  // A payload receive: posted ahead by the owner, or chosen when its
  // header arrived.
  // Memory libfabric writes a payload into: its ops hold it (Op::keep).
  using Landing = std::shared_ptr<std::vector<std::byte>>;

  struct Rx {
    std::span<std::byte> dst;
    // What keeps `dst` alive (PayloadAction::owner): held by the receive's
    // ops for as long as the provider may write into it.
    std::shared_ptr<const void> owner;
    Landing scratch;  // discarded payloads land here
    // A posted receive's payload lands here, and reaches `dst` only whole
    // (transport.h); from spare_landings_.
    Landing landing;
    std::optional<FrameHeader> header;
    std::vector<Op*> ops;
    uint32_t fragments_left = 0;
    bool expected = false;  // posted by post_receive()
    bool posted = false;
    bool cancelled = false;
    bool discard = false;
    bool any_cancelled = false;                        // some fragment completed with FI_ECANCELED
    std::chrono::steady_clock::time_point owed_since;  // when its header was taken
    std::vector<MrCache::Entry*> mrs;
  };

  struct Post {
    Op* op = nullptr;  // null: an inject, which has no completion
    std::function<ssize_t()> attempt;
  };

  std::shared_ptr<FrameHandler> handler() { return handler_; }

  Status open_endpoint();

  // Hands a post to libfabric, or queues it behind earlier refused ones so
  // a stream's posts keep their order.
  void submit(Op* op, std::function<ssize_t()> attempt);

  void post_failed(Op* op, ssize_t rc);

  // Called by every op completion first: the op is no longer in libfabric.
  void op_finished(Op* op);

  Result<void*> desc_for(const void* p, size_t n, std::vector<MrCache::Entry*>& held);

  // --- sending -----------------------------------------------------------

  // A payload being sent: its fragments' ops hold it (Op::keep), and with
  // it the caller's `done`, which owns the payload.
  struct SendState {
    uint32_t left = 0;
    Status failure;
    SendDone done;
    bool called = false;  // `done` has run
    std::vector<MrCache::Entry*> mrs;
    // Runs `done` once; the function object stays (and what it owns)
    // until the state goes.
    void finish(const Status& status) {
      if (called || !done) return;
      called = true;
      done(status);
    }
  };

  void send_fabric(const FrameHeader& header, std::span<const std::byte> payload, SendDone done);

  // --- receiving ---------------------------------------------------------

  void post_header(uint64_t seq);

  void on_header(uint64_t seq, const Status& s, size_t n);

  // Takes arrived headers strictly in sequence order.
  void take_headers();

  // One header; false when it must be offered again (pause) or the stream closed.
  bool take_header(const FrameHeader& h);

  // The control stream's heartbeats prove the peer process alive, not the
  // fabric path: a payload that stops arriving after its header (a stalled
  // rendezvous, a fabric-only partition) closes the stream after the peer
  // timeout, as a stalled TCP stream would be.
  void arm_watchdog();

  void check_payloads();

  // A payload whose buffer the handler chose is taken before the next
  // header is offered: handlers see header, payload, header, ... as on TCP.
  void await(const ReceiveKey& key);

  void discard_payload(const ReceiveKey& key, const FrameHeader& h);

  void post_payload(const ReceiveKey& key, Rx& rx);

  void on_payload_fragment(const ReceiveKey& key, Op* op, const Status& s, size_t n,
                           size_t expected);

  // A cancelled receive's fragments are done: make sure the payload is
  // consumed once and only once.
  void settle_cancelled(const ReceiveKey& key);

  void deliver(const ReceiveKey& key);

  // Gives back what `rx` holds: its registrations, its landing (for reuse
  // only where no op of the provider's still holds it).
  void release(Rx& rx);

  // Posts receives that waited for room, oldest first.
  void refill();

  void finish_close();

  EndpointSource endpoint_source_;
  std::shared_ptr<Connection> control_;  // null once abandoned
  asio::any_io_executor executor_;
  std::string peer_;
  ConnectionOptions options_;
  FrameLimits limits_;
  asio::steady_timer grace_;
  asio::steady_timer watchdog_;
  std::chrono::steady_clock::time_point last_payload_;  // last payload fragment completed
  std::shared_ptr<FrameHandler> handler_;
  std::shared_ptr<Endpoint> endpoint_;
  Mode mode_ = Mode::kUndecided;
  bool offered_ = false;
  bool closed_ = false;
  bool finished_ = false;
  bool payload_stalled_ = false;  // closed by the payload watchdog
  bool paused_ = false;
  bool taking_ = false;
  bool awaiting_ = false;  // a handler-chosen payload is still arriving
  ReceiveKey awaited_;
  Status close_reason_;

  uint32_t stream_ = 0;       // ours: the peer tags what it sends us with it
  uint32_t peer_stream_ = 0;  // theirs
  fi_addr_t peer_addr_ = FI_ADDR_UNSPEC;
  size_t fragment_bytes_ = 0;  // payloads are cut into messages of this size

  uint64_t seq_out_ = 0;
  uint64_t seq_in_ = 0;
  // Held by the header receives posted into them (Op::keep).
  std::shared_ptr<std::array<EncodedHeader, kHeaderSlots>> header_bufs_ =
      std::make_shared<std::array<EncodedHeader, kHeaderSlots>>();
  std::array<bool, kHeaderSlots> header_ready_{};

  std::unordered_map<ReceiveKey, Rx, ReceiveKeyHash> rx_;
  std::deque<ReceiveKey> waiting_;
  std::unordered_set<ReceiveKey, ReceiveKeyHash> consumed_;
  size_t posted_payloads_ = 0;
  // Landings of finished receives, reused (no allocation per payload).
  std::vector<Landing> spare_landings_;

  std::unordered_set<Op*> ops_;
  // Sends not completed yet: a close that gives up on them (finish_close)
  // still answers their callers.
  std::unordered_set<std::shared_ptr<SendState>> sending_;
  std::deque<Post> pending_;
};

}  // namespace tally::fabric
