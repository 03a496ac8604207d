#include "tally/reducer/reducer.h"

#include <spdlog/spdlog.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <future>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <algorithm>
#include <atomic>
#include <deque>
#include <fstream>
#include <mutex>
#include <sstream>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/connection_factory.h"
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
// Dialling another replica: each attempt may take this long, and failed
// attempts are retried after a pause that doubles up to the maximum.
constexpr std::chrono::milliseconds kReplicaConnectTimeout{1000};
constexpr std::chrono::milliseconds kReplicaRetryMin{100};
constexpr std::chrono::milliseconds kReplicaRetryMax{1000};

class WorkerSession;
class Replicas;

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
  std::shared_ptr<Replicas> replicas;  // null with one group

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
  // A job another replica announced (PeerJob): found, checked, or created.
  Result<std::shared_ptr<Job>> admit_peer_job(const wire::PeerJob& peer, uint32_t from_group);
  // Creates a job and tells the other participants; mu held.
  Result<std::shared_ptr<Job>> create_job_locked(JobSettings settings);
  std::shared_ptr<Job> find_job(const std::string& name);
  void on_replica_lost(uint32_t group, const Status& why);
  // PeerJob messages of the jobs `group` takes part in.
  std::vector<std::shared_ptr<const wire::Control>> announcements(uint32_t group);
  // Takes `job` out of the table; mu held.
  void erase_job_locked(const std::shared_ptr<Job>& job);
  // Why an ended job's workers left, from its tombstone; mu held.
  std::string ended_job_note_locked(const std::string& name) const;
  void remove(const std::shared_ptr<WorkerSession>& session, const std::shared_ptr<Job>& job,
              const Status& why, bool goodbye);
  // Keeps why `job`'s ranks left (unless all left cleanly) for its
  // successor of the same name; mu held.
  void remember_departures_locked(const Job& job);
  void arm_sweep();
  void stop();
  void join();
};

