// One worker's stream on a reducer: its Hello (the job it joins), then its
// contributions in and the finished chunks out. Created by the daemon when a
// stream's first message is a Hello.
//
// Lives on its connection's executor; the JobMember methods may be called
// from any I/O thread and only post to it.
#pragma once

#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "tally/protocol/transport.h"
#include "tally/reducer/job.h"
#include "tally/reducer/session.h"

namespace tally {

namespace wire {
class Hello;
class AuthResponse;
}  // namespace wire

class WorkerSession final : public FrameHandler,
                            public JobMember,
                            public std::enable_shared_from_this<WorkerSession> {
 public:
  // `admit` is asked once, on the connection's executor, just before the
  // stream joins its job (authenticated where it must be): false means the
  // stream was cut meanwhile (InboundStream::Admit), and it joins nothing.
  WorkerSession(std::shared_ptr<SessionContext> context, std::shared_ptr<Connection> conn,
                std::function<bool()> admit);

  // JobMember
  uint32_t rank() const override { return rank_; }
  const std::string& peer() const override { return peer_; }
  void send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) override;
  void send_control(std::shared_ptr<const wire::Control> message) override;
  void wake() override;
  void close(const Status& why) override;

  // FrameHandler
  PayloadAction on_data_header(const FrameHeader& header) override;
  void on_data(const FrameHeader& header, std::span<std::byte> payload) override;
  void on_control(const wire::Control& message) override;
  void on_closed(const Status& why) override;

 private:
  void on_hello(const wire::Hello& hello);
  void on_auth_response(const wire::AuthResponse& response);
  // Joins the job and sends the Welcome (with the reducer's proof when the
  // worker authenticated).
  void admit(const wire::Hello& hello, bool authenticated);
  // admit()'s join, on the connection's executor. A refusal for state this
  // stream may be outliving (the rank is still connected, or the job has
  // failed and not every rank has left yet) is tried again every
  // kStaleStateRetry until `deadline`: a worker that reconnects after a
  // hang or a lost stream usually gets here before the reducer has read its
  // old streams' ends (docs/protocol.md, "Reconnecting").
  void join(std::shared_ptr<const wire::Hello> hello, bool authenticated,
            std::chrono::steady_clock::time_point deadline);
  // What a worker's MAC covers besides the nonces: who it says it is.
  static std::string identity(const wire::Hello& hello);
  // The secret job `job`'s workers authenticate with: the job secret, or
  // with per_job_secrets the job's own, derived from it.
  Secret job_secret(std::string_view job) const;

  const std::shared_ptr<SessionContext> context_;
  const std::function<bool()> admit_;
  const std::shared_ptr<Connection> conn_;
  const std::string peer_;
  std::shared_ptr<Job> job_;
  uint32_t rank_ = 0;
  bool said_goodbye_ = false;
  std::string goodbye_reason_;
  std::optional<std::pair<uint64_t, uint32_t>> last_key_;  // last contribution accepted
  // Ops whose Error this stream was sent (the latest few: a stream's
  // contributions come in op order, so a failed op's repeats are recent).
  static constexpr size_t kOpErrorsRemembered = 64;
  std::deque<uint64_t> op_errors_sent_;
  // Between an authenticating Hello and its AuthResponse: the Hello, both
  // nonces, and the deadline for the answer (the hello timeout).
  std::unique_ptr<wire::Hello> pending_hello_;
  std::string worker_nonce_, reducer_nonce_;
  std::optional<boost::asio::steady_timer> auth_timer_;
  // Set while (and after) join() waits to try again; a second Hello then is
  // refused like any second Hello.
  std::optional<boost::asio::steady_timer> join_timer_;
  bool closed_ = false;  // on_closed has run: a pending join() does nothing
  PendingContribution pending_;
};

}  // namespace tally
