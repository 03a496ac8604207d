// Reaching a TCP peer: the asynchronous resolve-and-connect with a deadline
// that workers and replica links dial with, the check of a congestion
// control name, and the link rate streams are paced to
// (tally/protocol/tcp_transport.h).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "tally/protocol/tcp_transport.h"

namespace tally {

namespace asio = boost::asio;
using asio::ip::tcp;

void async_tcp_connect(asio::io_context& ctx, const HostPort& address,
                       std::chrono::milliseconds timeout,
                       std::function<void(Result<tcp::socket>)> done) {
  struct State {
    explicit State(asio::io_context& c) : resolver(c), socket(c), timer(c) {}
    tcp::resolver resolver;
    tcp::socket socket;
    asio::steady_timer timer;
    bool finished = false;
    bool timed_out = false;
    std::function<void(Result<tcp::socket>)> done;
  };
  auto st = std::make_shared<State>(ctx);
  st->done = std::move(done);
  const std::string name = address.to_string();
  st->timer.expires_after(timeout);
  st->timer.async_wait([st](const boost::system::error_code& ec) {
    if (ec || st->finished) return;
    st->timed_out = true;
    st->resolver.cancel();
    boost::system::error_code ignored;
    st->socket.close(ignored);
  });
  auto finish = [st, name, timeout](Result<tcp::socket> r) {
    if (st->finished) return;
    st->finished = true;
    st->timer.cancel();
    if (!r && st->timed_out) {
      r = Status(ErrorCode::kTimeout, "connecting to " + name + " took longer than " +
                                          std::to_string(timeout.count()) + " ms");
    }
    st->done(std::move(r));
  };
  st->resolver.async_resolve(
      address.host, std::to_string(address.port),
      [st, finish, name](const boost::system::error_code& ec, tcp::resolver::results_type results) {
        if (ec) {
          return finish(Status(ErrorCode::kUnavailable, "resolving " + name + ": " + ec.message()));
        }
        asio::async_connect(
            st->socket, results,
            [st, finish, name](const boost::system::error_code& ec, const tcp::endpoint&) {
              if (ec) {
                return finish(
                    Status(ErrorCode::kUnavailable, "connecting to " + name + ": " + ec.message()));
              }
              finish(std::move(st->socket));
            });
      });
}

Status check_congestion_control(const std::string& name) {
  if (name.empty()) return Status::ok();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status(ErrorCode::kUnavailable, "socket: " + std::string(strerror(errno)));
  const int rc = ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), name.size());
  const int err = errno;
  ::close(fd);
  if (rc == 0) return Status::ok();
  std::string allowed;
  if (std::ifstream in("/proc/sys/net/ipv4/tcp_allowed_congestion_control"); in) {
    std::getline(in, allowed);
  }
  return Status(ErrorCode::kInvalidArgument,
                "TCP congestion control '" + name + "' cannot be used here (" + strerror(err) +
                    "; allowed: " + (allowed.empty() ? "?" : allowed) + ")");
}

Result<std::string> paced_congestion_control(const std::string& named) {
  std::string chosen = named;
  if (chosen.empty() && check_congestion_control("cubic").is_ok()) chosen = "cubic";
  std::string effective = chosen;
  if (effective.empty()) {
    if (std::ifstream in("/proc/sys/net/ipv4/tcp_congestion_control"); in) {
      std::getline(in, effective);
    }
  }
  if (effective == "bbr") {
    return Status(ErrorCode::kInvalidArgument,
                  std::string("a link rate paces the streams, and under bbr") +
                      (named.empty() ? " (this system's default; cubic is not allowed here)" : "") +
                      " a capped pacing rate stalls transfers below a few MiB: name a "
                      "loss-based congestion control (--tcp-congestion / TALLY_TCP_CONGESTION, "
                      "e.g. cubic, which an unprivileged process may use once it is in "
                      "net.ipv4.tcp_allowed_congestion_control), or set no link rate");
  }
  return chosen;
}

Result<std::string> stream_congestion_control(const std::string& named, uint64_t link_rate_bits,
                                              const std::string& congestion_option,
                                              const std::string& rate_option) {
  TALLY_RETURN_IF_ERROR(check_congestion_control(named).with_context(congestion_option));
  if (link_rate_bits == 0) return named;
  // cubic only where check_congestion_control allowed it, else `named`.
  auto paced = paced_congestion_control(named);
  if (!paced) return paced.status().with_context(rate_option);
  return paced;
}

}  // namespace tally
