#include "tally/reducer/reducer.h"

#include <spdlog/spdlog.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <future>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/control.h"
#include "tally/reducer/job.h"
#include "tally/reducer/slab_pool.h"

namespace tally {
namespace asio = boost::asio;

// How long a stopping reducer waits for its streams to take their last error.
constexpr std::chrono::milliseconds kShutdownGrace{1000};
// Ended jobs whose ranks left with an error are remembered this long, and
// at most this many, to explain a late worker's timeout.
constexpr std::chrono::minutes kTombstoneLife{10};
constexpr size_t kTombstonesKept = 256;
// How often jobs are checked for timed-out ops.
constexpr std::chrono::milliseconds kSweepInterval{100};
// A goodbye's reason is quoted in other ranks' errors; keep it readable.
constexpr size_t kMaxReasonBytes = 1024;
// Job names are identifiers, not payloads.
constexpr size_t kMaxJobNameBytes = 256;
// Slabs a job holds beyond its window: one for a staging read, one for a
// finished chunk still being sent (job.h).
constexpr size_t kJobSlack = 2;

class WorkerSession;

struct Reducer::Impl : std::enable_shared_from_this<Reducer::Impl> {
  ReducerOptions options;
  std::vector<std::unique_ptr<asio::io_context>> contexts;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> guards;
  std::vector<std::thread> threads;
  std::unique_ptr<TcpListener> listener;
  std::shared_ptr<Fabric> fabric;  // with --transport fabric
  std::unique_ptr<asio::steady_timer> sweep_timer;
  std::shared_ptr<SlabPool> pool;
  ReducerCounters counters;
  HostPort bound;

  std::mutex mu;  // jobs and sessions; taken on connect and disconnect only
  std::unordered_map<std::string, std::shared_ptr<Job>> jobs;
  // Why the ranks of recently ended jobs left, by job name (bounded).
  struct Tombstone {
    std::chrono::steady_clock::time_point ended;
    std::map<uint32_t, std::string> departures;
  };
  std::map<std::string, Tombstone> tombstones;
  // Set once the I/O threads are joined: late callbacks (a slab freed while
  // the contexts are destroyed) must not post to them any more.
  std::atomic<bool> stopped{false};
  std::unordered_set<std::shared_ptr<WorkerSession>> sessions;
  bool stopping = false;

