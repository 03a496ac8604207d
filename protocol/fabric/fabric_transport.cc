// libfabric RDM transport. See include/tally/protocol/fabric_transport.h for
// the object tree and docs/architecture.md ("libfabric data path") for why
// it is shaped this way.
//
// Terms used below:
//   stream id   a 16-bit number each side picks for a stream on its own
//               endpoint and tells the peer in the handshake; the peer puts
//               it into the tag of everything it sends on that stream, and
//               receives are directed (FI_DIRECTED_RECV) at the peer's
//               address, so tags never collide across streams or peers.
//   header seq  the number of a data-frame header on a stream. Header
//               receives are posted for seq, seq+1, ... seq+kHeaderSlots-1
//               and taken strictly in seq order, so frames keep the order
//               they were sent in whatever the provider's message ordering.
//   piece       a payload longer than the provider's max_msg_size goes as
//               several messages, numbered in the tag.
//
// Tag layout (62 bits used; the top two stay zero for providers with
// narrower tags, checked against mem_tag_format at open):
//   bits 60-61 type (1 header, 2 payload) | 44-59 stream id |
//   header:  0-43 seq
//   payload: 41-43 frame kind | 26-40 op (low 15 bits) | 6-25 chunk (low 20
//            bits) | 0-5 piece
// Op and chunk wrap, but a stream never has two receives posted whose ops
// are 32768 apart or whose chunks are 2^20 apart in one op.
#include "tally/protocol/fabric_transport.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <array>
#include <algorithm>
#include <cstring>
#include <optional>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {

bool fabric_available() { return true; }

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

constexpr uint32_t kFiVersion = FI_VERSION(1, 9);
constexpr uint64_t kTagHeader = 1ull << 60;
constexpr uint64_t kTagPayload = 2ull << 60;
constexpr int kStreamShift = 44;
constexpr uint64_t kSeqMask = (1ull << 44) - 1;
constexpr int kTagBitsUsed = 62;
// Header receives posted ahead per stream: a worker's window of chunks can
// be in flight without waiting for a repost between headers.
constexpr size_t kHeaderSlots = 32;
// Payload receives posted into libfabric ahead per stream; the rest of an
// op's posted receives wait in order, so a large op cannot exhaust the
// provider's receive queue.
constexpr size_t kPrepostLimit = 64;
// At most this many pieces per payload (6 tag bits).
constexpr uint64_t kMaxPieces = 64;
// After close(), operations the provider still holds get this long to
// complete or cancel before on_closed runs anyway (a dead peer's sends
// never complete: libfabric does not report dead peers).
constexpr auto kCloseGrace = 1000ms;
// While posts are refused with -FI_EAGAIN and no completion arrives, they are
// retried at this interval instead of spinning.
constexpr auto kRetryInterval = 1ms;
// Completions read per fi_cq_read call.
constexpr size_t kCqBatch = 32;
// Registrations kept per endpoint; least recently used idle ones go first.
constexpr size_t kMrCacheEntries = 512;

Status fi_status(std::string_view call, ssize_t rc, std::string_view context = {}) {
  std::string msg = std::string(call) + ": " + fi_strerror(static_cast<int>(-rc));
  if (!context.empty()) msg += " (" + std::string(context) + ")";
  return Status(ErrorCode::kUnavailable, std::move(msg));
}

uint64_t header_tag(uint32_t stream, uint64_t seq) {
  return kTagHeader | (uint64_t{stream} << kStreamShift) | (seq & kSeqMask);
}

uint64_t payload_tag(uint32_t stream, const ReceiveKey& key, uint32_t piece) {
  return kTagPayload | (uint64_t{stream} << kStreamShift) |
         ((static_cast<uint64_t>(key.kind) & 0x7) << 41) | ((key.op & 0x7FFF) << 26) |
         ((uint64_t{key.chunk} & 0xFFFFF) << 6) | (piece & 0x3F);
}

// Messages a payload of `nbytes` takes (max_msg_size may be near SIZE_MAX:
// no rounding-up addition that could wrap).
uint64_t piece_count(size_t nbytes, size_t piece_bytes) {
  return nbytes == 0 ? 0 : 1 + (nbytes - 1) / piece_bytes;
}

