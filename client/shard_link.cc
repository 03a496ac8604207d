#include "shard_link.h"

#include <spdlog/spdlog.h>

#include <boost/asio/steady_timer.hpp>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/connection_factory.h"
#include "tally/protocol/control.h"
#include "tally/protocol/link_rate.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {
namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Pause between attempts to reach a reducer that is not listening yet.
constexpr milliseconds kConnectRetry{100};
// Pauses between attempts to reopen a lost stream: doubling up to the last.
constexpr milliseconds kResumeBackoffFirst{100};
constexpr milliseconds kResumeBackoffMost{1000};
// The longest one attempt to reopen a stream may take to connect: a link
// that drops packets (rather than refusing) must not hold the attempt until
// the resume deadline, when it may be back in a second.
constexpr milliseconds kResumeAttempt{2000};

void ShardLink::connect(Clock::time_point deadline) {
  if (closing_) return settle(Status(ErrorCode::kCancelled, "client closed while connecting"));
  if (phase_ == Phase::kJoining) connect_deadline_ = deadline;
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  if (left <= milliseconds(0)) {
    if (phase_ == Phase::kResuming) return retry();
    return settle(
        Status(ErrorCode::kTimeout, "could not reach reducer " + address_.to_string() + " (shard " +
                                        std::to_string(shard_) + ") within " +
                                        std::to_string(settings_.options.connect_timeout.count()) +
                                        " ms" + (last_error_.empty() ? "" : ": " + last_error_)));
  }
  async_tcp_connect(settings_.io, address_,
                    phase_ == Phase::kResuming ? std::min(left, kResumeAttempt) : left,
                    [self = shared_from_this()](Result<asio::ip::tcp::socket> r) {
                      self->on_connected(std::move(r));
                    });
}

void ShardLink::close(const Status& why) {
  closing_ = true;
  if (conn_) conn_->close(why);
}

void ShardLink::leave(const std::string& reason, std::function<void()> done) {
  closing_ = true;  // a connect still in progress must not open a stream now
  if (!conn_ || closed_) return done();
  wire::Control bye;
  bye.mutable_goodbye()->set_reason(reason);
  // Weak: the callback sits in the connection's own queue (see the reducer's close_with_error).
  conn_->send_control(bye, [weak = std::weak_ptr<Connection>(conn_), done](const Status&) {
    if (auto conn = weak.lock())
      conn->close(Status(ErrorCode::kCancelled, std::string(kCleanGoodbyeReason)));
    done();
  });
}

void ShardLink::send_received(uint64_t op_below) {
  if (closed_ || !conn_) return;
  wire::Control received;
  received.mutable_received()->set_op_below(op_below);
  received.mutable_received()->set_released_below(owner_.released_below());
  conn_->send_control(received);
}

PayloadAction ShardLink::on_data_header(const FrameHeader& h) {
  if (h.kind == FrameKind::kResult && owner_.on_unposted_result(*this, h)) {
    return PayloadAction::discard();
  }
  return PayloadAction::close(
      Status(ErrorCode::kProtocol, "unexpected " + describe(h) + " from reducer " + conn_->peer()));
}

std::string ShardLink::name() const {
  return "reducer " + address_.to_string() + " (shard " + std::to_string(shard_) + ")";
}

std::string ShardLink::identity() const {
  return auth_identity(settings_.options.job, settings_.options.rank, settings_.options.world_size,
                       settings_.group);
}

