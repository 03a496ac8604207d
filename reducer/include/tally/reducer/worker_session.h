// One worker's stream on a reducer: its Hello (the job it joins), then its
// contributions in and the finished chunks out. Created by the daemon when a
// stream's first message is a Hello.
//
// Lives on its connection's executor; the JobMember methods may be called
// from any I/O thread and only post to it.
#pragma once

#include <cstdint>
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
}

class WorkerSession final : public FrameHandler,
                            public JobMember,
                            public std::enable_shared_from_this<WorkerSession> {
 public:
  WorkerSession(std::shared_ptr<SessionContext> context, std::shared_ptr<Connection> conn);

  // JobMember
  uint32_t rank() const override { return rank_; }
  const std::string& peer() const override { return peer_; }
  void send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) override;
  void send_control(std::shared_ptr<const wire::Control> message) override;
  void wake() override;

  // FrameHandler
  PayloadAction on_data_header(const FrameHeader& header) override;
  void on_data(const FrameHeader& header, std::span<std::byte> payload) override;
  void on_control(const wire::Control& message) override;
  void on_closed(const Status& why) override;

 private:
  void on_hello(const wire::Hello& hello);

  const std::shared_ptr<SessionContext> context_;
  const std::shared_ptr<Connection> conn_;
  const std::string peer_;
  std::shared_ptr<Job> job_;
  uint32_t rank_ = 0;
  bool said_goodbye_ = false;
  std::string goodbye_reason_;
  std::optional<std::pair<uint64_t, uint32_t>> last_key_;  // last contribution accepted
  PendingContribution pending_;
};

}  // namespace tally