// Buffers are registered where the provider asks (FI_MR_LOCAL) or when forced.
bool needs_registration(const FabricOptions& options, const fi_info* info) {
  return options.force_registration || (info->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
}

struct FiInfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, FiInfoDeleter>;

// What we can do, so the provider tells us what it requires of us.
InfoPtr make_hints(const std::string& provider) {
  InfoPtr hints(fi_allocinfo());
  TALLY_CHECK(hints);
  hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  // Local registration we can do; the RMA-related bits cost nothing to
  // accept because tally never exposes memory for remote access.
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->resource_mgmt = FI_RM_ENABLED;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  return hints;
}

Result<InfoPtr> get_info(const std::string& provider, const std::string& node) {
  InfoPtr hints = make_hints(provider);
  fi_info* info = nullptr;
  int rc = fi_getinfo(kFiVersion, node.empty() ? nullptr : node.c_str(), nullptr,
                      node.empty() ? 0 : FI_SOURCE, hints.get(), &info);
  if (rc != 0 || !info) {
    return Status(ErrorCode::kUnavailable,
                  "libfabric provider '" + provider + "' is not available" +
                      (node.empty() ? "" : " on " + node) + ": fi_getinfo: " + fi_strerror(-rc) +
                      " (fi_info -l lists the providers this machine has)");
  }
  InfoPtr out(info);
  const uint64_t fmt = out->ep_attr->mem_tag_format;
  const int bits = fmt == 0 ? 64 : 64 - __builtin_clzll(fmt);
  if (bits < kTagBitsUsed) {
    return Status(ErrorCode::kUnimplemented, "libfabric provider '" + provider + "' offers " +
                                                 std::to_string(bits) + "-bit tags; tally needs " +
                                                 std::to_string(kTagBitsUsed));
  }
  return out;
}

class Endpoint;
class FabricConnection;

// One operation handed to libfabric; &ctx is its op_context. Owned by the
// endpoint until its completion is read (or the endpoint closes).
struct Op {
  fi_context2 ctx;  // first: libfabric may use it as scratch (FI_CONTEXT2 mode)
  std::function<void(const Status&, size_t)> done;
};

// Registrations by address range, for providers that want local memory
// registered (FI_MR_LOCAL) or when forced. A registration covers whole
// pages and is reused for any buffer inside it.
class MrCache {
 public:
  MrCache(fid_domain* domain, bool provider_keys) : domain_(domain), provider_keys_(provider_keys) {}

  // The descriptor for [p, p+n); registers on first use. The entry stays
  // pinned while `in_use` counts it (released with release()).
  struct Entry {
    uintptr_t start = 0;
    uintptr_t end = 0;
    fid_mr* mr = nullptr;
    uint64_t last_use = 0;
    uint32_t in_use = 0;
  };

  Result<Entry*> acquire(const void* p, size_t n) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    for (auto& [start, e] : entries_) {
      if (e.start <= a && a + n <= e.end) {
        e.last_use = ++clock_;
        e.in_use++;
        hits_++;
        return &e;
      }
    }
    evict();
    static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    Entry e;
    e.start = a & ~(page - 1);
    e.end = (a + n + page - 1) & ~(page - 1);
    int rc = fi_mr_reg(domain_, reinterpret_cast<void*>(e.start), e.end - e.start, FI_SEND | FI_RECV,
                       0, provider_keys_ ? 0 : next_key_++, 0, &e.mr, nullptr);
    if (rc != 0) return fi_status("fi_mr_reg", rc, std::to_string(e.end - e.start) + " bytes");
    e.last_use = ++clock_;
    e.in_use = 1;
    registrations_++;
    auto [it, inserted] = entries_.emplace(std::make_pair(e.start, e.end), e);
    if (!inserted) {  // same range registered twice: keep the older one
      fi_close(&e.mr->fid);
      it->second.in_use++;
    }
    return &it->second;
  }

  void release(Entry* e) { e->in_use--; }

  void close() {
    for (auto& [range, e] : entries_) fi_close(&e.mr->fid);
    entries_.clear();
  }

  uint64_t registrations() const { return registrations_; }
  uint64_t hits() const { return hits_; }

 private:
  void evict() {
    while (entries_.size() >= kMrCacheEntries) {
      auto victim = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (it->second.in_use == 0 &&
            (victim == entries_.end() || it->second.last_use < victim->second.last_use)) {
          victim = it;
        }
      }
      if (victim == entries_.end()) return;  // all in use: grow past the bound
      fi_close(&victim->second.mr->fid);
      entries_.erase(victim);
    }
  }

  fid_domain* domain_;
  bool provider_keys_;
  uint64_t next_key_ = 1;
  uint64_t clock_ = 0;
  uint64_t registrations_ = 0;
  uint64_t hits_ = 0;
  std::map<std::pair<uintptr_t, uintptr_t>, Entry> entries_;
};

// The per-(I/O thread, local address) libfabric objects and their progress.
// Used only on its executor, except close() once the thread has stopped.
class Endpoint : public std::enable_shared_from_this<Endpoint> {
 public:
  static Result<std::shared_ptr<Endpoint>> open(const FabricOptions& options, const std::string& node,
                                                asio::any_io_executor executor);
  ~Endpoint() { close(); }

  const std::string& address() const { return address_; }
  const std::string& provider() const { return provider_; }
  std::string fabric_name() const { return info_->fabric_attr->name ? info_->fabric_attr->name : ""; }
  std::string domain_name() const { return info_->domain_attr->name ? info_->domain_attr->name : ""; }
  size_t max_msg_size() const { return max_msg_size_; }
  size_t inject_size() const { return inject_size_; }
  bool registration() const { return registration_; }
  fid_ep* ep() { return ep_; }
  MrCache& mr() { return *mr_; }

  Result<fi_addr_t> insert_peer(const std::string& address) {
    if (auto it = peers_.find(address); it != peers_.end()) return it->second;
    fi_addr_t a = FI_ADDR_UNSPEC;
    int n = fi_av_insert(av_, address.data(), 1, &a, 0, nullptr);
    if (n != 1) {
      return Status(ErrorCode::kInvalidArgument,
                    "fi_av_insert: the peer's fabric address was not accepted" +
                        (n < 0 ? std::string(": ") + fi_strerror(-n) : std::string()));
    }
    peers_.emplace(address, a);
    return a;
  }

  // Stream ids in use on this endpoint are never handed out twice.
  Result<uint32_t> allocate_stream() {
    for (uint32_t tries = 0; tries < 0xFFFF; ++tries) {
      next_stream_ = next_stream_ % 0xFFFF + 1;  // 1..65535
      if (streams_.insert(next_stream_).second) return next_stream_;
    }
    return Status(ErrorCode::kResourceExhausted, "all 65535 fabric stream ids of this endpoint are in use");
  }
  void release_stream(uint32_t id) { streams_.erase(id); }

  Op* new_op(std::function<void(const Status&, size_t)> done) {
    auto op = std::make_unique<Op>();
    std::memset(&op->ctx, 0, sizeof(op->ctx));
    op->done = std::move(done);
    Op* raw = op.get();
    ops_.emplace(raw, std::move(op));
    return raw;
  }
  void drop_op(Op* op) { ops_.erase(op); }