void ShardLink::on_control(const wire::Control& message) {
  if (message.has_welcome()) return on_welcome(message.welcome());
  if (message.has_released() && settled_ && phase_ == Phase::kLive) {
    return owner_.on_released(shard_, message.released().op_below());
  }
  if (message.has_replica_lost() && settled_ && phase_ == Phase::kLive) {
    replica_lost_ = ReplicaLost{utf8_prefix(message.replica_lost().replica(), 256),
                                utf8_prefix(message.replica_lost().reason(), 1024)};
    return;
  }
  if (message.has_rejoin() && settled_ && phase_ == Phase::kLive) {
    // Another replica of the shard was lost: the ops in flight start again
    // on every replica, from a new stream (docs/protocol.md, "Resuming with
    // replica groups").
    rejoining_ = true;
    replica_lost_.reset();
    return conn_->close(
        Status(ErrorCode::kPeerLost,
               "it asked this worker to rejoin: " + utf8_prefix(message.rejoin().reason(), 1024)));
  }
  if (message.has_auth_challenge() && !settled_ && reducer_nonce_.empty()) {
    const std::string& nonce = message.auth_challenge().nonce();
    if (settings_.options.secret.empty() || nonce.size() != kAuthNonceBytes) {
      Status why(ErrorCode::kUnauthenticated,
                 "reducer " + address_.to_string() +
                     " asks this worker to authenticate, but it has no job secret (set "
                     "TALLY_JOB_SECRET_FILE or TALLY_JOB_SECRET)");
      settle(why);
      return conn_->close(why);
    }
    reducer_nonce_ = nonce;
    wire::Control answer;
    answer.mutable_auth_response()->set_mac(auth_mac(settings_.options.secret, AuthRole::kWorker,
                                                     reducer_nonce_, worker_nonce_, identity()));
    conn_->send_control(answer);
    return;
  }
  if (message.has_error()) {
    Status status = status_from_error(message.error());
    if (message.error().has_op()) {
      return owner_.on_op_error(*this, message.error().op(), status.with_context(name()));
    }
    fatal_ = status;  // the reducer closes the stream next
    if (!settled_) settle(status.with_context("reducer " + address_.to_string()));
    return;
  }
  conn_->close(Status(ErrorCode::kProtocol,
                      "unexpected control message from reducer " + address_.to_string()));
}

void ShardLink::on_closed(const Status& status) {
  Status why = fatal_ ? *fatal_ : status;
  why = why.with_context("lost " + name());
  closed_ = true;
  switch (phase_) {
    case Phase::kJoining:
      // A stream that ends before its Welcome, refused by nobody, is a
      // reducer that died or restarted mid-handshake: dialled again until
      // the connect deadline, as a refused connection is.
      if (!settled_ && !fatal_ && !closing_ && why.code() == ErrorCode::kPeerLost &&
          Clock::now() + kConnectRetry < connect_deadline_) {
        last_error_ = why.message();
        worker_nonce_.clear();
        reducer_nonce_.clear();
        return redial();
      }
      settle(why);
      phase_ = Phase::kGone;
      return owner_.on_link_closed(shard_, why);
    case Phase::kLive:
      if (!resumable(why)) {
        phase_ = Phase::kGone;
        return owner_.on_link_closed(shard_, why);
      }
      phase_ = Phase::kResuming;
      lost_ = why;
      resume_deadline_ = Clock::now() + settings_.options.op_timeout;
      // Asked to rejoin by a live reducer: at once.
      backoff_ = rejoining_ ? milliseconds(0) : kResumeBackoffFirst;
      spdlog::log(rejoining_ ? spdlog::level::info : spdlog::level::warn,
                  "job '{}' rank {}: {}; reconnecting for up to {} ms", settings_.options.job,
                  settings_.options.rank, why.to_string(), settings_.options.op_timeout.count());
      owner_.on_link_lost(shard_);
      return retry();
    case Phase::kResuming:
      // An attempt that did not get its Welcome.
      if (!resumable(why)) {
        return give_up(Status(why.code(), lost_->message() + "; reconnecting to it failed: " +
                                              fatal_.value_or(status).message()));
      }
      return retry();
    case Phase::kGone:
      return;
  }
}

bool ShardLink::resumable(const Status& why) const {
  if (closing_) return false;
  // A live reducer asked: it starts the ops in flight again, which needs
  // no kept result for the chunks no rank has a result of.
  if (rejoining_) return true;
  if (settings_.options.resume_bytes == 0) return false;
  // A reducer's refusal stops it, unless it is the stale state a reducer
  // holds until it has seen the old stream end, or a reducer shutting down.
  if (!fatal_) return true;
  const ErrorCode code = why.code();
  return code == ErrorCode::kUnavailable || code == ErrorCode::kAlreadyExists;
}

