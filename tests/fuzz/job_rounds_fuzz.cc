// Fuzzes the state of a job across replica groups, in-process: the Jobs of
// two groups (world 4, ranks 0-1 in group 0 and 2-3 in group 1, one chunk
// of 8 float32 per op), joined by a mesh that queues every partial and
// replica message until the input delivers it, in any order. The input is
// a sequence of actions, each its opcode byte and its argument bytes:
// honest ranks contributing their next op, resuming after a new round as a
// worker does (replaying the results they have from the Released mark on,
// contributing the rest again), saying their Received marks with a
// released_below of any size; and lies: contributions and replays of any
// op with any values, marks of any size, ranks leaving (lost, stalled or
// with a goodbye) and joining, forged replica messages (a round, a mark,
// an error, a departure, a loss, a return), deliveries out of order,
// sweeps far in the future.
//
// An input of odd length runs the job with reproducible sums (the groups
// exchange the sum tree's nodes instead of the butterfly's segments).
//
// Checks, beside ASan and UBSan: every result of an op that no lie touched
// is the exact sum (or average) of the ranks' inputs, on every rank, each
// time it arrives; and once both jobs are evicted and the queues dropped,
// every chunk buffer is back in its quota.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "../unit/job_test_support.h"
#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/reducer/job.h"

namespace {

using namespace tally;
using job_testing::QueuedPartial;
using job_testing::QueueMesh;
using job_testing::RecordingMember;

constexpr uint32_t kWorld = 4;
constexpr uint32_t kGroups = 2;
constexpr uint64_t kCount = 8;
constexpr uint64_t kMaxOps = 24;  // an honest rank's ops per input

uint32_t group_of(uint32_t rank) { return rank < 2 ? 0 : 1; }
RedOp redop_of(uint64_t op) { return op % 2 ? RedOp::kAverage : RedOp::kSum; }

// Small integers: every order of adding them gives the same float32.
float input(uint32_t rank, uint64_t op, uint64_t i) {
  return static_cast<float>((op * 7 + rank * 3 + i) % 17);
}
float expected(uint64_t op, uint64_t i) {
  float sum = 0;
  for (uint32_t r = 0; r < kWorld; ++r) sum += input(r, op, i);
  return redop_of(op) == RedOp::kAverage ? sum / kWorld : sum;
}

// The input's bytes, read one at a time (0 past the end).
struct Bytes {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  bool more() const { return at < size; }
  uint8_t next() { return at < size ? data[at++] : 0; }
  uint64_t big() {  // a number of any size: 2^(next % 64) + next
    const uint8_t shift = next() % 64;
    return (uint64_t{1} << shift) + next();
  }
};

// A rank as its worker sees it: its next op, the results it has, and its
// stream (member) if joined.
struct Rank {
  uint64_t next_op = 0;
  std::map<uint64_t, std::vector<float>> results;
  std::shared_ptr<RecordingMember> member;  // null: not joined
  size_t results_seen = 0;                  // of member->results, taken into `results`
  size_t controls_seen = 0;                 // of member->errors
  bool resuming = false;                    // joined with resume, waiting for its first Released
  bool ever_joined = false;
  // The least op it has no result of: its Received mark.
  uint64_t mark() const {
    uint64_t m = 0;
    while (results.count(m)) ++m;
    return m;
  }
};

class Harness {
 public:
  explicit Harness(bool deterministic) {
    slabs_ = *SlabPool::create(4096, 64);
    // Reproducible sums: a group's 2 ranks and the other group's one node.
    quota_ = *SlabQuota::reserve(slabs_, 2 * std::max(Job::quota_slabs(2, kGroups),
                                                      Job::deterministic_quota_slabs(2, 2, 1)));
    for (uint32_t g = 0; g < kGroups; ++g) {
      JobSettings settings;
      settings.name = "fuzz-rounds";
      settings.world_size = kWorld;
      settings.group = g;
      settings.group_sizes = {2, 2};
      settings.op_timeout = std::chrono::milliseconds(1000);
      settings.deterministic = deterministic;
      meshes_.push_back(std::make_shared<QueueMesh>(wire_, g));
      jobs_.push_back(std::make_shared<Job>(settings, quota_, counters_, meshes_.back()));
    }
  }

  void run(Bytes in) {
    for (uint32_t r = 0; r < kWorld; ++r) join(r, Arrival::kFresh);
    while (in.more()) {
      step(in);
      observe();
    }
    finish();
  }

 private:
  FrameHeader header(uint32_t r, uint64_t op, FrameKind kind) const {
    FrameHeader h;
    h.kind = kind;
    h.dtype = DType::kFloat32;
    h.redop = redop_of(op);
    h.rank = r;
    h.job = job_id("fuzz-rounds");
    h.op = op;
    h.count = kCount;
    h.chunks_on_shard = 1;
    h.length = kCount * sizeof(float);
    return h;
  }

