// The inbound stream another replica of this reducer's shard dialled (its
// ReplicaLink): it carries that replica's ReplicaJob announcements, partial
// sums and ReplicaError messages. Created by the daemon when a stream's
// first message is a ReplicaHello; the stream counts as up once this side
// has answered with its ReplicaWelcome.
//
// Lives on its connection's executor.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "tally/protocol/transport.h"
#include "tally/reducer/job.h"
#include "tally/reducer/session.h"

namespace tally {

namespace wire {
class ReplicaHello;
class AuthResponse;
}  // namespace wire

class ReplicaSession final : public FrameHandler,
                             public std::enable_shared_from_this<ReplicaSession> {
 public:
  // `admit` is asked once, on the connection's executor, just before the
  // replica's hello is accepted (authenticated where the pool has a
  // secret): false means the stream was cut meanwhile
  // (InboundStream::Admit), and it is not.
  ReplicaSession(std::shared_ptr<SessionContext> context, std::shared_ptr<Connection> conn,
                 std::function<bool()> admit);

  PayloadAction on_data_header(const FrameHeader& header) override;
  void on_data(const FrameHeader& header, std::span<std::byte> payload) override;
  void on_control(const wire::Control& message) override;
  void on_closed(const Status& why) override;

 private:
  void on_hello(const wire::ReplicaHello& hello);
  void on_auth_response(const wire::AuthResponse& response);
  // The hello is accepted (and authenticated where the pool has a secret):
  // attach the data path, welcome the replica, count its stream up.
  void accept(const wire::ReplicaHello& hello);
  // Sends the replica of this stream a ReplicaError.
  void answer(std::shared_ptr<const wire::Control> error);

  const std::shared_ptr<SessionContext> context_;
  const std::function<bool()> admit_;
  const std::shared_ptr<Connection> conn_;
  const std::string peer_;
  std::optional<uint32_t> group_;  // the replica's group, once its hello is accepted
  // Jobs this replica announced, by id. Weak: a job that ends here must
  // give its memory back even while the replica's stream stays up.
  struct AnnouncedJob {
    std::string name;
    std::weak_ptr<Job> job;
  };
  std::unordered_map<uint64_t, AnnouncedJob> jobs_;
  std::shared_ptr<Job> partial_job_;  // the job of the partial being read
  PendingPartial partial_;
  // With a pool secret, between the ReplicaHello and its AuthResponse.
  std::unique_ptr<wire::ReplicaHello> pending_hello_;
  std::string dialler_nonce_, acceptor_nonce_;
  std::optional<boost::asio::steady_timer> auth_timer_;
};

}  // namespace tally
