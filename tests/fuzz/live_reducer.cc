#include "live_reducer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "tally/protocol/chunking.h"
#include "tally/protocol/control.h"
#include "tally/reducer/reducer.h"

namespace tally::fuzz {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "fuzz harness: %s\n", what.c_str());
  std::abort();
}

// What both fuzzing reducers share: small enough that a run's memory stays
// far below -rss_limit_mb, short enough timeouts that a stalled stream ends
// long before kStreamDeadline.
ReducerOptions base_options() {
  // The reducers' logs would be one line per input; the harness checks what it needs.
  spdlog::set_level(spdlog::level::off);
  // The reducers are never stopped, so their I/O threads still run while
  // the process exits, and log (at level off) through spdlog's default
  // logger, which spdlog's registry frees at exit. A reference held here
  // for good keeps the logger alive for them: ASan saw a thread read the
  // freed logger, about one FuzzSeeds.replica_session run in 30, then hung
  // beside LeakSanitizer's exit check. (Stopping the reducers at exit
  // instead ends their threads, whose OpenSSL thread state LeakSanitizer
  // then reports.)
  static const auto* const kept_logger =
      new std::shared_ptr<spdlog::logger>(spdlog::default_logger());
  (void)kept_logger;
  ReducerOptions o;
  o.listen = HostPort{"127.0.0.1", 0};
  o.io_threads = 2;
  o.max_chunk_bytes = 64u << 10;     // inputs are smaller (libFuzzer's -max_len)
  o.memory_budget_bytes = 8u << 20;  // 128 buffers: a dozen jobs
  o.window_chunks = 4;
  o.ingress_window_bytes = 256u << 10;
  o.hello_timeout = std::chrono::milliseconds(1000);
  o.max_op_timeout = std::chrono::milliseconds(1000);
  o.connection.heartbeat_interval = std::chrono::milliseconds(200);
  o.connection.peer_timeout = std::chrono::milliseconds(2000);
  return o;
}

Reducer* start_or_die(const ReducerOptions& options) {
  auto reducer = Reducer::start(options);
  if (!reducer) die("cannot start a reducer: " + reducer.status().to_string());
  // Never stopped: it serves every input of this process.
  return reducer->release();
}

}  // namespace

const Secret& job_secret() {
  static const Secret secret(std::string("fuzzing job secret, 32 bytes...."));
  return secret;
}

const Secret& pool_secret() {
  static const Secret secret(std::string("fuzzing pool secret, 32 bytes..."));
  return secret;
}

HostPort worker_reducer() {
  static Reducer* const reducer = [] {
    ReducerOptions o = base_options();
    o.job_secret = job_secret();
    return start_or_die(o);
  }();
  return reducer->address();
}

HostPort replica_reducer() {
  // Both reducers stay reachable from here for the process's life.
  static Reducer* group0 = nullptr;
  static Reducer* group1 = nullptr;
  static const HostPort address = [] {
    // The pool list names ports known only once both listen: a file,
    // read when the replicas first dial (ReducerOptions::pool).
    char path[] = "/tmp/tally-fuzz-pool-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0) die(std::string("mkstemp: ") + std::strerror(errno));
    ::close(fd);
    ReducerOptions o = base_options();
    o.shard_count = 1;
    o.group_count = 2;
    o.pool = std::string("@") + path;
    o.pool_secret = pool_secret();
    o.group = 0;
    Reducer* a = group0 = start_or_die(o);
    o.group = 1;
    Reducer* b = group1 = start_or_die(o);
    std::ofstream(path) << a->address().to_string() << "," << b->address().to_string() << "\n";
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (a->stats().replica_links_up < 1 || b->stats().replica_links_up < 1) {
      if (Clock::now() > deadline) die("the two replicas did not link within 20 s");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::unlink(path);
    return a->address();
  }();
  return address;
}

std::string control_frame(std::span<const uint8_t> payload) {
  FrameHeader h;
  h.kind = FrameKind::kControl;
  h.length = payload.size();
  const EncodedHeader header = encode_header(h);
  std::string out(reinterpret_cast<const char*>(header.data()), header.size());
  out.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  return out;
}

std::string control_frame(const wire::Control& message) {
  const std::string payload = message.SerializeAsString();
  return control_frame(std::span(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()));
}

Stream::Stream(const HostPort& address) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) die(std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(address.port);
  if (::inet_pton(AF_INET, address.host.c_str(), &sa.sin_addr) != 1) die("bad address");
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 && errno != EINPROGRESS) {
    die(std::string("connect: ") + std::strerror(errno));
  }
  pollfd p{fd_, POLLOUT, 0};
  if (::poll(&p, 1, 5000) != 1) die("connect to the local reducer took over 5 s");
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) die(std::string("connect: ") + std::strerror(err));
}