  // A connection has posts refused with -FI_EAGAIN; retried after progress.
  void needs_retry(std::shared_ptr<FabricConnection> conn) {
    retry_.insert(std::move(conn));
    kick();
  }
  // Drive progress soon: manual-progress providers move nothing (sends,
  // rendezvous, connection set-up) unless the CQ is read.
  void kick() {
    if (kicked_ || closed_) return;
    kicked_ = true;
    asio::post(executor_, [self = shared_from_this()] {
      self->kicked_ = false;
      self->progress();
    });
  }

  void close();

 private:
  Endpoint(asio::any_io_executor executor)
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
  std::set<std::shared_ptr<FabricConnection>> retry_;

  friend class FabricImpl;
};

// The process-wide side: the provider choice and the endpoints by
// (I/O context, local address).
class FabricImpl final : public Fabric, public std::enable_shared_from_this<FabricImpl> {
 public:
  FabricImpl(FabricOptions options, InfoPtr probe) : options_(std::move(options)) {
    info_.provider = probe->fabric_attr->prov_name ? probe->fabric_attr->prov_name : options_.provider;
    info_.fabric = probe->fabric_attr->name ? probe->fabric_attr->name : "";
    info_.domain = probe->domain_attr->name ? probe->domain_attr->name : "";
    info_.registration = needs_registration(options_, probe.get());
  }
  ~FabricImpl() override { close(); }

  FabricInfo info() const override { return info_; }
  const FabricOptions& options() const { return options_; }

  std::shared_ptr<Connection> make_connection(tcp::socket socket,
                                              const ConnectionOptions& options) override;

  Status prepare_endpoint(asio::any_io_executor executor, const std::string& local_ip) override {
    auto ep = endpoint_for(executor, local_ip);
    return ep ? Status::ok() : ep.status();
  }

  // Opens (blocking, up to about a second) or reuses the endpoint for this
  // executor's context and local address. Thread-safe.
  Result<std::shared_ptr<Endpoint>> endpoint_for(asio::any_io_executor executor,
                                                 const std::string& node) {
    void* ctx = &asio::query(executor, asio::execution::context);
    std::lock_guard lock(mu_);
    if (closed_) return Status(ErrorCode::kCancelled, "fabric closed");
    auto key = std::make_pair(ctx, node);
    if (auto it = endpoints_.find(key); it != endpoints_.end()) return it->second;
    auto ep = Endpoint::open(options_, node, executor);
    if (!ep) return ep.status();
    endpoints_.emplace(key, *ep);
    spdlog::info("fabric endpoint open: provider {}, fabric {}, domain {}, bound to {}, registration {}, max message {} bytes",
                 (*ep)->provider(), (*ep)->fabric_name(), (*ep)->domain_name(),
                 node.empty() ? "(provider default)" : node,
                 (*ep)->registration() ? "on" : "off", (*ep)->max_msg_size());
    return *ep;
  }

  void close() override;

  // Every connection made, so close() can break the cycles of those still
  // waiting for libfabric (owner <-> connection <-> TCP side).
  void track(const std::shared_ptr<FabricConnection>& conn) {
    std::lock_guard lock(mu_);
    std::erase_if(connections_, [](const auto& w) { return w.expired(); });
    connections_.push_back(conn);
  }

 private:
  FabricOptions options_;
  FabricInfo info_;
  std::mutex mu_;
  bool closed_ = false;
  std::map<std::pair<void*, std::string>, std::shared_ptr<Endpoint>> endpoints_;
  std::vector<std::weak_ptr<FabricConnection>> connections_;
};

