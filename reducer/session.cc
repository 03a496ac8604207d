#include "tally/reducer/session.h"

#include <spdlog/spdlog.h>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"
#include "tally/protocol/log_limiter.h"

namespace tally {

void close_with_error(const std::shared_ptr<Connection>& conn, const Status& why) {
  // Weak: the callback sits in the connection's own queue, and a strong
  // reference there would keep it alive forever if the I/O threads stop
  // before the write completes.
  conn->send_control(make_error(why), [weak = std::weak_ptr<Connection>(conn), why](const Status&) {
    if (auto c = weak.lock()) c->close(why);
  });
}

namespace {

// " (and N more since the last such line)" where some went unlogged.
std::string unlogged_note(uint64_t unlogged) {
  return unlogged ? " (and " + std::to_string(unlogged) + " more since the last such line)" : "";
}

}  // namespace

void reject_stream(const std::shared_ptr<Connection>& conn, const Status& why) {
  static LogLimiter limiter;
  if (auto unlogged = limiter.allow()) {
    spdlog::warn("rejecting {}: {}{}", conn->peer(), why.to_string(), unlogged_note(*unlogged));
  }
  close_with_error(conn, why);
}

void warn_worker_reports(const std::string& peer, const Status& reported) {
  static LogLimiter limiter;
  if (auto unlogged = limiter.allow()) {
    spdlog::warn("worker {} reports: {}{}", peer, reported.to_string(), unlogged_note(*unlogged));
  }
}

void warn_closed_before_joining(const std::string& peer, const Status& why) {
  if (why.code() == ErrorCode::kCancelled) return;
  static LogLimiter limiter;
  if (auto unlogged = limiter.allow()) {
    spdlog::warn("connection from {} closed before joining a job: {}{}", peer, why.to_string(),
                 unlogged_note(*unlogged));
  }
}

std::string challenge(const std::shared_ptr<Connection>& conn, const SessionContext& context,
                      std::optional<boost::asio::steady_timer>& timer,
                      std::function<bool()> answered) {
  const auto deadline = context.options.hello_timeout;
  timer.emplace(conn->executor(), deadline);
  timer->async_wait([weak = std::weak_ptr<Connection>(conn), deadline,
                     answered = std::move(answered)](const boost::system::error_code& ec) {
    auto c = weak.lock();
    if (ec || !c || answered()) return;
    reject_stream(
        c, Status(ErrorCode::kTimeout, "no authentication answer from " + c->peer() + " within " +
                                           std::to_string(deadline.count()) + " ms"));
  });
  std::string nonce = make_nonce();
  wire::Control m;
  m.mutable_auth_challenge()->set_nonce(nonce);
  conn->send_control(m);
  return nonce;
}

}  // namespace tally
