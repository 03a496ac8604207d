// Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) from
// the real encoders, so that each target starts from valid frames and
// messages and mutates inward from there:
//   tally-fuzz-seeds tests/fuzz/corpus
// The files are committed; rerun this after a wire change and commit what
// changed (docs/fuzzing.md).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/frame.h"

namespace {

using namespace tally;
namespace fs = std::filesystem;

std::string frame(const FrameHeader& h, const std::string& payload) {
  const EncodedHeader bytes = encode_header(h);
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()) + payload;
}

std::string control(const wire::Control& m) {
  FrameHeader h;
  h.kind = FrameKind::kControl;
  const std::string payload = m.SerializeAsString();
  h.length = payload.size();
  return frame(h, payload);
}

// `count` elements of `dtype`, this frame carrying elements [first, first + n).
FrameHeader data_header(FrameKind kind, const std::string& job, uint32_t rank, uint64_t op,
                        uint32_t chunk, uint32_t chunks, DType dtype, uint64_t count,
                        uint64_t first, uint64_t n) {
  FrameHeader h;
  h.kind = kind;
  h.dtype = dtype;
  h.rank = rank;
  h.job = job_id(job);
  h.op = op;
  h.count = count;
  h.offset = first * dtype_size(dtype);
  h.chunk = chunk;
  h.chunks_on_shard = chunks;
  h.length = n * dtype_size(dtype);
  return h;
}

std::string payload(size_t nbytes) {
  std::string out(nbytes, '\0');
  for (size_t i = 0; i < nbytes; ++i) out[i] = static_cast<char>(i * 7 + 1);
  return out;
}

std::string contribution(const std::string& job, uint64_t op, uint32_t chunk, uint32_t chunks,
                         DType dtype, uint64_t count, uint64_t first, uint64_t n,
                         RedOp redop = RedOp::kSum) {
  FrameHeader h =
      data_header(FrameKind::kContribution, job, 0, op, chunk, chunks, dtype, count, first, n);
  h.redop = redop;
  return frame(h, payload(h.length));
}

wire::Control hello(const std::string& job, uint32_t rank, uint32_t world) {
  wire::Control m;
  auto* h = m.mutable_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_job(job);
  h->set_rank(rank);
  h->set_world_size(world);
  h->set_op_timeout_ms(100);
  h->set_client_version(TALLY_VERSION);
  h->mutable_data_path()->set_transport("tcp");
  return m;
}

wire::Control goodbye(const std::string& reason) {
  wire::Control m;
  m.mutable_goodbye()->set_reason(reason);
  return m;
}

wire::Control error(ErrorCode code, bool with_op) {
  wire::Control m;
  auto* e = m.mutable_error();
  e->set_code(static_cast<wire::ErrorCode>(code));
  e->set_message("op 3 failed: rank 1 disagrees");
  if (with_op) {
    e->set_has_op(true);
    e->set_op(3);
    e->add_ranks(1);
  }
  return m;
}

wire::Control replica_hello(bool nonce) {
  wire::Control m;
  auto* h = m.mutable_replica_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_shard(0);
  h->set_shard_count(1);
  h->set_group(1);
  h->set_group_count(2);
  h->mutable_data_path()->set_transport("tcp");
  if (nonce) h->set_auth_nonce(std::string(32, 'n'));
  return m;
}

wire::Control replica_job(const std::string& job) {
  wire::Control m;
  auto* rj = m.mutable_replica_job();
  rj->set_job(job);
  rj->set_world_size(2);
  rj->add_group_sizes(1);
  rj->add_group_sizes(1);
  rj->set_op_timeout_ms(50);
  return m;
}

wire::Control replica_error(const std::string& job, bool workers_left) {
  wire::Control m;
  auto* re = m.mutable_replica_error();
  re->set_job(job);
  *re->mutable_error() = error(ErrorCode::kPeerLost, !workers_left).error();
  re->set_workers_left(workers_left);
  return m;
}

