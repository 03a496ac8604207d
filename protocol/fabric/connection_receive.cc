// A fabric stream's receive path: frame headers taken in order from their
// slots, payload receives posted into libfabric (a bounded number ahead),
// each payload landed whole and then delivered to the posted destination
// or discarded, and the landings reused. The rest of the stream is
// connection.cc.
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#include <algorithm>
#include <cstring>

#include "connection.h"

namespace tally::fabric {
namespace {

// Payload receives posted into libfabric ahead per stream; the rest of an
// op's posted receives wait in order, so a large op cannot exhaust the
// provider's receive queue.
constexpr size_t kPrepostLimit = 64;
// Landings kept for reuse per stream: a client posts a receive per chunk
// it has sent (its window), so a few cover the steady state.
constexpr size_t kSpareLandings = 16;

}  // namespace

void FabricConnection::post_receive(const ReceiveKey& key, std::span<std::byte> dst) {
  if (closed_) return;
  if (mode_ != Mode::kFabric) return control_->post_receive(key, dst);
  Rx& rx = rx_[key];
  rx = Rx{};
  rx.dst = dst;
  rx.expected = true;
  if (posted_payloads_ < kPrepostLimit) {
    post_payload(key, rx);
  } else {
    waiting_.push_back(key);
  }
}

void FabricConnection::cancel_receive(const ReceiveKey& key) {
  if (!control_) return;  // abandoned: nothing writes any buffer now
  if (mode_ != Mode::kFabric) return control_->cancel_receive(key);
  auto it = rx_.find(key);
  if (it == rx_.end()) return;
  Rx& rx = it->second;
  // The owner's buffer is written only in deliver(): from here on, fragments
  // still arriving land in the Rx's landing only.
  if (rx.cancelled) return;
  if (!rx.posted) {
    rx_.erase(it);
    return;
  }
  if (rx.fragments_left == 0) {  // payload here, header not yet
    if (!rx.header) consumed_.insert(key);
    release(rx);
    rx_.erase(it);
    refill();
    return;
  }
  rx.cancelled = true;
  for (Op* op : rx.ops) fi_cancel(&endpoint_->ep()->fid, &op->ctx);
  endpoint_->kick();
}

void FabricConnection::post_header(uint64_t seq) {
  const size_t slot = seq % kHeaderSlots;
  Op* op = endpoint_->new_op(nullptr);
  op->done = [self = shared_from_this(), op, seq](const Status& s, size_t n) {
    self->op_finished(op);
    self->on_header(seq, s, n);
  };
  op->keep = header_bufs_;
  fid_ep* ep = endpoint_->ep();
  std::byte* buf = (*header_bufs_)[slot].data();
  const uint64_t tag = header_tag(stream_, seq);
  const fi_addr_t from = peer_addr_;
  submit(op, [ep, buf, from, tag, op] {
    return fi_trecv(ep, buf, kFrameHeaderBytes, nullptr, from, tag, 0, &op->ctx);
  });
}

void FabricConnection::on_header(uint64_t seq, const Status& s, size_t n) {
  if (closed_) return;
  if (!s.is_ok()) return close(s.with_context("receiving a header from " + peer()));
  if (n != kFrameHeaderBytes) {
    return close(Status(ErrorCode::kProtocol,
                        "short frame header (" + std::to_string(n) + " bytes) from " + peer()));
  }
  header_ready_[seq % kHeaderSlots] = true;
  take_headers();
}

void FabricConnection::take_headers() {
  // A handler callback below may resume() this stream: the loop already
  // running continues then, a nested one would take a header twice.
  if (taking_) return;
  taking_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{taking_};
  while (!closed_ && !paused_ && !awaiting_ && header_ready_[seq_in_ % kHeaderSlots]) {
    const size_t slot = seq_in_ % kHeaderSlots;
    auto decoded = decode_header(
        std::span<const std::byte, kFrameHeaderBytes>((*header_bufs_)[slot]), limits_);
    if (!decoded) return close(decoded.status().with_context("frame from " + peer()));
    const FrameHeader h = *decoded;
    if (h.kind == FrameKind::kControl) {
      return close(
          Status(ErrorCode::kProtocol, "control frame on the fabric data path from " + peer()));
    }
    if (!take_header(h)) return;  // paused or closed: the same header is taken again later
    header_ready_[slot] = false;
    const uint64_t next = seq_in_ + kHeaderSlots;
    seq_in_++;
    post_header(next);
  }
}

bool FabricConnection::take_header(const FrameHeader& h) {
  const ReceiveKey key{h.kind, h.op, h.chunk};
  if (consumed_.erase(key)) return true;
  if (auto it = rx_.find(key); it != rx_.end()) {
    Rx& rx = it->second;
    if (rx.dst.size() != h.length) {
      close(Status(ErrorCode::kProtocol, describe(h) + " from " + peer() + " does not match the " +
                                             std::to_string(rx.dst.size()) +
                                             "-byte receive posted for it"));
      return false;
    }
    rx.header = h;
    rx.owed_since = std::chrono::steady_clock::now();
    if (rx.cancelled) return true;  // settled when the cancel completes
    if (!rx.posted) post_payload(key, rx);
    if (rx.posted && rx.fragments_left == 0) deliver(key);
    return !closed_;
  }
  PayloadAction action = handler_->on_data_header(h);
  if (closed_) return false;
  switch (action.kind) {
    case PayloadAction::Kind::kReceive: {
      TALLY_CHECK_EQ(action.dst.size(), h.length);
      Rx& rx = rx_[key];
      rx = Rx{};
      rx.dst = action.dst;
      rx.owner = std::move(action.owner);
      rx.header = h;
      rx.owed_since = std::chrono::steady_clock::now();
      await(key);
      post_payload(key, rx);
      if (rx.posted && rx.fragments_left == 0) deliver(key);
      return !closed_;
    }
    case PayloadAction::Kind::kDiscard:
      if (h.length > 0) await(key);
      discard_payload(key, h);
      return !closed_;
    case PayloadAction::Kind::kPause:
      paused_ = true;
      return false;
    case PayloadAction::Kind::kClose:
      close(action.error);
      return false;
  }
  return false;
}

void FabricConnection::arm_watchdog() {
  // Ticks of an eighth of the peer timeout notice a stall within 1.125x it.
  watchdog_.expires_after(
      std::min<std::chrono::milliseconds>(options_.heartbeat_interval, options_.peer_timeout / 8));
  watchdog_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->closed_) return;
    self->check_payloads();
    if (!self->closed_) self->arm_watchdog();
  });
}

