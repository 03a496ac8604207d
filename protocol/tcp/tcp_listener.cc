// The TCP listener of a reducer (tally/protocol/tcp_transport.h): accepts
// streams onto its I/O threads in turn, and backs off (with rate-limited
// warnings) when the process is out of descriptors or memory.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <chrono>
#include <memory>
#include <vector>

#include "tally/protocol/log_limiter.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {

namespace asio = boost::asio;
using asio::ip::tcp;

struct TcpListener::Impl : std::enable_shared_from_this<TcpListener::Impl> {
  Impl(std::vector<asio::io_context*> ctxs, AcceptFn fn)
      : contexts(std::move(ctxs)),
        acceptor(*contexts.front()),
        backoff_timer(*contexts.front()),
        on_accept(std::move(fn)) {}
  std::vector<asio::io_context*> contexts;
  tcp::acceptor acceptor;
  asio::steady_timer backoff_timer;
  AcceptFn on_accept;
  size_t next = 0;
  // Out of descriptors or memory: accept again after `backoff` (doubling up
  // to kMaxAcceptBackoff), not at once, which would spin a core and flood
  // the log until descriptors free up.
  std::chrono::milliseconds backoff{0};
  // One warning per LogLimiter::kEvery, with the failures since the last.
  LogLimiter warnings{LogLimiter::kEvery, 1};

  static constexpr std::chrono::milliseconds kMinAcceptBackoff{10};
  static constexpr std::chrono::milliseconds kMaxAcceptBackoff{1000};

  static bool resource_exhausted(const boost::system::error_code& ec) {
    return ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
           ec == asio::error::no_memory || ec.value() == ENFILE;
  }

  void warn_rate_limited(const boost::system::error_code& ec) {
    if (auto unlogged = warnings.allow()) {
      spdlog::warn("accept failed: {} ({} time(s) since the last warning; retrying in {} ms)",
                   ec.message(), *unlogged + 1, backoff.count());
    }
  }

  void accept() {
    asio::io_context& target = *contexts[next++ % contexts.size()];
    acceptor.async_accept(target, [self = shared_from_this()](const boost::system::error_code& ec,
                                                              tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !self->acceptor.is_open()) return;
      if (!ec) {
        self->backoff = std::chrono::milliseconds(0);
        self->on_accept(std::move(socket));
        return self->accept();
      }
      if (!resource_exhausted(ec)) {
        self->warn_rate_limited(ec);
        return self->accept();
      }
      self->backoff = std::clamp(self->backoff * 2, kMinAcceptBackoff, kMaxAcceptBackoff);
      self->warn_rate_limited(ec);
      self->backoff_timer.expires_after(self->backoff);
      self->backoff_timer.async_wait([self](const boost::system::error_code& wait_ec) {
        if (!wait_ec && self->acceptor.is_open()) self->accept();
      });
    });
  }
};

Result<std::unique_ptr<TcpListener>> TcpListener::listen(std::vector<asio::io_context*> contexts,
                                                         const HostPort& address,
                                                         AcceptFn on_accept) {
  TALLY_CHECK(!contexts.empty());
  auto impl = std::make_shared<Impl>(std::move(contexts), std::move(on_accept));
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(address.host, ec);
  if (ec) {
    tcp::resolver resolver(*impl->contexts.front());
    auto results = resolver.resolve(address.host, std::to_string(address.port), ec);
    if (ec || results.empty()) {
      return Status(ErrorCode::kUnavailable,
                    "cannot resolve listen address " + address.to_string() + ": " + ec.message());
    }
    addr = results.begin()->endpoint().address();
  }
  tcp::endpoint ep(addr, address.port);
  auto& acc = impl->acceptor;
  acc.open(ep.protocol(), ec);
  if (!ec) acc.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acc.bind(ep, ec);
  if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status(ErrorCode::kUnavailable,
                  "cannot listen on " + address.to_string() + ": " + ec.message());
  }
  asio::post(*impl->contexts.front(), [impl] { impl->accept(); });
  return std::unique_ptr<TcpListener>(new TcpListener(impl));
}

TcpListener::TcpListener(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpListener::~TcpListener() { close(); }

tcp::endpoint TcpListener::local_endpoint() const {
  boost::system::error_code ec;
  return impl_->acceptor.local_endpoint(ec);
}

void TcpListener::close() {
  asio::post(impl_->acceptor.get_executor(), [impl = impl_] {
    boost::system::error_code ec;
    impl->acceptor.close(ec);
    impl->backoff_timer.cancel();
  });
}

}  // namespace tally
