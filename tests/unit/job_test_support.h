// What Job's unit tests share (job_test.cc, job_replicas_test.cc): a member
// that records what the job sends it.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tally.pb.h"
#include "tally/reducer/job.h"

namespace tally::job_testing {

class RecordingMember : public JobMember {
 public:
  RecordingMember(uint32_t rank) : rank_(rank), peer_("test-peer-" + std::to_string(rank)) {}
  uint32_t rank() const override { return rank_; }
  const std::string& peer() const override { return peer_; }
  void send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) override {
    std::lock_guard lock(mu);
    results.push_back(
        {header, std::vector<float>(reinterpret_cast<float*>(slab->data()),
                                    reinterpret_cast<float*>(slab->data()) + header.length / 4)});
  }
  // Released marks apart from the rest: every fresh member of a job is
  // told the first one.
  void send_control(std::shared_ptr<const wire::Control> message) override {
    std::lock_guard lock(mu);
    if (message->has_released()) {
      released.push_back(message->released().op_below());
    } else {
      errors.push_back(*message);
    }
  }
  void wake() override { wakes++; }
  void close(const Status& why) override {
    std::lock_guard lock(mu);
    closed = why;
  }

  struct Result {
    FrameHeader header;
    std::vector<float> values;
  };
  std::mutex mu;
  std::vector<Result> results;
  std::vector<wire::Control> errors;
  std::vector<uint64_t> released;
  int wakes = 0;
  std::optional<Status> closed;

 private:
  uint32_t rank_;
  std::string peer_;
};

}  // namespace tally::job_testing