  void on_accept(asio::ip::tcp::socket socket);
  Result<std::shared_ptr<Job>> admit(const wire::Hello& hello,
                                     const std::shared_ptr<WorkerSession>& session);
  void remove(const std::shared_ptr<WorkerSession>& session, const std::shared_ptr<Job>& job,
              const Status& why, bool goodbye);
  // Keeps why `job`'s ranks left (unless all left cleanly) for its
  // successor of the same name; mu held.
  void remember_departures_locked(const Job& job);
  void arm_sweep();
  void stop();
  void join();
};

// One worker stream: handshake, then contributions in and results out.
class WorkerSession final : public FrameHandler,
                            public JobMember,
                            public std::enable_shared_from_this<WorkerSession> {
 public:
  WorkerSession(std::shared_ptr<Reducer::Impl> reducer, std::shared_ptr<Connection> conn)
      : reducer_(std::move(reducer)), conn_(std::move(conn)), peer_(conn_->peer()) {}

  // Starts reading; a stream that has not said hello within the hello
  // timeout is closed (heartbeats alone do not keep it).
  void start() {
    conn_->start(shared_from_this());
    hello_timer_.emplace(conn_->executor(), reducer_->options.hello_timeout);
    hello_timer_->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->job_) return;
      self->reject(Status(ErrorCode::kTimeout, "no hello from " + self->peer_ + " within " +
                                                   std::to_string(self->reducer_->options.hello_timeout.count()) +
                                                   " ms"));
    });
  }
  // Tells the worker why, then closes once that is written. Thread-safe.
  void close(const Status& why) {
    asio::post(conn_->executor(), [self = shared_from_this(), why] { self->close_with_error(why); });
  }

  // JobMember
  uint32_t rank() const override { return rank_; }
  const std::string& peer() const override { return peer_; }
  void send_result(const FrameHeader& header, std::shared_ptr<Slab> slab) override {
    if (reducer_->stopped) return;
    asio::post(conn_->executor(), [self = shared_from_this(), header, slab = std::move(slab)] {
      auto payload = slab->first(header.length);
      self->conn_->send(header, payload, [slab](const Status&) {});
    });
  }
  void send_control(std::shared_ptr<const wire::Control> message) override {
    if (reducer_->stopped) return;
    asio::post(conn_->executor(), [self = shared_from_this(), message = std::move(message)] {
      self->conn_->send_control(*message);
    });
  }
  void wake() override {
    if (reducer_->stopped) return;
    asio::post(conn_->executor(), [self = shared_from_this()] { self->conn_->resume(); });
  }

  // FrameHandler
  PayloadAction on_data_header(const FrameHeader& h) override {
    if (!job_) {
      return PayloadAction::close(
          Status(ErrorCode::kProtocol, "data frame from " + peer_ + " before its hello"));
    }
    if (h.kind != FrameKind::kContribution) {
      return PayloadAction::close(
          Status(ErrorCode::kProtocol, "unexpected " + describe(h) + " from worker " + peer_));
    }
    if (h.job != job_->id() || h.rank != rank_) {
      return PayloadAction::close(Status(
          ErrorCode::kProtocol, "frame from " + peer_ + " names job " + std::to_string(h.job) +
                                    " rank " + std::to_string(h.rank) + ", but the stream is job '" +
                                    job_->name() + "' rank " + std::to_string(rank_)));
    }
    // A worker sends its chunks in (op, chunk) order on each stream, so a
    // repeat or a step back is a duplicate, never a retry of a live chunk.
    const std::pair<uint64_t, uint32_t> key{h.op, h.chunk};
    if (last_key_ && key <= *last_key_) {
      return PayloadAction::close(Status(
          ErrorCode::kProtocol, "rank " + std::to_string(rank_) + " sent op " + std::to_string(h.op) +
                                    " chunk " + std::to_string(h.chunk) + " after op " +
                                    std::to_string(last_key_->first) + " chunk " +
                                    std::to_string(last_key_->second) + ": duplicate or out of order"));
    }
    PayloadAction action = job_->on_contribution_header(shared_from_this(), h, pending_);
    if (action.kind == PayloadAction::Kind::kReceive || action.kind == PayloadAction::Kind::kDiscard) {
      last_key_ = key;
    }
    return action;
  }

  void on_data(const FrameHeader& h, std::span<std::byte>) override {
    job_->on_contribution_payload(h, pending_);
  }

  void on_control(const wire::Control& message) override {
    if (message.has_hello()) return on_hello(message.hello());
    if (message.has_goodbye()) {
      said_goodbye_ = true;
      goodbye_reason_ = message.goodbye().reason().substr(0, kMaxReasonBytes);
      return;
    }
    if (message.has_error()) {
      spdlog::warn("worker {} reports: {}", peer_, status_from_error(message.error()).to_string());
      return;
    }
    reject(Status(ErrorCode::kProtocol, "unexpected control message from worker " + peer_));
  }

  void on_closed(const Status& why) override {
    pending_.reset();
    if (hello_timer_) hello_timer_->cancel();
    if (job_) {
      if (why.code() == ErrorCode::kCancelled || said_goodbye_) {
        spdlog::info("stream of job '{}' rank {} ({}) closed: {}", job_->name(), rank_, peer_,
                     why.message());
      } else {
        spdlog::warn("stream of job '{}' rank {} ({}) closed: {}", job_->name(), rank_, peer_,
                     why.to_string());
      }
    } else if (why.code() != ErrorCode::kCancelled) {
      spdlog::warn("connection from {} closed before joining a job: {}", peer_, why.to_string());
    }
    reducer_->remove(shared_from_this(), job_,
                     said_goodbye_ ? Status(ErrorCode::kCancelled, goodbye_reason_) : why,
                     said_goodbye_);
  }

 private:
  // Sends the error, then closes once it is written, so the peer reads why.
  void reject(const Status& why) {
    spdlog::warn("rejecting {}: {}", peer_, why.to_string());
    close_with_error(why);
  }

  // On the stream's executor: send `why` as a fatal Error, close once written.
  void close_with_error(const Status& why) {
    conn_->send_control(make_error(why), [conn = conn_, why](const Status&) { conn->close(why); });
  }

  void on_hello(const wire::Hello& hello) {
    if (job_) return reject(Status(ErrorCode::kProtocol, "second hello from " + peer_));
    if (hello.protocol_version() != kProtocolVersion) {
      return reject(Status(ErrorCode::kVersionMismatch,
                           "worker speaks protocol version " +
                               std::to_string(hello.protocol_version()) + ", this reducer speaks " +
                               std::to_string(kProtocolVersion)));
    }
    rank_ = hello.rank();
    if (Status s = conn_->attach_data_path(hello.data_path()); !s.is_ok()) return reject(s);
    auto job = reducer_->admit(hello, shared_from_this());
    if (!job) return reject(job.status());
    job_ = *job;
    wire::Control welcome;
    auto* w = welcome.mutable_welcome();
    w->set_protocol_version(kProtocolVersion);
    w->set_shard(reducer_->options.shard);
    w->set_shard_count(reducer_->options.shard_count);
    w->set_max_chunk_bytes(reducer_->options.max_chunk_bytes);
    w->set_window_chunks(reducer_->options.window_chunks);
    w->set_reducer_version(TALLY_VERSION);
    TALLY_CHECK(conn_->describe_data_path(w->mutable_data_path()).is_ok());  // attached above
    conn_->send_control(welcome);
    spdlog::info("rank {}/{} of job '{}' joined from {}", rank_, hello.world_size(), job_->name(),
                 peer_);
  }

  std::shared_ptr<Reducer::Impl> reducer_;
  std::shared_ptr<Connection> conn_;
  const std::string peer_;
  std::shared_ptr<Job> job_;
  uint32_t rank_ = 0;
  bool said_goodbye_ = false;
  std::string goodbye_reason_;
  std::optional<std::pair<uint64_t, uint32_t>> last_key_;  // last contribution accepted
  PendingContribution pending_;
  std::optional<asio::steady_timer> hello_timer_;
};

