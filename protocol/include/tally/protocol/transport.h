// The transport interface: one Connection per peer stream, message-oriented.
//
// A Connection moves frames (header + payload) between two processes. A
// sender's payload is read in place until its SendDone runs, never copied.
// A receiver names the destination of a payload either on arrival, through
// FrameHandler::on_data_header() (the reducer's pool buffers; libfabric's
// unexpected-message path), where the payload lands as it arrives, or ahead
// of time with post_receive() (the result of a chunk, for the caller's
// tensor). A posted destination is written only with a whole payload: the
// payload lands in the connection's own buffer and is copied there once
// complete, so a stream lost mid-payload leaves the destination as it was.
// A worker's tensor holds its input until the result is in, and an input
// half overwritten by a result would be sent again after a reducer restart
// (docs/architecture.md, "Surviving a reducer restart").
//
// Threading: every Connection lives on one executor (one I/O thread). All
// methods must be called on it; other threads post to executor(). Handler
// callbacks run on it too.
#pragma once

#include <atomic>
#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "tally/protocol/frame.h"
#include "tally/protocol/status.h"

namespace tally {
namespace wire {
class Control;
class DataPath;
}  // namespace wire

// Identifies a payload a receiver expects: the kind and (op, chunk) of a
// frame on this connection.
struct ReceiveKey {
  FrameKind kind = FrameKind::kResult;
  uint64_t op = 0;
  uint32_t chunk = 0;
  bool operator==(const ReceiveKey&) const = default;
};

struct ReceiveKeyHash {
  size_t operator()(const ReceiveKey& k) const {
    return std::hash<uint64_t>()(k.op * 0x9E3779B97F4A7C15ULL ^ (uint64_t{k.chunk} << 8) ^
                                 static_cast<uint64_t>(k.kind));
  }
};

// What to do with the payload of a data frame nobody posted a receive for.
struct PayloadAction {
  enum class Kind { kReceive, kDiscard, kPause, kClose };
  Kind kind = Kind::kDiscard;
  std::span<std::byte> dst;  // kReceive: exactly header.length bytes
  // kReceive: what keeps `dst` alive. The connection holds it for as long
  // as anything may still write into `dst`, which on the fabric data path
  // can be after on_closed: a provider that has begun a payload cannot
  // always be stopped (fi_cancel does not withdraw a matched receive), and
  // finishes it into `dst` whenever the sender's bytes come (a link back
  // up, a stopped process continued). Memory handed back while that can
  // happen would take those bytes into whatever uses it next.
  std::shared_ptr<const void> owner;
  Status error;  // kClose: the reason, logged and given to on_closed

