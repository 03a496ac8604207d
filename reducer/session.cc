#include "tally/reducer/session.h"

#include <spdlog/spdlog.h>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"

namespace tally {

void close_with_error(const std::shared_ptr<Connection>& conn, const Status& why) {
  // Weak: the callback sits in the connection's own queue, and a strong
  // reference there would keep it alive forever if the I/O threads stop
  // before the write completes.
  conn->send_control(make_error(why), [weak = std::weak_ptr<Connection>(conn), why](const Status&) {
    if (auto c = weak.lock()) c->close(why);
  });
}

void reject_stream(const std::shared_ptr<Connection>& conn, const Status& why) {
  spdlog::warn("rejecting {}: {}", conn->peer(), why.to_string());
  close_with_error(conn, why);
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