  // Sends rank r's frame of `op` with `values`; false if it was not taken
  // (paused, or its stream closed).
  bool send(uint32_t r, uint64_t op, FrameKind kind, const std::vector<float>& values) {
    Rank& rank = ranks_[r];
    if (!rank.member) return false;
    const FrameHeader h = header(r, op, kind);
    PendingContribution pending;
    Job& job = *jobs_[group_of(r)];
    const PayloadAction action = job.on_contribution_header(rank.member, h, pending);
    if (action.kind == PayloadAction::Kind::kClose) {
      job.leave(rank.member.get(), action.error, Departure::kLost);
      rank.member = nullptr;
      return false;
    }
    if (action.kind == PayloadAction::Kind::kPause) return false;
    if (action.kind == PayloadAction::Kind::kReceive) {
      std::memcpy(action.dst.data(), values.data(), std::min(action.dst.size(), h.length));
      job.on_contribution_payload(h, pending);
    }
    return true;
  }
  std::vector<float> inputs(uint32_t r, uint64_t op) const {
    std::vector<float> v(kCount);
    for (uint64_t i = 0; i < kCount; ++i) v[i] = input(r, op, i);
    return v;
  }

  void join(uint32_t r, Arrival arrival) {
    Rank& rank = ranks_[r];
    if (rank.member) return;
    auto member = std::make_shared<RecordingMember>(r);
    if (!jobs_[group_of(r)]->join(member, arrival).is_ok()) return;
    members_.push_back(member);
    rank.member = member;
    rank.results_seen = rank.controls_seen = 0;
    rank.resuming = arrival == Arrival::kResuming;
    if (arrival == Arrival::kFresh && rank.ever_joined) {
      // A new client in a running job: its op numbers start again.
      all_tainted_ = true;
      rank.next_op = 0;
      rank.results.clear();
    }
    rank.ever_joined = true;
  }

  // What the members were sent: results taken into their ranks, a Rejoin
  // ends the stream, the first Released of a resumed stream resends.
  void observe() {
    for (uint32_t r = 0; r < kWorld; ++r) {
      Rank& rank = ranks_[r];
      if (!rank.member) continue;
      std::shared_ptr<RecordingMember> m = rank.member;
      std::vector<RecordingMember::Result> results;
      std::vector<wire::Control> controls;
      uint64_t released_below = 0;
      bool released = false;
      {
        std::lock_guard lock(m->mu);
        results.assign(m->results.begin() + rank.results_seen, m->results.end());
        rank.results_seen = m->results.size();
        controls.assign(m->errors.begin() + rank.controls_seen, m->errors.end());
        rank.controls_seen = m->errors.size();
        released = !m->released.empty();
        if (released) released_below = m->released.front();
      }
      for (auto& result : results) rank.results[result.header.op] = result.values;
      for (auto& c : controls) {
        if (c.has_rejoin()) {
          jobs_[group_of(r)]->leave(m.get(), Status(ErrorCode::kCancelled, "rejoin"),
                                    Departure::kGoodbye);
          rank.member = nullptr;
        }
      }
      if (rank.member && rank.resuming && released) {
        rank.resuming = false;
        for (uint64_t op = released_below; op < rank.next_op; ++op) {
          auto it = rank.results.find(op);
          if (it != rank.results.end()) {
            send(r, op, FrameKind::kReplay, it->second);
          } else {
            send(r, op, FrameKind::kContribution, inputs(r, op));
          }
        }
      }
    }
  }

  void step(Bytes& in) {
    const uint8_t op = in.next();
    const uint32_t r = in.next() % kWorld;
    const uint32_t g = r % kGroups;
    Rank& rank = ranks_[r];
    Job& job = *jobs_[group_of(r)];
    switch (op % 16) {
      case 0:
      case 1:
      case 2:  // the honest next op
        if (!rank.resuming && rank.next_op < kMaxOps &&
            send(r, rank.next_op, FrameKind::kContribution, inputs(r, rank.next_op))) {
          rank.next_op++;
        }
        break;
      case 3:
      case 4:
      case 5:  // a partial delivered, any of those queued
        deliver(in.next());
        break;
      case 6:  // a replica message delivered
        deliver_control(in.next());
        break;
      case 7:  // an honest mark, with any released_below
        if (rank.member && !rank.resuming) job.on_received(r, rank.mark(), in.big());
        break;
      case 8:  // the stream ends and the worker resumes on a new one
        if (rank.member) {
          job.leave(rank.member.get(), Status(ErrorCode::kCancelled, "resume"),
                    Departure::kGoodbye);
          rank.member = nullptr;
        }
        join(r, Arrival::kResuming);
        break;
      case 9:  // a rank asked to rejoin comes back
        join(r, in.next() % 8 ? Arrival::kResuming : Arrival::kFresh);
        break;
      case 10: {  // lie: any op, any values, contribution or replay
        const uint64_t lied = in.next() % (kMaxOps + 4);
        std::vector<float> v(kCount, static_cast<float>(in.next()));
        tainted_.insert(lied);
        send(r, lied, in.next() % 2 ? FrameKind::kReplay : FrameKind::kContribution, v);
        break;
      }
      case 11:  // lie: a mark of any size
        all_tainted_ = true;
        job.on_received(r, in.big(), in.big());
        break;
      case 12:  // lost without a goodbye: the job fails for good, or, stalled, waits for it
        if (rank.member) {
          job.leave(rank.member.get(), Status(ErrorCode::kPeerLost, "lost"),
                    in.next() % 2 ? Departure::kStalled : Departure::kLost);
          rank.member = nullptr;
        }
        break;
      case 13:  // forged replica messages
        forge(in, job, 1 - group_of(r));
        break;
      case 14:  // the other replica lost, or back (a new round)
        if (in.next() % 2) {
          job.on_replica_lost(1 - group_of(r), Status(ErrorCode::kPeerLost, "lost"));
        } else {
          job.on_replica_back(1 - group_of(r));
        }
        break;
      case 15:  // time passes
        jobs_[g]->sweep(Job::Clock::now() + std::chrono::milliseconds(100 * in.next()));
        break;
    }
  }

