// The C API (tally/tally.h) over tally::Client. No exception may leave a C
// function: every entry point that allocates catches std::bad_alloc and
// reports TALLY_RESOURCE_EXHAUSTED.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tally/client/client.h"
#include "tally/client/option_names.h"
#include "tally/protocol/version.h"
#include "tally/tally.h"

struct tally_options {
  tally::ClientOptions options;
  std::set<std::string> given;  // the names set so far (tally_options_missing)
  std::string missing;          // tally_options_missing's last answer
};

struct tally_client {
  std::unique_ptr<tally::Client> client;
};

namespace {

// An op's end as its callback saw it: with a completion queue, the tag is
// posted from the callback, before the handle's own state says the op has
// ended, so the one who takes the tag reads the end from here.
struct Outcome {
  std::mutex mu;
  std::optional<tally::Status> status;
};

}  // namespace

struct tally_op {
  tally::OpHandle handle;
  std::string message;               // filled when the op is seen to have failed
  std::shared_ptr<Outcome> outcome;  // set for ops started with a *_to function
};

namespace {

// The tags of ended ops; shared by the handle and the ops posting to it.
class Completions {
 public:
  void post(uint64_t tag) {
    {
      std::lock_guard lock(mu_);
      tags_.push_back(tag);
    }
    cv_.notify_one();
  }
  void close() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }
  tally_code next(std::chrono::milliseconds timeout, uint64_t* tag) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return closed_ || !tags_.empty(); })) {
      return TALLY_IN_PROGRESS;
    }
    if (tags_.empty()) return TALLY_CANCELLED;
    *tag = tags_.front();
    tags_.pop_front();
    return TALLY_OK;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<uint64_t> tags_;
  bool closed_ = false;
};

}  // namespace

struct tally_queue {
  std::shared_ptr<Completions> completions = std::make_shared<Completions>();
};

namespace {

thread_local std::string last_error;

tally_code code_of(const tally::Status& s) { return static_cast<tally_code>(s.code()); }

// Records a failure as this thread's last error and returns its code.
tally_code fail(const tally::Status& s) {
  last_error = s.to_string();
  return code_of(s);
}

tally_code report(const tally::Status& s) { return s.is_ok() ? TALLY_OK : fail(s); }

tally_code invalid(const char* what) {
  return fail(tally::Status(tally::ErrorCode::kInvalidArgument, what));
}

tally_code out_of_memory() {
  return fail(tally::Status(tally::ErrorCode::kResourceExhausted, "out of memory"));
}

// Capped so that now + timeout cannot overflow the clock.
std::chrono::milliseconds capped_ms(uint64_t timeout_ms) {
  return std::chrono::milliseconds(std::min<uint64_t>(timeout_ms, uint64_t{1} << 40));
}

// What the handle says of the op, or failing that its callback (Outcome).
std::optional<tally::Status> ended(tally_op* op) {
  std::optional<tally::Status> s = op->handle.test();
  if (!s && op->outcome) {
    std::lock_guard lock(op->outcome->mu);
    s = op->outcome->status;
  }
  return s;
}

// A callback that records the op's end in `outcome`, then posts `tag`.
tally::OpCallback post_to(const std::shared_ptr<Completions>& completions, uint64_t tag,
                          const std::shared_ptr<Outcome>& outcome) {
  return [completions, tag, outcome](const tally::Status& s) {
    {
      std::lock_guard lock(outcome->mu);
      outcome->status = s;
    }
    completions->post(tag);
  };
}

// The op's code once it has ended (its message kept in the handle).
tally_code settle(tally_op* op, const std::optional<tally::Status>& s) {
  if (!s) return TALLY_IN_PROGRESS;
  if (s->is_ok()) return TALLY_OK;
  if (op->message.empty()) op->message = s->to_string();
  return fail(*s);
}

}  // namespace