void ShardLink::retry() {
  if (closing_) return;
  const auto now = Clock::now();
  if (now >= resume_deadline_) {
    return give_up(Status(lost_->code(), lost_->message() + "; it did not come back within " +
                                             std::to_string(settings_.options.op_timeout.count()) +
                                             " ms"));
  }
  // The last pause ends at the deadline, so giving up is not a backoff late.
  auto timer = std::make_shared<asio::steady_timer>(
      settings_.io, std::min<Clock::duration>(backoff_, resume_deadline_ - now));
  backoff_ = backoff_ == milliseconds(0) ? kResumeBackoffFirst
                                         : std::min(backoff_ * 2, kResumeBackoffMost);
  timer->async_wait([self = shared_from_this(), timer](const boost::system::error_code&) {
    if (self->closing_ || self->phase_ != Phase::kResuming) return;
    // A fresh attempt: nothing of the last one's handshake carries over.
    self->settled_ = false;
    self->fatal_.reset();
    self->worker_nonce_.clear();
    self->reducer_nonce_.clear();
    self->connect(self->resume_deadline_);
  });
}

void ShardLink::redial() {
  auto timer = std::make_shared<asio::steady_timer>(settings_.io, kConnectRetry);
  timer->async_wait([self = shared_from_this(), timer](const boost::system::error_code&) {
    self->connect(self->connect_deadline_);
  });
}

void ShardLink::give_up(const Status& why) {
  phase_ = Phase::kGone;
  closed_ = true;
  owner_.on_link_closed(shard_, why);
}

void ShardLink::on_connected(Result<asio::ip::tcp::socket> r) {
  if (closing_) return settle(Status(ErrorCode::kCancelled, "client closed while connecting"));
  if (!r && phase_ == Phase::kResuming) return retry();
  if (!r) {
    last_error_ = r.status().message();
    if (r.status().code() == ErrorCode::kUnavailable &&
        Clock::now() + kConnectRetry < connect_deadline_) {
      return redial();
    }
    return settle(r.status().with_context("shard " + std::to_string(shard_)));
  }
  ConnectionOptions copts;
  // Results go into posted receives of the plan's chunks; the stream opens
  // before the Welcome says the reducer's limit, so this is the protocol's.
  copts.max_data_bytes = kMaxChunkBytesLimit;
  copts.heartbeat_interval = settings_.options.heartbeat_interval;
  copts.peer_timeout = settings_.options.peer_timeout;
  copts.congestion_control = settings_.options.tcp_congestion;
  conn_ = make_connection(settings_.fabric, std::move(*r), copts);
  conn_->start(shared_from_this());
  wire::Control hello;
  auto* h = hello.mutable_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_job(settings_.options.job);
  h->set_rank(settings_.options.rank);
  h->set_world_size(settings_.options.world_size);
  h->set_op_timeout_ms(static_cast<uint32_t>(settings_.options.op_timeout.count()));
  h->set_client_version(TALLY_VERSION);
  h->set_group(settings_.group);
  for (uint32_t n : settings_.group_sizes) h->add_group_sizes(n);
  h->set_groups_explicit(settings_.options.group.has_value());
  h->set_resume(phase_ == Phase::kResuming);
  h->set_deterministic(settings_.options.deterministic);
  h->set_paced(settings_.options.link_rate_bits > 0);
  if (!settings_.options.secret.empty()) {
    worker_nonce_ = make_nonce();
    h->set_auth_nonce(worker_nonce_);
  }
  if (Status s = conn_->describe_data_path(h->mutable_data_path()); !s.is_ok()) {
    Status why = s.with_context("shard " + std::to_string(shard_));
    settle(why);
    return conn_->close(why);
  }
  conn_->send_control(hello);
}

