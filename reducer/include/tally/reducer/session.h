// What the streams a reducer accepts share: the context every session is
// given, and how a session refuses its peer.
#pragma once

#include <atomic>
#include <boost/asio/steady_timer.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "tally/protocol/status.h"
#include "tally/protocol/transport.h"
#include "tally/reducer/reducer_options.h"

namespace tally {

class JobTable;
class Replicas;

// Given by the daemon to every session it starts; outlives none of them
// (each session holds it).
struct SessionContext {
  ReducerOptions options;
  std::shared_ptr<JobTable> jobs;
  std::shared_ptr<Replicas> replicas;  // null with one group
  // Set once the I/O threads are joined: late callbacks (a slab freed while
  // the contexts are destroyed) must not post to them any more.
  std::atomic<bool> stopped{false};
};

// Sends `why` as a fatal Error, then closes `conn` once that is written, so
// the peer reads why. On the connection's executor.
void close_with_error(const std::shared_ptr<Connection>& conn, const Status& why);
// Logs the refusal (at most once per 10 s, with how many went unlogged:
// LogLimiter), then close_with_error.
void reject_stream(const std::shared_ptr<Connection>& conn, const Status& why);
// Warns of an Error a worker's stream sent (a worker's own failure, or a
// stranger's noise), at most once per 10 s with how many went unlogged.
void warn_worker_reports(const std::string& peer, const Status& reported);
// Warns that a stream closed before its hello joined a job (not when it was
// cancelled), at most once per 10 s with how many went unlogged.
void warn_closed_before_joining(const std::string& peer, const Status& why);

// Challenges a hello that asked to authenticate: sends an AuthChallenge
// with a fresh nonce (returned) and arms `timer` so that the stream is
// rejected unless `answered()` is true once the hello timeout has passed.
std::string challenge(const std::shared_ptr<Connection>& conn, const SessionContext& context,
                      std::optional<boost::asio::steady_timer>& timer,
                      std::function<bool()> answered);

}  // namespace tally
