// What Job's unit tests and its fuzz target share (job_test.cc,
// job_replicas_test.cc, tests/fuzz/job_rounds_fuzz.cc): a member that
// records what the job sends it, and an in-process mesh that queues what
// one group's Job sends the others until the caller delivers it.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tally.pb.h"
#include "tally/reducer/job.h"
#include "tally/reducer/replica_mesh.h"

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

// A partial (or final) on its way from group `from` to group `to`.
struct QueuedPartial {
  uint32_t from, to;
  FrameHeader header;
  std::shared_ptr<Slab> slab;
  size_t offset;
  ReplicaMesh::SendDone done;
};

// The mesh of group `self`: partials go to `wire` (shared by every
// group's mesh), controls to `controls`.
class QueueMesh : public ReplicaMesh {
 public:
  QueueMesh(std::vector<QueuedPartial>& wire, uint32_t self) : wire_(wire), self_(self) {}
  void send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                    size_t byte_offset, std::chrono::steady_clock::time_point,
                    std::function<bool()>, SendDone done) override {
    std::lock_guard lock(mu_);
    wire_.push_back({self_, group, header, std::move(slab), byte_offset, std::move(done)});
  }
  void send_control(uint32_t group, std::shared_ptr<const wire::Control> message) override {
    std::lock_guard lock(mu_);
    controls.emplace_back(group, *message);
  }
  std::optional<Status> lost(uint32_t) const override { return std::nullopt; }
  std::string describe(uint32_t group) const override {
    return "replica group " + std::to_string(group);
  }

  std::vector<std::pair<uint32_t, wire::Control>> controls;

 private:
  std::mutex mu_;
  std::vector<QueuedPartial>& wire_;
  uint32_t self_;
};

}  // namespace tally::job_testing
