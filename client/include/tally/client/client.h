// libtally: the worker side of a tally reduction server.
//
//   auto options = tally::client_options_from_env();   // TALLY_POOL, TALLY_JOB, ...
//   auto client = tally::Client::connect(*options);
//   tally::Status s = (*client)->allreduce(grads.data(), grads.size(),
//                                          tally::DType::kFloat32, tally::RedOp::kAverage);
//
// Every worker of a job issues the same ops in the same order (as with NCCL
// and MPI collectives). An op either ends with the same complete result on
// every worker or fails on every worker with an error naming the cause.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tally/protocol/dtype.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/status.h"

namespace tally {

struct ClientOptions {
  // Reducer addresses ("host:port") in (group, shard) order: the S reducers
  // of group 0, then those of group 1, ...
  std::vector<std::string> pool;
  // Replica groups in the pool; pool.size() must be a multiple of it.
  uint32_t groups = 1;
  // This worker's group. Unset: the contiguous block default_group_of()
  // (tally/protocol/groups.h) gives. Set (TALLY_GROUP), it needs group_sizes too.
  std::optional<uint32_t> group;
  // Workers per group, the same list on every rank; only with `group`.
  std::vector<uint32_t> group_sizes;
  std::string job;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // Tensors are cut into chunks of this size (rounded down to whole
  // elements) and striped over the shards; at most the reducers' maximum.
  size_t chunk_bytes = 1u << 20;
  // Reducers fail an op whose contributions are not all in by then.
  std::chrono::milliseconds op_timeout{60000};
  // How long connect() keeps trying to reach every reducer.
  std::chrono::milliseconds connect_timeout{30000};
  std::chrono::milliseconds heartbeat_interval{1000};
  // A reducer stream silent this long is dead.
  std::chrono::milliseconds peer_timeout{10000};
  // Data path: "tcp" (data frames on the TCP streams) or "fabric"
  // (libfabric tagged messages; control stays on TCP). The pool must serve it.
  std::string transport = "tcp";
  FabricOptions fabric;
};

// Reads TALLY_POOL (comma-separated), TALLY_JOB, TALLY_RANK,
// TALLY_WORLD_SIZE, and optionally TALLY_GROUPS, TALLY_GROUP,
// TALLY_GROUP_SIZES, TALLY_CHUNK_BYTES, TALLY_OP_TIMEOUT_MS,
// TALLY_CONNECT_TIMEOUT_MS, TALLY_HEARTBEAT_MS, TALLY_PEER_TIMEOUT_MS,
// TALLY_TRANSPORT, TALLY_FABRIC_PROVIDER (else FI_PROVIDER),
// TALLY_FABRIC_FORCE_REGISTRATION, TALLY_FABRIC_MAX_MSG_BYTES
// (docs/configuration.md). Errors: kInvalidArgument naming the variable.
Result<ClientOptions> client_options_from_env();
// Checks the options; the same checks connect() applies.
Status validate(const ClientOptions& options);

class Client {
 public:
  // Connects to every reducer of the pool and joins the job. Blocks up to
  // options.connect_timeout. Errors: kInvalidArgument, kUnavailable,
  // kTimeout, or the reducer's refusal (kVersionMismatch, kAlreadyExists,
  // kMismatch, kResourceExhausted).
  static Result<std::unique_ptr<Client>> connect(const ClientOptions& options);
  // Closes the streams and joins the I/O thread.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // In-place all-reduce of `count` elements at `data`. Blocks until every
  // worker's contribution is summed and the result is in `data`, or until
  // the op fails (kMismatch, kPeerLost, kTimeout, kProtocol, kUnimplemented;
  // the message names the ranks or reducer involved). On failure `data`
  // holds a mix of input and result, and is no longer touched by tally.
  // Thread-safe, but ops are numbered in call order, which must match on
  // every worker. Once a reducer stream is lost every later op fails too.
  Status allreduce(void* data, size_t count, DType dtype, RedOp op);

  template <typename T>
  Status allreduce(std::span<T> data, DType dtype, RedOp op) {
    return allreduce(data.data(), data.size(), dtype, op);
  }

  uint32_t rank() const;
  uint32_t world_size() const;
  uint32_t shards() const;
  uint32_t groups() const;
  uint32_t group() const;

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tally