// A peer stream: control on the wrapped TCP connection, data on the
// endpoint once attached.
class FabricConnection final : public Connection,
                               public std::enable_shared_from_this<FabricConnection> {
 public:
  FabricConnection(std::shared_ptr<FabricImpl> fabric, std::shared_ptr<Connection> control,
                   std::string local_ip, const ConnectionOptions& options)
      : fabric_(std::move(fabric)),
        control_(std::move(control)),
        local_ip_(std::move(local_ip)),
        executor_(control_->executor()),
        peer_(control_->peer()),
        options_(options),
        grace_(control_->executor()),
        watchdog_(control_->executor()) {
    limits_.max_data_bytes = options.max_data_bytes;
  }

  asio::any_io_executor executor() override { return executor_; }

  void start(std::shared_ptr<FrameHandler> handler) override {
    handler_ = std::move(handler);
    control_->start(std::make_shared<ControlSide>(shared_from_this()));
  }

  void send(const FrameHeader& header, std::span<const std::byte> payload, SendDone done) override {
    if (closed_) return done(close_reason_);
    if (mode_ != Mode::kFabric) return control_->send(header, payload, std::move(done));
    send_fabric(header, payload, std::move(done));
  }

  void send_control(const wire::Control& message, SendDone done) override {
    if (!control_) {  // abandoned at shutdown
      if (done) done(close_reason_);
      return;
    }
    control_->send_control(message, std::move(done));
  }

  void post_receive(const ReceiveKey& key, std::span<std::byte> dst) override {
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

  bool cancel_receive(const ReceiveKey& key) override {
    if (!control_) return true;  // abandoned: nothing writes any buffer now
    if (mode_ != Mode::kFabric) return control_->cancel_receive(key);
    auto it = rx_.find(key);
    if (it == rx_.end()) return true;
    Rx& rx = it->second;
    if (rx.cancelled) return false;
    if (!rx.posted) {
      rx_.erase(it);
      return true;
    }
    if (rx.pieces_left == 0) {  // payload here, header not yet: nothing writes the buffer now
      if (!rx.header) consumed_.insert(key);
      rx_.erase(it);
      return true;
    }
    rx.cancelled = true;
    for (Op* op : rx.ops) fi_cancel(&endpoint_->ep()->fid, &op->ctx);
    endpoint_->kick();
    return false;
  }

  void resume() override {
    if (!control_) return;
    if (mode_ != Mode::kFabric) return control_->resume();
    if (closed_ || !paused_) return;
    paused_ = false;
    take_headers();
  }

  void close(const Status& reason) override {
    if (closed_) return;
    closed_ = true;
    close_reason_ = reason;
    watchdog_.cancel();
    control_->close(reason);
    paused_ = true;  // take no more headers
    // Posts still waiting for -FI_EAGAIN to clear never reached libfabric.
    for (auto& p : pending_) {
      if (p.op) {
        ops_.erase(p.op);
        auto done = std::move(p.op->done);
        endpoint_->drop_op(p.op);
        if (done) done(Status(ErrorCode::kCancelled, "never posted"), 0);
      }
    }
    pending_.clear();
    if (endpoint_) {
      for (Op* op : ops_) fi_cancel(&endpoint_->ep()->fid, &op->ctx);
      endpoint_->kick();
    }
    if (ops_.empty()) return finish_close();
    grace_.expires_after(kCloseGrace);
    grace_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec) return;
      if (!self->ops_.empty()) {
        spdlog::warn("fabric stream to {}: {} operation(s) did not finish within {} ms of close",
                     self->peer(), self->ops_.size(), kCloseGrace.count());
      }
      self->finish_close();
    });
  }

  bool is_open() const override { return !closed_; }
  const std::string& peer() const override { return peer_; }

  Status describe_data_path(wire::DataPath* out) override {
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

  Status attach_data_path(const wire::DataPath& peer) override {
    if (!control_) return Status(ErrorCode::kCancelled, "connection abandoned at shutdown");
    if (peer.transport().empty() || peer.transport() == "tcp") {
      if (offered_) {
        return Status(ErrorCode::kUnimplemented,
                      peer_ + " answered with a tcp data path to a fabric hello "
                                         "(start the pool with --transport fabric)");
      }
      mode_ = Mode::kTcp;
      return Status::ok();
    }
    if (peer.transport() != "fabric") {
      return Status(ErrorCode::kInvalidArgument, "unknown data path transport '" + peer.transport() + "'");
    }
    TALLY_RETURN_IF_ERROR(open_endpoint());
    if (peer.provider() != endpoint_->provider()) {
      return Status(ErrorCode::kInvalidArgument,
                    "fabric provider mismatch: " + peer_ + " uses '" + peer.provider() +
                        "', this side '" + endpoint_->provider() + "'");
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
    // Both sides cut payloads into the same pieces.
    piece_bytes_ = std::min<uint64_t>(endpoint_->max_msg_size(), peer.max_message_bytes());
    mode_ = Mode::kFabric;
    for (uint64_t s = 0; s < kHeaderSlots; ++s) post_header(s);
    arm_watchdog();
    return Status::ok();
  }

  // The process is shutting down and the I/O threads have stopped: forget
  // every operation and the handler without calling back, and let go of
  // the TCP side, which breaks the owner <-> connection cycles.
  void abandon() {
    closed_ = true;
    finished_ = true;
    ops_.clear();
    pending_.clear();
    rx_.clear();
    waiting_.clear();
    handler_.reset();
    control_.reset();
  }

 private:
  enum class Mode { kUndecided, kTcp, kFabric };

  // The TCP connection's handler: control messages, and data frames while
  // the data path is still on TCP.
  class ControlSide final : public FrameHandler {
   public:
    explicit ControlSide(std::shared_ptr<FabricConnection> owner) : owner_(std::move(owner)) {}
    PayloadAction on_data_header(const FrameHeader& h) override {
      if (owner_->mode_ == Mode::kFabric) {
        return PayloadAction::close(Status(ErrorCode::kProtocol, "data frame on the control stream of a fabric connection"));
      }
      return owner_->handler()->on_data_header(h);
    }
    void on_data(const FrameHeader& h, std::span<std::byte> p) override { owner_->handler()->on_data(h, p); }
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

  // A payload receive: posted ahead by the owner, or chosen when its
  // header arrived.
  struct Rx {
    std::span<std::byte> dst;
    std::vector<std::byte> scratch;  // discarded payloads land here
    std::optional<FrameHeader> header;
    std::vector<Op*> ops;
    uint32_t pieces_left = 0;
    bool expected = false;   // posted by post_receive()
    bool posted = false;
    bool cancelled = false;
    bool discard = false;
    bool any_cancelled = false;  // some piece completed with FI_ECANCELED
    std::chrono::steady_clock::time_point owed_since;  // when its header was taken
    std::vector<MrCache::Entry*> mrs;
  };

  struct Post {
    Op* op = nullptr;  // null: an inject, which has no completion
    std::function<ssize_t()> attempt;
  };

  std::shared_ptr<FrameHandler> handler() { return handler_; }

  Status open_endpoint() {
    if (endpoint_) return Status::ok();
    auto ep = fabric_->endpoint_for(executor(), local_ip_);
    if (!ep) return ep.status();
    auto id = (*ep)->allocate_stream();
    if (!id) return id.status();
    endpoint_ = *ep;
    stream_ = *id;
    return Status::ok();
  }

  // Hands a post to libfabric, or queues it behind earlier refused ones so
  // a stream's posts keep their order.
  void submit(Op* op, std::function<ssize_t()> attempt) {
    if (op) ops_.insert(op);
    if (pending_.empty()) {
      ssize_t rc = attempt();
    if (rc == 0) return endpoint_->kick();
      if (rc != -FI_EAGAIN) return post_failed(op, rc);
    }
    pending_.push_back(Post{op, std::move(attempt)});
    endpoint_->needs_retry(shared_from_this());
  }

  void post_failed(Op* op, ssize_t rc) {
    Status why = fi_status("posting to " + peer(), rc);
    if (op) {
      ops_.erase(op);
      endpoint_->drop_op(op);
    }
    close(why);
  }

 public:
  // Retries refused posts in order; true while some are still refused.
  bool retry_posts() {
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

 private:
  // Called by every op completion first: the op is no longer in libfabric.
  void op_finished(Op* op) {
    ops_.erase(op);
    if (closed_ && ops_.empty() && !finished_) {
      grace_.cancel();
      finish_close();
    }
  }

  Result<void*> desc_for(const void* p, size_t n, std::vector<MrCache::Entry*>& held) {
    if (!endpoint_->registration() || n == 0) return static_cast<void*>(nullptr);
    auto e = endpoint_->mr().acquire(p, n);
    if (!e) return e.status();
    held.push_back(*e);
    return fi_mr_desc((*e)->mr);
  }

  // --- sending -----------------------------------------------------------

  struct SendState {
    uint32_t left = 0;
    Status failure;
    SendDone done;
    std::vector<MrCache::Entry*> mrs;
  };

  void send_fabric(const FrameHeader& header, std::span<const std::byte> payload, SendDone done) {
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
        if (!s.is_ok() && !self->closed_) self->close(s.with_context("sending a header to " + self->peer()));
      };
      submit(op, [ep, encoded, to, htag, op] {
        return fi_tsend(ep, encoded->data(), encoded->size(), nullptr, to, htag, &op->ctx);
      });
    }
    if (payload.empty()) {
      return asio::post(executor(), [done = std::move(done)] { done(Status::ok()); });
    }

    const ReceiveKey key{header.kind, header.op, header.chunk};
    const size_t piece_bytes = piece_bytes_;
    const uint64_t pieces = piece_count(payload.size(), piece_bytes);
    if (pieces > kMaxPieces) {
      done(Status(ErrorCode::kInvalidArgument, "payload too large for this provider's max_msg_size"));
      return close(Status(ErrorCode::kInvalidArgument,
                          std::to_string(payload.size()) + "-byte payload needs more than " +
                              std::to_string(kMaxPieces) + " messages of max_msg_size " +
                              std::to_string(piece_bytes)));
    }
    auto state = std::make_shared<SendState>();
    state->left = static_cast<uint32_t>(pieces);
    state->done = std::move(done);
    auto desc = desc_for(payload.data(), payload.size(), state->mrs);
    if (!desc) {
      state->done(desc.status());
      return close(desc.status().with_context("registering a send buffer"));
    }
    for (uint64_t i = 0; i < pieces; ++i) {
      const size_t off = i * piece_bytes;
      const size_t len = std::min(piece_bytes, payload.size() - off);
      const uint64_t tag = payload_tag(peer_stream_, key, static_cast<uint32_t>(i));
      Op* op = endpoint_->new_op(nullptr);
      op->done = [self = shared_from_this(), state, op](const Status& s, size_t) {
        self->op_finished(op);
        if (!s.is_ok() && state->failure.is_ok()) state->failure = s;
        if (--state->left > 0) return;
        for (auto* e : state->mrs) self->endpoint_->mr().release(e);
        if (state->done) {
          auto d = std::move(state->done);
          d(state->failure.is_ok() ? Status::ok() : state->failure.with_context("sending to " + self->peer()));
        }
        if (!state->failure.is_ok() && !self->closed_) self->close(state->failure.with_context("sending to " + self->peer()));
      };
      const std::byte* buf = payload.data() + off;
      void* d = *desc;
      submit(op, [ep, buf, len, d, to, tag, op] {
        return fi_tsend(ep, buf, len, d, to, tag, &op->ctx);
      });
    }
  }

  // --- receiving ---------------------------------------------------------

  void post_header(uint64_t seq) {
    const size_t slot = seq % kHeaderSlots;
    Op* op = endpoint_->new_op(nullptr);
    op->done = [self = shared_from_this(), op, seq](const Status& s, size_t n) {
      self->op_finished(op);
      self->on_header(seq, s, n);
    };
    fid_ep* ep = endpoint_->ep();
    std::byte* buf = header_bufs_[slot].data();
    const uint64_t tag = header_tag(stream_, seq);
    const fi_addr_t from = peer_addr_;
    submit(op, [ep, buf, from, tag, op] {
      return fi_trecv(ep, buf, kFrameHeaderBytes, nullptr, from, tag, 0, &op->ctx);
    });
  }

  void on_header(uint64_t seq, const Status& s, size_t n) {
    if (closed_) return;
    if (!s.is_ok()) return close(s.with_context("receiving a header from " + peer()));
    if (n != kFrameHeaderBytes) {
      return close(Status(ErrorCode::kProtocol, "short frame header (" + std::to_string(n) +
                                                    " bytes) from " + peer()));
    }
    header_ready_[seq % kHeaderSlots] = true;
    take_headers();
  }

  // Takes arrived headers strictly in sequence order.
  void take_headers() {
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
      auto decoded = decode_header(std::span<const std::byte, kFrameHeaderBytes>(header_bufs_[slot]), limits_);
      if (!decoded) return close(decoded.status().with_context("frame from " + peer()));
      const FrameHeader h = *decoded;
      if (h.kind == FrameKind::kControl) {
        return close(Status(ErrorCode::kProtocol, "control frame on the fabric data path from " + peer()));
      }
      if (!take_header(h)) return;  // paused or closed: the same header is taken again later
      header_ready_[slot] = false;
      const uint64_t next = seq_in_ + kHeaderSlots;
      seq_in_++;
      post_header(next);
    }
  }

  // One header; false when it must be offered again (pause) or the stream closed.
  bool take_header(const FrameHeader& h) {
    const ReceiveKey key{h.kind, h.op, h.chunk};
    if (consumed_.erase(key)) return true;
    if (auto it = rx_.find(key); it != rx_.end()) {
      Rx& rx = it->second;
      if (rx.dst.size() != h.length) {
        close(Status(ErrorCode::kProtocol, describe(h) + " from " + peer() + " does not match the " +
                                                std::to_string(rx.dst.size()) + "-byte receive posted for it"));
        return false;
      }
      rx.header = h;
      rx.owed_since = std::chrono::steady_clock::now();
      if (rx.cancelled) return true;  // settled when the cancel completes
      if (!rx.posted) post_payload(key, rx);
      if (rx.posted && rx.pieces_left == 0) deliver(key);
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
        rx.header = h;
        rx.owed_since = std::chrono::steady_clock::now();
        await(key);
        post_payload(key, rx);
        if (rx.posted && rx.pieces_left == 0) deliver(key);
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

  // The control stream's heartbeats prove the peer process alive, not the
  // fabric path: a payload that stops arriving after its header (a stalled
  // rendezvous, a fabric-only partition) closes the stream after the peer
  // timeout, as a stalled TCP stream would be.
  void arm_watchdog() {
    // Ticks of an eighth of the peer timeout notice a stall within 1.125x it.
    watchdog_.expires_after(std::min<std::chrono::milliseconds>(options_.heartbeat_interval,
                                                                options_.peer_timeout / 8));
    watchdog_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->closed_) return;
      self->check_payloads();
      if (!self->closed_) self->arm_watchdog();
    });
  }

  void check_payloads() {
    const auto now = std::chrono::steady_clock::now();
    for (auto& [key, rx] : rx_) {
      if (!rx.header || rx.cancelled || rx.pieces_left == 0) continue;
      const auto since = std::max(rx.owed_since, last_payload_);
      if (now - since > options_.peer_timeout) {
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - rx.owed_since).count();
        return close(Status(ErrorCode::kPeerLost,
                            "the payload of " + describe(*rx.header) + " from " + peer() +
                                " has not arrived " + std::to_string(ms) +
                                " ms after its header (fabric data path stalled)"));
      }
    }
  }

  // A payload whose buffer the handler chose is taken before the next
  // header is offered: handlers see header, payload, header, ... as on TCP.
  void await(const ReceiveKey& key) {
    awaiting_ = true;
    awaited_ = key;
  }

  void discard_payload(const ReceiveKey& key, const FrameHeader& h) {
    if (h.length == 0) return;
    Rx& rx = rx_[key];
    rx = Rx{};
    rx.scratch.resize(h.length);
    rx.dst = rx.scratch;
    rx.header = h;
    rx.owed_since = std::chrono::steady_clock::now();
    rx.discard = true;
    post_payload(key, rx);
  }

  void post_payload(const ReceiveKey& key, Rx& rx) {
    rx.posted = true;
    if (rx.dst.empty()) return;  // nothing to receive; delivered with its header
    const size_t piece_bytes = piece_bytes_;
    const uint64_t pieces = piece_count(rx.dst.size(), piece_bytes);
    if (pieces > kMaxPieces) {
      return close(Status(ErrorCode::kInvalidArgument, "receive of " + std::to_string(rx.dst.size()) +
                                                           " bytes exceeds the provider's message limits"));
    }
    auto desc = desc_for(rx.dst.data(), rx.dst.size(), rx.mrs);
    if (!desc) return close(desc.status().with_context("registering a receive buffer"));
    if (rx.expected) posted_payloads_++;
    rx.pieces_left = static_cast<uint32_t>(pieces);
    fid_ep* ep = endpoint_->ep();
    const fi_addr_t from = peer_addr_;
    for (uint64_t i = 0; i < pieces; ++i) {
      const size_t off = i * piece_bytes;
      const size_t len = std::min(piece_bytes, rx.dst.size() - off);
      const uint64_t tag = payload_tag(stream_, key, static_cast<uint32_t>(i));
      Op* op = endpoint_->new_op(nullptr);
      op->done = [self = shared_from_this(), op, key, len](const Status& s, size_t n) {
        self->op_finished(op);
        self->on_payload_piece(key, op, s, n, len);
      };
      rx.ops.push_back(op);
      std::byte* buf = rx.dst.data() + off;
      void* d = *desc;
      submit(op, [ep, buf, len, d, from, tag, op] {
        return fi_trecv(ep, buf, len, d, from, tag, 0, &op->ctx);
      });
    }
  }

  void on_payload_piece(const ReceiveKey& key, Op* op, const Status& s, size_t n, size_t expected) {
    auto it = rx_.find(key);
    if (it == rx_.end()) return;  // closed meanwhile
    Rx& rx = it->second;
    std::erase(rx.ops, op);
    last_payload_ = std::chrono::steady_clock::now();
    const bool cancelled_now = !s.is_ok() && s.code() == ErrorCode::kCancelled;
    if (!s.is_ok() && !cancelled_now && !closed_) {
      return close(s.with_context("receiving a payload from " + peer()));
    }
    if (s.is_ok() && n != expected && !closed_) {
      return close(Status(ErrorCode::kProtocol, "payload piece of " + std::to_string(n) + " bytes from " +
                                                    peer() + " where " + std::to_string(expected) +
                                                    " were expected"));
    }
    if (cancelled_now) rx.any_cancelled = true;
    if (--rx.pieces_left > 0) return;
    if (rx.cancelled) return settle_cancelled(key);
    if (rx.header) deliver(key);
  }

  // A cancelled receive is done with its buffer: tell the owner (the
  // contract of cancel_receive returning false), and make sure the payload
  // is consumed once and only once.
  void settle_cancelled(const ReceiveKey& key) {
    auto node = rx_.extract(key);
    Rx& rx = node.mapped();
    release(rx);
    if (rx.any_cancelled) {
      // The payload was not taken; if its header came already, drain it.
      if (rx.header && !closed_) discard_payload(key, *rx.header);
    } else if (!rx.header) {
      consumed_.insert(key);
    }
    FrameHeader h;
    h.kind = key.kind;
    h.op = key.op;
    h.chunk = key.chunk;
    h.length = rx.dst.size();
    if (!closed_) handler_->on_data(h, rx.dst);
    refill();
  }

  void deliver(const ReceiveKey& key) {
    auto node = rx_.extract(key);
    Rx& rx = node.mapped();
    release(rx);
    if (!rx.discard && !closed_) handler_->on_data(*rx.header, rx.dst);
    refill();
    if (awaiting_ && awaited_ == key) {
      awaiting_ = false;
      take_headers();
    }
  }

  void release(Rx& rx) {
    if (rx.expected && rx.posted && !rx.dst.empty()) posted_payloads_--;
    for (auto* e : rx.mrs) endpoint_->mr().release(e);
    rx.mrs.clear();
  }

  // Posts receives that waited for room, oldest first.
  void refill() {
    while (!closed_ && posted_payloads_ < kPrepostLimit && !waiting_.empty()) {
      ReceiveKey key = waiting_.front();
      waiting_.pop_front();
      auto it = rx_.find(key);
      if (it == rx_.end() || it->second.posted) continue;
      post_payload(key, it->second);
      if (it->second.header && it->second.pieces_left == 0) deliver(key);
    }
  }

  void finish_close() {
    if (finished_) return;
    finished_ = true;
    // Whatever libfabric still holds is abandoned: its completions find
    // nothing to call back.
    for (Op* op : ops_) op->done = nullptr;
    ops_.clear();
    for (auto& [key, rx] : rx_) release(rx);
    rx_.clear();
    waiting_.clear();
    if (endpoint_) endpoint_->release_stream(stream_);
    auto handler = std::move(handler_);
    if (handler) handler->on_closed(close_reason_);
  }

  std::shared_ptr<FabricImpl> fabric_;
  std::shared_ptr<Connection> control_;  // null once abandoned
  std::string local_ip_;
  asio::any_io_executor executor_;
  std::string peer_;
  ConnectionOptions options_;
  FrameLimits limits_;
  asio::steady_timer grace_;
  asio::steady_timer watchdog_;
  std::chrono::steady_clock::time_point last_payload_;  // last payload piece completed
  std::shared_ptr<FrameHandler> handler_;
  std::shared_ptr<Endpoint> endpoint_;
  Mode mode_ = Mode::kUndecided;
  bool offered_ = false;
  bool closed_ = false;
  bool finished_ = false;
  bool paused_ = false;
  bool taking_ = false;
  bool awaiting_ = false;  // a handler-chosen payload is still arriving
  ReceiveKey awaited_;
  Status close_reason_;

  uint32_t stream_ = 0;       // ours: the peer tags what it sends us with it
  uint32_t peer_stream_ = 0;  // theirs
  fi_addr_t peer_addr_ = FI_ADDR_UNSPEC;
  size_t piece_bytes_ = 0;    // payloads are cut into messages of this size

  uint64_t seq_out_ = 0;
  uint64_t seq_in_ = 0;
  std::array<EncodedHeader, kHeaderSlots> header_bufs_{};
  std::array<bool, kHeaderSlots> header_ready_{};

  std::unordered_map<ReceiveKey, Rx, ReceiveKeyHash> rx_;
  std::deque<ReceiveKey> waiting_;
  std::unordered_set<ReceiveKey, ReceiveKeyHash> consumed_;
  size_t posted_payloads_ = 0;

  std::unordered_set<Op*> ops_;
  std::deque<Post> pending_;
};

