/* The C API from a C11 program (built with -std=c11 -Wall -Werror): starts a
 * real tally-reducer ($TALLY_REDUCER, --listen 127.0.0.1:0, --ready-file),
 * runs two ranks on two threads, and checks every dtype, both reductions,
 * async handles with callbacks, fused buffers, and the error paths, against
 * closed forms. Prints "N passed, N failed" and exits non-zero on a failure. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tally/tally.h"

extern char** environ;

static int passed = 0;
static int failed = 0;
static pthread_mutex_t count_mu = PTHREAD_MUTEX_INITIALIZER;

/* `cond` is evaluated before the lock: it may block on the other rank. */
#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    int check_ok_ = (cond);                                                    \
    pthread_mutex_lock(&count_mu);                                             \
    if (check_ok_) {                                                           \
      passed++;                                                                \
    } else {                                                                   \
      failed++;                                                                \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
    }                                                                          \
    pthread_mutex_unlock(&count_mu);                                           \
  } while (0)

enum { kWorld = 2, kCount = 1009 };
static char pool_address[128];

/* v(r, i) = (i mod 1021) * 64 + r + 1: sums are exact in every dtype. */
static double value(int rank, size_t i) { return (double)((i % 1021) * 64 + (size_t)rank + 1); }
static double sum_of(size_t i) { return kWorld * (double)((i % 1021) * 64) + 3.0; }

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

struct callback_record {
  pthread_mutex_t mu;
  int calls;
  tally_code code;
};

static void on_done(void* user, tally_code code, const char* message) {
  struct callback_record* r = user;
  (void)message;
  pthread_mutex_lock(&r->mu);
  r->calls++;
  r->code = code;
  pthread_mutex_unlock(&r->mu);
}

static tally_client* connect_rank(int rank, const char* job) {
  tally_options* o = NULL;
  tally_client* c = NULL;
  char rank_text[16];
  snprintf(rank_text, sizeof rank_text, "%d", rank);
  CHECK(tally_options_create(&o) == TALLY_OK, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_POOL", pool_address) == TALLY_OK, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_JOB", job) == TALLY_OK, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_RANK", rank_text) == TALLY_OK, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_WORLD_SIZE", "2") == TALLY_OK, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_CHUNK_BYTES", "1024") == TALLY_OK, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_OP_TIMEOUT_MS", "10000") == TALLY_OK, "%s", tally_last_error());
  tally_code code = tally_client_connect(o, &c);
  CHECK(code == TALLY_OK, "connect rank %d: %s", rank, tally_last_error());
  tally_options_destroy(o);
  return c;
}

