/* libtally's C API: a stable ABI for FFI (ctypes, cffi, Rust, Go, ...).
 *
 *   tally_options* o;  tally_client* c;
 *   tally_options_from_env(&o);               (or tally_options_create + tally_options_set)
 *   if (tally_client_connect(o, &c) != TALLY_OK) puts(tally_last_error());
 *   tally_allreduce(c, grads, n, TALLY_FLOAT32, TALLY_AVG);
 *
 * Handles are opaque and owned by the caller, who frees each with its
 * *_destroy function. Every function that can fail returns a tally_code;
 * TALLY_OK is 0 and the other codes are the wire's error codes. The message
 * of the calling thread's latest failure is tally_last_error(). No C++ type
 * or exception crosses this header. Blocking calls are marked; every one of
 * them ends by a deadline (the client's backstop, docs/configuration.md).
 *
 * Op numbering: every rank of a job must issue the same ops (same counts,
 * dtypes and reductions) in the same order, as with MPI and NCCL
 * collectives. A call refused for its arguments takes no op number.
 */
#ifndef TALLY_TALLY_H_
#define TALLY_TALLY_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Exported from libtally_c.so; everything else in it is hidden. */
#if defined(__GNUC__)
#define TALLY_API __attribute__((visibility("default")))
#else
#define TALLY_API
#endif

/* The version of this header's API; tally_c_api_version() gives the library's.
 * 2 added tally_options_read_env, tally_options_missing, tally_option_name,
 * tally_client_groups, tally_client_group, tally_default_fuse_bytes, the
 * completion queue and the *_to functions that post to it; 3 added
 * tally_client_stats, tally_op_seconds_bound and tally_stats_op_seconds_quantile. */
#define TALLY_C_API_VERSION 3

typedef enum tally_code {
  TALLY_OK = 0,
  TALLY_INVALID_ARGUMENT = 1,
  TALLY_PROTOCOL = 2,
  TALLY_VERSION_MISMATCH = 3,
  TALLY_TIMEOUT = 4,
  TALLY_PEER_LOST = 5,
  TALLY_MISMATCH = 6,
  TALLY_RESOURCE_EXHAUSTED = 7,
  TALLY_CANCELLED = 8,
  TALLY_UNAVAILABLE = 9,
  TALLY_ALREADY_EXISTS = 10,
  TALLY_UNIMPLEMENTED = 11,
  TALLY_INTERNAL = 12,
  TALLY_UNAUTHENTICATED = 13,
  /* Not an error: the op has not ended yet (tally_op_wait_for, tally_op_test). */
  TALLY_IN_PROGRESS = 100
} tally_code;

typedef enum tally_dtype {
  TALLY_FLOAT32 = 1,
  TALLY_FLOAT64 = 2,
  TALLY_FLOAT16 = 3,  /* summed in float32 by the reducers, rounded once */
  TALLY_BFLOAT16 = 4, /* likewise */
  TALLY_INT32 = 5,
  TALLY_INT64 = 6
} tally_dtype;

typedef enum tally_redop { TALLY_SUM = 1, TALLY_AVG = 2 } tally_redop;

typedef struct tally_options tally_options;
typedef struct tally_client tally_client;
typedef struct tally_op tally_op;
typedef struct tally_queue tally_queue;

/* "0.1.0 (<git sha>)"; static storage. */
TALLY_API const char* tally_version(void);
/* TALLY_C_API_VERSION of the library that is linked. */
TALLY_API int tally_c_api_version(void);
/* "ok", "invalid_argument", "peer_lost", ..., "in_progress"; static storage. */
TALLY_API const char* tally_code_name(tally_code code);
/* The message of this thread's latest failed call ("" if none). Valid until
 * this thread's next call into libtally. */
TALLY_API const char* tally_last_error(void);