Result<std::shared_ptr<Endpoint>> Endpoint::open(const FabricOptions& options, const std::string& node,
                                                 asio::any_io_executor executor) {
  auto info = get_info(options.provider, node);
  if (!info) return info.status();
  std::shared_ptr<Endpoint> e(new Endpoint(executor));
  e->info_ = std::move(*info);
  fi_info* i = e->info_.get();
  auto fail = [&](const char* call, int rc) {
    e->close();
    return fi_status(call, rc, "provider " + options.provider);
  };
  int rc = fi_fabric(i->fabric_attr, &e->fabric_, nullptr);
  if (rc) return fail("fi_fabric", rc);
  rc = fi_domain(e->fabric_, i, &e->domain_, nullptr);
  if (rc) return fail("fi_domain", rc);
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_TAGGED;
  cq_attr.wait_obj = FI_WAIT_FD;
  rc = fi_cq_open(e->domain_, &cq_attr, &e->cq_, nullptr);
  if (rc) return fail("fi_cq_open", rc);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_UNSPEC;
  rc = fi_av_open(e->domain_, &av_attr, &e->av_, nullptr);
  if (rc) return fail("fi_av_open", rc);
  rc = fi_endpoint(e->domain_, i, &e->ep_, nullptr);
  if (rc) return fail("fi_endpoint", rc);
  rc = fi_ep_bind(e->ep_, &e->av_->fid, 0);
  if (rc) return fail("fi_ep_bind(av)", rc);
  rc = fi_ep_bind(e->ep_, &e->cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc) return fail("fi_ep_bind(cq)", rc);
  rc = fi_enable(e->ep_);
  if (rc) return fail("fi_enable", rc);
  std::string name(256, '\0');
  size_t len = name.size();
  rc = fi_getname(&e->ep_->fid, name.data(), &len);
  if (rc == -FI_ETOOSMALL) {
    name.resize(len);
    rc = fi_getname(&e->ep_->fid, name.data(), &len);
  }
  if (rc) return fail("fi_getname", rc);
  name.resize(len);
  e->address_ = std::move(name);
  int fd = -1;
  rc = fi_control(&e->cq_->fid, FI_GETWAIT, &fd);
  if (rc) return fail("fi_control(FI_GETWAIT)", rc);
  e->wait_.assign(fd);
  e->provider_ = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : options.provider;
  e->max_msg_size_ = i->ep_attr->max_msg_size;
  if (options.max_msg_bytes > 0) e->max_msg_size_ = std::min(e->max_msg_size_, options.max_msg_bytes);
  e->inject_size_ = i->tx_attr->inject_size;
  e->registration_ = needs_registration(options, i);
  e->mr_ = std::make_unique<MrCache>(e->domain_, (i->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0);
  asio::post(executor, [e] { e->progress(); });
  return e;
}

void Endpoint::close() {
  if (closed_) return;
  closed_ = true;
  boost::system::error_code ec;
  retry_timer_.cancel();
  wait_.cancel(ec);
  if (wait_.is_open()) wait_.release();  // libfabric owns the fd
  retry_.clear();
  // Close order: endpoint, registrations, AV, CQ, domain, fabric.
  if (ep_) fi_close(&ep_->fid);
  if (mr_) mr_->close();
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (domain_) {
    int rc = fi_close(&domain_->fid);
    if (rc) spdlog::debug("closing fabric domain: {}", fi_strerror(-rc));
  }
  if (fabric_) fi_close(&fabric_->fid);
  ep_ = nullptr;
  av_ = nullptr;
  cq_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  // Operations the provider never finished hold their connections; drop
  // both without calling back.
  std::unordered_map<Op*, std::unique_ptr<Op>> ops;
  ops.swap(ops_);
  for (auto& [raw, op] : ops) op->done = nullptr;
  ops.clear();
}

void Endpoint::progress() {
  if (closed_) return;
  const bool completed = drain_cq();
  if (closed_) return;
  const bool refused = retry_posts();
  if (refused) {
    if (completed) {
      kick();
    } else if (!retry_armed_) {
      retry_armed_ = true;
      retry_timer_.expires_after(kRetryInterval);
      retry_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
        self->retry_armed_ = false;
        if (!ec) self->progress();
      });
    }
  }
  arm_wait();
}

