// The daemon: options, I/O threads, the listener, the sweep timer and
// shutdown. Each accepted stream (an InboundStream, let in by
// StreamAdmission: inbound_stream.h) is routed by its first message to a
// WorkerSession (a Hello) or a ReplicaSession (a ReplicaHello); jobs live
// in the JobTable, the other replicas of this shard in Replicas.
#include "tally/reducer/reducer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/connection_factory.h"
#include "tally/protocol/control.h"
#include "tally/protocol/version.h"
#include "tally/reducer/inbound_stream.h"
#include "tally/reducer/job_table.h"
#include "tally/reducer/replica_session.h"
#include "tally/reducer/replicas.h"
#include "tally/reducer/session.h"
#include "tally/reducer/slab_pool.h"
#include "tally/reducer/worker_session.h"

namespace tally {
namespace asio = boost::asio;

// How long a stopping reducer waits for its streams to take their last error.
constexpr std::chrono::milliseconds kShutdownGrace{1000};
// How often jobs are checked for timed-out ops.
constexpr std::chrono::milliseconds kSweepInterval{100};
// /healthz fails when the 100 ms sweep has not run for this long: I/O thread
// 0 is wedged (50 missed sweeps; loaded machines delay timers by far less).
constexpr std::chrono::milliseconds kStalledSweep{5000};
// Control frames queued for all streams' peers, beyond 16 KiB per stream
// (kControlBytesFloor): a reducer's memory outside its --memory-budget is
// bounded whatever its peers do (docs/architecture.md, "Memory").
constexpr size_t kReducerControlBudgetBytes = 32u << 20;

struct Reducer::Impl : std::enable_shared_from_this<Reducer::Impl> {
  std::shared_ptr<SessionContext> context = std::make_shared<SessionContext>();
  const ReducerOptions& options = context->options;
  std::vector<std::unique_ptr<asio::io_context>> contexts;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> guards;
  std::vector<std::thread> threads;
  std::unique_ptr<TcpListener> listener;
  std::shared_ptr<Fabric> fabric;  // with --transport fabric
  std::unique_ptr<asio::steady_timer> sweep_timer;
  std::shared_ptr<SlabPool> pool;
  // Shared with the streams, which may outlive a stopping Impl by a handler.
  std::shared_ptr<ReducerCounters> counters = std::make_shared<ReducerCounters>();
  HostPort bound;
  // When the sweep last ran on I/O thread 0: /healthz fails if it stalls.
  std::atomic<int64_t> last_sweep_ns{Job::Clock::now().time_since_epoch().count()};

  std::mutex mu;  // the streams; taken on accept, admission, close and stop only
  std::unordered_set<std::shared_ptr<InboundStream>> streams;
  StreamAdmission admission{options};
  bool stopping = false;