/* Options with their defaults (docs/configuration.md). */
TALLY_API tally_code tally_options_create(tally_options** out);
/* Options read from the TALLY_* environment, as the C++ client_options_from_env
 * (with a launcher's RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID where the
 * TALLY_* names are unset); fails if a required one is missing. */
TALLY_API tally_code tally_options_from_env(tally_options** out);
/* Applies to `options` whatever the environment sets, as tally_options_from_env
 * reads it, without requiring anything: for a caller that sets more on top. */
TALLY_API tally_code tally_options_read_env(tally_options* options);
/* Sets the option that environment variable `name` configures ("TALLY_POOL",
 * "TALLY_RANK", ...), parsing `value` as the environment's value. */
TALLY_API tally_code tally_options_set(tally_options* options, const char* name, const char* value);
/* The required options not set yet, as "TALLY_JOB, TALLY_RANK" ("" when none):
 * TALLY_POOL, TALLY_JOB, TALLY_RANK, TALLY_WORLD_SIZE. Valid until the next
 * call on `options`. */
TALLY_API const char* tally_options_missing(tally_options* options);
/* The i-th name tally_options_set takes (in the order the environment
 * applies them), or NULL past the last; static storage. */
TALLY_API const char* tally_option_name(size_t i);
TALLY_API void tally_options_destroy(tally_options* options);

/* Connects to every reducer of the pool and joins the job. Blocks up to the
 * connect timeout. */
TALLY_API tally_code tally_client_connect(const tally_options* options, tally_client** out);
/* Says goodbye and closes. Ops still in flight end with TALLY_CANCELLED
 * (their callbacks run on this thread). Blocks up to about 2 s. */
TALLY_API void tally_client_destroy(tally_client* client);
TALLY_API uint32_t tally_client_rank(const tally_client* client);
TALLY_API uint32_t tally_client_world_size(const tally_client* client);
TALLY_API uint32_t tally_client_shards(const tally_client* client);
TALLY_API uint32_t tally_client_groups(const tally_client* client);
TALLY_API uint32_t tally_client_group(const tally_client* client);
/* The fuse_bytes of tally_allreduce_fused that the C++ API defaults to. */
TALLY_API size_t tally_default_fuse_bytes(void);

/* A client's counters since it connected; each field as tally::ClientStats
 * describes it (tally/client/stats.h). */
#define TALLY_OP_SECONDS_BUCKETS 16
typedef struct tally_stats {
  uint64_t ops_completed;
  uint64_t ops_failed;
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t reconnects;
  uint64_t replays;
  double op_seconds_sum;
  double op_seconds_max;
  /* Ops by time: bucket i up to tally_op_seconds_bound(i) (over the bound
   * before it); the last, over every bound. */
  uint64_t op_seconds_buckets[TALLY_OP_SECONDS_BUCKETS];
} tally_stats;
/* Fills `out`. Thread-safe. */
TALLY_API tally_code tally_client_stats(const tally_client* client, tally_stats* out);
/* The upper bound in seconds of op_seconds_buckets[i], for i below
 * TALLY_OP_SECONDS_BUCKETS - 1; infinity for the last. */
TALLY_API double tally_op_seconds_bound(size_t i);
/* The bound within which a fraction `q` (0 to 1) of the ops ended, from the
 * buckets (tally::ClientStats::op_seconds_quantile); 0 with no op. */
TALLY_API double tally_stats_op_seconds_quantile(const tally_stats* stats, double q);

/* In-place all-reduce of `count` elements at `data`. Blocks until the op ends,
 * doing the client's I/O on the calling thread meanwhile where no other
 * blocking call is (callbacks of async ops in flight may then run on it). */
TALLY_API tally_code tally_allreduce(tally_client* client, void* data, size_t count,
                                     tally_dtype dtype, tally_redop op);

/* Runs once when an async op ends, on the thread doing the client's I/O: its
 * I/O thread or a thread blocked in tally_allreduce(_fused) (or on the calling
 * thread if the call is refused at once). `message` is "" on success and valid
 * during the call only. It must not block. */