void Reducer::Impl::on_accept(asio::ip::tcp::socket socket) {
  auto conn = fabric ? fabric->make_connection(std::move(socket), options.connection)
                     : make_tcp_connection(std::move(socket), options.connection);
  auto session = std::make_shared<WorkerSession>(shared_from_this(), conn);
  {
    std::lock_guard lock(mu);
    if (stopping) return;
    sessions.insert(session);
  }
  // The socket lives on its own context; start there.
  asio::post(conn->executor(), [session] { session->start(); });
}

Result<std::shared_ptr<Job>> Reducer::Impl::admit(const wire::Hello& hello,
                                                  const std::shared_ptr<WorkerSession>& session) {
  if (hello.job().empty() || hello.job().size() > kMaxJobNameBytes) {
    return Status(ErrorCode::kInvalidArgument, "job name must have 1 to 256 bytes");
  }
  if (hello.world_size() > options.max_world_size) {
    return Status(ErrorCode::kInvalidArgument,
                  "world size " + std::to_string(hello.world_size()) + " exceeds this reducer's maximum of " +
                      std::to_string(options.max_world_size));
  }
  if (hello.world_size() == 0 || hello.rank() >= hello.world_size()) {
    return Status(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(hello.rank()) + " is not below world size " +
                      std::to_string(hello.world_size()));
  }
  std::chrono::milliseconds timeout(hello.op_timeout_ms());
  if (timeout.count() == 0 || timeout > options.max_op_timeout) {
    return Status(ErrorCode::kInvalidArgument,
                  "op timeout must be 1.." + std::to_string(options.max_op_timeout.count()) + " ms");
  }
  std::shared_ptr<Job> job;
  {
    std::lock_guard lock(mu);
    auto it = jobs.find(hello.job());
    if (it != jobs.end()) {
      job = it->second;
      if (job->settings().world_size != hello.world_size()) {
        return Status(ErrorCode::kMismatch,
                      "rank " + std::to_string(hello.rank()) + " says job '" + hello.job() +
                          "' has world size " + std::to_string(hello.world_size()) +
                          ", other ranks said " + std::to_string(job->settings().world_size));
      }
    } else {
      auto quota = SlabQuota::reserve(pool, options.window_chunks + kJobSlack);
      if (!quota) return quota.status().with_context("job '" + hello.job() + "'");
      JobSettings settings;
      settings.name = hello.job();
      settings.world_size = hello.world_size();
      settings.shard = options.shard;
      settings.op_timeout = timeout;
      if (auto t = tombstones.find(hello.job()); t != tombstones.end()) {
        if (std::chrono::steady_clock::now() - t->second.ended < kTombstoneLife) {
          settings.history = t->second.departures;
        }
        tombstones.erase(t);
      }
      job = std::make_shared<Job>(std::move(settings), std::move(*quota), counters);
      jobs.emplace(hello.job(), job);
    }
    // Joined under `mu`, so remove() cannot erase the job between finding
    // and joining it (which would leave this rank in an orphaned job).
    TALLY_RETURN_IF_ERROR(job->join(session));
  }
  return job;
}

