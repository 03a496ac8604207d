// A fabric stream's life and its send path: the TCP control side, the
// handshake of the data path, posting and retrying operations, close. The
// receive path is connection_receive.cc.
#include "connection.h"

#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/post.hpp>

#include "tally.pb.h"

namespace tally::fabric {
namespace {

using namespace std::chrono_literals;

// After close(), operations the provider still holds get this long to
// complete or cancel before on_closed runs anyway (a dead peer's sends
// never complete: libfabric does not report dead peers).
constexpr auto kCloseGrace = 1000ms;

}  // namespace

// The TCP connection's handler: control messages, and data frames while
// the data path is still on TCP.
class FabricConnection::ControlSide final : public FrameHandler {
 public:
  explicit ControlSide(std::shared_ptr<FabricConnection> owner) : owner_(std::move(owner)) {}
  PayloadAction on_data_header(const FrameHeader& h) override {
    if (owner_->mode_ == Mode::kFabric) {
      return PayloadAction::close(
          Status(ErrorCode::kProtocol, "data frame on the control stream of a fabric connection"));
    }
    return owner_->handler()->on_data_header(h);
  }
  void on_data(const FrameHeader& h, std::span<std::byte> p) override {
    owner_->handler()->on_data(h, p);
  }
  void on_control(const wire::Control& m) override {
    if (auto h = owner_->handler()) h->on_control(m);
  }
  void on_closed(const Status& reason) override {
    auto owner = std::move(owner_);
    owner->close(reason);
  }

 private:
  std::shared_ptr<FabricConnection> owner_;
};

FabricConnection::FabricConnection(std::shared_ptr<Connection> control,
                                   EndpointSource endpoint_source, const ConnectionOptions& options)
    : endpoint_source_(std::move(endpoint_source)),
      control_(std::move(control)),
      executor_(control_->executor()),
      peer_(control_->peer()),
      options_(options),
      grace_(control_->executor()),
      watchdog_(control_->executor()) {
  limits_.max_data_bytes = options.max_data_bytes;
}

void FabricConnection::start(std::shared_ptr<FrameHandler> handler) {
  handler_ = std::move(handler);
  control_->start(std::make_shared<ControlSide>(shared_from_this()));
}

void FabricConnection::send(const FrameHeader& header, std::span<const std::byte> payload,
                            SendDone done) {
  if (closed_) return done(close_reason_);
  if (mode_ != Mode::kFabric) return control_->send(header, payload, std::move(done));
  send_fabric(header, payload, std::move(done));
}

void FabricConnection::send_control(const wire::Control& message, SendDone done) {
  if (!control_) {  // abandoned at shutdown
    if (done) done(close_reason_);
    return;
  }
  control_->send_control(message, std::move(done));
}
void FabricConnection::resume() {
  if (!control_) return;
  if (mode_ != Mode::kFabric) return control_->resume();
  if (closed_ || !paused_) return;
  paused_ = false;
  take_headers();
}

void FabricConnection::close(const Status& reason) {
  if (closed_) return;
  closed_ = true;
  close_reason_ = reason;
  watchdog_.cancel();
  control_->close(reason);
  paused_ = true;  // take no more headers
  // Posts still waiting for -FI_EAGAIN to clear never reached libfabric.
  // Each op goes after its callback, which takes it (op_finished).
  std::deque<Post> never_posted = std::move(pending_);
  pending_.clear();
  for (auto& p : never_posted) {
    if (p.op) {
      ops_.erase(p.op);
      auto done = std::move(p.op->done);
      if (done) done(Status(ErrorCode::kCancelled, "never posted"), 0);
      endpoint_->drop_op(p.op);
    }
  }
  if (endpoint_) {
    for (Op* op : ops_) fi_cancel(&endpoint_->ep()->fid, &op->ctx);
    endpoint_->kick();
  }
  if (ops_.empty()) return finish_close();
  grace_.expires_after(kCloseGrace);
  grace_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;
    if (!self->ops_.empty()) {
      spdlog::warn(
          "fabric stream to {}: {} operation(s) did not finish within {} ms of close; the "
          "memory they read or write is kept until the provider lets them go",
          self->peer(), self->ops_.size(), kCloseGrace.count());
    }
    self->finish_close();
  });
}

void FabricConnection::pace(uint64_t bytes_per_second) {
  if (mode_ == Mode::kTcp && control_) control_->pace(bytes_per_second);
}

void FabricConnection::bound_receive_window(uint64_t bytes) {
  if (mode_ == Mode::kTcp && control_) control_->bound_receive_window(bytes);
}

