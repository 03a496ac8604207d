// Streams a reducer accepted, before and after their hello, and the
// admission of new ones. An InboundStream belongs to no session until its
// first Hello or ReplicaHello (protected mode may refuse it then); a
// stream that has not said hello within the hello timeout is closed.
// StreamAdmission decides whether a newly accepted stream may stay:
// within --max-pending-per-source streams not yet admitted per source
// address, and within --max-connections, cutting the oldest stream not yet
// admitted when at the limit (docs/protocol.md, "Limits").
#pragma once

#include <atomic>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "tally/protocol/log_limiter.h"
#include "tally/protocol/status.h"
#include "tally/protocol/transport.h"
#include "tally/reducer/reducer_counters.h"
#include "tally/reducer/reducer_options.h"

namespace tally {

namespace wire {
class Control;
}

// A stream this reducer accepted. Until its first message it belongs to no
// one: a stream that has not said hello within the hello timeout is closed
// (heartbeats alone do not keep it). Its first Hello or ReplicaHello hands
// it to the session that serves it, to which every later callback goes.
// Lives on its connection's executor; close() and cut() may be called from
// any thread.
class InboundStream final : public FrameHandler,
                            public std::enable_shared_from_this<InboundStream> {
 public:
  // Asked by the stream's session, once, on the connection's executor,
  // just before it joins a job or replica link (after authenticating where
  // it must): whether it may. False when the stream was cut to make room
  // meanwhile; the session then does nothing, and the cut closes it. Asking
  // under the admission's lock is what keeps a cut from landing on a stream
  // that has joined.
  using Admit = std::function<bool()>;
  // Makes the session for a stream whose first message is `first`.
  using Route = std::function<std::shared_ptr<FrameHandler>(
      const wire::Control& first, std::shared_ptr<Connection> conn, Admit admit)>;
  // Whether `stream` may be admitted (see Admit).
  using AdmitStream = std::function<bool(const std::shared_ptr<InboundStream>&)>;
  // Called once, when the stream closes.
  using Event = std::function<void(const std::shared_ptr<InboundStream>&)>;

  // What protected mode refuses a stream from its address (ReducerOptions::
  // insecure_open_pool): workers for want of a job secret, replicas for want
  // of a pool secret.
  struct Refused {
    bool workers = false;
    bool replicas = false;
  };

  InboundStream(std::shared_ptr<Connection> conn, std::string source, Refused refused,
                std::chrono::milliseconds hello_timeout, std::shared_ptr<ReducerCounters> counters,
                Route route, AdmitStream admit, Event closed);

  // The peer's address, which its streams not yet admitted are counted by.
  const std::string source;
  // Kept by StreamAdmission under its owner's lock: the stream is not
  // admitted yet (no hello, or a hello not yet authenticated or joined),
  // and it was cut to make room for a newer one.
  bool pending = true;
  bool evicted = false;

  // Starts reading, and the hello deadline.
  void start();
  // Tells the peer why, then closes once that is written.
  void close(const Status& why);
  // Closes without a word: a worker cut before its Welcome dials again, as
  // after a reducer that died mid-handshake.
  void cut(const Status& why);

  PayloadAction on_data_header(const FrameHeader& h) override;
  void on_data(const FrameHeader& h, std::span<std::byte> payload) override;
  void on_control(const wire::Control& message) override;
  void on_closed(const Status& why) override;

 private:
  const Refused refused_;
  const std::shared_ptr<Connection> conn_;
  const std::chrono::milliseconds hello_timeout_;
  const std::shared_ptr<ReducerCounters> counters_;
  const Route route_;
  const AdmitStream admit_;
  const Event closed_;
  std::optional<boost::asio::steady_timer> hello_timer_;
  std::shared_ptr<FrameHandler> session_;
  std::atomic<int64_t>* kind_ = nullptr;  // counts this stream while routed
  bool paused_ = false;                   // counted in streams_paused
};

// Which accepted streams may stay open. Plain bookkeeping with no lock of
// its own: the reducer calls it under the lock that guards its streams.
class StreamAdmission {
 public:
  // Its limits are `options`' (max_connections, max_pending_per_source),
  // read as each stream arrives; `options` outlives it.
  explicit StreamAdmission(const ReducerOptions& options) : options_(options) {}

  // Whether a new stream from `source` may be open beside the `open` ones:
  // within its source's share of streams not yet admitted, and within
  // --max-connections, cutting the oldest stream not yet admitted when at
  // the limit. Logs each refusal and cut, at most once per 10 s per kind.
  bool make_room(const std::string& source, size_t open);
  // `stream` was let in (after make_room said so): it is not admitted yet.
  void opened(const std::shared_ptr<InboundStream>& stream);
  // Whether `stream` may join a job or a replica link: false when it was
  // cut to make room. Once admitted it is never cut.
  bool admit(InboundStream& stream);
  // `stream`, one of the open ones, closed.
  void closed(InboundStream& stream);

 private:
  // `stream` is no longer waiting to be admitted (it was, or it closed).
  void settle(InboundStream& stream);

  const ReducerOptions& options_;
  // Streams not yet admitted: in accept order (entries admitted, closed or
  // cut are dropped as they reach the front), and counted by source address.
  std::deque<std::weak_ptr<InboundStream>> pending_order_;
  std::unordered_map<std::string, size_t> pending_by_source_;
  size_t evicting_ = 0;  // cut to make room, not closed yet
  LogLimiter refusals_logged_{LogLimiter::kEvery, 1};
  LogLimiter source_refusals_logged_{LogLimiter::kEvery, 1};
  LogLimiter evictions_logged_{LogLimiter::kEvery, 1};
};

}  // namespace tally
