// Fuzzes a live reducer's worker streams: the routing of a stream by its
// first message, WorkerSession (Hello, authentication, contributions,
// Goodbye, Error), the job table's admission and the job's chunk path, as
// a worker's bytes reach them over a real loopback TCP stream.
//
// Input: one mode byte, then the bytes the peer sends.
//   mode & 3: what the harness sends first, so inputs start past the
//             handshake: 0 nothing; 1 a Hello of job "fuzz-1" (world 1:
//             every contribution completes a chunk); 2 a Hello of rank 0 of
//             job "fuzz-2" (world 2: chunks wait for rank 1 until the 50 ms
//             op timeout); 3 an authenticated Hello of job "fuzz-1", the
//             harness answering the reducer's challenge with the job secret.
//   mode & 4: the bytes are the payload of one control frame the harness
//             frames, rather than raw frames (so a mutated message is never
//             lost to a length field that no longer matches).
// The harness then half-closes and requires the reducer to close the
// stream before kStreamDeadline: a stream left open is a finding too.
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "live_reducer.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"

namespace {

using namespace tally;
using namespace tally::fuzz;

wire::Control hello(const std::string& job, uint32_t world, uint32_t op_timeout_ms) {
  wire::Control m;
  auto* h = m.mutable_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_job(job);
  h->set_rank(0);
  h->set_world_size(world);
  h->set_op_timeout_ms(op_timeout_ms);
  return m;
}

// Sends the prefix `mode` names; false if the reducer did not take it.
bool send_prefix(Stream& stream, uint8_t mode, std::chrono::steady_clock::time_point deadline) {
  switch (mode & 3) {
    case 1:
      return stream.write(control_frame(hello("fuzz-1", 1, 1000)), deadline);
    case 2:
      return stream.write(control_frame(hello("fuzz-2", 2, 50)), deadline);
    case 3: {
      wire::Control m = hello("fuzz-1", 1, 1000);
      const std::string worker_nonce = make_nonce();
      m.mutable_hello()->set_auth_nonce(worker_nonce);
      if (!stream.write(control_frame(m), deadline)) return false;
      auto challenge = stream.read_control(deadline);
      if (!challenge || !challenge->has_auth_challenge()) return false;
      // WorkerSession::identity: job NUL rank/world/group.
      const std::string identity = std::string("fuzz-1") + '\0' + "0/1/0";
      wire::Control answer;
      answer.mutable_auth_response()->set_mac(auth_mac(job_secret(), AuthRole::kWorker,
                                                       challenge->auth_challenge().nonce(),
                                                       worker_nonce, identity));
      return stream.write(control_frame(answer), deadline);
    }
    default:
      return true;
  }
}

}  // namespace

// The reducers start before the first input, so that nothing they
// allocate for good is counted against an input (libFuzzer's leak check).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  route_protobuf_logs();
  worker_reducer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const HostPort address = worker_reducer();
  run_live_input(address, data, size, &send_prefix);
  return 0;
}