// Reads the pool list of ReducerOptions::peers ("@PATH" or the list itself).
Result<std::vector<HostPort>> read_pool(const ReducerOptions& o) {
  std::string text = o.peers;
  if (!text.empty() && text.front() == '@') {
    std::ifstream in(text.substr(1));
    if (!in) return Status(ErrorCode::kUnavailable, "pool file " + text.substr(1) + " does not exist yet");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  std::vector<HostPort> out;
  std::string_view rest = text;
  while (!rest.empty()) {
    auto comma = rest.find_first_of(",\n");
    auto item = rest.substr(0, comma);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\r')) item.remove_suffix(1);
    if (!item.empty()) {
      auto hp = parse_host_port(item);
      if (!hp) return hp.status();
      out.push_back(*hp);
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  const size_t want = size_t{o.shard_count} * o.group_count;
  if (out.size() != want) {
    return Status(ErrorCode::kInvalidArgument,
                  "the pool list has " + std::to_string(out.size()) + " addresses, a pool of " +
                      std::to_string(o.shard_count) + " shards x " + std::to_string(o.group_count) +
                      " groups has " + std::to_string(want) + " (in (group, shard) order)");
  }
  return out;
}

class ReplicaLink;

// The other replicas of this reducer's shard. To each one this reducer
// dials an outbound stream on which it sends everything it has for that
// replica (PeerJob, partials, PeerError); it receives on the inbound stream
// that replica dials here (a WorkerSession that said PeerHello). A replica
// is usable while both are up. Once both had been up, losing either one
// fails the ops in flight and makes new ones fail at once, until both are
// up again. Thread-safe.
class Replicas final : public ReplicaMesh, public std::enable_shared_from_this<Replicas> {
 public:
  Replicas(std::weak_ptr<Reducer::Impl> reducer, ReducerOptions options, std::shared_ptr<Fabric> fabric)
      : reducer_(std::move(reducer)),
        options_(std::move(options)),
        fabric_(std::move(fabric)),
        peers_(options_.group_count) {}
  void start(const std::vector<asio::io_context*>& contexts);
  void stop();
  // After the I/O threads are joined: drops the links (they hold this).
  void release();

  void send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                    size_t byte_offset, std::chrono::steady_clock::time_point deadline,
                    SendDone done) override;
  void send_control(uint32_t group, std::shared_ptr<const wire::Control> message) override;
  std::optional<Status> lost(uint32_t group) const override {
    std::lock_guard lock(mu_);
    const Peer& p = peers_.at(group);
    if (p.lost && !(p.out_up && p.in_up)) return p.lost;
    return std::nullopt;
  }
  std::string describe(uint32_t group) const override {
    std::string out = "replica (shard " + std::to_string(options_.shard) + ", group " + std::to_string(group) + ")";
    std::lock_guard lock(mu_);
    if (!peers_.at(group).address.empty()) out += " at " + peers_.at(group).address;
    return out;
  }

  // The address of `group`'s replica, reading the pool list if needed.
  Result<HostPort> address_of(uint32_t group) {
    auto pool = read_pool(options_);
    if (!pool) return pool.status();
    const HostPort hp = (*pool)[size_t{group} * options_.shard_count + options_.shard];
    std::lock_guard lock(mu_);
    peers_[group].address = hp.to_string();
    return hp;
  }
  void set_up(uint32_t group, bool outbound, bool up, const Status& why = {});
  // PeerJob messages of the live jobs `group` takes part in, for a new
  // stream to it (the replica's session for the old one has forgotten them).
  std::vector<std::shared_ptr<const wire::Control>> announcements(uint32_t group);
  // With --transport fabric: the outbound streams' data path; else null.
  const std::shared_ptr<Fabric>& fabric() const { return fabric_; }

 private:
  struct Peer {
    bool out_up = false;
    bool in_up = false;
    std::optional<Status> lost;
    std::string address;
  };
  std::weak_ptr<Reducer::Impl> reducer_;
  const ReducerOptions options_;
  const std::shared_ptr<Fabric> fabric_;
  std::vector<std::shared_ptr<ReplicaLink>> links_;  // by group; null for our own
  mutable std::mutex mu_;
  std::vector<Peer> peers_;  // by group
};

// The outbound stream to one other replica: dials (and redials after a
// loss), says PeerHello with the data path it offers (its fabric endpoint
// with --transport fabric), and is up once the replica's PeerWelcome names
// the data path it attached; then it carries what this reducer sends that
// replica. A PeerWelcome missing after kReplicaConnectTimeout fails the
// connect like a refused dial.
// Lives on one I/O thread; public methods may be called from any thread.
class ReplicaLink final : public FrameHandler, public std::enable_shared_from_this<ReplicaLink> {
 public:
  ReplicaLink(std::shared_ptr<Replicas> owner, const ReducerOptions& options, uint32_t group,
              asio::io_context& io)
      : owner_(std::move(owner)), options_(options), group_(group), io_(io), retry_timer_(io), welcome_timer_(io) {}

  void start() {
    asio::post(io_, [self = shared_from_this()] { self->dial(); });
  }
  void stop() {
    asio::post(io_, [self = shared_from_this()] {
      self->stopping_ = true;
      self->retry_timer_.cancel();
      self->welcome_timer_.cancel();
      self->fail_queue(Status(ErrorCode::kCancelled, "reducer is shutting down"));
      if (self->conn_) self->conn_->close(Status(ErrorCode::kCancelled, "reducer is shutting down"));
    });
  }

  // After the I/O threads are joined: breaks the link <-> connection cycle
  // of a stream whose close never ran (its stop was still queued).
  void drop() {
    conn_.reset();
    queue_.clear();
  }

  // Sends at once while up; while the first connection is still being
  // made, queues until `deadline`; after a loss, fails at once.
  void send(std::function<void(Connection&)> send, std::function<void(const Status&)> fail,
            std::chrono::steady_clock::time_point deadline) {
    asio::post(io_, [self = shared_from_this(), send = std::move(send), fail = std::move(fail), deadline] {
      if (self->conn_ && self->conn_->is_open() && self->up_) return send(*self->conn_);
      if (self->stopping_) return fail(Status(ErrorCode::kCancelled, "reducer is shutting down"));
      if (self->ever_up_) {
        return fail(self->owner_->lost(self->group_).value_or(
            Status(ErrorCode::kPeerLost, self->owner_->describe(self->group_) + " is not connected")));
      }
      self->queue_.push_back({deadline, std::move(send), std::move(fail)});
    });
  }

  // FrameHandler: a replica sends nothing on our outbound stream but its
  // PeerWelcome, heartbeats and, before closing it, an Error.
  PayloadAction on_data_header(const FrameHeader& h) override {
    return PayloadAction::close(Status(ErrorCode::kProtocol, "unexpected " + describe(h) + " from " +
                                                                 owner_->describe(group_)));
  }
  void on_data(const FrameHeader&, std::span<std::byte>) override {}
  void on_control(const wire::Control& message) override {
    if (message.has_error()) {
      fatal_ = status_from_error(message.error());
      return;
    }
    if (message.has_peer_welcome() && !up_) return on_welcome(message.peer_welcome());
    conn_->close(Status(ErrorCode::kProtocol, "unexpected control message from " + owner_->describe(group_)));
  }
  void on_closed(const Status& status) override {
    const Status why = fatal_ ? *fatal_ : status;
    fatal_.reset();
    conn_.reset();
    welcome_timer_.cancel();
    if (!up_) last_error_ = why.message();
    const bool was_up = up_;
    up_ = false;
    if (was_up) owner_->set_up(group_, /*outbound=*/true, false, why);
    if (stopping_) return;
    if (was_up) spdlog::info("{}: outbound stream closed: {}", owner_->describe(group_), why.to_string());
    if (was_up) retry_ = kReplicaRetryMin;  // else (no PeerWelcome) back off as for a failed dial
    schedule_dial();
  }

 private:
  struct Queued {
    std::chrono::steady_clock::time_point deadline;
    std::function<void(Connection&)> send;
    std::function<void(const Status&)> fail;
  };

  void dial() {
    if (stopping_) return;
    expire_queue();
    auto address = owner_->address_of(group_);
    if (!address) {
      last_error_ = address.status().message();
      return schedule_dial();
    }
    address_ = address->to_string();
    async_tcp_connect(io_, *address, kReplicaConnectTimeout,
                      [self = shared_from_this()](Result<asio::ip::tcp::socket> r) { self->on_connected(std::move(r)); });
  }

  void schedule_dial() {
    retry_timer_.expires_after(retry_);
    retry_ = std::min(retry_ * 2, kReplicaRetryMax);
    retry_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) self->dial();
    });
  }

  void on_connected(Result<asio::ip::tcp::socket> r) {
    if (stopping_) return;
    if (!r) {
      last_error_ = r.status().message();
      return schedule_dial();
    }
    conn_ = make_connection(owner_->fabric(), std::move(*r), options_.connection);
    conn_->start(shared_from_this());
    wire::Control hello;
    auto* h = hello.mutable_peer_hello();
    h->set_protocol_version(kProtocolVersion);
    h->set_shard(options_.shard);
    h->set_shard_count(options_.shard_count);
    h->set_group(options_.group);
    h->set_group_count(options_.group_count);
    if (Status s = conn_->describe_data_path(h->mutable_data_path()); !s.is_ok()) {
      return conn_->close(s.with_context("data path for " + owner_->describe(group_)));  // on_closed redials
    }
    conn_->send_control(hello);
    // Up only once the replica's PeerWelcome says where data goes.
    welcome_timer_.expires_after(kReplicaConnectTimeout);
    welcome_timer_.async_wait([self = shared_from_this(), conn = conn_](const boost::system::error_code& ec) {
      if (ec || self->conn_ != conn || self->up_) return;
      conn->close(Status(ErrorCode::kTimeout, "no PeerWelcome from " + self->owner_->describe(self->group_) +
                                                  " within " + std::to_string(kReplicaConnectTimeout.count()) +
                                                  " ms"));
    });
  }

  void on_welcome(const wire::PeerWelcome& welcome) {
    welcome_timer_.cancel();
    if (Status s = conn_->attach_data_path(welcome.data_path()); !s.is_ok()) {
      return conn_->close(s.with_context("data path of " + owner_->describe(group_)));  // on_closed redials
    }
    const std::string& t = welcome.data_path().transport();
    spdlog::info("replica link to (shard {}, group {}) at {}: data path {}", options_.shard, group_, address_,
                 t.empty() ? "tcp" : t);
    for (auto& announce : owner_->announcements(group_)) conn_->send_control(*announce);
    up_ = true;
    ever_up_ = true;
    spdlog::info("connected to {}", owner_->describe(group_));
    owner_->set_up(group_, /*outbound=*/true, true);
    auto queued = std::move(queue_);
    queue_.clear();
    for (auto& q : queued) q.send(*conn_);
  }

  void expire_queue() {
    const auto now = std::chrono::steady_clock::now();
    std::deque<Queued> keep;
    for (auto& q : queue_) {
      if (q.deadline > now) {
        keep.push_back(std::move(q));
      } else {
        q.fail(Status(ErrorCode::kTimeout, owner_->describe(group_) + " could not be reached" +
                                               (last_error_.empty() ? "" : ": " + last_error_)));
      }
    }
    queue_ = std::move(keep);
  }

  void fail_queue(const Status& why) {
    auto queued = std::move(queue_);
    queue_.clear();
    for (auto& q : queued) q.fail(why);
  }

  std::shared_ptr<Replicas> owner_;
  const ReducerOptions& options_;
  const uint32_t group_;
  asio::io_context& io_;
  asio::steady_timer retry_timer_;
  asio::steady_timer welcome_timer_;  // while a PeerHello awaits its PeerWelcome
  std::chrono::milliseconds retry_ = kReplicaRetryMin;
  std::shared_ptr<Connection> conn_;
  bool up_ = false;
  bool ever_up_ = false;
  bool stopping_ = false;
  std::optional<Status> fatal_;
  std::string last_error_;
  std::string address_;  // last dialled
  std::deque<Queued> queue_;
};