  void on_accept(asio::ip::tcp::socket socket);
  // The session for a stream whose first message is `first`.
  std::shared_ptr<FrameHandler> route(const wire::Control& first, std::shared_ptr<Connection> conn,
                                      InboundStream::Admit admit);
  void arm_sweep();
  // Replicas ask the job table for what to announce and tell it of lost
  // and returning replicas.
  void connect_replicas_to_jobs();
  // Opens every I/O thread's fabric endpoint, in parallel.
  Status prepare_fabric_endpoints();
  void stop();
  void join();
};

void Reducer::Impl::connect_replicas_to_jobs() {
  std::weak_ptr<JobTable> jobs = context->jobs;
  context->replicas->set_callbacks(
      {[jobs](uint32_t group) {
         auto table = jobs.lock();
         return table ? table->announcements(group)
                      : std::vector<std::shared_ptr<const wire::Control>>{};
       },
       [jobs](uint32_t group, const Status& why) {
         if (auto table = jobs.lock()) table->on_replica_lost(group, why);
       },
       [jobs](uint32_t group) {
         if (auto table = jobs.lock()) table->on_replica_back(group);
       }});
}

Status Reducer::Impl::prepare_fabric_endpoints() {
  // Opened now so that the first fabric Hello on a thread does not stall
  // that thread's other streams. With a wildcard listen address the local
  // IP is only known per connection.
  boost::system::error_code ec;
  const auto ip = asio::ip::make_address(bound.host, ec);
  if (ec || ip.is_unspecified()) return Status::ok();
  std::vector<std::future<Status>> opened;
  for (auto& c : contexts) {
    auto done = std::make_shared<std::promise<Status>>();
    opened.push_back(done->get_future());
    asio::post(*c, [self = shared_from_this(), ctx = c.get(), done, host = bound.host] {
      done->set_value(self->fabric->prepare_endpoint(ctx->get_executor(), host));
    });
  }
  Status first = Status::ok();
  for (auto& f : opened) {
    Status s = f.get();  // each open has fi_getinfo's own bounds
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  return first;
}

void Reducer::Impl::on_accept(asio::ip::tcp::socket socket) {
  boost::system::error_code peer_error;
  const auto peer = socket.remote_endpoint(peer_error);
  if (peer_error) return;  // gone already; the socket closes with it
  const std::string source = peer.address().to_string();
  // Protected mode: only loopback may speak without the secrets.
  InboundStream::Refused refused;
  if (!options.insecure_open_pool) {
    auto address = peer.address();
    if (address.is_v6() && address.to_v6().is_v4_mapped()) {
      address = asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6());
    }
    const bool local = address.is_loopback();
    refused.workers = !local && options.job_secret.empty();
    refused.replicas = !local && options.pool_secret.empty();
  }
  {
    std::lock_guard lock(mu);
    if (!admission.make_room(source, streams.size())) {
      boost::system::error_code ignored;
      socket.close(ignored);
      return;
    }
  }
  ConnectionOptions copts = options.connection;
  copts.write_timeout = copts.peer_timeout;           // workers and replicas read what we send them
  copts.first_frame_timeout = options.hello_timeout;  // the hello deadline governs until then
  auto conn = make_connection(fabric, std::move(socket), copts);
  std::weak_ptr<Impl> weak = shared_from_this();
  auto stream = std::make_shared<InboundStream>(
      conn, source, refused, options.hello_timeout, counters,
      [weak](const wire::Control& first, std::shared_ptr<Connection> c,
             InboundStream::Admit admit) -> std::shared_ptr<FrameHandler> {
        auto self = weak.lock();
        return self ? self->route(first, std::move(c), std::move(admit)) : nullptr;
      },
      [weak](const std::shared_ptr<InboundStream>& stream) {
        auto self = weak.lock();
        if (!self) return false;
        std::lock_guard lock(self->mu);
        return self->admission.admit(*stream);
      },
      [weak](const std::shared_ptr<InboundStream>& closed) {
        if (auto self = weak.lock()) {
          std::lock_guard lock(self->mu);
          if (self->streams.erase(closed) == 0) return;
          self->admission.closed(*closed);
        }
      });
  {
    std::lock_guard lock(mu);
    if (stopping) return;
    streams.insert(stream);
    admission.opened(stream);
  }
  // The socket lives on its own context; start there.
  asio::post(conn->executor(), [stream] { stream->start(); });
}

std::shared_ptr<FrameHandler> Reducer::Impl::route(const wire::Control& first,
                                                   std::shared_ptr<Connection> conn,
                                                   InboundStream::Admit admit) {
  if (first.has_replica_hello()) {
    return std::make_shared<ReplicaSession>(context, std::move(conn), std::move(admit));
  }
  return std::make_shared<WorkerSession>(context, std::move(conn), std::move(admit));
}

void Reducer::Impl::arm_sweep() {
  sweep_timer->expires_after(kSweepInterval);
  sweep_timer->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;
    {
      std::lock_guard lock(self->mu);
      if (self->stopping) return;
    }
    const auto now = Job::Clock::now();
    self->last_sweep_ns.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    self->context->jobs->sweep(now);
    self->arm_sweep();
  });
}

void Reducer::Impl::stop() {
  std::vector<std::shared_ptr<InboundStream>> to_close;
  {
    std::lock_guard lock(mu);
    if (stopping) return;
    stopping = true;
    to_close.assign(streams.begin(), streams.end());
  }
  context->jobs->stop();
  spdlog::info("shard {} stopping: closing {} streams", options.shard, to_close.size());
  if (listener) listener->close();
  if (context->replicas) context->replicas->stop();
  asio::post(*contexts.front(), [self = shared_from_this()] { self->sweep_timer->cancel(); });
  for (auto& s : to_close) {
    s->close(Status(ErrorCode::kUnavailable,
                    "reducer shard " + std::to_string(options.shard) + " is shutting down"));
  }
  for (auto& g : guards) g.reset();
}

void Reducer::Impl::join() {
  // Streams close once their error is written; a worker that does not read
  // gets its stream cut when the grace runs out.
  const auto deadline = std::chrono::steady_clock::now() + kShutdownGrace;
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard lock(mu);
      if (streams.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& c : contexts) c->stop();
  for (auto& t : threads) {
    if (t.joinable()) t.join();
  }
  if (fabric) fabric->close();
  // Handlers still queued hold sessions and this Impl: drop our references
  // to what lives on the contexts, then destroy the contexts, which destroys
  // those handlers and with them the last references.
  context->stopped = true;
  listener.reset();
  sweep_timer.reset();
  if (context->replicas) context->replicas->release();
  context->jobs->clear();
  {
    std::lock_guard lock(mu);
    streams.clear();
  }
  guards.clear();
  contexts.clear();
}

