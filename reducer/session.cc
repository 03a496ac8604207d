#include "tally/reducer/session.h"

#include <spdlog/spdlog.h>

#include "tally.pb.h"
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

}  // namespace tally
