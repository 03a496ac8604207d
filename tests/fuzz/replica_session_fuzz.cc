// Fuzzes a live reducer's replica streams: ReplicaSession (ReplicaHello,
// the pool-secret challenge, ReplicaJob, ReplicaError, partials) and the
// job table and job code they reach, on group 0 of a real two-group pool
// of this process, over a real loopback TCP stream that claims to be
// group 1 (the real group 1 stays linked beside it).
//
// Input: one mode byte, then the bytes the peer sends.
//   mode & 3: what the harness sends first: 0 nothing; 1 a ReplicaHello,
//             authenticated (the harness answers the challenge with the
//             pool secret); 2 the same, then a ReplicaJob of job "fuzz-r"
//             (world 2, one worker per group, 50 ms op timeout), so
//             partials of it are accepted; 3 a ReplicaHello whose challenge
//             the harness leaves unanswered (the bytes may answer it).
//   mode & 4: the bytes are the payload of one control frame the harness
//             frames, rather than raw frames.
// The harness then half-closes and requires the reducer to close the
// stream before kStreamDeadline.
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "live_reducer.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"
#include "tally/reducer/replica_mesh.h"

namespace {

using namespace tally;
using namespace tally::fuzz;

bool send_prefix(Stream& stream, uint8_t mode, std::chrono::steady_clock::time_point deadline) {
  if ((mode & 3) == 0) return true;
  wire::Control m;
  auto* h = m.mutable_replica_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_shard(0);
  h->set_shard_count(1);
  h->set_group(1);
  h->set_group_count(2);
  const std::string dialler_nonce = make_nonce();
  h->set_auth_nonce(dialler_nonce);
  if (!stream.write(control_frame(m), deadline)) return false;
  if ((mode & 3) == 3) return true;
  auto challenge = stream.read_control(deadline);
  if (!challenge || !challenge->has_auth_challenge()) return false;
  wire::Control answer;
  answer.mutable_auth_response()->set_mac(auth_mac(
      pool_secret(), AuthRole::kReplicaDialler, challenge->auth_challenge().nonce(), dialler_nonce,
      replica_identity(/*shard=*/0, /*shard_count=*/1, /*from_group=*/1, /*to_group=*/0,
                       /*group_count=*/2)));
  if (!stream.write(control_frame(answer), deadline)) return false;
  if ((mode & 3) == 1) return true;
  wire::Control job;
  auto* rj = job.mutable_replica_job();
  rj->set_job("fuzz-r");
  rj->set_world_size(2);
  rj->add_group_sizes(1);
  rj->add_group_sizes(1);
  rj->set_op_timeout_ms(50);
  return stream.write(control_frame(job), deadline);
}

}  // namespace

// The reducers start before the first input, so that nothing they
// allocate for good is counted against an input (libFuzzer's leak check).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  route_protobuf_logs();
  replica_reducer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const HostPort address = replica_reducer();
  run_live_input(address, data, size, &send_prefix);
  return 0;
}
