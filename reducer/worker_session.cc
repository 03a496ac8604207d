#include "tally/reducer/worker_session.h"

#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/reducer/job_table.h"

namespace tally {
namespace asio = boost::asio;

// A goodbye's reason is quoted in other ranks' errors; keep it readable.
constexpr size_t kMaxReasonBytes = 1024;

WorkerSession::WorkerSession(std::shared_ptr<SessionContext> context,
                             std::shared_ptr<Connection> conn)
    : context_(std::move(context)), conn_(std::move(conn)), peer_(conn_->peer()) {}

void WorkerSession::send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) {
  if (context_->stopped) return;
  asio::post(conn_->executor(), [self = shared_from_this(), header, slab = std::move(slab)] {
    auto payload = slab->first(header.length);
    self->conn_->send(header, payload, [slab](const Status&) {});
  });
}

void WorkerSession::send_control(std::shared_ptr<const wire::Control> message) {
  if (context_->stopped) return;
  asio::post(conn_->executor(), [self = shared_from_this(), message = std::move(message)] {
    self->conn_->send_control(*message);
  });
}

void WorkerSession::wake() {
  if (context_->stopped) return;
  asio::post(conn_->executor(), [self = shared_from_this()] { self->conn_->resume(); });
}

PayloadAction WorkerSession::on_data_header(const FrameHeader& h) {
  if (!job_) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol, "data frame from " + peer_ + " before its hello"));
  }
  if (h.kind != FrameKind::kContribution) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol, "unexpected " + describe(h) + " from worker " + peer_));
  }
  if (h.job != job_->id() || h.rank != rank_) {
    return PayloadAction::close(Status(
        ErrorCode::kProtocol, "frame from " + peer_ + " names job " + std::to_string(h.job) +
                                  " rank " + std::to_string(h.rank) + ", but the stream is job '" +
                                  job_->name() + "' rank " + std::to_string(rank_)));
  }
  // A worker sends its chunks in (op, chunk) order on each stream, so a
  // repeat or a step back is a duplicate, never a retry of a live chunk.
  const std::pair<uint64_t, uint32_t> key{h.op, h.chunk};
  if (last_key_ && key <= *last_key_) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol,
               "rank " + std::to_string(rank_) + " sent op " + std::to_string(h.op) + " chunk " +
                   std::to_string(h.chunk) + " after op " + std::to_string(last_key_->first) +
                   " chunk " + std::to_string(last_key_->second) + ": duplicate or out of order"));
  }
  PayloadAction action = job_->on_contribution_header(shared_from_this(), h, pending_);
  if (action.kind == PayloadAction::Kind::kReceive ||
      action.kind == PayloadAction::Kind::kDiscard) {
    last_key_ = key;
  }
  return action;
}

void WorkerSession::on_data(const FrameHeader& h, std::span<std::byte>) {
  job_->on_contribution_payload(h, pending_);
}

void WorkerSession::on_control(const wire::Control& message) {
  if (message.has_hello()) return on_hello(message.hello());
  if (message.has_goodbye()) {
    said_goodbye_ = true;
    goodbye_reason_ = message.goodbye().reason().substr(0, kMaxReasonBytes);
    return;
  }
  if (message.has_error()) {
    spdlog::warn("worker {} reports: {}", peer_, status_from_error(message.error()).to_string());
    return;
  }
  reject_stream(conn_,
                Status(ErrorCode::kProtocol, "unexpected control message from worker " + peer_));
}

void WorkerSession::on_closed(const Status& why) {
  pending_.reset();
  if (job_) {
    if (why.code() == ErrorCode::kCancelled || said_goodbye_) {
      spdlog::info("stream of job '{}' rank {} ({}) closed: {}", job_->name(), rank_, peer_,
                   why.message());
    } else {
      spdlog::warn("stream of job '{}' rank {} ({}) closed: {}", job_->name(), rank_, peer_,
                   why.to_string());
    }
    context_->jobs->leave(job_, this,
                          said_goodbye_ ? Status(ErrorCode::kCancelled, goodbye_reason_) : why,
                          said_goodbye_ ? Departure::kGoodbye : Departure::kLost);
  } else if (why.code() != ErrorCode::kCancelled) {
    spdlog::warn("connection from {} closed before joining a job: {}", peer_, why.to_string());
  }
}

void WorkerSession::on_hello(const wire::Hello& hello) {
  if (job_) return reject_stream(conn_, Status(ErrorCode::kProtocol, "second hello from " + peer_));
  if (hello.protocol_version() != kProtocolVersion) {
    return reject_stream(
        conn_, Status(ErrorCode::kVersionMismatch,
                      "worker speaks protocol version " + std::to_string(hello.protocol_version()) +
                          ", this reducer speaks " + std::to_string(kProtocolVersion)));
  }
  rank_ = hello.rank();
  if (Status s = conn_->attach_data_path(hello.data_path()); !s.is_ok()) {
    return reject_stream(conn_, s);
  }
  auto job = context_->jobs->admit(hello, shared_from_this());
  if (!job) return reject_stream(conn_, job.status());
  job_ = *job;
  const ReducerOptions& o = context_->options;
  wire::Control welcome;
  auto* w = welcome.mutable_welcome();
  w->set_protocol_version(kProtocolVersion);
  w->set_shard(o.shard);
  w->set_shard_count(o.shard_count);
  w->set_max_chunk_bytes(o.max_chunk_bytes);
  w->set_window_chunks(o.window_chunks);
  // The ingress budget shared by the job's workers on this shard (at least
  // a byte: the worker may always have one chunk in flight).
  w->set_window_bytes(std::max<uint64_t>(1, o.ingress_window_bytes / job_->local_size()));
  w->set_reducer_version(TALLY_VERSION);
  w->set_group(o.group);
  w->set_group_count(o.group_count);
  TALLY_CHECK(conn_->describe_data_path(w->mutable_data_path()).is_ok());  // attached above
  conn_->send_control(welcome);
  spdlog::info("rank {}/{} of job '{}' joined from {}", rank_, hello.world_size(), job_->name(),
               peer_);
}

}  // namespace tally