  static PayloadAction receive(std::span<std::byte> dst, std::shared_ptr<const void> owner) {
    return {Kind::kReceive, dst, std::move(owner), {}};
  }
  static PayloadAction discard() { return {Kind::kDiscard, {}, {}, {}}; }
  // Stop reading this stream (back-pressure) until Connection::resume(); the
  // same header is then offered again.
  static PayloadAction pause() { return {Kind::kPause, {}, {}, {}}; }
  static PayloadAction close(Status why) { return {Kind::kClose, {}, {}, std::move(why)}; }
};

// Implemented by the owner of a connection (a reducer's worker session, a
// client's shard link). Called on the connection's executor.
class FrameHandler {
 public:
  virtual ~FrameHandler() = default;
  // A data frame arrived with no posted receive for it.
  virtual PayloadAction on_data_header(const FrameHeader& header) = 0;
  // A data payload is complete in the buffer chosen for it (posted and not
  // cancelled, or from on_data_header).
  virtual void on_data(const FrameHeader& header, std::span<std::byte> payload) = 0;
  virtual void on_control(const wire::Control& message) = 0;
  // Called once, after which the connection calls nothing back and writes
  // no posted receive's `dst`; a payload's `owner` (PayloadAction) it may
  // hold a while longer.
  virtual void on_closed(const Status& reason) = 0;
};

// Control frames are copies (data payloads are slabs a memory budget
// bounds), queued until the peer reads them; a peer that never reads,
// asking for replies (a Received per Released) as fast as it can, made
// 8 streams cost a reducer 540 MiB. Each queued control frame is charged
// its payload plus kQueuedFrameOverhead (the queue entry, the payload's heap
// block), which is what it costs in memory. A stream may queue
// kMaxQueuedControlBytes at most; all streams sharing a ControlBudget
// together queue at most its limit plus kControlBytesFloor each.
inline constexpr size_t kMaxQueuedControlBytes = 4u << 20;
inline constexpr size_t kControlBytesFloor = 16u << 10;
inline constexpr size_t kQueuedFrameOverhead = 256;

class ControlBudget {
 public:
  explicit ControlBudget(size_t limit) : limit_(limit) {}
  // Takes `bytes` if they fit under the limit.
  bool take(size_t bytes) {
    size_t used = used_.load(std::memory_order_relaxed);
    do {
      if (bytes > limit_ - used) return false;  // used <= limit_: only take() adds
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  void give(size_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  size_t limit() const { return limit_; }
  size_t used() const { return used_.load(std::memory_order_relaxed); }

 private:
  const size_t limit_;
  std::atomic<size_t> used_{0};
};

struct ConnectionOptions {
  size_t max_data_bytes = 4u << 20;  // larger data frames are a protocol error
  // An idle stream gets a heartbeat this often, so the peer can tell idle from dead.
  std::chrono::milliseconds heartbeat_interval{1000};
  // A stream that delivers nothing for this long while being read is dead.
  std::chrono::milliseconds peer_timeout{10000};
  // Before the peer's first frame it may be silent this long instead, where
  // that is longer. The reducer sets its hello deadline, which governs a
  // stream that has not said hello: a worker opening its fabric endpoint
  // between its TCP connect and its Hello says nothing meanwhile (1-2.5 s
  // under TSan), and a short peer timeout closed it before it joined.
  std::chrono::milliseconds first_frame_timeout{0};
  // A frame whose write has not completed this long after it began means a
  // peer that does not read: the stream is closed (0: no deadline). The
  // reducer sets it on the streams it accepts, whose peers always read;
  // not where the peer may hold its reads back for longer (back-pressure).
  std::chrono::milliseconds write_timeout{0};
  // TCP congestion control of the stream's socket (TCP_CONGESTION), e.g.
  // "cubic"; empty: the system's default. Checked beforehand with
  // check_congestion_control (tcp_transport.h).
  std::string congestion_control;
  // Shared by the streams given the same one (a reducer gives all of its
  // own): beyond kControlBytesFloor each, the control frames queued for
  // their peers draw on it, and a stream that finds it spent is closed as a
  // peer that does not read. Null: each stream's own cap only.
  std::shared_ptr<ControlBudget> control_budget;
};

class Connection {
 public:
  using SendDone = std::function<void(const Status&)>;
  virtual ~Connection() = default;

  virtual boost::asio::any_io_executor executor() = 0;
  // Starts reading; the connection keeps `handler` until it closes.
  virtual void start(std::shared_ptr<FrameHandler> handler) = 0;
  // Queues a data frame; `payload` must stay valid until `done` runs (once,
  // on the executor, with ok or the reason it was not sent). Non-blocking.
  // A stream closed while a payload is still being sent runs `done` with
  // the close's reason, but the fabric data path may go on reading the
  // payload after that (and after on_closed), until its provider lets go
  // of the send: it keeps the `done` object, and what it owns, until then.
  // A caller whose `done` does not own the payload (a worker sending from
  // its caller's tensor) leaves it to be read late, into a stream its peer
  // has closed by then (docs/fabric.md, "Failure").
  virtual void send(const FrameHeader& header, std::span<const std::byte> payload,
                    SendDone done) = 0;
  // Queues a control frame (the message is serialized immediately); `done`,
  // if given, runs once it is written or dropped.
  virtual void send_control(const wire::Control& message, SendDone done = nullptr) = 0;
  // The payload of the data frame matching `key` goes to `dst`, written
  // once whole (see the top of this file). `dst` must stay valid until
  // on_data for it, cancel_receive or close.
  virtual void post_receive(const ReceiveKey& key, std::span<std::byte> dst) = 0;
  // Withdraws a posted receive: `dst` is not written after this returns, and
  // no on_data comes for it (a payload already arriving is dropped).
  virtual void cancel_receive(const ReceiveKey& key) = 0;
  // Continues after on_data_header answered pause().
  virtual void resume() = 0;
  // Closes the stream; idempotent. Queued sends complete with `reason`,
  // posted receives are dropped, on_closed(reason) runs once.
  virtual void close(const Status& reason) = 0;
  virtual bool is_open() const = 0;
  // The data path this side offers or uses, for a Hello or Welcome: "tcp"
  // for a plain TCP stream, the endpoint's address for libfabric. May open
  // the fabric endpoint (blocking, once per I/O thread and local address).
  virtual Status describe_data_path(wire::DataPath* out) = 0;
  // Adopts the data path the peer described, before any data frame flows.
  // Errors: kUnimplemented when this side cannot serve that transport,
  // kInvalidArgument for an unusable description, kUnavailable when the
  // fabric endpoint cannot be opened.
  virtual Status attach_data_path(const wire::DataPath& peer) = 0;
  // "host:port" of the peer, for messages.
  virtual const std::string& peer() const = 0;
  // Sends no faster than `bytes_per_second` on average (0: no cap), so that
  // the streams sharing a link together stay within it (--link-rate,
  // TALLY_LINK_RATE). A stream whose data does not pass its kernel socket
  // (the fabric data path) is not paced.
  virtual void pace(uint64_t bytes_per_second) = 0;
  // Lets the peer have at most about `bytes` in flight towards this end
  // (0: no bound), so that streams converging on one receiver together
  // stay within what its link and queue hold (docs/architecture.md, "The
  // receive budget"). Best effort; a data path that does not pass its
  // kernel socket (the fabric) is not bounded.
  virtual void bound_receive_window(uint64_t bytes) = 0;
  // Whether the stream was closed because the peer stalled past the peer
  // timeout: nothing heard from it, nothing of ours read, or a fabric
  // payload that stopped arriving. A stalled peer may be alive behind a
  // partition or a pause and come back; one that closed or reset its end,
  // or broke the protocol, is gone.
  virtual bool peer_stalled() const = 0;
};

}  // namespace tally