void FabricConnection::check_payloads() {
  const auto now = std::chrono::steady_clock::now();
  for (auto& [key, rx] : rx_) {
    if (!rx.header || rx.cancelled || rx.fragments_left == 0) continue;
    const auto since = std::max(rx.owed_since, last_payload_);
    if (now - since > options_.peer_timeout) {
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - rx.owed_since).count();
      payload_stalled_ = true;
      return close(
          Status(ErrorCode::kPeerLost, "the payload of " + describe(*rx.header) + " from " +
                                           peer() + " has not arrived " + std::to_string(ms) +
                                           " ms after its header (fabric data path stalled)"));
    }
  }
}

void FabricConnection::await(const ReceiveKey& key) {
  awaiting_ = true;
  awaited_ = key;
}

void FabricConnection::discard_payload(const ReceiveKey& key, const FrameHeader& h) {
  if (h.length == 0) return;
  Rx& rx = rx_[key];
  rx = Rx{};
  rx.scratch = std::make_shared<std::vector<std::byte>>(h.length);
  rx.dst = *rx.scratch;
  rx.header = h;
  rx.owed_since = std::chrono::steady_clock::now();
  rx.discard = true;
  post_payload(key, rx);
}

void FabricConnection::post_payload(const ReceiveKey& key, Rx& rx) {
  rx.posted = true;
  if (rx.dst.empty()) return;  // nothing to receive; delivered with its header
  const size_t fragment_bytes = fragment_bytes_;
  const uint64_t fragments = fragment_count(rx.dst.size(), fragment_bytes);
  if (fragments > kMaxFragments) {
    return close(
        Status(ErrorCode::kInvalidArgument, "receive of " + std::to_string(rx.dst.size()) +
                                                " bytes exceeds the provider's message limits"));
  }
  std::span<std::byte> into = rx.dst;
  // Whatever the payload lands in stays alive while libfabric may write it.
  std::shared_ptr<const void> keep = rx.discard ? rx.scratch : rx.owner;
  if (rx.expected) {
    // The smallest spare landing that holds it, or a new one.
    auto fits = spare_landings_.end();
    for (auto it = spare_landings_.begin(); it != spare_landings_.end(); ++it) {
      if ((*it)->capacity() >= rx.dst.size() &&
          (fits == spare_landings_.end() || (*it)->capacity() < (*fits)->capacity())) {
        fits = it;
      }
    }
    if (fits != spare_landings_.end()) {
      rx.landing = std::move(*fits);
      spare_landings_.erase(fits);
    } else {
      rx.landing = std::make_shared<std::vector<std::byte>>();
    }
    rx.landing->resize(rx.dst.size());
    into = *rx.landing;
    keep = rx.landing;
  }
  auto desc = desc_for(into.data(), into.size(), rx.mrs);
  if (!desc) return close(desc.status().with_context("registering a receive buffer"));
  if (rx.expected) posted_payloads_++;
  rx.fragments_left = static_cast<uint32_t>(fragments);
  fid_ep* ep = endpoint_->ep();
  const fi_addr_t from = peer_addr_;
  for (uint64_t i = 0; i < fragments; ++i) {
    const size_t off = i * fragment_bytes;
    const size_t len = std::min(fragment_bytes, rx.dst.size() - off);
    const uint64_t tag = payload_tag(stream_, key, static_cast<uint32_t>(i));
    Op* op = endpoint_->new_op(nullptr);
    op->done = [self = shared_from_this(), op, key, len](const Status& s, size_t n) {
      self->op_finished(op);
      self->on_payload_fragment(key, op, s, n, len);
    };
    op->keep = keep;
    rx.ops.push_back(op);
    std::byte* buf = into.data() + off;
    void* d = *desc;
    submit(op, [ep, buf, len, d, from, tag, op] {
      return fi_trecv(ep, buf, len, d, from, tag, 0, &op->ctx);
    });
  }
}

