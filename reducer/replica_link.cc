#include "tally/reducer/replica_link.h"

#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/connection_factory.h"
#include "tally/protocol/control.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/reducer/replica_mesh.h"
#include "tally/reducer/replicas.h"

namespace tally {
namespace asio = boost::asio;

// Dialling another replica: each attempt may take this long, and failed
// attempts are retried after a pause that doubles up to the maximum.
constexpr std::chrono::milliseconds kReplicaConnectTimeout{1000};
constexpr std::chrono::milliseconds kReplicaRetryMin{100};
constexpr std::chrono::milliseconds kReplicaRetryMax{1000};

namespace {
const Status kShuttingDown(ErrorCode::kCancelled, "reducer is shutting down");
}

ReplicaLink::ReplicaLink(std::shared_ptr<Replicas> owner, const ReducerOptions& options,
                         uint32_t group, asio::io_context& io)
    : owner_(std::move(owner)),
      options_(options),
      group_(group),
      io_(io),
      retry_timer_(io),
      welcome_timer_(io),
      retry_(kReplicaRetryMin) {}

void ReplicaLink::start() {
  asio::post(io_, [self = shared_from_this()] { self->dial(); });
}

void ReplicaLink::stop() {
  asio::post(io_, [self = shared_from_this()] {
    self->stopping_ = true;
    self->retry_timer_.cancel();
    self->welcome_timer_.cancel();
    self->fail_queue(kShuttingDown);
    if (self->conn_) self->conn_->close(kShuttingDown);
  });
}

void ReplicaLink::drop() {
  conn_.reset();
  queue_.clear();
}

void ReplicaLink::send(std::function<void(Connection&)> send,
                       std::function<void(const Status&)> fail,
                       std::chrono::steady_clock::time_point deadline) {
  asio::post(io_, [self = shared_from_this(), send = std::move(send), fail = std::move(fail),
                   deadline] {
    if (self->conn_ && self->conn_->is_open() && self->up_) return send(*self->conn_);
    if (self->stopping_) return fail(kShuttingDown);
    if (self->ever_up_) {
      return fail(self->owner_->lost(self->group_)
                      .value_or(Status(ErrorCode::kPeerLost, self->owner_->describe(self->group_) +
                                                                 " is not connected")));
    }
    self->queue_.push_back({deadline, std::move(send), std::move(fail)});
  });
}

PayloadAction ReplicaLink::on_data_header(const FrameHeader& h) {
  return PayloadAction::close(Status(
      ErrorCode::kProtocol, "unexpected " + describe(h) + " from " + owner_->describe(group_)));
}

void ReplicaLink::on_control(const wire::Control& message) {
  if (message.has_error()) {
    fatal_ = status_from_error(message.error());
    return;
  }
  if (message.has_auth_challenge() && !up_ && !dialler_nonce_.empty() && acceptor_nonce_.empty() &&
      message.auth_challenge().nonce().size() == kAuthNonceBytes) {
    acceptor_nonce_ = message.auth_challenge().nonce();
    wire::Control answer;
    answer.mutable_auth_response()->set_mac(
        auth_mac(options_.pool_secret, AuthRole::kReplicaDialler, acceptor_nonce_, dialler_nonce_,
                 replica_identity(options_.shard, options_.shard_count, options_.group, group_,
                                  options_.group_count)));
    conn_->send_control(answer);
    return;
  }
  if (message.has_replica_welcome() && !up_) return on_welcome(message.replica_welcome());
  conn_->close(
      Status(ErrorCode::kProtocol, "unexpected control message from " + owner_->describe(group_)));
}

void ReplicaLink::on_closed(const Status& status) {
  const Status why = fatal_ ? *fatal_ : status;
  fatal_.reset();
  conn_.reset();
  welcome_timer_.cancel();
  if (!up_) last_error_ = why.message();
  const bool was_up = up_;
  up_ = false;
  if (was_up) owner_->stream_down(group_, StreamDirection::kOutbound, why);
  if (stopping_) return;
  if (was_up) {
    spdlog::info("{}: outbound stream closed: {}", owner_->describe(group_), why.to_string());
    retry_ = kReplicaRetryMin;  // else (no ReplicaWelcome) back off as for a failed dial
  }
  schedule_dial();
}

void ReplicaLink::dial() {
  if (stopping_) return;
  expire_queue();
  auto address = owner_->address_of(group_);
  if (!address) {
    last_error_ = address.status().message();
    return schedule_dial();
  }
  address_ = address->to_string();
  async_tcp_connect(io_, *address, kReplicaConnectTimeout,
                    [self = shared_from_this()](Result<asio::ip::tcp::socket> r) {
                      self->on_connected(std::move(r));
                    });
}

void ReplicaLink::schedule_dial() {
  retry_timer_.expires_after(retry_);
  retry_ = std::min(retry_ * 2, kReplicaRetryMax);
  retry_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (!ec) self->dial();
  });
}