#define CHECK_SUMS(type, dtype_value)                                                \
  do {                                                                               \
    type* v = malloc(kCount * sizeof(type));                                         \
    for (int op = TALLY_SUM; op <= TALLY_AVG; ++op) {                                \
      for (size_t i = 0; i < kCount; ++i) v[i] = (type)value(rank, i);               \
      tally_code code = tally_allreduce(c, v, kCount, dtype_value, (tally_redop)op); \
      CHECK(code == TALLY_OK, "%s: %s", #type, tally_last_error());                  \
      size_t wrong = 0;                                                              \
      for (size_t i = 0; i < kCount; ++i) {                                          \
        type expected = (type)sum_of(i);                                             \
        if (op == TALLY_AVG) expected = (type)(expected / (type)kWorld);             \
        wrong += v[i] != expected;                                                   \
      }                                                                              \
      CHECK(wrong == 0, "%s op %d: %zu wrong", #type, op, wrong);                    \
    }                                                                                \
    free(v);                                                                         \
  } while (0)

static void* rank_main(void* arg) {
  int rank = (int)(intptr_t)arg;
  tally_client* c = connect_rank(rank, "c-api");
  if (!c) return NULL;
  CHECK(tally_client_rank(c) == (uint32_t)rank, "rank");
  CHECK(tally_client_world_size(c) == kWorld, "world size");
  CHECK(tally_client_shards(c) == 1, "shards");

  CHECK_SUMS(float, TALLY_FLOAT32);
  CHECK_SUMS(double, TALLY_FLOAT64);
  CHECK_SUMS(int32_t, TALLY_INT32);
  CHECK_SUMS(int64_t, TALLY_INT64);

  /* The counters: every op so far ended well, and each is timed. */
  tally_stats st;
  CHECK(tally_client_stats(c, &st) == TALLY_OK, "%s", tally_last_error());
  CHECK(st.ops_completed > 0 && st.ops_failed == 0, "ops %llu ok, %llu failed",
        (unsigned long long)st.ops_completed, (unsigned long long)st.ops_failed);
  CHECK(st.bytes_sent > 0 && st.bytes_sent == st.bytes_received, "bytes %llu sent, %llu received",
        (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_received);
  uint64_t timed = 0;
  for (int i = 0; i < TALLY_OP_SECONDS_BUCKETS; ++i) timed += st.op_seconds_buckets[i];
  CHECK(timed == st.ops_completed, "%llu ops timed", (unsigned long long)timed);
  CHECK(tally_op_seconds_bound(0) > 0 &&
            tally_op_seconds_bound(TALLY_OP_SECONDS_BUCKETS - 1) > 1e300,
        "bounds");
  double p50 = tally_stats_op_seconds_quantile(&st, 0.5);
  CHECK(p50 > 0 && p50 <= tally_stats_op_seconds_quantile(&st, 0.99), "p50 %g", p50);
  CHECK(tally_client_stats(c, NULL) == TALLY_INVALID_ARGUMENT, "NULL out refused");

  /* Async: two ops in flight, one with a callback. */
  float* a = malloc(kCount * sizeof(float));
  float* b = malloc(kCount * sizeof(float));
  for (size_t i = 0; i < kCount; ++i) a[i] = b[i] = (float)value(rank, i);
  struct callback_record record = {PTHREAD_MUTEX_INITIALIZER, 0, TALLY_INTERNAL};
  tally_op* first = NULL;
  tally_op* second = NULL;
  CHECK(tally_allreduce_async(c, a, kCount, TALLY_FLOAT32, TALLY_SUM, on_done, &record, &first) ==
            TALLY_OK,
        "%s", tally_last_error());
  CHECK(tally_allreduce_async(c, b, kCount, TALLY_FLOAT32, TALLY_SUM, NULL, NULL, &second) ==
            TALLY_OK,
        "%s", tally_last_error());
  CHECK(tally_op_number(second) == tally_op_number(first) + 1, "op numbers in call order");
  CHECK(tally_op_wait(second) == TALLY_OK, "%s", tally_op_message(second));
  CHECK(tally_op_wait_for(first, 10000) == TALLY_OK, "%s", tally_op_message(first));
  CHECK(tally_op_test(first) == TALLY_OK, "test after the end");
  CHECK(strcmp(tally_op_message(first), "") == 0, "no message on success");
  for (int tries = 0; tries < 100; ++tries) { /* the callback runs just after the op ends */
    pthread_mutex_lock(&record.mu);
    int calls = record.calls;
    pthread_mutex_unlock(&record.mu);
    if (calls) break;
    sleep_ms(10);
  }
  CHECK(record.calls == 1 && record.code == TALLY_OK, "callback %d %d", record.calls, record.code);
  size_t wrong = 0;
  for (size_t i = 0; i < kCount; ++i)
    wrong += (a[i] != (float)sum_of(i)) + (b[i] != (float)sum_of(i));
  CHECK(wrong == 0, "async: %zu wrong", wrong);
  tally_op_destroy(first);
  tally_op_destroy(second);

  /* Fused: three small buffers in one op, one large alone. */
  size_t counts[4] = {7, 300, 1, kCount};
  void* data[4] = {a, a + 7, a + 307, b};
  for (size_t i = 0; i < kCount; ++i) a[i] = b[i] = (float)value(rank, i % 500);
  CHECK(tally_allreduce_fused(c, data, counts, 4, TALLY_FLOAT32, TALLY_AVG, 2048) == TALLY_OK, "%s",
        tally_last_error());
  wrong = 0;
  for (size_t i = 0; i < 308; ++i) wrong += a[i] != (float)(sum_of(i % 500) / kWorld);
  for (size_t i = 0; i < kCount; ++i) wrong += b[i] != (float)(sum_of(i % 500) / kWorld);
  CHECK(wrong == 0, "fused: %zu wrong", wrong);

  /* A completion queue: two ops post their tags as they end, a fused call
   * one tag for all of its ops; the op's end is known once its tag is. */
  tally_queue* queue = NULL;
  CHECK(tally_queue_create(&queue) == TALLY_OK, "%s", tally_last_error());
  for (size_t i = 0; i < kCount; ++i) a[i] = b[i] = (float)value(rank, i);
  tally_op* queued[3] = {NULL, NULL, NULL};
  CHECK(tally_allreduce_async_to(c, a, kCount, TALLY_FLOAT32, TALLY_SUM, queue, 7, &queued[0]) ==
            TALLY_OK,
        "%s", tally_last_error());
  CHECK(tally_allreduce_async_to(c, b, kCount, TALLY_FLOAT32, TALLY_AVG, queue, 8, &queued[1]) ==
            TALLY_OK,
        "%s", tally_last_error());
  int32_t small[2][3] = {{rank, rank, rank}, {1, 2, 3}};
  void* small_data[2] = {small[0], small[1]};
  size_t small_counts[2] = {3, 3};
  CHECK(
      tally_allreduce_fused_async_to(c, small_data, small_counts, 2, TALLY_INT32, TALLY_SUM,
                                     tally_default_fuse_bytes(), queue, 9, &queued[2]) == TALLY_OK,
      "%s", tally_last_error());
  int seen = 0;
  for (int n = 0; n < 3; ++n) {
    uint64_t tag = 0;
    CHECK(tally_queue_next(queue, 10000, &tag) == TALLY_OK, "tag %d of 3", n);
    CHECK(tag >= 7 && tag <= 9, "tag %llu", (unsigned long long)tag);
    if (tag >= 7 && tag <= 9) {
      seen |= 1 << (tag - 7);
      CHECK(tally_op_test(queued[tag - 7]) == TALLY_OK, "op of tag %llu ended well",
            (unsigned long long)tag);
    }
  }
  CHECK(seen == 7, "every tag once: %d", seen);
  uint64_t none = 0;
  CHECK(tally_queue_next(queue, 10, &none) == TALLY_IN_PROGRESS, "no fourth tag");
  tally_queue_close(queue);
  CHECK(tally_queue_next(queue, 10000, &none) == TALLY_CANCELLED, "closed and empty");
  wrong = 0;
  for (size_t i = 0; i < kCount; ++i) {
    wrong += (a[i] != (float)sum_of(i)) + (b[i] != (float)(sum_of(i) / kWorld));
  }
  for (int i = 0; i < 3; ++i) wrong += (small[0][i] != 1) + (small[1][i] != 2 * (i + 1));
  CHECK(wrong == 0, "queued ops: %zu wrong", wrong);
  for (int i = 0; i < 3; ++i) tally_op_destroy(queued[i]);
  tally_queue_destroy(queue);
  CHECK(tally_client_groups(c) == 1 && tally_client_group(c) == 0, "one group");

  /* Refused at once: a null buffer; the op number is not used up. */
  tally_op* bad = NULL;
  CHECK(tally_allreduce_async(c, NULL, 4, TALLY_FLOAT32, TALLY_SUM, NULL, NULL, &bad) ==
            TALLY_INVALID_ARGUMENT,
        "null buffer");
  CHECK(strstr(tally_last_error(), "null buffer") != NULL, "%s", tally_last_error());
  CHECK(tally_op_number(bad) == UINT64_MAX, "no op number");
  CHECK(tally_op_wait(bad) == TALLY_INVALID_ARGUMENT, "ended handle");
  tally_op_destroy(bad);
  CHECK(tally_allreduce(c, a, 4, (tally_dtype)99, TALLY_SUM) == TALLY_INVALID_ARGUMENT,
        "bad dtype");

  /* The ranks agree that the sequence still lines up. */
  int32_t one = 1;
  CHECK(tally_allreduce(c, &one, 1, TALLY_INT32, TALLY_SUM) == TALLY_OK && one == kWorld, "%s",
        tally_last_error());
  free(a);
  free(b);
  tally_client_destroy(c);
  return NULL;
}

static void check_errors(void) {
  CHECK(tally_c_api_version() == TALLY_C_API_VERSION, "api version");
  CHECK(strncmp(tally_version(), "0.", 2) == 0, "version %s", tally_version());
  CHECK(strcmp(tally_code_name(TALLY_PEER_LOST), "peer_lost") == 0, "code name");
  CHECK(strcmp(tally_code_name(TALLY_IN_PROGRESS), "in_progress") == 0, "code name");
  tally_options* o = NULL;
  CHECK(tally_options_create(&o) == TALLY_OK, "create");
  CHECK(tally_options_set(o, "TALLY_RANK", "x") == TALLY_INVALID_ARGUMENT, "bad number");
  CHECK(strstr(tally_last_error(), "TALLY_RANK") != NULL, "%s", tally_last_error());
  CHECK(tally_options_set(o, "TALLY_NOPE", "1") == TALLY_INVALID_ARGUMENT, "unknown name");
  CHECK(strcmp(tally_options_missing(o), "TALLY_POOL, TALLY_JOB, TALLY_RANK, TALLY_WORLD_SIZE") ==
            0,
        "missing: %s", tally_options_missing(o));
  /* TALLY_LOG_LEVEL first: it applies to what reading the others logs. */
  CHECK(strcmp(tally_option_name(0), "TALLY_LOG_LEVEL") == 0, "first name %s",
        tally_option_name(0));
  size_t names = 0;
  while (tally_option_name(names)) names++;
  CHECK(names > 10 && tally_option_name(names) == NULL, "%zu names", names);
  /* A pool address where nothing listens: a clear error at connect. */
  tally_options_set(o, "TALLY_POOL", "127.0.0.1:1");
  tally_options_set(o, "TALLY_JOB", "c-api-nobody");
  CHECK(strcmp(tally_options_missing(o), "TALLY_RANK, TALLY_WORLD_SIZE") == 0, "missing: %s",
        tally_options_missing(o));
  tally_options_set(o, "TALLY_CONNECT_TIMEOUT_MS", "300");
  tally_client* c = NULL;
  tally_code code = tally_client_connect(o, &c);
  CHECK(code == TALLY_TIMEOUT || code == TALLY_UNAVAILABLE, "connect: %s", tally_code_name(code));
  CHECK(c == NULL, "no client");
  CHECK(strstr(tally_last_error(), "127.0.0.1:1") != NULL, "%s", tally_last_error());
  tally_options_destroy(o);
  /* From the environment. */
  unsetenv("TALLY_POOL");
  CHECK(tally_options_from_env(&o) == TALLY_INVALID_ARGUMENT, "no TALLY_POOL");
  CHECK(o == NULL && strstr(tally_last_error(), "TALLY_POOL") != NULL, "%s", tally_last_error());
  /* A launcher's RANK and WORLD_SIZE stand in for the unset TALLY_* names. */
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "4", 1);
  CHECK(tally_options_create(&o) == TALLY_OK, "create");
  CHECK(tally_options_read_env(o) == TALLY_OK, "%s", tally_last_error());
  CHECK(strcmp(tally_options_missing(o), "TALLY_POOL, TALLY_JOB") == 0, "missing: %s",
        tally_options_missing(o));
  tally_options_destroy(o);
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
}

int main(void) {
  const char* reducer = getenv("TALLY_REDUCER");
  if (!reducer) {
    fprintf(stderr, "set TALLY_REDUCER to the tally-reducer binary\n");
    return 2;
  }
  check_errors();
  char dir[] = "/tmp/tally-c-api-XXXXXX";
  if (!mkdtemp(dir)) return 2;
  char ready[256];
  snprintf(ready, sizeof ready, "%s/ready", dir);
  char* argv[] = {(char*)reducer,      "--listen", "127.0.0.1:0", "--ready-file", ready,
                  "--max-chunk-bytes", "4096",     "--log-level", "warn",         NULL};
  pid_t pid;
  if (posix_spawn(&pid, reducer, NULL, NULL, argv, environ) != 0) {
    perror("posix_spawn");
    return 2;
  }
  FILE* f = NULL;
  for (int tries = 0; tries < 1500 && !f; ++tries) { /* 15 s */
    f = fopen(ready, "r");
    if (!f) sleep_ms(10);
  }
  if (!f || !fgets(pool_address, sizeof pool_address, f)) {
    fprintf(stderr, "the reducer did not listen within 15 s\n");
    kill(pid, SIGKILL);
    return 2;
  }
  fclose(f);
  pool_address[strcspn(pool_address, "\n")] = 0;

  pthread_t threads[kWorld];
  for (int r = 0; r < kWorld; ++r) pthread_create(&threads[r], NULL, rank_main, (void*)(intptr_t)r);
  for (int r = 0; r < kWorld; ++r) pthread_join(threads[r], NULL);

  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  unlink(ready);
  rmdir(dir);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