Stream::~Stream() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {
int poll_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}
}  // namespace

bool Stream::read_some(Clock::time_point deadline, std::string* into) {
  if (eof_) return false;
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, poll_ms(deadline)) <= 0) return true;  // nothing yet
  char buf[64 << 10];
  const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
  if (n > 0) {
    // Only a handshake reads what it is sent; afterwards it is dropped,
    // so a long stream of results does not pile up here.
    if (into->size() < (1u << 20)) into->append(buf, static_cast<size_t>(n));
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  eof_ = true;  // the end, or a reset: the reducer closed the stream
  return false;
}

bool Stream::write(std::string_view bytes, Clock::time_point deadline) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    if (eof_ || Clock::now() > deadline) return false;
    pollfd p{fd_, POLLIN | POLLOUT, 0};
    if (::poll(&p, 1, poll_ms(deadline)) <= 0) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      if (!read_some(deadline, &pending_)) return false;
    }
    if (p.revents & POLLOUT) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        return false;  // reset: the reducer closed the stream
      }
    }
  }
  return true;
}

std::optional<wire::Control> Stream::read_control(Clock::time_point deadline) {
  // Results may be up to the reducer's chunk size; anything else is refused.
  const FrameLimits limits{kMaxChunkBytesLimit};
  for (;;) {
    if (pending_.size() >= kFrameHeaderBytes) {
      auto h =
          decode_header(std::span<const std::byte, kFrameHeaderBytes>(
                            reinterpret_cast<const std::byte*>(pending_.data()), kFrameHeaderBytes),
                        limits);
      if (!h) return std::nullopt;
      if (pending_.size() >= kFrameHeaderBytes + h->length) {
        const auto payload =
            std::as_bytes(std::span(pending_)).subspan(kFrameHeaderBytes, h->length);
        std::optional<wire::Control> message;
        if (h->kind == FrameKind::kControl) {
          auto parsed = parse_control(payload);
          if (!parsed) return std::nullopt;
          message = std::move(*parsed);
        }
        pending_.erase(0, kFrameHeaderBytes + h->length);
        if (message && !message->has_heartbeat()) return message;
        continue;
      }
    }
    if (Clock::now() > deadline || !read_some(deadline, &pending_)) return std::nullopt;
  }
}

bool Stream::finish(Clock::time_point deadline) {
  ::shutdown(fd_, SHUT_WR);
  std::string dropped;
  while (Clock::now() <= deadline) {
    if (!read_some(deadline, &dropped)) return true;
    dropped.clear();
  }
  return false;
}

void run_live_input(const HostPort& address, const uint8_t* data, size_t size,
                    SendPrefix send_prefix) {
  if (size == 0) return;
  const uint8_t mode = data[0];
  const std::span<const uint8_t> rest(data + 1, size - 1);
  const auto deadline = std::chrono::steady_clock::now() + kStreamDeadline;
  Stream stream(address);
  if (send_prefix(stream, mode, deadline)) {
    const std::string bytes =
        (mode & 4) ? control_frame(rest)
                   : std::string(reinterpret_cast<const char*>(rest.data()), rest.size());
    stream.write(bytes, deadline);
  }
  // The reducer must close a stream whose peer is done, in bounded time.
  const bool closed = stream.finish(deadline);
  TALLY_CHECK(closed);
}

}  // namespace tally::fuzz