Status FabricConnection::describe_data_path(wire::DataPath* out) {
  if (!control_) return Status(ErrorCode::kCancelled, "connection abandoned at shutdown");
  if (mode_ == Mode::kTcp) return control_->describe_data_path(out);
  TALLY_RETURN_IF_ERROR(open_endpoint());
  out->set_transport("fabric");
  out->set_provider(endpoint_->provider());
  out->set_address(endpoint_->address());
  out->set_stream_id(stream_);
  out->set_max_message_bytes(endpoint_->max_msg_size());
  offered_ = true;
  return Status::ok();
}

Status FabricConnection::attach_data_path(const wire::DataPath& peer) {
  if (!control_) return Status(ErrorCode::kCancelled, "connection abandoned at shutdown");
  if (peer.transport().empty() || peer.transport() == "tcp") {
    if (offered_) {
      return Status(ErrorCode::kUnimplemented,
                    peer_ +
                        " answered with a tcp data path to a fabric hello "
                        "(start the pool with --transport fabric)");
    }
    mode_ = Mode::kTcp;
    return Status::ok();
  }
  if (peer.transport() != "fabric") {
    return Status(ErrorCode::kInvalidArgument,
                  "unknown data path transport '" + peer.transport() + "'");
  }
  TALLY_RETURN_IF_ERROR(open_endpoint());
  if (peer.provider() != endpoint_->provider()) {
    return Status(ErrorCode::kInvalidArgument, "fabric provider mismatch: " + peer_ + " uses '" +
                                                   peer.provider() + "', this side '" +
                                                   endpoint_->provider() + "'");
  }
  if (peer.stream_id() == 0 || peer.stream_id() > 0xFFFF) {
    return Status(ErrorCode::kInvalidArgument, "bad fabric stream id from " + peer_);
  }
  auto addr = endpoint_->insert_peer(peer.address());
  if (!addr) return addr.status().with_context("fabric address of " + peer_);
  if (peer.max_message_bytes() == 0) {
    return Status(ErrorCode::kInvalidArgument, "no fabric max_message_bytes from " + peer_);
  }
  peer_addr_ = *addr;
  peer_stream_ = peer.stream_id();
  // Both sides cut payloads into the same fragments.
  fragment_bytes_ = std::min<uint64_t>(endpoint_->max_msg_size(), peer.max_message_bytes());
  mode_ = Mode::kFabric;
  for (uint64_t s = 0; s < kHeaderSlots; ++s) post_header(s);
  arm_watchdog();
  return Status::ok();
}

void FabricConnection::abandon() {
  closed_ = true;
  finished_ = true;
  ops_.clear();
  pending_.clear();
  sending_.clear();
  rx_.clear();
  waiting_.clear();
  handler_.reset();
  control_.reset();
}

Status FabricConnection::open_endpoint() {
  if (endpoint_) return Status::ok();
  auto ep = endpoint_source_();
  if (!ep) return ep.status();
  auto id = (*ep)->allocate_stream();
  if (!id) return id.status();
  endpoint_ = *ep;
  stream_ = *id;
  return Status::ok();
}

void FabricConnection::submit(Op* op, std::function<ssize_t()> attempt) {
  if (op) ops_.insert(op);
  if (pending_.empty()) {
    ssize_t rc = attempt();
    if (rc == 0) return endpoint_->kick();
    if (rc != -FI_EAGAIN) return post_failed(op, rc);
  }
  pending_.push_back(Post{op, std::move(attempt)});
  endpoint_->needs_retry(shared_from_this());
}

void FabricConnection::post_failed(Op* op, ssize_t rc) {
  Status why = fi_status("posting to " + peer(), rc);
  if (op) {
    ops_.erase(op);
    endpoint_->drop_op(op);
  }
  close(why);
}

bool FabricConnection::retry_posts() {
  while (!pending_.empty() && !closed_) {
    ssize_t rc = pending_.front().attempt();
    if (rc == -FI_EAGAIN) return true;
    Post p = std::move(pending_.front());
    pending_.pop_front();
    if (rc != 0) {
      post_failed(p.op, rc);
      return false;
    }
  }
  return false;
}

void FabricConnection::op_finished(Op* op) {
  op->keep.reset();  // its completion is read: the provider has let go
  ops_.erase(op);
  if (closed_ && ops_.empty() && !finished_) {
    grace_.cancel();
    finish_close();
  }
}

Result<void*> FabricConnection::desc_for(const void* p, size_t n,
                                         std::vector<MrCache::Entry*>& held) {
  if (!endpoint_->registration() || n == 0) return static_cast<void*>(nullptr);
  auto e = endpoint_->mr().acquire(p, n);
  if (!e) return e.status();
  held.push_back(*e);
  return fi_mr_desc((*e)->mr);
}

