#include "tally/protocol/tcp_transport.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <unordered_map>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/control.h"

namespace tally {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

// Payloads are read in fragments of at most this size so that a slow but live
// peer keeps refreshing the liveness clock during a large chunk.
constexpr size_t kReadFragmentBytes = 1u << 20;
// Discarded payloads are drained through a scratch buffer of this size.
constexpr size_t kScratchBytes = 64u << 10;
// How long a stream whose write failed keeps reading what the peer sent
// before it (the goodbye that says why the peer left, typically).
constexpr std::chrono::milliseconds kDrainDeadline{1000};

// asio::transfer_all() hands the socket at most 64 KiB per call, so a 1 MiB
// chunk took 16 sendmsg calls and as many trips through epoll. Writes offer
// the kernel everything left; it takes what fits in the send buffer.
struct TransferAllUnbounded {
  size_t operator()(const boost::system::error_code& ec, size_t) const {
    return ec ? 0 : std::numeric_limits<size_t>::max();
  }
};

std::string endpoint_string(const tcp::endpoint& ep) {
  const auto addr = ep.address();
  std::string host = addr.is_v6() ? "[" + addr.to_string() + "]" : addr.to_string();
  return host + ":" + std::to_string(ep.port());
}

Status from_asio(const boost::system::error_code& ec, std::string_view what,
                 const std::string& peer) {
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::broken_pipe) {
    return Status(ErrorCode::kPeerLost,
                  std::string(what) + " " + peer + ": connection closed by peer");
  }
  if (ec == asio::error::operation_aborted) {
    return Status(ErrorCode::kCancelled, std::string(what) + " " + peer + ": cancelled");
  }
  return Status(ErrorCode::kPeerLost, std::string(what) + " " + peer + ": " + ec.message());
}

class TcpConnection final : public Connection, public std::enable_shared_from_this<TcpConnection> {
 public:
  TcpConnection(tcp::socket socket, const ConnectionOptions& options)
      : socket_(std::move(socket)),
        options_(options),
        timer_(socket_.get_executor()),
        drain_timer_(socket_.get_executor()) {
    boost::system::error_code ec;
    auto ep = socket_.remote_endpoint(ec);
    peer_ = ec ? std::string("unknown-peer") : endpoint_string(ep);
    socket_.set_option(tcp::no_delay(true), ec);
    if (!options_.congestion_control.empty()) {
      // Checked when the option was set; a refusal now keeps the default.
      ::setsockopt(socket_.native_handle(), IPPROTO_TCP, TCP_CONGESTION,
                   options_.congestion_control.data(), options_.congestion_control.size());
    }
    limits_.max_data_bytes = options_.max_data_bytes;
  }

  // Frames still queued (a write the executor never completed) give back
  // what they drew on the shared budget.
  ~TcpConnection() override {
    if (const size_t drawn = drawn_from(queued_control_bytes_); drawn > 0) {
      options_.control_budget->give(drawn);
    }
  }

  asio::any_io_executor executor() override { return socket_.get_executor(); }

  void start(std::shared_ptr<FrameHandler> handler) override {
    handler_ = std::move(handler);
    last_rx_ = last_tx_ = Clock::now();
    arm_timer();
    read_header();
  }

  void send(const FrameHeader& header, std::span<const std::byte> payload, SendDone done) override {
    if (closed_ || write_failed_) {
      done(closed_ ? close_reason_ : *write_failed_);
      return;
    }
    Outgoing out;
    out.header = encode_header(header);
    out.payload = payload;
    out.done = std::move(done);
    queue_.push_back(std::move(out));
    if (!writing_) write_next();
  }

  void send_control(const wire::Control& message, SendDone done) override {
    if (closed_ || write_failed_) {
      if (done) done(closed_ ? close_reason_ : *write_failed_);
      return;
    }
    Outgoing out;
    out.owned.resize(message.ByteSizeLong());
    message.SerializeToArray(out.owned.data(), static_cast<int>(out.owned.size()));
    FrameHeader h;
    h.kind = FrameKind::kControl;
    h.length = out.owned.size();
    out.header = encode_header(h);
    out.payload = {reinterpret_cast<const std::byte*>(out.owned.data()), out.owned.size()};
    out.done = std::move(done);
    out.charged = out.owned.size() + kQueuedFrameOverhead;
    if (Status why = charge(out.charged); !why.is_ok()) {
      if (out.done) out.done(why);
      return fail(why);
    }
    queue_.push_back(std::move(out));
    if (!writing_) write_next();
  }