bool Endpoint::drain_cq() {
  bool any = false;
  std::array<fi_cq_tagged_entry, kCqBatch> entries;
  for (;;) {
    ssize_t n = fi_cq_read(cq_, entries.data(), entries.size());
    if (n == -FI_EAGAIN) return any;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      ssize_t r = fi_cq_readerr(cq_, &err, 0);
      if (r < 0) return any;
      any = true;
      auto it = ops_.find(static_cast<Op*>(err.op_context));
      if (it == ops_.end()) continue;
      std::unique_ptr<Op> op = std::move(it->second);
      ops_.erase(it);
      Status why;
      if (err.err == FI_ECANCELED) {
        why = Status(ErrorCode::kCancelled, "cancelled");
      } else if (err.err == FI_ETRUNC) {
        why = Status(ErrorCode::kProtocol, "truncated: a message longer than its header announced (" +
                                               std::to_string(err.olen) + " bytes too many)");
      } else {
        char buf[256];
        const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
        why = Status(ErrorCode::kPeerLost, std::string("completion error: ") + fi_strerror(err.err) +
                                               (detail ? std::string(" (") + detail + ")" : ""));
      }
      if (op->done) op->done(why, err.len);
      if (closed_) return any;
      continue;
    }
    if (n < 0) {
      spdlog::error("fi_cq_read: {}", fi_strerror(static_cast<int>(-n)));
      return any;
    }
    any = true;
    for (ssize_t k = 0; k < n; ++k) {
      auto it = ops_.find(static_cast<Op*>(entries[k].op_context));
      if (it == ops_.end()) continue;
      std::unique_ptr<Op> op = std::move(it->second);
      ops_.erase(it);
      if (op->done) op->done(Status::ok(), entries[k].len);
      if (closed_) return any;
    }
  }
}