void Replicas::start(const std::vector<asio::io_context*>& contexts) {
  links_.resize(options_.group_count);
  for (uint32_t g = 0; g < options_.group_count; ++g) {
    if (g == options_.group) continue;
    links_[g] = std::make_shared<ReplicaLink>(shared_from_this(), options_, g, *contexts[g % contexts.size()]);
    links_[g]->start();
  }
}

void Replicas::stop() {
  for (auto& link : links_) {
    if (link) link->stop();
  }
}

void Replicas::release() {
  for (auto& link : links_) {
    if (link) link->drop();
  }
  links_.clear();
}

void Replicas::send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                            size_t byte_offset, std::chrono::steady_clock::time_point deadline,
                            SendDone done) {
  auto shared_done = std::make_shared<SendDone>(std::move(done));
  links_.at(group)->send(
      [header, slab, byte_offset, shared_done](Connection& conn) {
        conn.send(header, {slab->data() + byte_offset, header.length},
                  [slab, shared_done](const Status& s) { (*shared_done)(s); });
      },
      [shared_done](const Status& s) { (*shared_done)(s); }, deadline);
}

void Replicas::send_control(uint32_t group, std::shared_ptr<const wire::Control> message) {
  // Control messages hold no slab and a PeerJob must never be dropped
  // before its partials: they wait for the first connection however long.
  links_.at(group)->send([message](Connection& conn) { conn.send_control(*message); },
                         [](const Status&) {}, std::chrono::steady_clock::time_point::max());
}