  void forge(Bytes& in, Job& job, uint32_t from) {
    switch (in.next() % 4) {
      case 0: {
        const uint64_t round = job.round() + in.next() % 3;
        const bool with_mark = in.next() % 2;  // a mark of any size: may touch any op
        if (with_mark) all_tainted_ = true;
        job.on_replica_round(from, round, with_mark ? std::optional(in.big()) : std::nullopt);
        break;
      }
      case 1:
        all_tainted_ = true;
        job.on_replica_mark(from, in.big());
        break;
      case 2: {
        wire::Control error =
            make_error(Status(ErrorCode::kInternal, "forged"), in.next() % kMaxOps);
        job.on_replica_error(error.error());
        break;
      }
      case 3:
        job.on_replica_left(from, Status(ErrorCode::kCancelled, "left"));
        break;
    }
  }

  void deliver(uint8_t pick) {
    if (wire_.empty()) return;
    const size_t at = pick % wire_.size();
    QueuedPartial q = std::move(wire_[at]);
    wire_.erase(wire_.begin() + static_cast<std::ptrdiff_t>(at));
    PendingPartial pending;
    Job& to = *jobs_[q.to];
    const PayloadAction action = to.on_partial_header(q.from, q.header, pending, [] {});
    if (action.kind == PayloadAction::Kind::kPause) {
      wire_.push_back(std::move(q));  // offered again later
      return;
    }
    if (action.kind == PayloadAction::Kind::kReceive) {
      std::memcpy(action.dst.data(), q.slab->data() + q.offset, q.header.length);
      to.on_partial_payload(q.header, pending);
    }
    q.done(Status::ok());
  }

  void deliver_control(uint8_t pick) {
    QueueMesh& mesh = *meshes_[pick % kGroups];
    const uint32_t from = pick % kGroups;
    if (mesh.controls.empty()) return;
    auto [to, message] = std::move(mesh.controls.front());
    mesh.controls.erase(mesh.controls.begin());
    Job& job = *jobs_[to];
    if (message.has_replica_job()) {
      const auto& rj = message.replica_job();
      job.on_replica_round(from, rj.round(),
                           rj.has_mark() ? std::optional<uint64_t>(rj.mark()) : std::nullopt);
    } else if (message.has_replica_mark()) {
      job.on_replica_mark(from, message.replica_mark().mark());
    } else if (message.has_replica_error()) {
      job.on_replica_error(message.replica_error().error());
    }
  }

  void finish() {
    for (auto& m : members_) {
      std::lock_guard lock(m->mu);
      for (const auto& result : m->results) {
        const uint64_t op = result.header.op;
        if (all_tainted_ || tainted_.count(op)) continue;
        for (uint64_t i = 0; i < kCount && i < result.values.size(); ++i) {
          if (result.values[i] != expected(op, i)) {
            std::fprintf(stderr, "rank %u op %llu element %llu: %g, not %g\n", m->rank(),
                         static_cast<unsigned long long>(op), static_cast<unsigned long long>(i),
                         result.values[i], expected(op, i));
            std::abort();
          }
        }
      }
    }
    for (auto& job : jobs_) job->evict(Status(ErrorCode::kCancelled, "the input ended"));
    for (auto& q : wire_) q.done(Status(ErrorCode::kCancelled, "dropped"));
    wire_.clear();
    if (quota_->in_use() != 0) {
      std::fprintf(stderr, "%zu chunk buffers still in use after both jobs were evicted\n",
                   quota_->in_use());
      std::abort();
    }
  }

  std::shared_ptr<SlabPool> slabs_;
  std::shared_ptr<SlabQuota> quota_;
  ReducerCounters counters_;
  std::vector<QueuedPartial> wire_;
  std::vector<std::shared_ptr<QueueMesh>> meshes_;
  std::vector<std::shared_ptr<Job>> jobs_;
  Rank ranks_[kWorld];
  std::vector<std::shared_ptr<RecordingMember>> members_;  // every stream, for the checks
  std::set<uint64_t> tainted_;                             // ops a lie touched
  bool all_tainted_ = false;                               // a lie that may touch any op
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  Harness(size % 2 == 1).run(Bytes{data, size});
  return 0;
}