// Every control message the protocol defines, valid.
std::vector<std::pair<std::string, wire::Control>> every_message() {
  std::vector<std::pair<std::string, wire::Control>> out;
  wire::Control m = hello("job", 1, 4);
  m.mutable_hello()->set_group(1);
  m.mutable_hello()->add_group_sizes(2);
  m.mutable_hello()->add_group_sizes(2);
  m.mutable_hello()->set_auth_nonce(std::string(32, 'w'));
  out.emplace_back("hello", m);
  m.Clear();
  auto* w = m.mutable_welcome();
  w->set_protocol_version(kProtocolVersion);
  w->set_shard(1);
  w->set_shard_count(2);
  w->set_max_chunk_bytes(4u << 20);
  w->set_window_chunks(8);
  w->set_window_bytes(8u << 20);
  w->set_reducer_version(TALLY_VERSION);
  w->set_group_count(1);
  w->mutable_data_path()->set_transport("fabric");
  w->mutable_data_path()->set_provider("tcp;ofi_rxm");
  w->mutable_data_path()->set_address(std::string(16, 'a'));
  w->mutable_data_path()->set_stream_id(7);
  w->mutable_data_path()->set_max_message_bytes(1u << 20);
  w->set_auth_proof(std::string(32, 'p'));
  out.emplace_back("welcome", m);
  m.Clear();
  m.mutable_auth_challenge()->set_nonce(std::string(32, 'r'));
  out.emplace_back("auth_challenge", m);
  m.Clear();
  m.mutable_auth_response()->set_mac(std::string(32, 'm'));
  out.emplace_back("auth_response", m);
  out.emplace_back("error_op", error(ErrorCode::kMismatch, true));
  out.emplace_back("error_fatal", error(ErrorCode::kVersionMismatch, false));
  m.Clear();
  m.mutable_heartbeat()->set_sequence(42);
  out.emplace_back("heartbeat", m);
  out.emplace_back("goodbye", goodbye("client closed"));
  out.emplace_back("replica_hello", replica_hello(true));
  m.Clear();
  m.mutable_replica_welcome()->mutable_data_path()->set_transport("tcp");
  m.mutable_replica_welcome()->set_auth_proof(std::string(32, 'q'));
  out.emplace_back("replica_welcome", m);
  out.emplace_back("replica_job", replica_job("job"));
  out.emplace_back("replica_error_op", replica_error("job", false));
  out.emplace_back("replica_error_left", replica_error("job", true));
  m.Clear();
  m.mutable_received()->set_op_below(7);
  out.emplace_back("received", m);
  m.Clear();
  m.mutable_released()->set_op_below(5);
  out.emplace_back("released", m);
  return out;
}

void write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