std::vector<std::shared_ptr<const wire::Control>> Replicas::announcements(uint32_t group) {
  auto reducer = reducer_.lock();
  return reducer ? reducer->announcements(group) : std::vector<std::shared_ptr<const wire::Control>>{};
}

void Replicas::set_up(uint32_t group, bool outbound, bool up, const Status& why) {
  std::optional<Status> lost_now;
  {
    std::lock_guard lock(mu_);
    Peer& p = peers_.at(group);
    (outbound ? p.out_up : p.in_up) = up;
    if (up && p.out_up && p.in_up) p.lost.reset();
    if (!up && !p.lost) {
      std::string who = "replica (shard " + std::to_string(options_.shard) + ", group " + std::to_string(group) + ")";
      if (!p.address.empty()) who += " at " + p.address;
      p.lost = Status(ErrorCode::kPeerLost, who + " lost: " + why.message());
      lost_now = p.lost;
    }
  }
  if (lost_now) {
    if (auto reducer = reducer_.lock()) reducer->on_replica_lost(group, *lost_now);
  }
}

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
      if (ec || self->job_ || self->peer_group_) return;
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
    if (peer_group_) return on_partial_header(h);
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
    if (peer_group_) return partial_job_->on_partial_payload(h, partial_);
    job_->on_contribution_payload(h, pending_);
  }

  void on_control(const wire::Control& message) override {
    if (peer_group_) return on_peer_control(message);
    if (message.has_peer_hello() && !job_) return on_peer_hello(message.peer_hello());
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
    partial_ = {};
    if (hello_timer_) hello_timer_->cancel();
    if (peer_group_) {
      const bool expected = why.code() == ErrorCode::kCancelled || why.code() == ErrorCode::kUnavailable;
      spdlog::log(expected ? spdlog::level::info : spdlog::level::warn,
                  "inbound stream of replica group {} ({}) closed: {}", *peer_group_, peer_, why.to_string());
      peer_jobs_.clear();
      partial_job_.reset();
      reducer_->replicas->set_up(*peer_group_, /*outbound=*/false, false, why);
      return reducer_->remove(shared_from_this(), nullptr, why, false);
    }
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
    // Weak: the callback sits in the connection's own queue, and a strong
    // reference there would keep it alive forever if the I/O threads stop
    // before the write completes.
    conn_->send_control(make_error(why), [weak = std::weak_ptr<Connection>(conn_), why](const Status&) {
      if (auto conn = weak.lock()) conn->close(why);
    });
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
    w->set_group(reducer_->options.group);
    w->set_group_count(reducer_->options.group_count);
    TALLY_CHECK(conn_->describe_data_path(w->mutable_data_path()).is_ok());  // attached above
    conn_->send_control(welcome);
    spdlog::info("rank {}/{} of job '{}' joined from {}", rank_, hello.world_size(), job_->name(),
                 peer_);
  }

  // A stream another replica of this shard dialled: it carries that
  // replica's PeerJob, partials and PeerError messages.
  void on_peer_hello(const wire::PeerHello& hello) {
    const ReducerOptions& o = reducer_->options;
    if (hello.protocol_version() != kProtocolVersion) {
      return reject(Status(ErrorCode::kVersionMismatch,
                           "replica speaks protocol version " + std::to_string(hello.protocol_version()) +
                               ", this reducer speaks " + std::to_string(kProtocolVersion)));
    }
    if (!reducer_->replicas || hello.shard() != o.shard || hello.shard_count() != o.shard_count ||
        hello.group_count() != o.group_count || hello.group() >= o.group_count || hello.group() == o.group) {
      return reject(Status(ErrorCode::kInvalidArgument,
                           "replica at " + peer_ + " says it is shard " + std::to_string(hello.shard()) + " of " +
                               std::to_string(hello.shard_count()) + ", group " + std::to_string(hello.group()) +
                               " of " + std::to_string(hello.group_count()) + "; this reducer is shard " +
                               std::to_string(o.shard) + " of " + std::to_string(o.shard_count) + ", group " +
                               std::to_string(o.group) + " of " + std::to_string(o.group_count)));
    }
    if (Status s = conn_->attach_data_path(hello.data_path()); !s.is_ok()) {
      return reject(s.with_context("data path of replica group " + std::to_string(hello.group()) + " at " + peer_));
    }
    wire::Control welcome;
    if (Status s = conn_->describe_data_path(welcome.mutable_peer_welcome()->mutable_data_path()); !s.is_ok()) {
      return reject(s.with_context("data path for replica group " + std::to_string(hello.group())));
    }
    conn_->send_control(welcome);
    peer_group_ = hello.group();
    const std::string& t = hello.data_path().transport();
    spdlog::info("inbound stream of replica group {} from {}: data path {}", *peer_group_, peer_,
                 t.empty() ? "tcp" : t);
    reducer_->replicas->set_up(*peer_group_, /*outbound=*/false, true);
  }

  void on_peer_control(const wire::Control& message) {
    if (message.has_peer_job()) {
      const wire::PeerJob& pj = message.peer_job();
      auto job = reducer_->admit_peer_job(pj, *peer_group_);
      if (!job) {
        spdlog::warn("job '{}' from replica group {}: {}", pj.job(), *peer_group_, job.status().to_string());
        auto reply = std::make_shared<wire::Control>();
        reply->mutable_peer_error()->set_job(pj.job());
        *reply->mutable_peer_error()->mutable_error() = make_error(job.status()).error();
        reducer_->replicas->send_control(*peer_group_, reply);
        peer_jobs_[job_id(pj.job())] = {pj.job(), {}};
        return;
      }
      peer_jobs_[(*job)->id()] = {pj.job(), *job};
      return;
    }
    if (message.has_peer_error()) {
      const wire::PeerError& pe = message.peer_error();
      auto job = reducer_->find_job(pe.job());
      if (!job) return;
      if (pe.workers_left()) return job->on_replica_left(*peer_group_, status_from_error(pe.error()));
      job->on_peer_error(pe.error());
      return;
    }
    if (message.has_error()) {
      spdlog::warn("replica group {} reports: {}", *peer_group_, status_from_error(message.error()).to_string());
      return;
    }
    reject(Status(ErrorCode::kProtocol, "unexpected control message from replica " + peer_));
  }

  PayloadAction on_partial_header(const FrameHeader& h) {
    if (h.kind != FrameKind::kPartial) {
      return PayloadAction::close(Status(ErrorCode::kProtocol, "unexpected " + describe(h) + " from replica " + peer_));
    }
    auto it = peer_jobs_.find(h.job);
    if (it == peer_jobs_.end()) {
      return PayloadAction::close(Status(ErrorCode::kProtocol, "partial of a job replica " + peer_ +
                                                                   " did not announce: " + describe(h)));
    }
    partial_job_ = it->second.job.lock();
    if (!partial_job_) {
      // Refused (the sender was told then), or ended here since.
      auto reply = std::make_shared<wire::Control>();
      reply->mutable_peer_error()->set_job(it->second.name);
      std::string note;
      {
        std::lock_guard lock(reducer_->mu);
        note = reducer_->ended_job_note_locked(it->second.name);
      }
      *reply->mutable_peer_error()->mutable_error() =
          make_error(Status(ErrorCode::kPeerLost, "replica (shard " + std::to_string(reducer_->options.shard) +
                                                      ", group " + std::to_string(reducer_->options.group) +
                                                      ") no longer has job '" + it->second.name +
                                                      "' (or refused it): " + note),
                     h.op)
              .error();
      reducer_->replicas->send_control(*peer_group_, reply);
      return PayloadAction::discard();
    }
    std::weak_ptr<WorkerSession> weak = shared_from_this();
    return partial_job_->on_partial_header(*peer_group_, h, partial_, [weak] {
      if (auto self = weak.lock()) self->wake();
    });
  }

  std::shared_ptr<Reducer::Impl> reducer_;
  std::shared_ptr<Connection> conn_;
  const std::string peer_;
  std::optional<uint32_t> peer_group_;  // set when the stream is another replica's
  // Jobs this replica announced, by id. Weak: a job that ends here must
  // give its memory back even while the replica's stream stays up.
  struct PeerJobRef {
    std::string name;
    std::weak_ptr<Job> job;
  };
  std::unordered_map<uint64_t, PeerJobRef> peer_jobs_;
  std::shared_ptr<Job> partial_job_;  // the job of the partial being read
  PendingPartial partial_;
  std::shared_ptr<Job> job_;
  uint32_t rank_ = 0;
  bool said_goodbye_ = false;
  std::string goodbye_reason_;
  std::optional<std::pair<uint64_t, uint32_t>> last_key_;  // last contribution accepted
  PendingContribution pending_;
  std::optional<asio::steady_timer> hello_timer_;
};