void FabricConnection::on_payload_fragment(const ReceiveKey& key, Op* op, const Status& s, size_t n,
                                           size_t expected) {
  auto it = rx_.find(key);
  if (it == rx_.end()) return;  // closed meanwhile
  Rx& rx = it->second;
  std::erase(rx.ops, op);
  // A closed stream delivers nothing: a posted destination is left as it
  // was (its owner may send from it again on a new stream, or free it), and
  // the landing stays with the ops still out.
  if (closed_) return;
  last_payload_ = std::chrono::steady_clock::now();
  const bool cancelled_now = !s.is_ok() && s.code() == ErrorCode::kCancelled;
  if (cancelled_now && !rx.cancelled) {
    return close(Status(ErrorCode::kInternal,
                        "the provider cancelled a payload receive from " + peer() + " unasked"));
  }
  if (!s.is_ok() && !cancelled_now)
    return close(s.with_context("receiving a payload from " + peer()));
  if (s.is_ok() && n != expected) {
    return close(Status(ErrorCode::kProtocol, "payload fragment of " + std::to_string(n) +
                                                  " bytes from " + peer() + " where " +
                                                  std::to_string(expected) + " were expected"));
  }
  if (cancelled_now) rx.any_cancelled = true;
  if (--rx.fragments_left > 0) return;
  if (rx.cancelled) return settle_cancelled(key);
  if (rx.header) deliver(key);
}

void FabricConnection::settle_cancelled(const ReceiveKey& key) {
  auto node = rx_.extract(key);
  Rx& rx = node.mapped();
  release(rx);
  if (rx.any_cancelled) {
    // The payload was not taken; if its header came already, drain it.
    if (rx.header && !closed_) discard_payload(key, *rx.header);
  } else if (!rx.header) {
    consumed_.insert(key);
  }
  refill();
}

void FabricConnection::deliver(const ReceiveKey& key) {
  auto node = rx_.extract(key);
  Rx& rx = node.mapped();
  if (rx.expected && !rx.dst.empty()) std::memcpy(rx.dst.data(), rx.landing->data(), rx.dst.size());
  release(rx);
  if (!rx.discard && !closed_) handler_->on_data(*rx.header, rx.dst);
  refill();
  if (awaiting_ && awaited_ == key) {
    awaiting_ = false;
    take_headers();
  }
}

void FabricConnection::release(Rx& rx) {
  if (rx.expected && rx.posted && !rx.dst.empty()) posted_payloads_--;
  // A receive the provider still holds (a stream closed under it) keeps its
  // registrations, and its landing is not reused: its ops hold the memory.
  if (rx.ops.empty()) {
    for (auto* e : rx.mrs) endpoint_->mr().release(e);
    if (rx.landing && rx.landing.use_count() == 1 && spare_landings_.size() < kSpareLandings) {
      spare_landings_.push_back(std::move(rx.landing));
    }
  }
  rx.mrs.clear();
  rx.landing.reset();
}

void FabricConnection::refill() {
  while (!closed_ && posted_payloads_ < kPrepostLimit && !waiting_.empty()) {
    ReceiveKey key = waiting_.front();
    waiting_.pop_front();
    auto it = rx_.find(key);
    if (it == rx_.end() || it->second.posted) continue;
    post_payload(key, it->second);
    if (it->second.header && it->second.fragments_left == 0) deliver(key);
  }
}

}  // namespace tally::fabric