// A mode byte (the live targets' first byte), then the bytes.
std::string live(uint8_t mode, const std::string& bytes) {
  return std::string(1, static_cast<char>(mode)) + bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];

  // frame: a header and its payload.
  const fs::path fr = root / "frame";
  for (auto& [name, m] : every_message()) write(fr, "control_" + name, control(m));
  write(fr, "contribution_f32", contribution("job", 0, 0, 1, DType::kFloat32, 16, 0, 16));
  write(fr, "contribution_f16_chunk",
        contribution("job", 5, 1, 3, DType::kFloat16, 100, 40, 30, RedOp::kAverage));
  FrameHeader h =
      data_header(FrameKind::kResult, "job", kReducerRank, 0, 0, 1, DType::kInt64, 8, 0, 8);
  write(fr, "result_i64", frame(h, payload(h.length)));
  h = data_header(FrameKind::kPartial, "job", 2, 1, 0, 1, DType::kBFloat16, 64, 32, 32);
  h.flags = kFrameFlagAccumulators;
  h.length = 32 * 4;  // float32 accumulators of 32 bfloat16 elements
  write(fr, "partial_bf16_accumulators", frame(h, payload(h.length)));
  h = data_header(FrameKind::kReplay, "job", 1, 3, 0, 1, DType::kBFloat16, 64, 0, 32);
  h.flags = kFrameFlagAccumulators;  // float32 results of a bfloat16 op
  h.length = 32 * 4;
  write(fr, "replay_bf16_float32_results", frame(h, payload(h.length)));
  std::string v1 = control(goodbye("x"));
  v1[4] = 1;  // protocol version 1
  write(fr, "version_1", v1);

  // control: one valid payload of each message.
  for (auto& [name, m] : every_message()) write(root / "control", name, m.SerializeAsString());

  // worker_session (mode byte: worker_session_fuzz.cc).
  const fs::path ws = root / "worker_session";
  const std::string bye = control(goodbye("client closed"));
  write(ws, "raw_hello_contribution",
        live(0, control(hello("fuzz-0", 0, 1)) +
                    contribution("fuzz-0", 0, 0, 1, DType::kFloat32, 16, 0, 16) + bye));
  write(ws, "world1_two_ops",
        live(1, contribution("fuzz-1", 0, 0, 1, DType::kFloat32, 16, 0, 16) +
                    contribution("fuzz-1", 1, 0, 2, DType::kBFloat16, 64, 0, 32) +
                    contribution("fuzz-1", 1, 1, 2, DType::kBFloat16, 64, 32, 32) + bye));
  write(ws, "world1_avg_int64",
        live(1, contribution("fuzz-1", 0, 0, 1, DType::kInt64, 4, 0, 4, RedOp::kAverage) +
                    contribution("fuzz-1", 1, 0, 1, DType::kFloat64, 4, 0, 4, RedOp::kAverage)));
  write(ws, "world2_waits",
        live(2, contribution("fuzz-2", 0, 0, 1, DType::kFloat16, 8, 0, 8) + bye));
  // After a reconnect: a replayed result, a contribution to the same chunk
  // from a rank that has none (world 1: the replay alone completes it),
  // then the marks.
  FrameHeader replay =
      data_header(FrameKind::kReplay, "fuzz-1", 0, 4, 0, 1, DType::kFloat32, 16, 0, 16);
  wire::Control mark;
  mark.mutable_received()->set_op_below(5);
  write(ws, "world1_replay_then_received",
        live(1, frame(replay, payload(replay.length)) + control(mark) +
                    contribution("fuzz-1", 5, 0, 1, DType::kFloat32, 16, 0, 16) + bye));
  replay.job = job_id("fuzz-2");
  write(ws, "world2_replay_waits", live(2, frame(replay, payload(replay.length)) + bye));
  write(ws, "auth_contribution",
        live(3, contribution("fuzz-1", 0, 0, 1, DType::kFloat32, 16, 0, 16) + bye));
  write(ws, "auth_error_then_goodbye", live(3, control(error(ErrorCode::kCancelled, false)) + bye));
  wire::Control grouped = hello("fuzz-g", 1, 3);
  grouped.mutable_hello()->add_group_sizes(3);
  grouped.mutable_hello()->set_groups_explicit(true);
  write(ws, "first_hello_grouped", live(4, grouped.SerializeAsString()));
  write(ws, "first_hello", live(4, hello("fuzz-4", 0, 2).SerializeAsString()));
  wire::Control with_nonce = hello("fuzz-4", 0, 1);
  with_nonce.mutable_hello()->set_auth_nonce(std::string(32, 'w'));
  write(ws, "first_hello_nonce", live(4, with_nonce.SerializeAsString()));
  write(ws, "after_hello_goodbye", live(5, goodbye("closed after: timeout").SerializeAsString()));
  write(ws, "after_hello_second_hello", live(5, hello("fuzz-1", 0, 1).SerializeAsString()));
  write(ws, "after_hello_error", live(6, error(ErrorCode::kInternal, true).SerializeAsString()));
  write(ws, "after_auth_auth_response", live(7, every_message()[3].second.SerializeAsString()));

  // replica_session (mode byte: replica_session_fuzz.cc).
  const fs::path rs = root / "replica_session";
  // The butterfly of two groups (butterfly.h): partials of the chunk's
  // halves (reduce-scatter step 0, tag 2; all-gather step 0, tag 34).
  const auto partial = [](uint32_t tag, uint64_t first, uint64_t n) {
    FrameHeader p =
        data_header(FrameKind::kPartial, "fuzz-r", tag, 0, 0, 1, DType::kFloat32, 16, first, n);
    return frame(p, payload(p.length));
  };
  write(rs, "job_partials", live(2, partial(2, 8, 8) + partial(34, 0, 8)));
  write(rs, "job_partial_whole", live(2, partial(2, 0, 16)));
  write(rs, "job_error_left", live(2, control(replica_error("fuzz-r", true))));
  write(rs, "job_error_op", live(2, control(replica_error("fuzz-r", false))));
  write(rs, "hello_then_job", live(1, control(replica_job("fuzz-s")) + partial(2, 0, 8)));
  write(rs, "hello_then_error", live(1, control(error(ErrorCode::kUnavailable, false))));
  write(rs, "raw_hello_unauthenticated", live(0, control(replica_hello(false))));
  write(rs, "unanswered_challenge_wrong_mac", live(3, control(every_message()[3].second)));
  write(rs, "first_replica_hello", live(4, replica_hello(true).SerializeAsString()));
  write(rs, "after_hello_replica_job", live(5, replica_job("fuzz-t").SerializeAsString()));
  write(rs, "after_job_replica_error", live(6, replica_error("fuzz-r", false).SerializeAsString()));
  write(rs, "after_challenge_auth_response",
        live(7, every_message()[3].second.SerializeAsString()));

  // job_rounds: actions (job_rounds_fuzz.cc), each an opcode, a rank and
  // its arguments.
  const fs::path jr = root / "job_rounds";
  std::string ops;
  for (uint8_t op = 0; op < 3; ++op) {
    for (uint8_t r = 0; r < 4; ++r) ops += std::string{0, static_cast<char>(r)};
  }
  std::string deliveries;
  for (int i = 0; i < 12; ++i) deliveries += std::string{3, 0, 0};
  for (uint8_t g = 0; g < 2; ++g) {
    for (int i = 0; i < 3; ++i) deliveries += std::string{6, 0, static_cast<char>(g)};
  }
  std::string marks;
  for (uint8_t r = 0; r < 4; ++r) marks += std::string{7, static_cast<char>(r), 1, 0};
  write(jr, "honest_ops", ops + deliveries + marks + deliveries);
  // The same with reproducible sums (an input of odd length): one more
  // delivery.
  write(jr, "honest_ops_deterministic", ops + deliveries + marks + deliveries + std::string{3});
  // Group 0 hears group 1 is back: a new round; every rank resumes and
  // resends once Released.
  std::string rejoin;
  for (uint8_t r = 0; r < 4; ++r) rejoin += std::string{9, static_cast<char>(r), 1};
  write(jr, "new_round_resume",
        ops + std::string{14, 0, 0} + deliveries + rejoin + deliveries + deliveries + ops +
            deliveries);
  // Lies: a contribution of another op, a mark of 2^40, a forged round and
  // mark, time passing.
  write(jr, "lies",
        ops + std::string{10, 1, 2, 5, 0} + std::string{11, 2, 40, 0, 40, 0} +
            std::string{13, 0, 0, 1, 1, 40, 0} + std::string{13, 3, 1, 20, 0} + deliveries +
            std::string{15, 0, 50} + std::string{12, 3} + ops + deliveries);
  return 0;
}