namespace {

Status check_options(const ReducerOptions& options) {
  if (options.io_threads == 0) return Status(ErrorCode::kInvalidArgument, "io threads must be > 0");
  if (options.shard_count == 0 || options.shard >= options.shard_count) {
    return Status(ErrorCode::kInvalidArgument, "shard index must be below the shard count");
  }
  if (options.group_count == 0 || options.group >= options.group_count) {
    return Status(ErrorCode::kInvalidArgument, "group index must be below the group count");
  }
  if (options.group_count > 1) {
    if (options.pool.empty()) {
      return Status(ErrorCode::kInvalidArgument,
                    "with more than one group the reducer needs --pool");
    }
    if (options.pool.front() != '@') {
      auto pool = read_pool_list(options);
      if (!pool) return pool.status();
    }
  }
  if (options.max_chunk_bytes < 4096 || options.max_chunk_bytes % 4096 != 0 ||
      options.max_chunk_bytes > kMaxChunkBytesLimit) {
    return Status(ErrorCode::kInvalidArgument,
                  "max chunk bytes must be a multiple of 4096, at most " +
                      std::to_string(kMaxChunkBytesLimit));
  }
  if (options.ingress_window_bytes == 0) {
    return Status(ErrorCode::kInvalidArgument, "ingress window must be at least one byte");
  }
  if (options.window_chunks == 0) {
    return Status(ErrorCode::kInvalidArgument, "window must be at least one chunk");
  }
  const size_t slabs = options.memory_budget_bytes / options.max_chunk_bytes;
  // A job whose every group has workers needs the most.
  const size_t per_job = Job::quota_slabs(options.window_chunks, options.group_count);
  if (slabs < per_job) {
    return Status(ErrorCode::kInvalidArgument,
                  "memory budget of " + std::to_string(options.memory_budget_bytes) +
                      " bytes holds " + std::to_string(slabs) + " chunk buffers, a job needs " +
                      std::to_string(per_job) + " (window x (1 + 2F) + 2, F = " +
                      std::to_string(butterfly_max_receives(options.group_count)) +
                      " partials received per chunk with " + std::to_string(options.group_count) +
                      " groups)");
  }
  if (options.transport != "tcp" && options.transport != "fabric") {
    return Status(ErrorCode::kInvalidArgument, "transport must be 'tcp' or 'fabric'");
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<Reducer>> Reducer::start(const ReducerOptions& options) {
  TALLY_RETURN_IF_ERROR(check_options(options));
  auto congestion =
      stream_congestion_control(options.connection.congestion_control, options.link_rate_bits,
                                "--tcp-congestion", "--link-rate");
  if (!congestion) return congestion.status();
  auto impl = std::make_shared<Impl>();
  impl->context->options = options;
  impl->context->options.connection.congestion_control = *congestion;
  // Every stream's queued control frames together (transport.h).
  impl->context->options.connection.control_budget =
      std::make_shared<ControlBudget>(kReducerControlBudgetBytes);
  if (options.transport == "fabric") {
    auto fabric = Fabric::open(options.fabric);
    if (!fabric) return fabric.status();
    impl->fabric = *fabric;
    const FabricInfo fi = impl->fabric->info();
    spdlog::info("fabric data path: provider {}, fabric {}, domain {}, memory registration {}",
                 fi.provider, fi.fabric, fi.domain, fi.registration ? "on" : "off");
  }
  // A payload is read into one pool buffer: never accept a larger frame.
  impl->context->options.connection.max_data_bytes = options.max_chunk_bytes;
  const size_t slabs = options.memory_budget_bytes / options.max_chunk_bytes;
  auto pool = SlabPool::create(options.max_chunk_bytes, slabs);
  if (!pool) return pool.status();
  impl->pool = *pool;
  if (options.group_count > 1) {
    impl->context->replicas = std::make_shared<Replicas>(impl->options, impl->fabric);
  }
  impl->context->jobs = std::make_shared<JobTable>(impl->options, impl->pool, *impl->counters,
                                                   impl->context->replicas);
  if (impl->context->replicas) impl->connect_replicas_to_jobs();
  for (size_t i = 0; i < options.io_threads; ++i) {
    impl->contexts.push_back(std::make_unique<asio::io_context>(1));
    impl->guards.push_back(asio::make_work_guard(*impl->contexts.back()));
  }
  std::vector<asio::io_context*> raw;
  for (auto& c : impl->contexts) raw.push_back(c.get());
  std::weak_ptr<Impl> weak = impl;
  auto listener = TcpListener::listen(raw, options.listen, [weak](asio::ip::tcp::socket s) {
    if (auto self = weak.lock()) self->on_accept(std::move(s));
  });
  if (!listener) return listener.status();
  impl->listener = std::move(*listener);
  auto ep = impl->listener->local_endpoint();
  impl->bound = HostPort{ep.address().to_string(), ep.port()};
  impl->sweep_timer = std::make_unique<asio::steady_timer>(*impl->contexts.front());
  impl->arm_sweep();
  if (impl->context->replicas) impl->context->replicas->start(raw);
  for (auto& c : impl->contexts) {
    impl->threads.emplace_back([ctx = c.get()] { ctx->run(); });
  }
  if (impl->fabric) {
    if (Status s = impl->prepare_fabric_endpoints(); !s.is_ok()) {
      impl->stop();
      impl->join();
      return s;
    }
  }
  spdlog::info(
      "tally-reducer {} ({}) shard {}/{} group {}/{} listening on {}: {} I/O threads, {} buffers "
      "of {} bytes",
      TALLY_VERSION, git_sha(), options.shard, options.shard_count, options.group,
      options.group_count, impl->bound.to_string(), options.io_threads, slabs,
      options.max_chunk_bytes);
  return std::unique_ptr<Reducer>(new Reducer(impl));
}

Reducer::Reducer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Reducer::~Reducer() {
  stop();
  wait();
}

HostPort Reducer::address() const { return impl_->bound; }

ReducerStats Reducer::stats() const {
  ReducerStats s;
  const ReducerCounters& c = *impl_->counters;
  for (size_t i = 0; i < kCounts; ++i) s.counts[i] = c.counts[i].load();
  for (size_t i = 0; i < kLevels; ++i) {
    s.levels[i] = static_cast<uint64_t>(std::max<int64_t>(0, c.levels[i].load()));
  }
  for (size_t i = 0; i < ReducerCounters::kReasons; ++i) {
    const uint64_t ops = c.ops_failed_by[i].load();
    const uint64_t chunks = c.chunks_failed_by[i].load();
    if (ops == 0 && chunks == 0) continue;
    const std::string reason(error_code_name(static_cast<ErrorCode>(i)));
    s.ops_failed_by_reason[reason] = ops;
    s.chunks_failed_by_reason[reason] = chunks;
  }
  s.op_seconds = c.op_seconds.Collect().histogram;
  s.slabs_total = impl_->pool->total();
  s.slabs_in_use = impl_->pool->in_use();
  const size_t unreserved = impl_->pool->available();
  s.slabs_free = unreserved;
  s.slabs_reserved_idle =
      s.slabs_total - unreserved - std::min(s.slabs_in_use, s.slabs_total - unreserved);
  s.slabs_per_job = Job::quota_slabs(impl_->options.window_chunks, 1);
  if (impl_->context->replicas) {
    s.replica_links_up = impl_->context->replicas->links_up();
    s.replica_links_expected = impl_->context->replicas->links_expected();
  }
  s.jobs = impl_->context->jobs->size();
  std::lock_guard lock(impl_->mu);
  s.connections = impl_->streams.size();
  s.stopping = impl_->stopping;
  return s;
}

Status Reducer::liveness() const {
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->stopping) return Status(ErrorCode::kUnavailable, "shutting down");
  }
  const auto last = Job::Clock::time_point(Job::Clock::duration(impl_->last_sweep_ns.load()));
  const auto stalled = Job::Clock::now() - last;
  if (stalled > kStalledSweep) {
    return Status(
        ErrorCode::kUnavailable,
        "I/O thread 0 has not run the sweep for " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(stalled).count()) +
            " ms");
  }
  return Status::ok();
}

Status Reducer::readiness() const {
  TALLY_RETURN_IF_ERROR(liveness());
  const ReducerStats s = stats();
  if (s.replica_links_up < s.replica_links_expected) {
    return Status(ErrorCode::kUnavailable, std::to_string(s.replica_links_up) + " of " +
                                               std::to_string(s.replica_links_expected) +
                                               " replica links up");
  }
  if (s.slabs_free < s.slabs_per_job) {
    return Status(ErrorCode::kResourceExhausted,
                  "memory budget full: " + std::to_string(s.slabs_free) +
                      " free chunk buffers, a job needs " + std::to_string(s.slabs_per_job));
  }
  return Status::ok();
}

void Reducer::stop() { impl_->stop(); }

void Reducer::wait() { impl_->join(); }

}  // namespace tally
