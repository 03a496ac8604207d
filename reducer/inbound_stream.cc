#include "tally/reducer/inbound_stream.h"

#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/reducer/session.h"

namespace tally {
namespace asio = boost::asio;

InboundStream::InboundStream(std::shared_ptr<Connection> conn, std::string source, Refused refused,
                             std::chrono::milliseconds hello_timeout,
                             std::shared_ptr<ReducerCounters> counters, Route route,
                             AdmitStream admit, Event closed)
    : source(std::move(source)),
      refused_(refused),
      conn_(std::move(conn)),
      hello_timeout_(hello_timeout),
      counters_(std::move(counters)),
      route_(std::move(route)),
      admit_(std::move(admit)),
      closed_(std::move(closed)) {}

void InboundStream::start() {
  conn_->start(shared_from_this());
  hello_timer_.emplace(conn_->executor(), hello_timeout_);
  hello_timer_->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->session_) return;
    reject_stream(self->conn_, Status(ErrorCode::kTimeout,
                                      "no hello from " + self->conn_->peer() + " within " +
                                          std::to_string(self->hello_timeout_.count()) + " ms"));
  });
}

void InboundStream::close(const Status& why) {
  asio::post(conn_->executor(),
             [self = shared_from_this(), why] { close_with_error(self->conn_, why); });
}

void InboundStream::cut(const Status& why) {
  asio::post(conn_->executor(), [self = shared_from_this(), why] { self->conn_->close(why); });
}

PayloadAction InboundStream::on_data_header(const FrameHeader& h) {
  if (session_) {
    PayloadAction action = session_->on_data_header(h);
    // A paused stream is offered the same header again after resume().
    const bool paused = action.kind == PayloadAction::Kind::kPause;
    if (paused != paused_) {
      paused_ = paused;
      counters_->add(Level::kStreamsPaused, paused ? 1 : -1);
      if (paused) counters_->add(Count::kStreamPauses);
    }
    return action;
  }
  return PayloadAction::close(
      Status(ErrorCode::kProtocol, "data frame from " + conn_->peer() + " before its hello"));
}
void InboundStream::on_data(const FrameHeader& h, std::span<std::byte> payload) {
  if (session_) session_->on_data(h, payload);
}
void InboundStream::on_control(const wire::Control& message) {
  if (!session_ && (message.has_hello() || message.has_replica_hello())) {
    const bool replica = message.has_replica_hello();
    if (replica ? refused_.replicas : refused_.workers) {
      return reject_stream(
          conn_,
          Status(ErrorCode::kUnauthenticated,
                 std::string(replica ? "replica" : "worker") + " stream from " + conn_->peer() +
                     " refused: this reducer has no " + (replica ? "pool" : "job") +
                     " secret, so it serves loopback addresses only (protected mode); give "
                     "the reducers " +
                     (replica ? "--pool-secret-file"
                              : "--job-secret-file (and the workers "
                                "TALLY_JOB_SECRET_FILE)") +
                     ", or start them with --insecure-open-pool"));
    }
    hello_timer_->cancel();
    session_ = route_(message, conn_, [weak = weak_from_this()] {
      auto self = weak.lock();
      return self && self->admit_(self);
    });
    if (session_) {
      kind_ = &(
          *counters_)[message.has_replica_hello() ? Level::kReplicaStreams : Level::kWorkerStreams];
      kind_->fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (session_) return session_->on_control(message);
  if (message.has_goodbye()) return;  // it leaves before joining anything
  if (message.has_error()) {
    warn_worker_reports(conn_->peer(), status_from_error(message.error()));
    return;
  }
  reject_stream(conn_, Status(ErrorCode::kProtocol,
                              "unexpected control message from worker " + conn_->peer()));
}
void InboundStream::on_closed(const Status& why) {
  if (hello_timer_) hello_timer_->cancel();
  if (kind_) kind_->fetch_sub(1, std::memory_order_relaxed);
  kind_ = nullptr;
  if (paused_) counters_->add(Level::kStreamsPaused, -1);
  paused_ = false;
  if (session_) {
    session_->on_closed(why);
  } else {
    warn_closed_before_joining(conn_->peer(), why);
  }
  closed_(shared_from_this());
}

bool StreamAdmission::make_room(const std::string& source, size_t open) {
  if (auto it = pending_by_source_.find(source);
      it != pending_by_source_.end() && it->second >= options_.max_pending_per_source) {
    if (auto unlogged = source_refusals_logged_.allow()) {
      spdlog::warn(
          "refused {} connection(s) from {}: {} streams from it are not admitted, the "
          "--max-pending-per-source limit",
          *unlogged + 1, source, it->second);
    }
    return false;
  }
  while (!pending_order_.empty()) {
    auto front = pending_order_.front().lock();
    if (front && front->pending && !front->evicted) break;
    pending_order_.pop_front();
  }
  if (open - evicting_ < options_.max_connections) return true;
  if (pending_order_.empty()) {
    if (auto unlogged = refusals_logged_.allow()) {
      spdlog::warn(
          "refused {} connection(s): {} streams open, every one joined, the --max-connections "
          "limit",
          *unlogged + 1, open);
    }
    return false;
  }
  auto oldest = pending_order_.front().lock();
  pending_order_.pop_front();
  oldest->evicted = true;
  ++evicting_;
  if (auto unlogged = evictions_logged_.allow()) {
    spdlog::warn(
        "cut {} stream(s) not yet admitted to make room at the --max-connections limit "
        "({} open), the oldest first",
        *unlogged + 1, open);
  }
  oldest->cut(Status(ErrorCode::kResourceExhausted,
                     "cut: not admitted while the reducer is at its --max-connections limit"));
  return true;
}

bool StreamAdmission::admit(InboundStream& stream) {
  if (stream.evicted) return false;
  settle(stream);
  return true;
}

void StreamAdmission::settle(InboundStream& stream) {
  if (!stream.pending) return;
  stream.pending = false;
  auto it = pending_by_source_.find(stream.source);
  if (it != pending_by_source_.end() && --it->second == 0) pending_by_source_.erase(it);
}

void StreamAdmission::opened(const std::shared_ptr<InboundStream>& stream) {
  ++pending_by_source_[stream->source];
  pending_order_.push_back(stream);
}

void StreamAdmission::closed(InboundStream& stream) {
  settle(stream);
  if (stream.evicted) --evicting_;
}

}  // namespace tally