extern "C" {

const char* tally_version(void) {
  static const std::string version = tally::version_string();
  return version.c_str();
}

int tally_c_api_version(void) { return TALLY_C_API_VERSION; }

const char* tally_code_name(tally_code code) {
  if (code == TALLY_IN_PROGRESS) return "in_progress";
  // error_code_name returns views of string literals, so data() is terminated.
  return tally::error_code_name(static_cast<tally::ErrorCode>(code)).data();
}

const char* tally_last_error(void) { return last_error.c_str(); }

tally_code tally_options_create(tally_options** out) {
  if (!out) return invalid("tally_options_create: out is NULL");
  *out = new (std::nothrow) tally_options;
  return *out ? TALLY_OK : out_of_memory();
}

tally_code tally_options_from_env(tally_options** out) {
  if (!out) return invalid("tally_options_from_env: out is NULL");
  *out = nullptr;
  try {
    auto options = tally::client_options_from_env();
    if (!options) return fail(options.status());
    // Every required option was found.
    *out = new tally_options{
        std::move(*options), {"TALLY_POOL", "TALLY_JOB", "TALLY_RANK", "TALLY_WORLD_SIZE"}, {}};
    return TALLY_OK;
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_options_read_env(tally_options* options) {
  if (!options) return invalid("tally_options_read_env: options is NULL");
  try {
    return report(tally::apply_environment(options->options, options->given));
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_options_set(tally_options* options, const char* name, const char* value) {
  if (!options || !name || !value) return invalid("tally_options_set: NULL argument");
  try {
    tally::Status s = tally::set_client_option(options->options, name, value);
    if (s.is_ok() && *value) options->given.insert(name);
    return report(s);
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

const char* tally_options_missing(tally_options* options) {
  if (!options) return "";
  try {
    options->missing.clear();
    for (const std::string& name : tally::missing_required(options->given)) {
      options->missing += (options->missing.empty() ? "" : ", ") + name;
    }
  } catch (const std::bad_alloc&) {
    options->missing.clear();
  }
  return options->missing.c_str();
}

const char* tally_option_name(size_t i) {
  // string_views of string literals: terminated.
  const auto& names = tally::client_option_names();
  return i < names.size() ? names[i].data() : nullptr;
}

void tally_options_destroy(tally_options* options) { delete options; }

tally_code tally_client_connect(const tally_options* options, tally_client** out) {
  if (!options || !out) return invalid("tally_client_connect: NULL argument");
  *out = nullptr;
  try {
    auto client = tally::Client::connect(options->options);
    if (!client) return fail(client.status());
    *out = new tally_client{std::move(*client)};
    return TALLY_OK;
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

void tally_client_destroy(tally_client* client) { delete client; }

uint32_t tally_client_rank(const tally_client* client) { return client->client->rank(); }
uint32_t tally_client_world_size(const tally_client* client) {
  return client->client->world_size();
}
uint32_t tally_client_shards(const tally_client* client) { return client->client->shards(); }
uint32_t tally_client_groups(const tally_client* client) { return client->client->groups(); }
uint32_t tally_client_group(const tally_client* client) { return client->client->group(); }

size_t tally_default_fuse_bytes(void) { return tally::kDefaultFuseBytes; }

static_assert(TALLY_OP_SECONDS_BUCKETS == tally::kOpSecondsBounds.size() + 1);

tally_code tally_client_stats(const tally_client* client, tally_stats* out) {
  if (!client || !out) return invalid("tally_client_stats: client or out is NULL");
  const tally::ClientStats s = client->client->stats();
  out->ops_completed = s.ops_completed;
  out->ops_failed = s.ops_failed;
  out->bytes_sent = s.bytes_sent;
  out->bytes_received = s.bytes_received;
  out->reconnects = s.reconnects;
  out->replays = s.replays;
  out->op_seconds_sum = s.op_seconds_sum;
  out->op_seconds_max = s.op_seconds_max;
  std::copy(s.op_seconds_buckets.begin(), s.op_seconds_buckets.end(), out->op_seconds_buckets);
  return TALLY_OK;
}

double tally_stats_op_seconds_quantile(const tally_stats* stats, double q) {
  if (!stats) return 0;
  tally::ClientStats s;
  s.op_seconds_max = stats->op_seconds_max;
  std::copy(stats->op_seconds_buckets, stats->op_seconds_buckets + TALLY_OP_SECONDS_BUCKETS,
            s.op_seconds_buckets.begin());
  return s.op_seconds_quantile(q);
}

double tally_op_seconds_bound(size_t i) {
  return i < tally::kOpSecondsBounds.size() ? tally::kOpSecondsBounds[i]
                                            : std::numeric_limits<double>::infinity();
}

tally_code tally_allreduce(tally_client* client, void* data, size_t count, tally_dtype dtype,
                           tally_redop op) {
  if (!client) return invalid("tally_allreduce: client is NULL");
  try {
    return report(client->client->allreduce(data, count, static_cast<tally::DType>(dtype),
                                            static_cast<tally::RedOp>(op)));
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_allreduce_async(tally_client* client, void* data, size_t count, tally_dtype dtype,
                                 tally_redop op, tally_callback callback, void* user,
                                 tally_op** out) {
  if (!client || !out) return invalid("tally_allreduce_async: NULL argument");
  *out = nullptr;
  try {
    auto handle = std::make_unique<tally_op>();
    tally::OpCallback on_done;
    if (callback) {
      on_done = [callback, user](const tally::Status& s) {
        const std::string message = s.is_ok() ? std::string() : s.to_string();
        callback(user, code_of(s), message.c_str());
      };
    }
    handle->handle =
        client->client->allreduce_async(data, count, static_cast<tally::DType>(dtype),
                                        static_cast<tally::RedOp>(op), std::move(on_done));
    *out = handle.release();
    // A refused call has ended already: report it as the call's result too.
    auto now = (*out)->handle.test();
    return now && !now->is_ok() ? settle(*out, now) : TALLY_OK;
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_allreduce_fused(tally_client* client, void* const* data, const size_t* counts,
                                 size_t n, tally_dtype dtype, tally_redop op, size_t fuse_bytes) {
  if (!client || (n > 0 && (!data || !counts)))
    return invalid("tally_allreduce_fused: NULL argument");
  try {
    std::vector<tally::BufferRef> buffers(n);
    for (size_t i = 0; i < n; ++i) buffers[i] = {data[i], counts[i]};
    return report(client->client->allreduce_fused(buffers, static_cast<tally::DType>(dtype),
                                                  static_cast<tally::RedOp>(op), fuse_bytes));
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_op_wait(tally_op* op) {
  if (!op) return invalid("tally_op_wait: op is NULL");
  return settle(op, op->handle.wait());
}

tally_code tally_op_wait_for(tally_op* op, uint64_t timeout_ms) {
  if (!op) return invalid("tally_op_wait_for: op is NULL");
  return settle(op, op->handle.wait_for(capped_ms(timeout_ms)));
}

tally_code tally_op_test(tally_op* op) {
  if (!op) return invalid("tally_op_test: op is NULL");
  return settle(op, ended(op));
}

const char* tally_op_message(tally_op* op) {
  if (!op) return "";
  if (op->message.empty()) settle(op, ended(op));
  return op->message.c_str();
}

uint64_t tally_op_number(const tally_op* op) {
  if (!op || !op->handle.op()) return std::numeric_limits<uint64_t>::max();
  return *op->handle.op();
}

void tally_op_destroy(tally_op* op) { delete op; }

tally_code tally_queue_create(tally_queue** out) {
  if (!out) return invalid("tally_queue_create: out is NULL");
  *out = nullptr;
  try {
    *out = new tally_queue;
    return TALLY_OK;
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_queue_next(tally_queue* queue, uint64_t timeout_ms, uint64_t* tag) {
  if (!queue || !tag) return invalid("tally_queue_next: NULL argument");
  return queue->completions->next(capped_ms(timeout_ms), tag);
}

void tally_queue_close(tally_queue* queue) {
  if (queue) queue->completions->close();
}

void tally_queue_destroy(tally_queue* queue) { delete queue; }

tally_code tally_allreduce_async_to(tally_client* client, void* data, size_t count,
                                    tally_dtype dtype, tally_redop op, tally_queue* queue,
                                    uint64_t tag, tally_op** out) {
  if (!client || !queue || !out) return invalid("tally_allreduce_async_to: NULL argument");
  *out = nullptr;
  try {
    auto handle = std::make_unique<tally_op>();
    handle->outcome = std::make_shared<Outcome>();
    handle->handle = client->client->allreduce_async(
        data, count, static_cast<tally::DType>(dtype), static_cast<tally::RedOp>(op),
        post_to(queue->completions, tag, handle->outcome));
    *out = handle.release();
    auto now = (*out)->handle.test();
    return now && !now->is_ok() ? settle(*out, now) : TALLY_OK;
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

tally_code tally_allreduce_fused_async_to(tally_client* client, void* const* data,
                                          const size_t* counts, size_t n, tally_dtype dtype,
                                          tally_redop op, size_t fuse_bytes, tally_queue* queue,
                                          uint64_t tag, tally_op** out) {
  if (!client || !queue || !out || (n > 0 && (!data || !counts))) {
    return invalid("tally_allreduce_fused_async_to: NULL argument");
  }
  *out = nullptr;
  try {
    std::vector<tally::BufferRef> buffers(n);
    for (size_t i = 0; i < n; ++i) buffers[i] = {data[i], counts[i]};
    auto handle = std::make_unique<tally_op>();
    handle->outcome = std::make_shared<Outcome>();
    handle->handle = client->client->allreduce_fused_async(
        buffers, static_cast<tally::DType>(dtype), static_cast<tally::RedOp>(op), fuse_bytes,
        post_to(queue->completions, tag, handle->outcome));
    *out = handle.release();
    auto now = (*out)->handle.test();
    return now && !now->is_ok() ? settle(*out, now) : TALLY_OK;
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

}  // extern "C"