void Reducer::Impl::remove(const std::shared_ptr<WorkerSession>& session,
                           const std::shared_ptr<Job>& job, const Status& why, bool goodbye) {
  if (job) job->leave(session.get(), why, goodbye);
  std::lock_guard lock(mu);
  sessions.erase(session);
  // Checked again under `mu`: a rank may have joined since leave() returned.
  if (job && job->empty()) {
    auto it = jobs.find(job->name());
    if (it != jobs.end() && it->second == job) {
      jobs.erase(it);
      remember_departures_locked(*job);
      spdlog::info("job '{}' has no workers left on shard {}", job->name(), options.shard);
    }
  }
}

void Reducer::Impl::remember_departures_locked(const Job& job) {
  auto departures = job.departures();
  std::erase_if(departures, [](auto& d) { return d.second == kCleanGoodbyeReason; });
  if (departures.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  std::erase_if(tombstones, [&](auto& t) { return now - t.second.ended >= kTombstoneLife; });
  if (tombstones.size() >= kTombstonesKept) {
    tombstones.erase(std::min_element(tombstones.begin(), tombstones.end(), [](auto& a, auto& b) {
      return a.second.ended < b.second.ended;
    }));
  }
  tombstones[job.name()] = {now, std::move(departures)};
}

void Reducer::Impl::arm_sweep() {
  sweep_timer->expires_after(kSweepInterval);
  sweep_timer->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;
    std::vector<std::shared_ptr<Job>> snapshot;
    {
      std::lock_guard lock(self->mu);
      if (self->stopping) return;
      for (auto& [name, job] : self->jobs) snapshot.push_back(job);
    }
    const auto now = Job::Clock::now();
    for (auto& job : snapshot) job->sweep(now);
    self->arm_sweep();
  });
}

