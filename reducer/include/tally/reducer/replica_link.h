// The outbound stream to one other replica of this reducer's shard: dials
// (and redials after a loss), says ReplicaHello with the data path it
// offers (its fabric endpoint with --transport fabric), and is up once the
// replica's ReplicaWelcome names the data path it attached; then it carries
// what this reducer sends that replica. A ReplicaWelcome missing after the
// connect timeout fails the connect like a refused dial.
//
// Lives on one I/O thread; public methods may be called from any thread and
// do not block.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "tally/protocol/status.h"
#include "tally/protocol/tcp_transport.h"
#include "tally/protocol/transport.h"
#include "tally/reducer/reducer_options.h"

namespace tally {

namespace wire {
class ReplicaWelcome;
}

class Replicas;

class ReplicaLink final : public FrameHandler, public std::enable_shared_from_this<ReplicaLink> {
 public:
  ReplicaLink(std::shared_ptr<Replicas> owner, const ReducerOptions& options, uint32_t group,
              boost::asio::io_context& io);

  void start();
  void stop();
  // After the I/O threads are joined: breaks the link <-> connection cycle
  // of a stream whose close never ran (its stop was still queued).
  void drop();
  // Sends at once while up; while the first connection is still being
  // made, queues until `deadline`; after a loss, fails at once.
  void send(std::function<void(Connection&)> send, std::function<void(const Status&)> fail,
            std::chrono::steady_clock::time_point deadline);

  // FrameHandler: a replica sends nothing on our outbound stream but its
  // ReplicaWelcome, heartbeats and, before closing it, an Error.
  PayloadAction on_data_header(const FrameHeader& header) override;
  void on_data(const FrameHeader&, std::span<std::byte>) override {}
  void on_control(const wire::Control& message) override;
  void on_closed(const Status& status) override;

 private:
  struct Queued {
    std::chrono::steady_clock::time_point deadline;
    std::function<void(Connection&)> send;
    std::function<void(const Status&)> fail;
  };

  void dial();
  void schedule_dial();
  void on_connected(Result<boost::asio::ip::tcp::socket> socket);
  void on_welcome(const wire::ReplicaWelcome& welcome);
  void expire_queue();
  void fail_queue(const Status& why);

  std::shared_ptr<Replicas> owner_;
  const ReducerOptions& options_;
  const uint32_t group_;
  boost::asio::io_context& io_;
  boost::asio::steady_timer retry_timer_;
  boost::asio::steady_timer welcome_timer_;  // while a ReplicaHello awaits its ReplicaWelcome
  std::chrono::milliseconds retry_;
  std::shared_ptr<Connection> conn_;
  bool up_ = false;
  bool ever_up_ = false;
  bool stopping_ = false;
  std::optional<Status> fatal_;
  // With a pool secret: this side's nonce (in the ReplicaHello) and the
  // acceptor's (its AuthChallenge), which the ReplicaWelcome's proof covers.
  std::string dialler_nonce_, acceptor_nonce_;
  std::string last_error_;
  std::string address_;  // last dialled
  std::deque<Queued> queue_;
};

}  // namespace tally
