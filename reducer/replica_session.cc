#include "tally/reducer/replica_session.h"

#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"
#include "tally/protocol/link_rate.h"
#include "tally/reducer/job_table.h"
#include "tally/reducer/replica_mesh.h"
#include "tally/reducer/replicas.h"

namespace tally {

ReplicaSession::ReplicaSession(std::shared_ptr<SessionContext> context,
                               std::shared_ptr<Connection> conn, std::function<bool()> admit)
    : context_(std::move(context)),
      admit_(std::move(admit)),
      conn_(std::move(conn)),
      peer_(conn_->peer()) {}

void ReplicaSession::answer(std::shared_ptr<const wire::Control> error) {
  context_->replicas->send_control(*group_, std::move(error));
}

void ReplicaSession::on_hello(const wire::ReplicaHello& hello) {
  const ReducerOptions& o = context_->options;
  if (hello.protocol_version() != kProtocolVersion) {
    return reject_stream(
        conn_,
        Status(ErrorCode::kVersionMismatch,
               "replica speaks protocol version " + std::to_string(hello.protocol_version()) +
                   ", this reducer speaks " + std::to_string(kProtocolVersion)));
  }
  if (!context_->replicas || hello.shard() != o.shard || hello.shard_count() != o.shard_count ||
      hello.group_count() != o.group_count || hello.group() >= o.group_count ||
      hello.group() == o.group) {
    return reject_stream(
        conn_,
        Status(ErrorCode::kInvalidArgument,
               "replica at " + peer_ + " says it is shard " + std::to_string(hello.shard()) +
                   " of " + std::to_string(hello.shard_count()) + ", group " +
                   std::to_string(hello.group()) + " of " + std::to_string(hello.group_count()) +
                   "; this reducer is shard " + std::to_string(o.shard) + " of " +
                   std::to_string(o.shard_count) + ", group " + std::to_string(o.group) + " of " +
                   std::to_string(o.group_count)));
  }
  if (group_ || pending_hello_) {
    return reject_stream(conn_, Status(ErrorCode::kProtocol, "second hello from " + peer_));
  }
  if (o.pool_secret.empty() != hello.auth_nonce().empty()) {
    return reject_stream(
        conn_, Status(ErrorCode::kUnauthenticated,
                      "replica at " + peer_ +
                          (o.pool_secret.empty() ? " authenticates" : " does not authenticate") +
                          " with a pool secret, but this reducer " +
                          (o.pool_secret.empty() ? "has none" : "requires it") +
                          " (start every reducer of the pool with the same --pool-secret-file)"));
  }
  if (!o.pool_secret.empty()) {
    if (hello.auth_nonce().size() != kAuthNonceBytes) {
      return reject_stream(
          conn_, Status(ErrorCode::kProtocol, "malformed authentication nonce from " + peer_));
    }
    pending_hello_ = std::make_unique<wire::ReplicaHello>(hello);
    dialler_nonce_ = hello.auth_nonce();
    std::weak_ptr<ReplicaSession> weak = shared_from_this();
    acceptor_nonce_ = challenge(conn_, *context_, auth_timer_, [weak] {
      auto self = weak.lock();
      return !self || !self->pending_hello_;
    });
    return;
  }
  accept(hello);
}

void ReplicaSession::on_auth_response(const wire::AuthResponse& response) {
  if (!pending_hello_) {
    return reject_stream(
        conn_, Status(ErrorCode::kProtocol, "authentication answer from " + peer_ + " unasked"));
  }
  std::unique_ptr<wire::ReplicaHello> hello = std::move(pending_hello_);
  auth_timer_->cancel();
  const ReducerOptions& o = context_->options;
  const std::string expected =
      auth_mac(o.pool_secret, AuthRole::kReplicaDialler, acceptor_nonce_, dialler_nonce_,
               replica_identity(o.shard, o.shard_count, hello->group(), o.group, o.group_count));
  if (!auth_mac_matches(response.mac(), expected)) {
    return reject_stream(
        conn_, Status(ErrorCode::kUnauthenticated,
                      "authentication failed for the replica of group " +
                          std::to_string(hello->group()) + " at " + peer_ +
                          ": its pool secret is not this reducer's (--pool-secret-file)"));
  }
  accept(*hello);
}

void ReplicaSession::accept(const wire::ReplicaHello& hello) {
  if (!admit_()) return;  // cut to make room: the cut closes the stream
  const ReducerOptions& o = context_->options;
  if (Status s = conn_->attach_data_path(hello.data_path()); !s.is_ok()) {
    return reject_stream(conn_, s.with_context("data path of replica group " +
                                               std::to_string(hello.group()) + " at " + peer_));
  }
  wire::Control welcome;
  if (Status s = conn_->describe_data_path(welcome.mutable_replica_welcome()->mutable_data_path());
      !s.is_ok()) {
    return reject_stream(
        conn_, s.with_context("data path for replica group " + std::to_string(hello.group())));
  }
  if (!o.pool_secret.empty()) {
    welcome.mutable_replica_welcome()->set_auth_proof(
        auth_mac(o.pool_secret, AuthRole::kReplicaAcceptor, dialler_nonce_, acceptor_nonce_,
                 replica_identity(o.shard, o.shard_count, hello.group(), o.group, o.group_count)));
  }
  // Partial sums come from each other replica group on its own stream,
  // beside the workers' contributions: this stream's share of the receive
  // budget (docs/architecture.md, "The receive budget").
  conn_->bound_receive_window(receive_share(o.receive_budget_bytes, o.group_count));
  conn_->send_control(welcome);
  group_ = hello.group();
  const std::string& t = hello.data_path().transport();
  spdlog::info("inbound stream of replica group {} from {}: data path {}", *group_, peer_,
               t.empty() ? "tcp" : t);
  // 0: a dialler that says none (a raw stream): nothing to compare.
  context_->replicas->stream_up(
      *group_, StreamDirection::kInbound,
      hello.incarnation() != 0 ? std::optional<uint64_t>(hello.incarnation()) : std::nullopt);
}

void ReplicaSession::on_control(const wire::Control& message) {
  if (!group_) {
    if (message.has_replica_hello()) return on_hello(message.replica_hello());
    if (message.has_auth_response()) return on_auth_response(message.auth_response());
  } else if (message.has_replica_job()) {
    const wire::ReplicaJob& rj = message.replica_job();
    auto job = context_->jobs->admit_replica_job(rj, *group_);
    if (!job) {
      spdlog::warn("job '{}' from replica group {}: {}", rj.job(), *group_,
                   job.status().to_string());
      answer(replica_error_message(rj.job(), job.status()));
      jobs_[job_id(rj.job())] = {rj.job(), {}};
      return;
    }
    jobs_[(*job)->id()] = {rj.job(), *job};
    (*job)->on_replica_round(*group_, rj.round(),
                             rj.has_mark() ? std::optional<uint64_t>(rj.mark()) : std::nullopt);
    return;
  } else if (message.has_replica_mark()) {
    const wire::ReplicaMark& rm = message.replica_mark();
    auto it = jobs_.find(job_id(rm.job()));
    if (it == jobs_.end()) return;
    if (auto job = it->second.job.lock()) job->on_replica_mark(*group_, rm.mark());
    return;
  } else if (message.has_replica_error()) {
    const wire::ReplicaError& re = message.replica_error();
    auto job = context_->jobs->find(re.job());
    if (!job) return;
    if (re.workers_left()) return job->on_replica_left(*group_, status_from_error(re.error()));
    return job->on_replica_error(re.error());
  }
  if (message.has_error()) {
    spdlog::warn("replica group {} reports: {}", group_ ? std::to_string(*group_) : "?",
                 status_from_error(message.error()).to_string());
    return;
  }
  reject_stream(conn_,
                Status(ErrorCode::kProtocol, "unexpected control message from replica " + peer_));
}

PayloadAction ReplicaSession::on_data_header(const FrameHeader& h) {
  if (!group_) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol, "data frame from " + peer_ + " before its hello"));
  }
  if (h.kind != FrameKind::kPartial) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol, "unexpected " + describe(h) + " from replica " + peer_));
  }
  auto it = jobs_.find(h.job);
  if (it == jobs_.end()) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol,
               "partial of a job replica " + peer_ + " did not announce: " + describe(h)));
  }
  partial_job_ = it->second.job.lock();
  if (!partial_job_) {
    // Refused (the sender was told then), or ended here since.
    const ReducerOptions& o = context_->options;
    answer(replica_error_message(
        it->second.name,
        job_gone_here(o.shard, o.group, it->second.name,
                      context_->jobs->ended_job_note(it->second.name), JobGone::kMaybeRefused),
        h.op));
    return PayloadAction::discard();
  }
  std::weak_ptr<ReplicaSession> weak = shared_from_this();
  return partial_job_->on_partial_header(*group_, h, partial_, [weak] {
    auto self = weak.lock();
    if (!self || self->context_->stopped) return;
    boost::asio::post(self->conn_->executor(), [self] { self->conn_->resume(); });
  });
}

void ReplicaSession::on_data(const FrameHeader& h, std::span<std::byte>) {
  partial_job_->on_partial_payload(h, partial_);
}

void ReplicaSession::on_closed(const Status& why) {
  if (auth_timer_) auth_timer_->cancel();
  partial_ = {};
  jobs_.clear();
  partial_job_.reset();
  if (!group_) {
    warn_closed_before_joining(peer_, why);
    return;
  }
  const bool expected =
      why.code() == ErrorCode::kCancelled || why.code() == ErrorCode::kUnavailable;
  spdlog::log(expected ? spdlog::level::info : spdlog::level::warn,
              "inbound stream of replica group {} ({}) closed: {}", *group_, peer_,
              why.to_string());
  context_->replicas->stream_down(*group_, StreamDirection::kInbound, why);
}

}  // namespace tally
