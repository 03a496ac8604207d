#include "cut_link.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstring>

#include "tally/protocol/address.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/frame.h"

namespace tally::testing {

struct CutLink::Session {
  int worker = -1;
  int reducer = -1;
  std::thread up, down;
  bool holding = false;  // under CutLink::mu_
};

namespace {

bool send_all(int fd, const std::byte* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

}  // namespace

CutLink::CutLink(const std::string& target) {
  auto hp = parse_host_port(target);
  EXPECT_TRUE(hp.is_ok()) << target;
  if (!hp) return;
  target_host_ = hp->host;
  target_port_ = hp->port;
  listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener_, 16) != 0 ||
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ADD_FAILURE() << "cut link: cannot listen: " << std::strerror(errno);
    return;
  }
  address_ = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  acceptor_ = std::thread([this] { accept_loop(); });
}

CutLink::~CutLink() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  if (listener_ >= 0) ::shutdown(listener_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  cut();
  if (listener_ >= 0) ::close(listener_);
}

void CutLink::arm(size_t min_payload) {
  std::lock_guard lock(mu_);
  armed_min_ = min_payload;
  held_ = false;
}

bool CutLink::held_within(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return held_; });
}

void CutLink::cut() {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard lock(mu_);
    sessions.swap(sessions_);
    armed_min_ = 0;
    held_ = false;
  }
  for (auto& s : sessions) {
    ::shutdown(s->worker, SHUT_RDWR);
    ::shutdown(s->reducer, SHUT_RDWR);
    if (s->up.joinable()) s->up.join();
    if (s->down.joinable()) s->down.join();
    ::close(s->worker);
    ::close(s->reducer);
  }
}

void CutLink::accept_loop() {
  for (;;) {
    const int worker = ::accept(listener_, nullptr, nullptr);
    if (worker < 0) return;  // shut down
    const int reducer = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(target_port_);
    ::inet_pton(AF_INET, target_host_.c_str(), &to.sin_addr);
    if (::connect(reducer, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      ::close(reducer);
      ::close(worker);  // as a refused connection would be
      continue;
    }
    auto s = std::make_shared<Session>();
    s->worker = worker;
    s->reducer = reducer;
    std::lock_guard lock(mu_);
    if (stopping_) {
      ::close(worker);
      ::close(reducer);
      return;
    }
    s->up = std::thread([this, s] { relay_up(s); });
    s->down = std::thread([this, s] { relay_down(s); });
    sessions_.push_back(s);
  }
}

void CutLink::relay_up(const std::shared_ptr<Session>& s) {
  std::array<std::byte, 64 << 10> buf;
  for (;;) {
    const ssize_t n = ::recv(s->worker, buf.data(), buf.size(), 0);
    {
      std::lock_guard lock(mu_);
      if (s->holding) return;  // nothing more goes through until cut()
    }
    if (n <= 0 || !send_all(s->reducer, buf.data(), static_cast<size_t>(n))) break;
  }
  ::shutdown(s->reducer, SHUT_RDWR);
}

void CutLink::relay_down(const std::shared_ptr<Session>& s) {
  std::array<std::byte, 64 << 10> buf;
  // Where the stream is: filling a frame header, or inside a payload.
  std::array<std::byte, kFrameHeaderBytes> header{};
  size_t header_filled = 0;
  uint64_t payload_left = 0;
  uint64_t relay_before_hold = UINT64_MAX;  // of the payload in progress
  bool framed = true;                       // false once a header does not decode
  for (;;) {
    const ssize_t n = ::recv(s->reducer, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    size_t at = 0;
    while (at < static_cast<size_t>(n)) {
      const std::byte* p = buf.data() + at;
      const size_t have = static_cast<size_t>(n) - at;
      size_t take = have;
      if (framed && payload_left == 0) {
        take = std::min(have, kFrameHeaderBytes - header_filled);
        std::memcpy(header.data() + header_filled, p, take);
        header_filled += take;
        if (header_filled == kFrameHeaderBytes) {
          header_filled = 0;
          auto h = decode_header(header, FrameLimits{.max_data_bytes = kMaxChunkBytesLimit});
          if (!h) {
            framed = false;
          } else {
            payload_left = h->length;
            std::lock_guard lock(mu_);
            if (armed_min_ > 0 && h->kind == FrameKind::kResult && h->length >= armed_min_) {
              armed_min_ = 0;
              relay_before_hold = h->length / 2;
            }
          }
        }
      } else if (framed) {
        take = std::min<uint64_t>(have, payload_left);
        if (relay_before_hold != UINT64_MAX) {
          take = std::min<uint64_t>(take, relay_before_hold);
          relay_before_hold -= take;
        }
        payload_left -= take;
      }
      if (take > 0 && !send_all(s->worker, p, take)) return;
      at += take;
      if (relay_before_hold == 0) {
        std::lock_guard lock(mu_);
        s->holding = true;
        held_ = true;
        cv_.notify_all();
        return;  // the rest is held back until cut()
      }
    }
  }
  std::lock_guard lock(mu_);
  if (!s->holding) ::shutdown(s->worker, SHUT_RDWR);
}

}  // namespace tally::testing
