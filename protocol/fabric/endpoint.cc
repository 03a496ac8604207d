#include "endpoint.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <boost/asio/post.hpp>
#include <cstring>

namespace tally::fabric {
namespace {

using namespace std::chrono_literals;

// While posts are refused with -FI_EAGAIN and no completion arrives, they are
// retried at this interval instead of spinning.
constexpr auto kRetryInterval = 1ms;
// Completions read per fi_cq_read call.
constexpr size_t kCqBatch = 32;

}  // namespace

Result<std::shared_ptr<Endpoint>> Endpoint::open(const FabricOptions& options,
                                                 const std::string& node,
                                                 asio::any_io_executor executor) {
  auto info = get_info(options.provider, node, kTagBitsUsed);
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
  if (options.max_msg_bytes > 0)
    e->max_msg_size_ = std::min(e->max_msg_size_, options.max_msg_bytes);
  e->inject_size_ = i->tx_attr->inject_size;
  e->registration_ = needs_registration(options, i);
  e->mr_ = std::make_unique<MrCache>(e->domain_, (i->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0
                                                     ? MrKeys::kFromProvider
                                                     : MrKeys::kOurs);
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
        why =
            Status(ErrorCode::kProtocol, "truncated: a message longer than its header announced (" +
                                             std::to_string(err.olen) + " bytes too many)");
      } else {
        char buf[256];
        const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
        why =
            Status(ErrorCode::kPeerLost, std::string("completion error: ") + fi_strerror(err.err) +
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
  std::set<std::shared_ptr<RefusedPosts>> conns;
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

Result<fi_addr_t> Endpoint::insert_peer(const std::string& address) {
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

Result<uint32_t> Endpoint::allocate_stream() {
  for (uint32_t tries = 0; tries < 0xFFFF; ++tries) {
    next_stream_ = next_stream_ % 0xFFFF + 1;  // 1..65535
    if (streams_.insert(next_stream_).second) return next_stream_;
  }
  return Status(ErrorCode::kResourceExhausted,
                "all 65535 fabric stream ids of this endpoint are in use");
}

Op* Endpoint::new_op(std::function<void(const Status&, size_t)> done) {
  auto op = std::make_unique<Op>();
  std::memset(&op->ctx, 0, sizeof(op->ctx));
  op->done = std::move(done);
  Op* raw = op.get();
  ops_.emplace(raw, std::move(op));
  return raw;
}

void Endpoint::needs_retry(std::shared_ptr<RefusedPosts> stream) {
  retry_.insert(std::move(stream));
  kick();
}

void Endpoint::kick() {
  if (kicked_ || closed_) return;
  kicked_ = true;
  asio::post(executor_, [self = shared_from_this()] {
    self->kicked_ = false;
    self->progress();
  });
}

}  // namespace tally::fabric