bool Endpoint::retry_posts() {
  bool refused = false;
  std::set<std::shared_ptr<FabricConnection>> conns;
  conns.swap(retry_);
  for (auto& c : conns) {
    if (c->retry_posts()) {
      refused = true;
      retry_.insert(c);
    }
  }
  return refused;
}

void Endpoint::arm_wait() {
  if (waiting_ || closed_) return;
  fid* fids[1] = {&cq_->fid};
  if (fi_trywait(fabric_, fids, 1) != FI_SUCCESS) return kick();  // completions or work pending
  waiting_ = true;
  wait_.async_wait(asio::posix::stream_descriptor::wait_read,
                   [self = shared_from_this()](const boost::system::error_code& ec) {
                     self->waiting_ = false;
                     if (!ec) self->progress();
                   });
}

void FabricImpl::close() {
  std::map<std::pair<void*, std::string>, std::shared_ptr<Endpoint>> eps;
  std::vector<std::weak_ptr<FabricConnection>> conns;
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    eps.swap(endpoints_);
    conns.swap(connections_);
  }
  for (auto& [key, ep] : eps) ep->close();
  for (auto& w : conns) {
    if (auto c = w.lock()) c->abandon();
  }
}

std::shared_ptr<Connection> FabricImpl::make_connection(tcp::socket socket,
                                                        const ConnectionOptions& options) {
  boost::system::error_code ec;
  auto local = socket.local_endpoint(ec);
  std::string ip = ec ? std::string() : local.address().to_string();
  auto control = make_tcp_connection(std::move(socket), options);
  auto conn = std::make_shared<FabricConnection>(shared_from_this(), std::move(control), std::move(ip),
                                                 options);
  track(conn);
  return conn;
}

}  // namespace

Result<std::shared_ptr<Fabric>> Fabric::open(const FabricOptions& options) {
  auto probe = get_info(options.provider, "");
  if (!probe) return probe.status();
  return std::shared_ptr<Fabric>(std::make_shared<FabricImpl>(options, std::move(*probe)));
}

}  // namespace tally
