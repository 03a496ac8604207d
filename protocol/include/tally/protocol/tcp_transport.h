// TCP transport on Boost.Asio: a Connection per socket, a listener that
// spreads accepted sockets over I/O contexts, and a connect with a deadline.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tally/protocol/address.h"
#include "tally/protocol/transport.h"

namespace tally {

// Wraps a connected socket; the caller owns the connection (shared). It
// lives on the socket's executor (Connection's threading rules).
// Non-blocking; never fails: a dead socket shows as on_closed after start().
std::shared_ptr<Connection> make_tcp_connection(boost::asio::ip::tcp::socket socket,
                                                const ConnectionOptions& options);

// The least a TCP stream's receive window is bounded to, in segments of the
// stream's own size (Connection::bound_receive_window).
inline constexpr uint64_t kMinWindowSegments = 16;

// Whether a TCP socket here may use congestion control `name` (the
// kernel's tcp_available_congestion_control, and for an unprivileged
// process tcp_allowed_congestion_control). Empty is always fine.
// Errors: kInvalidArgument naming the algorithms that are allowed.
Status check_congestion_control(const std::string& name);

// The congestion control for streams paced to a link rate (--link-rate,
// TALLY_LINK_RATE): `named` where set, else cubic where this process may use
// it, else the system's default. bbr (named, or the default with cubic not
// allowed) is refused: under BBR v1 a capped pacing rate stalled transfers
// below a few MiB (docs/architecture.md, "Pacing to the link").
// Errors: kInvalidArgument saying which algorithm and what to do.
Result<std::string> paced_congestion_control(const std::string& named);

// The congestion control a process's streams use, checked usable here:
// `named` (--tcp-congestion, TALLY_TCP_CONGESTION; empty is the system's
// default), or with a link rate set, paced_congestion_control's choice. The
// one way the reducer and the client choose it. Errors: kInvalidArgument,
// in the context of `congestion_option` or `rate_option`, whichever is at
// fault.
Result<std::string> stream_congestion_control(const std::string& named, uint64_t link_rate_bits,
                                              const std::string& congestion_option,
                                              const std::string& rate_option);

// Resolves and connects within `timeout`, trying each resolved address.
// `done` runs on `ctx` with the socket or kUnavailable / kTimeout naming the
// address.
void async_tcp_connect(boost::asio::io_context& ctx, const HostPort& address,
                       std::chrono::milliseconds timeout,
                       std::function<void(Result<boost::asio::ip::tcp::socket>)> done);

// Accepts connections and hands each to `on_accept`, with the socket placed
// on the next of `contexts` in turn (one connection, one I/O thread).
class TcpListener {
 public:
  using AcceptFn = std::function<void(boost::asio::ip::tcp::socket)>;
  // Binds and listens; port 0 picks a free port. Errors: kUnavailable.
  static Result<std::unique_ptr<TcpListener>> listen(std::vector<boost::asio::io_context*> contexts,
                                                     const HostPort& address, AcceptFn on_accept);
  ~TcpListener();
  boost::asio::ip::tcp::endpoint local_endpoint() const;
  // Stops accepting; safe from any thread.
  void close();

 private:
  struct Impl;
  explicit TcpListener(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace tally
