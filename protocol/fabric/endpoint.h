// The libfabric objects of one (I/O thread, local address) and their
// progress, and the tag layout of the messages on them. Private to
// protocol/fabric/.
//
// Terms:
//   stream id   a 16-bit number each side picks for a stream on its own
//               endpoint and tells the peer in the handshake; the peer puts
//               it into the tag of everything it sends on that stream, and
//               receives are directed (FI_DIRECTED_RECV) at the peer's
//               address, so tags never collide across streams or peers.
//   header seq  the number of a data-frame header on a stream. Header
//               receives are posted for seq, seq+1, ... seq+kHeaderSlots-1
//               and taken strictly in seq order, so frames keep the order
//               they were sent in whatever the provider's message ordering.
//   fragment    a payload longer than the provider's max_msg_size goes as
//               several messages, numbered in the tag.
//
// Tag layout (62 bits used; the top two stay zero for providers with
// narrower tags, checked against mem_tag_format at open):
//   bits 60-61 type (1 header, 2 payload) | 44-59 stream id |
//   header:  0-43 seq
//   payload: 41-43 frame kind | 26-40 op (low 15 bits) | 6-25 chunk (low 20
//            bits) | 0-5 fragment
// Op and chunk wrap, but a stream never has two receives posted whose ops
// are 32768 apart or whose chunks are 2^20 apart in one op.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>

#include "libfabric.h"
#include "mr_cache.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/status.h"
#include "tally/protocol/transport.h"

namespace tally::fabric {

namespace asio = boost::asio;

// The tag layout above, in constants.
constexpr uint64_t kTagHeader = 1ull << 60;
constexpr uint64_t kTagPayload = 2ull << 60;
constexpr int kStreamShift = 44;
constexpr uint64_t kSeqMask = (1ull << 44) - 1;
constexpr int kTagBitsUsed = 62;
// At most this many fragments per payload (6 tag bits).
constexpr uint64_t kMaxFragments = 64;

inline uint64_t header_tag(uint32_t stream, uint64_t seq) {
  return kTagHeader | (uint64_t{stream} << kStreamShift) | (seq & kSeqMask);
}

inline uint64_t payload_tag(uint32_t stream, const ReceiveKey& key, uint32_t fragment) {
  return kTagPayload | (uint64_t{stream} << kStreamShift) |
         ((static_cast<uint64_t>(key.kind) & 0x7) << 41) | ((key.op & 0x7FFF) << 26) |
         ((uint64_t{key.chunk} & 0xFFFFF) << 6) | (fragment & 0x3F);
}

// Messages a payload of `nbytes` takes (max_msg_size may be near SIZE_MAX:
// no rounding-up addition that could wrap).
inline uint64_t fragment_count(size_t nbytes, size_t fragment_bytes) {
  return nbytes == 0 ? 0 : 1 + (nbytes - 1) / fragment_bytes;
}

// One operation handed to libfabric; &ctx is its op_context. Owned by the
// endpoint until its completion is read (or the endpoint closes).
struct Op {
  fi_context2 ctx;  // first: libfabric may use it as scratch (FI_CONTEXT2 mode)
  std::function<void(const Status&, size_t)> done;
  // What owns the memory the provider reads or writes for this op. Let go
  // when its completion is read or the endpoint closes, never before: a
  // stream that gives up on the op (FabricConnection::finish_close) drops
  // `done` only, since a matched receive or a send under way cannot be
  // withdrawn and completes into (or from) this memory whenever the peer's
  // bytes move again.
  std::shared_ptr<const void> keep;
};

// A stream whose posts the endpoint refused with -FI_EAGAIN: the endpoint
// calls it back after progress, on its executor. Implemented by the
// connection, so the endpoint never reaches into it.
class RefusedPosts {
 public:
  virtual ~RefusedPosts() = default;
  // Retries refused posts in order; true while some are still refused.
  virtual bool retry_posts() = 0;
};

// The per-(I/O thread, local address) libfabric objects and their progress.
// Used only on its executor, except close() once the thread has stopped.
class Endpoint : public std::enable_shared_from_this<Endpoint> {
 public:
  // Opens domain, CQ, AV and RDM endpoint for `node` ("": the provider's
  // default) and starts driving progress on `executor`. Blocks for up to
  // about a second; any thread. Errors: kUnavailable (naming the libfabric
  // call), kUnimplemented (tags too narrow).
  static Result<std::shared_ptr<Endpoint>> open(const FabricOptions& options,
                                                const std::string& node,
                                                asio::any_io_executor executor);
  ~Endpoint() { close(); }

  const std::string& address() const { return address_; }
  const std::string& provider() const { return provider_; }
  std::string fabric_name() const {
    return info_->fabric_attr->name ? info_->fabric_attr->name : "";
  }
  std::string domain_name() const {
    return info_->domain_attr->name ? info_->domain_attr->name : "";
  }
  size_t max_msg_size() const { return max_msg_size_; }
  size_t inject_size() const { return inject_size_; }
  bool registration() const { return registration_; }
  fid_ep* ep() { return ep_; }
  MrCache& mr() { return *mr_; }

  // The peer's address in this endpoint's AV, inserted on first use.
  // Errors: kInvalidArgument when libfabric rejects the address.
  Result<fi_addr_t> insert_peer(const std::string& address);

  // Stream ids in use on this endpoint are never handed out twice.
  // Errors: kResourceExhausted when all 65535 are in use.
  Result<uint32_t> allocate_stream();
  void release_stream(uint32_t id) { streams_.erase(id); }

  // A new operation, owned by the endpoint until its completion is read,
  // drop_op() or close().
  Op* new_op(std::function<void(const Status&, size_t)> done);
  void drop_op(Op* op) { ops_.erase(op); }

  // A connection has posts refused with -FI_EAGAIN; retried after progress.
  void needs_retry(std::shared_ptr<RefusedPosts> stream);
  // Drive progress soon: manual-progress providers move nothing (sends,
  // rendezvous, connection set-up) unless the CQ is read.
  void kick();

  // Closes the libfabric objects and drops unfinished operations without
  // calling them back. Idempotent.
  void close();

 private:
  explicit Endpoint(asio::any_io_executor executor)
      : executor_(executor), wait_(executor), retry_timer_(executor) {}

  void progress();
  bool drain_cq();
  bool retry_posts();
  void arm_wait();

  asio::any_io_executor executor_;
  asio::posix::stream_descriptor wait_;
  asio::steady_timer retry_timer_;
  InfoPtr info_;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::unique_ptr<MrCache> mr_;
  std::string address_;
  std::string provider_;
  size_t max_msg_size_ = 0;
  size_t inject_size_ = 0;
  bool registration_ = false;
  bool closed_ = false;
  bool kicked_ = false;
  bool waiting_ = false;
  bool retry_armed_ = false;
  std::unordered_map<std::string, fi_addr_t> peers_;
  std::set<uint32_t> streams_;
  uint32_t next_stream_ = 0;
  std::unordered_map<Op*, std::unique_ptr<Op>> ops_;
  std::set<std::shared_ptr<RefusedPosts>> retry_;
};

}  // namespace tally::fabric