void Reducer::Impl::on_accept(asio::ip::tcp::socket socket) {
  auto conn = make_connection(fabric, std::move(socket), options.connection);
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
  const std::string who = "rank " + std::to_string(hello.rank());
  std::vector<uint32_t> sizes(hello.group_sizes().begin(), hello.group_sizes().end());
  if (sizes.empty() && options.group_count > 1) {
    return Status(ErrorCode::kInvalidArgument,
                  who + " does not say its replica group, but this pool has " +
                      std::to_string(options.group_count) + " groups (set TALLY_GROUPS on every worker)");
  }
  if (!sizes.empty()) {
    uint64_t total = 0;
    for (uint32_t n : sizes) total += n;
    if (sizes.size() != options.group_count || hello.group() != options.group) {
      return Status(ErrorCode::kInvalidArgument,
                    who + " says it is in group " + std::to_string(hello.group()) + " of " +
                        std::to_string(sizes.size()) + ", but this reducer serves group " +
                        std::to_string(options.group) + " of " + std::to_string(options.group_count) +
                        " (check TALLY_GROUPS, and that TALLY_POOL lists the reducers in (group, shard) order)");
    }
    if (total != hello.world_size() || sizes[hello.group()] == 0) {
      return Status(ErrorCode::kInvalidArgument, who + " gives group sizes that do not add up to its world size " +
                                                     std::to_string(hello.world_size()) + " or leave its own group empty");
    }
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
      if (job->settings().group_sizes != sizes) {
        return Status(ErrorCode::kMismatch, who + " gives job '" + hello.job() +
                                                "' other group sizes than the ranks (or replicas) before it");
      }
    } else {
      JobSettings settings;
      settings.name = hello.job();
      settings.world_size = hello.world_size();
      settings.op_timeout = timeout;
      settings.group_sizes = sizes;
      settings.groups_explicit = hello.groups_explicit();
      auto created = create_job_locked(std::move(settings));
      if (!created) return created.status();
      job = *created;
    }
    // Joined under `mu`, so remove() cannot erase the job between finding
    // and joining it (which would leave this rank in an orphaned job).
    TALLY_RETURN_IF_ERROR(job->join(session));
  }
  return job;
}

