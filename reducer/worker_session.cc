#include "tally/reducer/worker_session.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/post.hpp>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"
#include "tally/protocol/link_rate.h"
#include "tally/reducer/job_table.h"

namespace tally {
namespace asio = boost::asio;

// A goodbye's reason is quoted in other ranks' errors; keep it readable.
constexpr size_t kMaxReasonBytes = 1024;
// How long a Hello refused for stale state (WorkerSession::join) keeps
// trying, and how often. The reducer reads a closed stream's end within
// milliseconds once it runs; a worker whose old stream vanished without a
// trace is seen lost by the peer timeout instead, and is refused after this.
constexpr std::chrono::milliseconds kStaleStateGrace{2000};
constexpr std::chrono::milliseconds kStaleStateRetry{20};

WorkerSession::WorkerSession(std::shared_ptr<SessionContext> context,
                             std::shared_ptr<Connection> conn, std::function<bool()> admit)
    : context_(std::move(context)),
      admit_(std::move(admit)),
      conn_(std::move(conn)),
      peer_(conn_->peer()) {}

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
    if (message->has_error() && message->error().has_op()) {
      // One Error per failed op per stream: a peer streaming contributions
      // to a failed op (and not reading) must not grow our send queue.
      auto& sent = self->op_errors_sent_;
      const uint64_t op = message->error().op();
      if (std::find(sent.begin(), sent.end(), op) != sent.end()) return;
      sent.push_back(op);
      if (sent.size() > kOpErrorsRemembered) sent.pop_front();
    }
    self->conn_->send_control(*message);
  });
}

void WorkerSession::wake() {
  if (context_->stopped) return;
  asio::post(conn_->executor(), [self = shared_from_this()] { self->conn_->resume(); });
}

void WorkerSession::close(const Status& why) {
  asio::post(conn_->executor(),
             [self = shared_from_this(), why] { close_with_error(self->conn_, why); });
}