void Reducer::Impl::stop() {
  std::vector<std::shared_ptr<WorkerSession>> to_close;
  {
    std::lock_guard lock(mu);
    if (stopping) return;
    stopping = true;
    to_close.assign(sessions.begin(), sessions.end());
  }
  spdlog::info("shard {} stopping: closing {} streams", options.shard, to_close.size());
  if (listener) listener->close();
  asio::post(*contexts.front(), [self = shared_from_this()] { self->sweep_timer->cancel(); });
  for (auto& s : to_close) {
    s->close(Status(ErrorCode::kUnavailable, "reducer shard " + std::to_string(options.shard) +
                                                 " is shutting down"));
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
      if (sessions.empty()) break;
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
  stopped = true;
  listener.reset();
  sweep_timer.reset();
  {
    std::lock_guard lock(mu);
    jobs.clear();
    sessions.clear();
  }
  guards.clear();
  contexts.clear();
}

Result<std::unique_ptr<Reducer>> Reducer::start(const ReducerOptions& options) {
  if (options.io_threads == 0) return Status(ErrorCode::kInvalidArgument, "io threads must be > 0");
  if (options.shard_count == 0 || options.shard >= options.shard_count) {
    return Status(ErrorCode::kInvalidArgument, "shard index must be below the shard count");
  }
  if (options.max_chunk_bytes < 4096 || options.max_chunk_bytes % 4096 != 0) {
    return Status(ErrorCode::kInvalidArgument, "max chunk bytes must be a multiple of 4096");
  }
  if (options.window_chunks == 0) {
    return Status(ErrorCode::kInvalidArgument, "window must be at least one chunk");
  }
  const size_t slabs = options.memory_budget_bytes / options.max_chunk_bytes;
  const size_t per_job = options.window_chunks + kJobSlack;
  if (slabs < per_job) {
    return Status(ErrorCode::kInvalidArgument,
                  "memory budget of " + std::to_string(options.memory_budget_bytes) +
                      " bytes holds " + std::to_string(slabs) + " chunk buffers, a job needs " +
                      std::to_string(per_job) + " (window + 2)");
  }
  if (options.transport != "tcp" && options.transport != "fabric") {
    return Status(ErrorCode::kInvalidArgument, "transport must be 'tcp' or 'fabric'");
  }
  auto impl = std::make_shared<Impl>();
  impl->options = options;
  if (options.transport == "fabric") {
    auto fabric = Fabric::open(options.fabric);
    if (!fabric) return fabric.status();
    impl->fabric = *fabric;
    const FabricInfo fi = impl->fabric->info();
    spdlog::info("fabric data path: provider {}, fabric {}, domain {}, memory registration {}",
                 fi.provider, fi.fabric, fi.domain, fi.registration ? "on" : "off");
  }
  // A payload is read into one pool buffer: never accept a larger frame.
  impl->options.connection.max_data_bytes = options.max_chunk_bytes;
  auto pool = SlabPool::create(options.max_chunk_bytes, slabs);
  if (!pool) return pool.status();
  impl->pool = *pool;
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
  for (auto& c : impl->contexts) {
    impl->threads.emplace_back([ctx = c.get()] { ctx->run(); });
  }
  if (impl->fabric) {
    // Open every I/O thread's endpoint now, in parallel, so the first fabric
    // Hello on a thread does not stall that thread's other streams. With a
    // wildcard listen address the local IP is only known per connection.
    boost::system::error_code ec;
    const auto ip = asio::ip::make_address(impl->bound.host, ec);
    if (!ec && !ip.is_unspecified()) {
      std::vector<std::future<Status>> opened;
      for (auto& c : impl->contexts) {
        auto done = std::make_shared<std::promise<Status>>();
        opened.push_back(done->get_future());
        asio::post(*c, [impl, ctx = c.get(), done, host = impl->bound.host] {
          done->set_value(impl->fabric->prepare_endpoint(ctx->get_executor(), host));
        });
      }
      for (auto& f : opened) {
        Status s = f.get();  // each open has fi_getinfo's own bounds
        if (!s.is_ok()) {
          impl->stop();
          impl->join();
          return s;
        }
      }
    }
  }
  spdlog::info("tally-reducer {} ({}) shard {}/{} listening on {}: {} I/O threads, {} buffers of {} bytes",
               TALLY_VERSION, TALLY_GIT_SHA, options.shard, options.shard_count,
               impl->bound.to_string(), options.io_threads, slabs, options.max_chunk_bytes);
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
  s.bytes_received = impl_->counters.bytes_received.load();
  s.bytes_sent = impl_->counters.bytes_sent.load();
  s.chunks_finished = impl_->counters.chunks_finished.load();
  s.ops_failed = impl_->counters.ops_failed.load();
  std::lock_guard lock(impl_->mu);
  s.jobs = impl_->jobs.size();
  s.connections = impl_->sessions.size();
  return s;
}

void Reducer::stop() { impl_->stop(); }

void Reducer::wait() { impl_->join(); }

}  // namespace tally