Result<std::shared_ptr<Job>> Reducer::Impl::create_job_locked(JobSettings settings) {
  settings.shard = options.shard;
  settings.group = options.group;
  size_t participants = 0;
  for (uint32_t n : settings.group_sizes) participants += n > 0;
  participants = std::max<size_t>(participants, 1);
  auto quota = SlabQuota::reserve(pool, Job::quota_slabs(options.window_chunks, participants));
  if (!quota) return quota.status().with_context("job '" + settings.name + "'");
  if (auto t = tombstones.find(settings.name); t != tombstones.end()) {
    if (std::chrono::steady_clock::now() - t->second.ended < kTombstoneLife) {
      settings.history = t->second.departures;
    }
    tombstones.erase(t);
  }
  auto job = std::make_shared<Job>(std::move(settings), std::move(*quota), counters,
                                   participants > 1 ? replicas : nullptr);
  jobs.emplace(job->name(), job);
  if (participants > 1) {
    // Before any partial of it: each replica creates the job on hearing of it.
    auto announce = job->peer_job_message();
    for (uint32_t g : job->participants()) {
      if (g != options.group) replicas->send_control(g, announce);
    }
  }
  return job;
}

Result<std::shared_ptr<Job>> Reducer::Impl::admit_peer_job(const wire::PeerJob& pj, uint32_t from_group) {
  std::vector<uint32_t> sizes(pj.group_sizes().begin(), pj.group_sizes().end());
  uint64_t total = 0;
  for (uint32_t n : sizes) total += n;
  const std::string who = replicas->describe(from_group);
  if (pj.job().empty() || pj.job().size() > kMaxJobNameBytes || pj.world_size() == 0 ||
      pj.world_size() > options.max_world_size || sizes.size() != options.group_count ||
      total != pj.world_size() || sizes[from_group] == 0 || sizes[options.group] == 0 ||
      pj.op_timeout_ms() == 0 || std::chrono::milliseconds(pj.op_timeout_ms()) > options.max_op_timeout) {
    return Status(ErrorCode::kInvalidArgument, who + " announced job '" + pj.job().substr(0, kMaxJobNameBytes) +
                                                   "' with a shape this reducer cannot serve");
  }
  std::lock_guard lock(mu);
  if (stopping) return Status(ErrorCode::kUnavailable, "reducer is shutting down");
  auto it = jobs.find(pj.job());
  if (it != jobs.end()) {
    TALLY_RETURN_IF_ERROR(it->second->check_peer_settings(pj, who));
    return it->second;
  }
  JobSettings settings;
  settings.name = pj.job();
  settings.world_size = pj.world_size();
  settings.op_timeout = std::chrono::milliseconds(pj.op_timeout_ms());
  settings.group_sizes = sizes;
  settings.groups_explicit = pj.groups_explicit();
  return create_job_locked(std::move(settings));
}

