#include "tally/reducer/http_server.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

namespace tally {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class HttpConnection;

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  Impl(HttpServerOptions o, HttpHandler h, HttpServerEvents e)
      : options(std::move(o)), handler(std::move(h)), events(std::move(e)), acceptor(io) {}

  const HttpServerOptions options;
  const HttpHandler handler;
  const HttpServerEvents events;
  asio::io_context io{1};
  tcp::acceptor acceptor;
  HostPort bound;
  std::thread thread;
  std::atomic<size_t> open{0};  // connections being served
  // Live connections, for stop(); touched on the server's thread only.
  std::unordered_map<HttpConnection*, std::weak_ptr<HttpConnection>> live;
  std::once_flag stopped;

  void accept();
};

// One connection: requests are read, answered and written one at a time
// (HTTP/1.1 keep-alive), each within the deadline. Lives on the server's
// single thread.
class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  HttpConnection(std::shared_ptr<HttpServer::Impl> server, tcp::socket socket)
      : server_(std::move(server)), stream_(std::move(socket)) {}
  ~HttpConnection() {
    server_->live.erase(this);
    server_->open.fetch_sub(1, std::memory_order_relaxed);
  }

  // Cuts the connection; its pending operation completes with an error.
  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  void read() {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(server_->options.max_request_bytes));
    parser_->body_limit(0);  // GET has no body; anything else is refused
    stream_.expires_after(server_->options.deadline);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

 private:
  void on_read(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == asio::error::eof ||
        ec == asio::error::connection_reset) {
      return close();
    }
    if (ec == beast::error::timeout) {
      // A partial request past the deadline is hostile or stuck; an idle
      // keep-alive connection simply ends.
      if (buffer_.size() > 0 || parser_->got_some()) {
        if (server_->events.on_timed_out) server_->events.on_timed_out();
      }
      return close();
    }
    if (ec) {
      const bool too_large = ec == http::error::header_limit || ec == http::error::body_limit ||
                             ec == http::error::buffer_overflow;
      const unsigned status = too_large ? 431 : 400;
      return respond(status, "", plain(status, too_large ? "request too large\n" : "bad request\n"),
                     false);
    }
    const auto& req = parser_->get();
    const std::string target(req.target());
    const bool keep_alive = req.keep_alive();
    if (req.method() != http::verb::get) {
      return respond(405, path_of(target), plain(405, "only GET is served\n"), keep_alive);
    }
    HttpResponse answer;
    try {
      answer = server_->handler(target);
    } catch (const std::exception& e) {
      answer = {500, "text/plain; charset=utf-8",
                std::string("internal error: ") + e.what() + "\n"};
    }
    respond(answer.status, path_of(target), std::move(answer), keep_alive);
  }

  static HttpResponse plain(unsigned status, std::string body) {
    return {status, "text/plain; charset=utf-8", std::move(body)};
  }

  static std::string path_of(const std::string& target) {
    const auto q = target.find('?');
    return target.substr(0, q);
  }

  void respond(unsigned status, const std::string& path, HttpResponse answer, bool keep_alive) {
    if (server_->events.on_request) server_->events.on_request(path, status);
    response_.emplace();
    response_->result(status);
    response_->version(11);
    response_->set(http::field::server, "tally-reducer");
    response_->set(http::field::content_type, answer.content_type);
    if (status == 405) response_->set(http::field::allow, "GET");
    response_->keep_alive(keep_alive);
    response_->body() = std::move(answer.body);
    response_->prepare_payload();
    stream_.expires_after(server_->options.deadline);
    http::async_write(stream_, *response_,
                      [self = shared_from_this(), keep_alive](beast::error_code ec, size_t) {
                        if (ec == beast::error::timeout && self->server_->events.on_timed_out) {
                          self->server_->events.on_timed_out();
                        }
                        if (ec || !keep_alive) return self->close();
                        self->read();
                      });
  }

  std::shared_ptr<HttpServer::Impl> server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  std::optional<http::response<http::string_body>> response_;
};

void HttpServer::Impl::accept() {
  acceptor.async_accept([self = shared_from_this()](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !self->acceptor.is_open()) return;
    if (!ec) {
      if (self->open.load(std::memory_order_relaxed) >= self->options.max_connections) {
        // Counted before the close: whoever sees the close sees the count.
        if (self->events.on_rejected) self->events.on_rejected();
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        self->open.fetch_add(1, std::memory_order_relaxed);
        auto conn = std::make_shared<HttpConnection>(self, std::move(socket));
        self->live.emplace(conn.get(), conn);
        conn->read();
      }
    }
    self->accept();
  });
}

Result<std::unique_ptr<HttpServer>> HttpServer::start(const HttpServerOptions& options,
                                                      HttpHandler handler,
                                                      HttpServerEvents events) {
  if (!handler) return Status(ErrorCode::kInvalidArgument, "the HTTP server needs a handler");
  if (options.deadline.count() <= 0 || options.max_request_bytes < 256 ||
      options.max_connections == 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "HTTP deadline must be positive, request limit at least 256 bytes, connection "
                  "limit at least 1");
  }
  auto impl = std::make_shared<Impl>(options, std::move(handler), std::move(events));
  beast::error_code ec;
  auto results = tcp::resolver(impl->io).resolve(
      options.listen.host, std::to_string(options.listen.port), tcp::resolver::passive, ec);
  if (ec || results.empty()) {
    return Status(ErrorCode::kUnavailable, "cannot resolve HTTP listen address " +
                                               options.listen.to_string() + ": " + ec.message());
  }
  const tcp::endpoint endpoint = results.begin()->endpoint();
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status(ErrorCode::kUnavailable,
                  "cannot listen for HTTP on " + options.listen.to_string() + ": " + ec.message());
  }
  const auto local = impl->acceptor.local_endpoint();
  impl->bound = HostPort{local.address().to_string(), local.port()};
  impl->accept();
  impl->thread = std::thread([raw = impl.get()] { raw->io.run(); });
  return std::unique_ptr<HttpServer>(new HttpServer(impl));
}

HttpServer::HttpServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { stop(); }

HostPort HttpServer::address() const { return impl_->bound; }

void HttpServer::stop() {
  std::call_once(impl_->stopped, [this] {
    // Closing the listener and every connection completes their pending
    // operations with errors; their handlers then end and release them, the
    // io_context runs out of work and the thread returns.
    asio::post(impl_->io, [impl = impl_] {
      beast::error_code ignored;
      impl->acceptor.close(ignored);
      std::vector<std::shared_ptr<HttpConnection>> open;
      for (auto& [raw, weak] : impl->live) {
        if (auto c = weak.lock()) open.push_back(std::move(c));
      }
      for (auto& c : open) c->close();
    });
    if (impl_->thread.joinable()) impl_->thread.join();
  });
}

}  // namespace tally
