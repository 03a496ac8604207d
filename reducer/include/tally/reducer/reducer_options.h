// What a reducer is configured with (tally-reducer's flags, main.cc): its
// place in the pool, its memory, its windows and limits, its transports
// and secrets. In a header of its own, so that the parts of the reducer
// below the daemon (sessions, the job table, replicas, metrics) read their
// settings without knowing the daemon.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "tally/protocol/address.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/transport.h"

namespace tally {

struct ReducerOptions {
  HostPort listen{"127.0.0.1", 7070};
  uint32_t shard = 0;
  uint32_t shard_count = 1;
  // Replica groups: this reducer serves group `group` of `group_count`.
  uint32_t group = 0;
  uint32_t group_count = 1;
  // With more than one group: the whole pool, "host:port,..." in (group,
  // shard) order (the same list workers get as TALLY_POOL), from which the
  // reducer takes the other replicas of its shard; or "@PATH", a file
  // holding that list, read when the replicas are first dialled (for
  // launchers that learn the ports only after start-up).
  std::string pool;
  size_t io_threads = 2;
  // All chunk memory, mapped at start-up and never grown.
  size_t memory_budget_bytes = 512u << 20;
  // Largest chunk accepted; the size of each buffer in the pool.
  size_t max_chunk_bytes = 4u << 20;
  // Chunks a worker may have in flight per stream; each job reserves this
  // many buffers plus two (job.h explains why that cannot deadlock).
  uint32_t window_chunks = 8;
  // Bytes of contributions all workers of a job together may have sent to
  // this reducer without their results (incast control); each worker stream
  // gets an equal share in its Welcome. docs/architecture.md says why 16 MiB.
  size_t ingress_window_bytes = 16u << 20;
  // The rate of this reducer's link, in bits per second (0: unknown). Each
  // worker stream is paced to an equal share of it, so that the results
  // sent to a job's workers at once stay within the link
  // (docs/architecture.md, "Pacing to the link"). --link-rate.
  uint64_t link_rate_bits = 0;
  // Bytes the streams sending to this reducer together may have in flight
  // towards it (0: not bounded): each worker stream of a job, and each
  // inbound replica stream, bounds its receive window to an equal share,
  // and the Welcome offers the same share for the results sent back, so
  // that W > S stays free of incast without a link rate
  // (docs/architecture.md, "The receive budget"). --receive-budget.
  size_t receive_budget_bytes = 512u << 10;
  ConnectionOptions connection;
  // "tcp": data on the TCP streams only. "fabric": also serves workers that
  // ask for the libfabric data path (tcp workers are still served).
  std::string transport = "tcp";
  FabricOptions fabric;
  // Largest world size a job may declare: a Hello is untrusted input, and
  // per-job and per-chunk state grow with it.
  uint32_t max_world_size = 65536;
  // Workers that hold the job secret authenticate with it (challenge-
  // response, docs/protocol.md); with require_auth every job must.
  Secret job_secret;
  // The job secret is a master: each job authenticates with its own secret,
  // derive_job_secret(job_secret, its name) (--per-job-secrets).
  bool per_job_secrets = false;
  bool require_auth = false;
  // Replicas of a shard authenticate their links with the pool secret.
  Secret pool_secret;
  // Protected mode, unless set: without a job secret, worker streams are
  // served from loopback addresses only, and without a pool secret, replica
  // streams too; from elsewhere they are refused with the reason.
  bool insecure_open_pool = false;
  // Open streams (workers, replicas, and streams not yet admitted), so a
  // flood of sockets cannot take every descriptor the reducer has. A new
  // stream past it cuts the oldest one not yet admitted (no hello, or one
  // not yet authenticated or joined), or is closed at once when every open
  // one is admitted.
  size_t max_connections = 4096;
  // Streams from one source address not yet admitted; more from it are
  // closed as they are accepted, so a few hosts cannot hold every slot
  // before authentication.
  size_t max_pending_per_source = 64;
  // A stream that has not sent its hello by then is closed.
  std::chrono::milliseconds hello_timeout{10000};
  // Longest op timeout a worker may ask for.
  std::chrono::milliseconds max_op_timeout{3600 * 1000};
};

}  // namespace tally
