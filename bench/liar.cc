#include "liar.h"

#include <optional>

#include "tally.pb.h"
#include "tally/bench/pattern.h"
#include "tally/bench/raw_peer.h"
#include "tally/protocol/control.h"
#include "tally/protocol/frame.h"

namespace tally::bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kLie = uint64_t{1} << 40;
constexpr uint64_t kCount = 1024;  // float32 elements of each op, one chunk

// The next frame from `peer`, or why there is none: "stream closed",
// "timeout" at `deadline`, or "" once `stop` is set (it is looked at every
// 100 ms).
std::optional<RawPeer::Frame> next_frame(RawPeer& peer, Clock::time_point deadline,
                                         const std::atomic<bool>& stop, std::string& why) {
  while (!stop) {
    if (auto frame = peer.read_frame(milliseconds(100))) return frame;
    if (peer.ended()) {
      why = "stream closed";
      return std::nullopt;
    }
    if (Clock::now() >= deadline) {
      why = "timeout";
      return std::nullopt;
    }
  }
  why.clear();
  return std::nullopt;
}

// What a control frame from the reducer means to a rank: nothing (go on
// reading), or why the incarnation ends ("<kind>: <message>"): an error
// ("op <code>", "refused <code>" before the Welcome), or a Rejoin (a
// replica is back after a loss: the job's ops in flight are sent again,
// which these ranks do by starting the job again).
std::optional<std::string> ending(const wire::Control& message, const char* what) {
  if (message.has_rejoin()) return "rejoin: " + message.rejoin().reason();
  if (!message.has_error()) return std::nullopt;
  const Status status = status_from_error(message.error());
  return std::string(what) + " " + std::string(error_code_name(status.code())) + ": " +
         status.message();
}

}  // namespace

Liar::Liar(Options options) : options_(std::move(options)) {
  thread_ = std::thread([this] { run(); });
}

Liar::~Liar() {
  stop_ = true;
  thread_.join();
}

uint64_t Liar::Counts::stalls() const {
  uint64_t n = 0;
  for (const char* kind : {"op timeout", "no result"}) {
    if (auto it = failures.find(kind); it != failures.end()) n += it->second;
  }
  return n;
}

Liar::Counts Liar::counts() const {
  std::lock_guard lock(mu_);
  return counts_;
}

void Liar::run() {
  for (uint64_t n = 0; !stop_; ++n) {
    {
      std::lock_guard lock(mu_);
      counts_.jobs++;
    }
    const std::string why = incarnation(n);
    if (why.empty()) break;
    {
      std::lock_guard lock(mu_);
      counts_.failures[why.substr(0, why.find(':'))]++;
      counts_.example = why;
    }
    // A killed reducer is restarted at once; try again shortly after.
    for (int i = 0; i < 10 && !stop_; ++i) std::this_thread::sleep_for(milliseconds(100));
  }
}

std::string Liar::incarnation(uint64_t n) {
  const std::string job = options_.job_prefix + "-liar-" + std::to_string(n);
  const uint32_t groups[2] = {0, options_.two_groups ? 1u : 0u};
  std::vector<std::unique_ptr<RawPeer>> ranks;
  std::vector<std::string> nonces;
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string& address = r == 0 ? options_.rank0_address : options_.rank1_address;
    try {
      ranks.push_back(std::make_unique<RawPeer>(address));
    } catch (const std::exception& e) {
      return "connect: " + address + ": " + e.what();
    }
    wire::Control hello;
    auto* h = hello.mutable_hello();
    h->set_protocol_version(kProtocolVersion);
    h->set_job(job);
    h->set_rank(r);
    h->set_world_size(2);
    h->set_op_timeout_ms(options_.op_timeout_ms);
    h->set_client_version("tally-bench liar");
    h->set_group(groups[r]);
    if (options_.two_groups) {
      h->add_group_sizes(1);
      h->add_group_sizes(1);
    }
    nonces.push_back(make_nonce());
    h->set_auth_nonce(nonces[r]);
    ranks[r]->send_control(hello);
  }
  // The handshake: the challenge answered, then the Welcome.
  for (uint32_t r = 0; r < 2; ++r) {
    const auto deadline = Clock::now() + milliseconds(10000);
    for (bool welcomed = false; !welcomed;) {
      std::string why;
      auto frame = next_frame(*ranks[r], deadline, stop_, why);
      if (!frame) return why.empty() ? "" : "handshake: " + why;
      auto message = parse_control(std::as_bytes(std::span(frame->payload)));
      if (frame->header.kind != FrameKind::kControl || !message) continue;
      if (auto why = ending(*message, "refused")) return *why;
      if (message->has_auth_challenge()) {
        wire::Control answer;
        answer.mutable_auth_response()->set_mac(
            auth_mac(options_.secret, AuthRole::kWorker, message->auth_challenge().nonce(),
                     nonces[r], auth_identity(job, r, 2, groups[r])));
        ranks[r]->send_control(answer);
      }
      welcomed = message->has_welcome();
    }
  }
  std::vector<float> input(kCount);
  for (uint64_t op = 0; !stop_; ++op) {
    for (uint32_t r = 0; r < 2; ++r) {
      FrameHeader h;
      h.kind = FrameKind::kContribution;
      h.rank = r;
      h.job = job_id(job);
      h.op = op;
      h.count = kCount;
      h.chunks_on_shard = 1;
      h.length = kCount * sizeof(float);
      fill_pattern(input.data(), kCount, r, op);
      ranks[r]->send_frame(h, std::string(reinterpret_cast<const char*>(input.data()), h.length));
    }
    for (uint32_t r = 0; r < 2; ++r) {
      const auto deadline = Clock::now() + milliseconds(options_.op_timeout_ms + 5000);
      for (bool done = false; !done;) {
        std::string why;
        auto frame = next_frame(*ranks[r], deadline, stop_, why);
        if (!frame) {
          if (why == "timeout") why = "no result";
          return why.empty() ? "" : why + ": op " + std::to_string(op);
        }
        if (frame->header.kind == FrameKind::kControl) {
          auto message = parse_control(std::as_bytes(std::span(frame->payload)));
          if (!message) continue;
          if (auto why = ending(*message, "op")) return *why;
          continue;
        }
        if (frame->header.kind != FrameKind::kResult || frame->header.op != op) continue;
        done = true;
        const bool exact = frame->payload.size() == kCount * sizeof(float) &&
                           count_wrong(reinterpret_cast<const float*>(frame->payload.data()),
                                       kCount, 2, RedOp::kSum, op) == 0;
        if (!exact) {
          std::lock_guard lock(mu_);
          counts_.wrong++;
        }
      }
    }
    // The lie: rank 0 has the results below op + 1, and says every rank
    // has those below 2^40.
    wire::Control received;
    received.mutable_received()->set_op_below(op + 1);
    received.mutable_received()->set_released_below(kLie);
    ranks[0]->send_control(received);
    std::lock_guard lock(mu_);
    counts_.ops++;
  }
  return "";
}

}  // namespace tally::bench