void ShardLink::on_welcome(const wire::Welcome& w) {
  const std::string who = "reducer " + address_.to_string();
  if (settled_) {
    return conn_->close(Status(ErrorCode::kProtocol, who + " sent a second welcome"));
  }
  Status bad;
  const uint32_t group_count = std::max<uint32_t>(w.group_count(), 1);
  if (w.shard_count() != settings_.shard_count || w.shard() != shard_ ||
      group_count != settings_.options.groups || w.group() != settings_.group) {
    bad = Status(
        ErrorCode::kInvalidArgument,
        who + " is shard " + std::to_string(w.shard()) + " of " + std::to_string(w.shard_count()) +
            " in group " + std::to_string(w.group()) + " of " + std::to_string(group_count) +
            ", but TALLY_POOL lists it as shard " + std::to_string(shard_) + " of " +
            std::to_string(settings_.shard_count) + " in group " + std::to_string(settings_.group) +
            " of " + std::to_string(settings_.options.groups) +
            " (the pool must list every reducer in shard order, group after group, i.e. in "
            "(group, shard) order, and TALLY_GROUPS must match the pool)");
  } else if (w.max_chunk_bytes() == 0 || w.max_chunk_bytes() > kMaxChunkBytesLimit) {
    bad = Status(ErrorCode::kProtocol, who + " gives a maximum chunk of " +
                                           std::to_string(w.max_chunk_bytes()) + " bytes (1 to " +
                                           std::to_string(kMaxChunkBytesLimit) + " expected)");
  } else if (settings_.options.chunk_bytes > w.max_chunk_bytes()) {
    bad = Status(ErrorCode::kInvalidArgument,
                 "chunk size " + std::to_string(settings_.options.chunk_bytes) + " exceeds " + who +
                     "'s maximum of " + std::to_string(w.max_chunk_bytes()));
  } else if (w.protocol_version() != kProtocolVersion) {
    bad = Status(ErrorCode::kVersionMismatch,
                 who + " speaks protocol version " + std::to_string(w.protocol_version()) +
                     ", this client speaks " + std::to_string(kProtocolVersion));
  } else if (!settings_.options.secret.empty() &&
             (reducer_nonce_.empty() ||
              !auth_mac_matches(w.auth_proof(),
                                auth_mac(settings_.options.secret, AuthRole::kReducer,
                                         worker_nonce_, reducer_nonce_, identity())))) {
    bad = Status(ErrorCode::kUnauthenticated,
                 who +
                     " did not prove it holds the job secret (is it started with the same "
                     "--job-secret-file?)");
  } else if (w.window_chunks() == 0 || w.window_bytes() == 0) {
    bad = Status(ErrorCode::kProtocol, who + " offers an empty window (" +
                                           std::to_string(w.window_chunks()) + " chunks, " +
                                           std::to_string(w.window_bytes()) + " bytes)");
  } else if (Status s = conn_->attach_data_path(w.data_path()); !s.is_ok()) {
    bad = s.with_context(who);
  }
  if (!bad.is_ok()) {
    fatal_ = bad;  // what on_closed reports (and, while resuming, gives up on)
    settle(bad);
    return conn_->close(bad);
  }
  // Contributions go to the group's S reducers at once: each stream gets
  // its share of this worker's link, and no more than the reducer's share
  // of its own, which W workers send to at once.
  const uint64_t own_share =
      settings_.options.link_rate_bits > 0
          ? paced_share(settings_.options.link_rate_bits, settings_.shard_count)
          : 0;
  if (own_share > 0) {
    conn_->pace(w.rate_bytes() > 0 ? std::min<uint64_t>(own_share, w.rate_bytes()) : own_share);
  }
  // Results come from the group's S reducers at once: unless the reducer
  // paces them within this stream's share of the worker's own link, this
  // stream's share of the worker's receive budget, and no more than the
  // reducer's share of its own, which W workers' results leave through at
  // once.
  const bool results_paced = w.rate_bytes() > 0 && w.rate_bytes() <= own_share;
  if (!results_paced) {
    uint64_t window = receive_share(settings_.options.receive_budget_bytes, settings_.shard_count);
    if (w.result_window_bytes() > 0) {
      window = window == 0 ? w.result_window_bytes() : std::min(window, w.result_window_bytes());
    }
    conn_->bound_receive_window(window);
  }
  window_.open(w.window_chunks(), w.window_bytes());
  max_chunk_bytes = w.max_chunk_bytes();
  link_rate_bits = w.link_rate_bits();
  replica_lost_.reset();
  settle(Status::ok());
}

void ShardLink::settle(const Status& s) {
  if (settled_) return;
  settled_ = true;
  if (phase_ == Phase::kJoining) {
    if (s.is_ok()) {
      phase_ = Phase::kLive;
      closed_ = false;  // a stream that ended mid-handshake was dialled again
    }
    return welcomed_.set_value(s);
  }
  // Resuming: a failed attempt's stream closes next, and on_closed decides.
  if (phase_ != Phase::kResuming || !s.is_ok()) return;
  spdlog::info("job '{}' rank {}: reducer {} (shard {}) is back", settings_.options.job,
               settings_.options.rank, address_.to_string(), shard_);
  phase_ = Phase::kLive;
  closed_ = false;
  lost_.reset();
  rejoining_ = false;
  owner_.on_link_resumed(shard_);
}

void ShardLink::on_data(const FrameHeader& h, std::span<std::byte>) { owner_.on_result(*this, h); }

}  // namespace tally