void FabricConnection::send_fabric(const FrameHeader& header, std::span<const std::byte> payload,
                                   SendDone done) {
  const uint64_t seq = seq_out_++;
  auto encoded = std::make_shared<EncodedHeader>(encode_header(header));
  const uint64_t htag = header_tag(peer_stream_, seq);
  fid_ep* ep = endpoint_->ep();
  const fi_addr_t to = peer_addr_;
  if (endpoint_->inject_size() >= kFrameHeaderBytes) {
    submit(nullptr, [ep, encoded, to, htag] {
      return fi_tinject(ep, encoded->data(), encoded->size(), to, htag);
    });
  } else {
    Op* op = endpoint_->new_op(nullptr);
    op->done = [self = shared_from_this(), encoded, op](const Status& s, size_t) {
      self->op_finished(op);
      if (!s.is_ok() && !self->closed_)
        self->close(s.with_context("sending a header to " + self->peer()));
    };
    op->keep = encoded;
    submit(op, [ep, encoded, to, htag, op] {
      return fi_tsend(ep, encoded->data(), encoded->size(), nullptr, to, htag, &op->ctx);
    });
  }
  if (payload.empty()) {
    return asio::post(executor(), [done = std::move(done)] { done(Status::ok()); });
  }

  const ReceiveKey key{header.kind, header.op, header.chunk};
  const size_t fragment_bytes = fragment_bytes_;
  const uint64_t fragments = fragment_count(payload.size(), fragment_bytes);
  if (fragments > kMaxFragments) {
    done(Status(ErrorCode::kInvalidArgument, "payload too large for this provider's max_msg_size"));
    return close(Status(ErrorCode::kInvalidArgument,
                        std::to_string(payload.size()) + "-byte payload needs more than " +
                            std::to_string(kMaxFragments) + " messages of max_msg_size " +
                            std::to_string(fragment_bytes)));
  }
  auto state = std::make_shared<SendState>();
  state->left = static_cast<uint32_t>(fragments);
  state->done = std::move(done);
  auto desc = desc_for(payload.data(), payload.size(), state->mrs);
  if (!desc) {
    state->done(desc.status());
    return close(desc.status().with_context("registering a send buffer"));
  }
  sending_.insert(state);
  for (uint64_t i = 0; i < fragments; ++i) {
    const size_t off = i * fragment_bytes;
    const size_t len = std::min(fragment_bytes, payload.size() - off);
    const uint64_t tag = payload_tag(peer_stream_, key, static_cast<uint32_t>(i));
    Op* op = endpoint_->new_op(nullptr);
    op->done = [self = shared_from_this(), state, op](const Status& s, size_t) {
      self->op_finished(op);
      if (!s.is_ok() && state->failure.is_ok()) state->failure = s;
      if (--state->left > 0) return;
      self->sending_.erase(state);
      for (auto* e : state->mrs) self->endpoint_->mr().release(e);
      state->finish(state->failure.is_ok()
                        ? Status::ok()
                        : state->failure.with_context("sending to " + self->peer()));
      state->done = nullptr;  // nothing reads the payload now: its owner may go
      if (!state->failure.is_ok() && !self->closed_)
        self->close(state->failure.with_context("sending to " + self->peer()));
    };
    // The payload's owner is the caller's `done`, which the state holds.
    op->keep = state;
    const std::byte* buf = payload.data() + off;
    void* d = *desc;
    submit(op,
           [ep, buf, len, d, to, tag, op] { return fi_tsend(ep, buf, len, d, to, tag, &op->ctx); });
  }
}
void FabricConnection::finish_close() {
  if (finished_) return;
  finished_ = true;
  // Whatever libfabric still holds is abandoned: its completions find
  // nothing to call back, and each keeps its memory (Op::keep) until then.
  // A send's caller is answered now all the same (a worker's op waits for
  // its sends before it ends): the payload's owner, in `done`, stays with
  // the ops.
  auto sending = std::move(sending_);
  sending_.clear();
  for (auto& state : sending) state->finish(close_reason_);
  for (Op* op : ops_) op->done = nullptr;
  ops_.clear();
  for (auto& [key, rx] : rx_) release(rx);
  rx_.clear();
  waiting_.clear();
  if (endpoint_) endpoint_->release_stream(stream_);
  auto handler = std::move(handler_);
  if (handler) handler->on_closed(close_reason_);
}

}  // namespace tally::fabric