std::shared_ptr<Job> Reducer::Impl::find_job(const std::string& name) {
  std::lock_guard lock(mu);
  auto it = jobs.find(name);
  return it == jobs.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const wire::Control>> Reducer::Impl::announcements(uint32_t group) {
  std::vector<std::shared_ptr<const wire::Control>> out;
  std::lock_guard lock(mu);
  for (auto& [name, job] : jobs) {
    const auto& p = job->participants();
    if (p.size() > 1 && std::find(p.begin(), p.end(), group) != p.end()) out.push_back(job->peer_job_message());
  }
  return out;
}

void Reducer::Impl::on_replica_lost(uint32_t group, const Status& why) {
  std::vector<std::shared_ptr<Job>> snapshot;
  {
    std::lock_guard lock(mu);
    if (stopping) return;  // every stream is closing anyway
    for (auto& [name, job] : jobs) snapshot.push_back(job);
  }
  spdlog::warn("{}", why.to_string());
  for (auto& job : snapshot) job->on_replica_lost(group, why);
}

void Reducer::Impl::erase_job_locked(const std::shared_ptr<Job>& job) {
  auto it = jobs.find(job->name());
  if (it == jobs.end() || it->second != job) return;
  jobs.erase(it);
  remember_departures_locked(*job);
  const std::string why = ended_job_note_locked(job->name());
  job->retire(why);
  if (job->participants().size() > 1) {
    // After every partial this replica sent for it (same streams, in order).
    auto left = std::make_shared<wire::Control>();
    auto* pe = left->mutable_peer_error();
    pe->set_job(job->name());
    pe->set_workers_left(true);
    *pe->mutable_error() = make_error(Status(ErrorCode::kPeerLost, "replica (shard " + std::to_string(options.shard) +
                                                                      ", group " + std::to_string(options.group) +
                                                                      ") no longer has job '" + job->name() +
                                                                      "': " + why))
                               .error();
    for (uint32_t g : job->participants()) {
      if (g != options.group) replicas->send_control(g, left);
    }
  }
}

std::string Reducer::Impl::ended_job_note_locked(const std::string& name) const {
  std::string note = "its workers have left";
  auto t = tombstones.find(name);
  if (t == tombstones.end()) return note;
  for (auto& [rank, reason] : t->second.departures) note += " (rank " + std::to_string(rank) + ": " + reason + ")";
  return note;
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
      erase_job_locked(job);
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
    // A job a replica announced whose workers never came here.
    for (auto& job : snapshot) {
      if (!job->abandoned(now)) continue;
      std::lock_guard lock(self->mu);
      if (job->abandoned(now)) {
        spdlog::info("job '{}' never got workers on shard {} group {}", job->name(), self->options.shard,
                     self->options.group);
        self->erase_job_locked(job);
      }
    }
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
  if (replicas) replicas->stop();
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
  if (replicas) replicas->release();
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
  if (options.group_count == 0 || options.group >= options.group_count) {
    return Status(ErrorCode::kInvalidArgument, "group index must be below the group count");
  }
  if (options.group_count > 1) {
    if (options.peers.empty()) {
      return Status(ErrorCode::kInvalidArgument, "with more than one group the reducer needs --peers");
    }
    if (options.peers.front() != '@') {
      auto pool = read_pool(options);
      if (!pool) return pool.status();
    }
  }
  if (options.max_chunk_bytes < 4096 || options.max_chunk_bytes % 4096 != 0) {
    return Status(ErrorCode::kInvalidArgument, "max chunk bytes must be a multiple of 4096");
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
                      " partials received per chunk with " + std::to_string(options.group_count) + " groups)");
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
  if (options.group_count > 1) {
    impl->replicas = std::make_shared<Replicas>(impl, impl->options, impl->fabric);
    impl->replicas->start(raw);
  }
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
  spdlog::info("tally-reducer {} ({}) shard {}/{} group {}/{} listening on {}: {} I/O threads, {} buffers of {} bytes",
               TALLY_VERSION, TALLY_GIT_SHA, options.shard, options.shard_count, options.group, options.group_count,
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
  s.replica_bytes_received = impl_->counters.replica_bytes_received.load();
  s.replica_bytes_sent = impl_->counters.replica_bytes_sent.load();
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