PayloadAction WorkerSession::on_data_header(const FrameHeader& h) {
  if (!job_) {
    return PayloadAction::close(
        Status(ErrorCode::kProtocol, "data frame from " + peer_ + " before its hello"));
  }
  if (h.kind != FrameKind::kContribution && h.kind != FrameKind::kReplay) {
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
  if (message.has_auth_response()) return on_auth_response(message.auth_response());
  if (message.has_received() && job_) {
    return job_->on_received(rank_, message.received().op_below(),
                             message.received().released_below());
  }
  if (message.has_goodbye()) {
    said_goodbye_ = true;
    goodbye_reason_ = utf8_prefix(message.goodbye().reason(), kMaxReasonBytes);
    return;
  }
  if (message.has_error()) {
    warn_worker_reports(peer_, status_from_error(message.error()));
    return;
  }
  reject_stream(conn_,
                Status(ErrorCode::kProtocol, "unexpected control message from worker " + peer_));
}

void WorkerSession::on_closed(const Status& why) {
  closed_ = true;
  pending_.reset();
  if (auth_timer_) auth_timer_->cancel();
  if (join_timer_) join_timer_->cancel();
  if (job_) {
    if (why.code() == ErrorCode::kCancelled || said_goodbye_) {
      spdlog::info("stream of job '{}' rank {} ({}) closed: {}", job_->name(), rank_, peer_,
                   why.message());
    } else {
      spdlog::warn("stream of job '{}' rank {} ({}) closed: {}", job_->name(), rank_, peer_,
                   why.to_string());
    }
    const Departure how = said_goodbye_           ? Departure::kGoodbye
                          : conn_->peer_stalled() ? Departure::kStalled
                                                  : Departure::kLost;
    context_->jobs->leave(
        job_, this, said_goodbye_ ? Status(ErrorCode::kCancelled, goodbye_reason_) : why, how);
  } else {
    warn_closed_before_joining(peer_, why);
  }
}

std::string WorkerSession::identity(const wire::Hello& hello) {
  return auth_identity(hello.job(), hello.rank(), hello.world_size(), hello.group());
}

void WorkerSession::on_hello(const wire::Hello& hello) {
  if (job_ || pending_hello_ || join_timer_) {
    return reject_stream(conn_, Status(ErrorCode::kProtocol, "second hello from " + peer_));
  }
  if (hello.protocol_version() != kProtocolVersion) {
    return reject_stream(
        conn_, Status(ErrorCode::kVersionMismatch,
                      "worker speaks protocol version " + std::to_string(hello.protocol_version()) +
                          ", this reducer speaks " + std::to_string(kProtocolVersion)));
  }
  rank_ = hello.rank();
  const ReducerOptions& o = context_->options;
  // Nothing about any job is looked at (or told) before the worker
  // authenticates: a stranger learns nothing and holds no job slot.
  if (!hello.auth_nonce().empty()) {
    if (o.job_secret.empty()) {
      return reject_stream(
          conn_, Status(ErrorCode::kUnauthenticated,
                        "worker " + peer_ +
                            " asks to authenticate with a job secret, but this reducer has none "
                            "(start it with --job-secret-file, or unset the workers' "
                            "TALLY_JOB_SECRET_FILE/TALLY_JOB_SECRET)"));
    }
    if (hello.auth_nonce().size() != kAuthNonceBytes) {
      return reject_stream(
          conn_, Status(ErrorCode::kProtocol, "malformed authentication nonce from " + peer_));
    }
    pending_hello_ = std::make_unique<wire::Hello>(hello);
    worker_nonce_ = hello.auth_nonce();
    std::weak_ptr<WorkerSession> weak = shared_from_this();
    reducer_nonce_ = challenge(conn_, *context_, auth_timer_, [weak] {
      auto self = weak.lock();
      return !self || !self->pending_hello_;
    });
    return;
  }
  if (o.require_auth) {
    return reject_stream(
        conn_, Status(ErrorCode::kUnauthenticated,
                      "this reducer serves authenticated jobs only: give the "
                      "workers the job secret (TALLY_JOB_SECRET_FILE or TALLY_JOB_SECRET)"));
  }
  admit(hello, false);
}

Secret WorkerSession::job_secret(std::string_view job) const {
  const ReducerOptions& o = context_->options;
  return o.per_job_secrets ? derive_job_secret(o.job_secret, job) : o.job_secret;
}

void WorkerSession::on_auth_response(const wire::AuthResponse& response) {
  if (!pending_hello_) {
    return reject_stream(
        conn_, Status(ErrorCode::kProtocol, "authentication answer from " + peer_ + " unasked"));
  }
  std::unique_ptr<wire::Hello> hello = std::move(pending_hello_);
  auth_timer_->cancel();
  const std::string expected = auth_mac(job_secret(hello->job()), AuthRole::kWorker, reducer_nonce_,
                                        worker_nonce_, identity(*hello));
  if (!auth_mac_matches(response.mac(), expected)) {
    return reject_stream(
        conn_,
        Status(ErrorCode::kUnauthenticated,
               "authentication failed for rank " + std::to_string(hello->rank()) + " of job '" +
                   utf8_prefix(hello->job(), kMaxJobNameBytes) + "' from " + peer_ +
                   ": its job secret is not this reducer's (check TALLY_JOB_SECRET_FILE or "
                   "TALLY_JOB_SECRET against the reducer's --job-secret-file)"));
  }
  admit(*hello, true);
}

void WorkerSession::admit(const wire::Hello& hello, bool authenticated) {
  if (!admit_()) return;  // cut to make room: the cut closes the stream
  if (Status s = conn_->attach_data_path(hello.data_path()); !s.is_ok()) {
    return reject_stream(conn_, s);
  }
  join(std::make_shared<const wire::Hello>(hello), authenticated,
       std::chrono::steady_clock::now() + kStaleStateGrace);
}

void WorkerSession::join(std::shared_ptr<const wire::Hello> hello, bool authenticated,
                         std::chrono::steady_clock::time_point deadline) {
  // A reducer that is stopping sends every stream its shutdown Error.
  if (closed_ || context_->stopped || context_->jobs->stopping()) return;
  auto job = context_->jobs->admit(*hello, authenticated, shared_from_this());
  if (!job) {
    const ErrorCode code = job.status().code();
    const bool stale = code == ErrorCode::kAlreadyExists || code == ErrorCode::kUnavailable;
    if (!stale || std::chrono::steady_clock::now() + kStaleStateRetry > deadline) {
      return reject_stream(conn_, job.status());
    }
    join_timer_.emplace(conn_->executor(), kStaleStateRetry);
    join_timer_->async_wait([weak = weak_from_this(), hello = std::move(hello), authenticated,
                             deadline](const boost::system::error_code& ec) {
      auto self = weak.lock();
      if (!ec && self) self->join(hello, authenticated, deadline);
    });
    return;
  }
  job_ = *job;
  const wire::Hello& h = *hello;
  const ReducerOptions& o = context_->options;
  wire::Control welcome;
  auto* w = welcome.mutable_welcome();
  w->set_protocol_version(kProtocolVersion);
  w->set_shard(o.shard);
  w->set_shard_count(o.shard_count);
  w->set_max_chunk_bytes(o.max_chunk_bytes);
  w->set_window_chunks(job_->window_chunks(o.window_chunks));
  // The ingress budget shared by the job's workers on this shard (at least
  // a byte: the worker may always have one chunk in flight).
  w->set_window_bytes(std::max<uint64_t>(1, o.ingress_window_bytes / job_->local_size()));
  // Results go to the job's workers here all at once: each stream gets its
  // share of the link.
  w->set_link_rate_bits(o.link_rate_bits);
  if (o.link_rate_bits > 0) {
    w->set_rate_bytes(paced_share(o.link_rate_bits, job_->local_size()));
    conn_->pace(w->rate_bytes());
  }
  // The streams sending to this reducer: the job's workers on this shard,
  // and one from each other replica group. Each gets its share of the
  // receive budget, and offers the same for the results; unless its worker
  // paces it and this reducer has a rate, so that the worker sends no faster
  // than rate_bytes, its share of this reducer's link.
  const uint64_t share =
      receive_share(o.receive_budget_bytes, job_->local_size() + o.group_count - 1);
  if (!(h.paced() && w->rate_bytes() > 0)) conn_->bound_receive_window(share);
  w->set_result_window_bytes(share);
  w->set_reducer_version(TALLY_VERSION);
  w->set_group(o.group);
  w->set_group_count(o.group_count);
  TALLY_CHECK(conn_->describe_data_path(w->mutable_data_path()).is_ok());  // attached above
  if (authenticated) {
    w->set_auth_proof(auth_mac(job_secret(h.job()), AuthRole::kReducer, worker_nonce_,
                               reducer_nonce_, identity(h)));
  }
  conn_->send_control(welcome);
  spdlog::info("rank {}/{} of job '{}' {} from {}", rank_, h.world_size(), job_->name(),
               h.resume() ? "resumed" : "joined", peer_);
}

}  // namespace tally