typedef void (*tally_callback)(void* user, tally_code code, const char* message);

/* Starts the all-reduce and returns at once with *out, a handle the caller
 * destroys. `callback` may be NULL. The buffer must stay valid until the op
 * ends. A refused call returns its error and still gives a handle that has
 * ended with it. */
TALLY_API tally_code tally_allreduce_async(tally_client* client, void* data, size_t count,
                                           tally_dtype dtype, tally_redop op,
                                           tally_callback callback, void* user, tally_op** out);
/* All-reduces `n` buffers of one dtype, fusing those below `fuse_bytes` into
 * one op per group (C++ Client::allreduce_fused). Blocks as tally_allreduce. */
TALLY_API tally_code tally_allreduce_fused(tally_client* client, void* const* data,
                                           const size_t* counts, size_t n, tally_dtype dtype,
                                           tally_redop op, size_t fuse_bytes);

/* A completion queue: the ends of async ops, for a caller that cannot take a
 * callback on the thread doing libtally's I/O (an interpreter with a global
 * lock would stall that thread while it waits for the lock). An op started with a
 * *_to function posts its tag here when it ends; the caller waits for tags
 * on a thread of its own. Thread-safe. */
TALLY_API tally_code tally_queue_create(tally_queue** out);
/* Waits up to `timeout_ms` for the next tag: TALLY_OK with *tag set,
 * TALLY_IN_PROGRESS when none came in time, TALLY_CANCELLED once the queue is
 * closed and empty. Blocks. */
TALLY_API tally_code tally_queue_next(tally_queue* queue, uint64_t timeout_ms, uint64_t* tag);
/* Wakes every waiter; tags already posted are still returned, then
 * TALLY_CANCELLED. Ops may still post to it. */
TALLY_API void tally_queue_close(tally_queue* queue);
/* Frees the handle; ops still in flight keep the queue alive until they end. */
TALLY_API void tally_queue_destroy(tally_queue* queue);

/* tally_allreduce_async, posting `tag` to `queue` when the op ends (a
 * refused call posts it too). Once the tag is taken, tally_op_test and
 * tally_op_message give the op's end. */
TALLY_API tally_code tally_allreduce_async_to(tally_client* client, void* data, size_t count,
                                              tally_dtype dtype, tally_redop op, tally_queue* queue,
                                              uint64_t tag, tally_op** out);
/* tally_allreduce_fused, started and returning at once, posting `tag` to
 * `queue` when every op of the call has ended. The buffers must stay valid
 * until then. */
TALLY_API tally_code tally_allreduce_fused_async_to(tally_client* client, void* const* data,
                                                    const size_t* counts, size_t n,
                                                    tally_dtype dtype, tally_redop op,
                                                    size_t fuse_bytes, tally_queue* queue,
                                                    uint64_t tag, tally_op** out);

/* Blocks until the op ends; its code. */
TALLY_API tally_code tally_op_wait(tally_op* op);
/* Waits at most `timeout_ms`: the op's code, or TALLY_IN_PROGRESS. */
TALLY_API tally_code tally_op_wait_for(tally_op* op, uint64_t timeout_ms);
/* Never blocks: the op's code, or TALLY_IN_PROGRESS. */
TALLY_API tally_code tally_op_test(tally_op* op);
/* The op's error message once it has ended with an error, else "". Valid
 * until the op is destroyed. */
TALLY_API const char* tally_op_message(tally_op* op);
/* The op's number (the collective sequence number), or UINT64_MAX if it took none. */
TALLY_API uint64_t tally_op_number(const tally_op* op);
/* Frees the handle; does not wait for or cancel the op. */
TALLY_API void tally_op_destroy(tally_op* op);

#ifdef __cplusplus
}
#endif

#endif /* TALLY_TALLY_H_ */