  void post_receive(const ReceiveKey& key, std::span<std::byte> dst) override {
    if (closed_) return;
    posted_[key] = dst;
  }

  void cancel_receive(const ReceiveKey& key) override {
    posted_.erase(key);
    // A payload arriving for it lands in landing_ and is dropped.
    if (reading_posted_ && active_key_ == key) reading_posted_ = false;
  }

  void resume() override {
    if (closed_ || !paused_) return;
    paused_ = false;
    last_rx_ = Clock::now();
    dispatch_data_header();
  }

  void close(const Status& reason) override {
    if (closed_) return;
    closed_ = true;
    close_reason_ = reason;
    boost::system::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    timer_.cancel();
    drain_timer_.cancel();
    posted_.clear();
    reading_posted_ = false;  // after close() nothing is written into any buffer (landing_ aside)
    // The write in progress (if any) completes with operation_aborted; the
    // queued ones never reached the socket.
    size_t keep = writing_ ? 1 : 0;
    while (queue_.size() > keep) {
      Outgoing out = std::move(queue_.back());
      queue_.pop_back();
      discharge(out.charged);
      if (out.done) out.done(reason);
    }
    auto handler = std::move(handler_);
    if (handler) handler->on_closed(reason);
  }

  bool is_open() const override { return !closed_; }
  bool peer_stalled() const override { return stalled_; }
  const std::string& peer() const override { return peer_; }