void ReplicaLink::on_connected(Result<asio::ip::tcp::socket> r) {
  if (stopping_) return;
  if (!r) {
    last_error_ = r.status().message();
    return schedule_dial();
  }
  conn_ = make_connection(owner_->fabric(), std::move(*r), options_.connection);
  conn_->start(shared_from_this());
  wire::Control hello;
  auto* h = hello.mutable_replica_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_shard(options_.shard);
  h->set_shard_count(options_.shard_count);
  h->set_group(options_.group);
  h->set_group_count(options_.group_count);
  h->set_incarnation(owner_->incarnation());
  dialler_nonce_.clear();
  acceptor_nonce_.clear();
  if (!options_.pool_secret.empty()) {
    dialler_nonce_ = make_nonce();
    h->set_auth_nonce(dialler_nonce_);
  }
  if (Status s = conn_->describe_data_path(h->mutable_data_path()); !s.is_ok()) {
    // on_closed redials
    return conn_->close(s.with_context("data path for " + owner_->describe(group_)));
  }
  conn_->send_control(hello);
  // Up only once the replica's ReplicaWelcome says where data goes.
  welcome_timer_.expires_after(kReplicaConnectTimeout);
  welcome_timer_.async_wait([self = shared_from_this(),
                             conn = conn_](const boost::system::error_code& ec) {
    if (ec || self->conn_ != conn || self->up_) return;
    conn->close(Status(ErrorCode::kTimeout,
                       "no ReplicaWelcome from " + self->owner_->describe(self->group_) +
                           " within " + std::to_string(kReplicaConnectTimeout.count()) + " ms"));
  });
}

void ReplicaLink::on_welcome(const wire::ReplicaWelcome& welcome) {
  welcome_timer_.cancel();
  if (!options_.pool_secret.empty() &&
      (acceptor_nonce_.empty() ||
       !auth_mac_matches(
           welcome.auth_proof(),
           auth_mac(options_.pool_secret, AuthRole::kReplicaAcceptor, dialler_nonce_,
                    acceptor_nonce_,
                    replica_identity(options_.shard, options_.shard_count, options_.group, group_,
                                     options_.group_count))))) {
    // on_closed redials
    return conn_->close(Status(
        ErrorCode::kUnauthenticated,
        owner_->describe(group_) + " did not prove it holds the pool secret (--pool-secret-file)"));
  }
  if (Status s = conn_->attach_data_path(welcome.data_path()); !s.is_ok()) {
    // on_closed redials
    return conn_->close(s.with_context("data path of " + owner_->describe(group_)));
  }
  const std::string& t = welcome.data_path().transport();
  spdlog::info("replica link to (shard {}, group {}) at {}: data path {}", options_.shard, group_,
               address_, t.empty() ? "tcp" : t);
  for (auto& announce : owner_->announcements(group_)) conn_->send_control(*announce);
  up_ = true;
  ever_up_ = true;
  spdlog::info("connected to {}", owner_->describe(group_));
  owner_->stream_up(group_, StreamDirection::kOutbound);
  auto queued = std::move(queue_);
  queue_.clear();
  for (auto& q : queued) q.send(*conn_);
}

void ReplicaLink::expire_queue() {
  const auto now = std::chrono::steady_clock::now();
  std::deque<Queued> keep;
  for (auto& q : queue_) {
    if (q.deadline > now) {
      keep.push_back(std::move(q));
    } else {
      q.fail(Status(ErrorCode::kTimeout, owner_->describe(group_) + " could not be reached" +
                                             (last_error_.empty() ? "" : ": " + last_error_)));
    }
  }
  queue_ = std::move(keep);
}

void ReplicaLink::fail_queue(const Status& why) {
  auto queued = std::move(queue_);
  queue_.clear();
  for (auto& q : queued) q.fail(why);
}

}  // namespace tally