  // The kernel paces the socket (SO_MAX_PACING_RATE: TCP's internal pacing
  // where the qdisc does not pace). Best effort, as the congestion control:
  // a refusal leaves the stream unpaced, with a warning.
  void pace(uint64_t bytes_per_second) override {
    const uint64_t rate = bytes_per_second == 0 ? ~uint64_t{0} : bytes_per_second;
    if (::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof rate) !=
        0) {
      spdlog::warn("stream to {} is not paced to {} bytes/s: {}", peer_, bytes_per_second,
                   std::strerror(errno));
    }
  }

  // The window the socket advertises is bounded by TCP_WINDOW_CLAMP over a
  // receive buffer left to autotuning, so the receiver never runs short of
  // memory for what the window lets in. Autotuning raises the clamp with the
  // buffer as it grows, so the clamp is set again after every read
  // (reclamp); once the buffer covers the bounded window it stops growing.
  // A fixed SO_RCVBUF would bound the window too, but current kernels size
  // the window from the buffer and the payload-to-truesize ratio of one
  // recent segment, so segments of a worse ratio are dropped for want of
  // memory, and streams so bounded stalled both ways until their peer
  // timeout (architecture.md, "How a window is bounded"). Set before the
  // peer sends data, so the window never opened wider. Never below
  // kMinWindowSegments of the stream's segment size: loopback's 64 KiB
  // segments (and jumbo frames) need room for several in flight, and
  // loopback has no port queue to protect. Best effort, as pace.
  void bound_receive_window(uint64_t bytes) override {
    if (bytes == 0) return;
    int segment = 0;
    socklen_t length = sizeof segment;
    if (::getsockopt(socket_.native_handle(), IPPROTO_TCP, TCP_MAXSEG, &segment, &length) == 0 &&
        segment > 0) {
      bytes = std::max<uint64_t>(bytes, kMinWindowSegments * static_cast<uint64_t>(segment));
    }
    window_clamp_ = static_cast<int>(std::min<uint64_t>(bytes, INT32_MAX));
    if (!reclamp()) {
      spdlog::warn("stream from {} is not bounded to a {} byte window: {}", peer_, bytes,
                   std::strerror(errno));
      window_clamp_ = 0;
    }
  }

  Status describe_data_path(wire::DataPath* out) override {
    out->set_transport("tcp");
    return Status::ok();
  }

  Status attach_data_path(const wire::DataPath& peer) override {
    if (peer.transport().empty() || peer.transport() == "tcp") return Status::ok();
    return Status(
        ErrorCode::kUnimplemented,
        "the peer asks for data path '" + peer.transport() +
            "' but this side serves only tcp (start the reducer with --transport fabric)");
  }

 private:
  struct Outgoing {
    EncodedHeader header;
    std::vector<char> owned;  // control frames own their payload
    std::span<const std::byte> payload;
    SendDone done;
    size_t charged = 0;  // against the control queue's caps
  };

  // Charges a control frame's cost to this stream and, beyond its floor, to
  // the shared budget; a refusal is the reason to close the stream.
  Status charge(size_t cost) {
    // Built only on refusal: this runs for every control frame.
    auto waiting = [&] {
      return peer_ + " does not read: " + std::to_string(queued_control_bytes_) +
             " bytes of control messages wait for it";
    };
    if (queued_control_bytes_ + cost > kMaxQueuedControlBytes) {
      return Status(ErrorCode::kPeerLost, waiting());
    }
    const size_t drawn =
        drawn_from(queued_control_bytes_ + cost) - drawn_from(queued_control_bytes_);
    if (drawn > 0 && !options_.control_budget->take(drawn)) {
      return Status(ErrorCode::kPeerLost, waiting() + ", and the " +
                                              std::to_string(options_.control_budget->limit()) +
                                              " bytes for all streams' control messages are spent");
    }
    queued_control_bytes_ += cost;
    return Status::ok();
  }

  void discharge(size_t cost) {
    const size_t drawn =
        drawn_from(queued_control_bytes_) - drawn_from(queued_control_bytes_ - cost);
    if (drawn > 0) options_.control_budget->give(drawn);
    queued_control_bytes_ -= cost;
  }

  // What `queued` control bytes draw on the shared budget.
  size_t drawn_from(size_t queued) const {
    if (!options_.control_budget || queued <= kControlBytesFloor) return 0;
    return queued - kControlBytesFloor;
  }

  // A read that ends the stream after a write failed reports the write's
  // failure, the first cause.
  void fail(const Status& status) {
    if (closed_) return;
    close(write_failed_ ? *write_failed_ : status);
  }

  // A write failed (the peer closed or reset): the peer may still have sent
  // frames we have not read, its goodbye with the reason it left among them.
  // Stop writing, read on until the stream ends or a short deadline passes,
  // then report the write's failure. A paused read cannot drain: fail now.
  void drain_then_fail(const Status& why) {
    write_failed_ = why;
    while (!queue_.empty()) {
      Outgoing out = std::move(queue_.front());
      queue_.pop_front();
      discharge(out.charged);
      if (out.done) out.done(why);
    }
    if (paused_) return fail(why);
    drain_timer_.expires_after(
        std::min<std::chrono::milliseconds>(kDrainDeadline, options_.peer_timeout));
    drain_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) self->fail(*self->write_failed_);
    });
  }

  void read_header() {
    if (closed_ || paused_) return;
    asio::async_read(socket_, asio::buffer(header_bytes_),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       self->on_header_read(ec);
                     });
  }

  void on_header_read(const boost::system::error_code& ec) {
    if (closed_) return;
    if (ec) return fail(from_asio(ec, "reading from", peer_));
    on_bytes_read();
    heard_ = true;
    auto decoded =
        decode_header(std::span<const std::byte, kFrameHeaderBytes>(header_bytes_), limits_);
    if (!decoded) {
      Status why = decoded.status().with_context("frame from " + peer_);
      if (why.code() == ErrorCode::kVersionMismatch) {
        // Tell the peer in our framing (it may understand it), then close.
        paused_ = true;  // read no further
        // Weak: the callback sits in this connection's own write queue.
        return send_control(make_error(why), [weak = weak_from_this(), why](const Status&) {
          if (auto self = weak.lock()) self->fail(why);
        });
      }
      return fail(why);
    }
    header_ = *decoded;
    if (header_.kind == FrameKind::kControl) return read_control();
    dispatch_data_header();
  }

  void read_control() {
    control_bytes_.resize(header_.length);
    asio::async_read(socket_, asio::buffer(control_bytes_),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       self->on_control_read(ec);
                     });
  }

  void on_control_read(const boost::system::error_code& ec) {
    if (closed_) return;
    if (ec) return fail(from_asio(ec, "reading from", peer_));
    on_bytes_read();
    auto message = parse_control(std::as_bytes(std::span(control_bytes_)));
    if (!message) return fail(message.status().with_context("control frame from " + peer_));
    if (!message->has_heartbeat()) {
      auto handler = handler_;  // the handler may close us
      handler->on_control(*message);
    }
    read_header();
  }

  void dispatch_data_header() {
    ReceiveKey key{header_.kind, header_.op, header_.chunk};
    auto it = posted_.find(key);
    if (it != posted_.end()) {
      if (it->second.size() != header_.length) {
        return fail(Status(ErrorCode::kProtocol,
                           describe(header_) + " from " + peer_ + " does not match the " +
                               std::to_string(it->second.size()) + "-byte receive posted for it"));
      }
      // Into landing_ first: the posted buffer is written only with the
      // whole payload (transport.h), never with part of one.
      posted_dst_ = it->second;
      posted_.erase(it);
      landing_.resize(header_.length);
      dst_ = landing_;
      landing_posted_ = true;
      reading_posted_ = true;
      active_key_ = key;
      discarding_ = false;
      return read_payload(0);
    }
    auto handler = handler_;
    PayloadAction action = handler->on_data_header(header_);
    if (closed_) return;
    reading_posted_ = false;
    switch (action.kind) {
      case PayloadAction::Kind::kReceive:
        TALLY_CHECK_EQ(action.dst.size(), header_.length);
        dst_ = action.dst;
        discarding_ = false;
        return read_payload(0);
      case PayloadAction::Kind::kDiscard:
        scratch_.resize(kScratchBytes);
        discarding_ = true;
        return read_payload(0);
      case PayloadAction::Kind::kPause:
        paused_ = true;
        return;
      case PayloadAction::Kind::kClose:
        return fail(action.error);
    }
  }

  void read_payload(size_t done) {
    const size_t total = header_.length;
    if (done == total) return on_payload_complete();
    const size_t fragment =
        std::min(total - done, discarding_ ? kScratchBytes : kReadFragmentBytes);
    asio::mutable_buffer buf = discarding_ ? asio::buffer(scratch_.data(), fragment)
                                           : asio::buffer(dst_.data() + done, fragment);
    // read_some, not asio::async_read: that reads at most 64 KiB per call.
    socket_.async_read_some(
        buf, [self = shared_from_this(), done](const boost::system::error_code& ec, size_t n) {
          if (self->closed_) return;
          if (ec) return self->fail(from_asio(ec, "reading from", self->peer_));
          self->on_bytes_read();
          self->read_payload(done + n);
        });
  }

  // After every read: the peer is alive, and the window's clamp is set
  // again, which autotuning may have raised on that read.
  void on_bytes_read() {
    last_rx_ = Clock::now();
    reclamp();
  }

  // bound_receive_window's clamp, set again. False where the kernel refused
  // it.
  bool reclamp() {
    if (window_clamp_ == 0) return true;
    return ::setsockopt(socket_.native_handle(), IPPROTO_TCP, TCP_WINDOW_CLAMP, &window_clamp_,
                        sizeof window_clamp_) == 0;
  }

  void on_payload_complete() {
    const bool deliver = !discarding_ && (!landing_posted_ || reading_posted_);
    if (landing_posted_ && reading_posted_) {
      if (!landing_.empty()) std::memcpy(posted_dst_.data(), landing_.data(), landing_.size());
      dst_ = posted_dst_;
    }
    landing_posted_ = false;
    reading_posted_ = false;
    if (deliver) {
      auto handler = handler_;
      handler->on_data(header_, dst_);
      if (closed_) return;
    }
    dst_ = {};
    read_header();
  }

  void write_next() {
    // A send's completion callback may send again (a client ending an op
    // tells the reducers so at once): that starts the next write, and the
    // one on_write would start must not be a second write of the same frame.
    if (closed_ || writing_ || queue_.empty()) return;
    writing_ = true;
    write_started_ = Clock::now();
    Outgoing& out = queue_.front();
    std::array<asio::const_buffer, 2> bufs{asio::buffer(out.header),
                                           asio::buffer(out.payload.data(), out.payload.size())};
    asio::async_write(socket_, bufs, TransferAllUnbounded{},
                      [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                        self->on_write(ec);
                      });
  }

  void on_write(const boost::system::error_code& ec) {
    writing_ = false;
    Outgoing out = std::move(queue_.front());
    queue_.pop_front();
    discharge(out.charged);
    last_tx_ = Clock::now();
    if (closed_) {
      if (out.done) out.done(close_reason_);
      return;
    }
    if (ec) {
      Status why = from_asio(ec, "writing to", peer_);
      if (out.done) out.done(why);
      return drain_then_fail(why);
    }
    if (out.done) out.done(Status::ok());
    write_next();
  }

  void arm_timer() {
    timer_.expires_after(options_.heartbeat_interval);
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->closed_) return;
      self->on_timer();
    });
  }

  void on_timer() {
    const auto now = Clock::now();
    const auto allowed = heard_ ? options_.peer_timeout
                                : std::max(options_.peer_timeout, options_.first_frame_timeout);
    if (!paused_ && now - last_rx_ > allowed) {
      auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_rx_);
      stalled_ = true;
      return fail(Status(ErrorCode::kPeerLost, "no data or heartbeat from " + peer_ + " for " +
                                                   std::to_string(silent.count()) + " ms"));
    }
    // The write deadline: a peer that sends (heartbeats, even data) but
    // does not read is as dead as a silent one.
    if (writing_ && options_.write_timeout.count() > 0 &&
        now - write_started_ > options_.write_timeout) {
      auto stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - write_started_);
      stalled_ = true;
      return fail(Status(ErrorCode::kPeerLost,
                         peer_ + " has not read for " + std::to_string(stalled.count()) + " ms (" +
                             std::to_string(queue_.size()) + " frames wait for it)"));
    }
    if (!writing_ && !write_failed_ && now - last_tx_ >= options_.heartbeat_interval) {
      wire::Control hb;
      hb.mutable_heartbeat()->set_sequence(++heartbeat_seq_);
      send_control(hb, nullptr);
    }
    arm_timer();
  }

  tcp::socket socket_;
  ConnectionOptions options_;
  FrameLimits limits_;
  asio::steady_timer timer_;
  std::string peer_;
  std::shared_ptr<FrameHandler> handler_;

  bool closed_ = false;
  bool stalled_ = false;  // closed for the peer timeout or the write deadline
  Status close_reason_;
  std::optional<Status> write_failed_;  // set by drain_then_fail
  Clock::time_point write_started_;     // of the frame being written
  size_t queued_control_bytes_ = 0;     // what the control frames in queue_ are charged
  asio::steady_timer drain_timer_;
  bool paused_ = false;
  int window_clamp_ = 0;  // bound_receive_window's; 0: not bounded

  // Read side: the frame being received.
  std::array<std::byte, kFrameHeaderBytes> header_bytes_{};
  FrameHeader header_;
  std::vector<char> control_bytes_;
  std::span<std::byte> dst_;
  std::vector<std::byte> scratch_;
  bool discarding_ = false;
  // The payload being read is a posted receive's (landing_posted_), not
  // cancelled since (reading_posted_): it lands in landing_, and is copied
  // to posted_dst_ once whole.
  bool landing_posted_ = false;
  bool reading_posted_ = false;
  ReceiveKey active_key_;
  std::span<std::byte> posted_dst_;
  std::vector<std::byte> landing_;
  std::unordered_map<ReceiveKey, std::span<std::byte>, ReceiveKeyHash> posted_;

  // Write side.
  std::deque<Outgoing> queue_;
  bool writing_ = false;

  Clock::time_point last_rx_;
  bool heard_ = false;  // a frame header has arrived (options_.first_frame_timeout)
  Clock::time_point last_tx_;
  uint64_t heartbeat_seq_ = 0;
};

}  // namespace

std::shared_ptr<Connection> make_tcp_connection(tcp::socket socket,
                                                const ConnectionOptions& options) {
  return std::make_shared<TcpConnection>(std::move(socket), options);
}

}  // namespace tally
