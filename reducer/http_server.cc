#include "tally/reducer/http_server.h"

#include <spdlog/spdlog.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <mutex>
#include <optional>
#include <string>
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
  // Touched on the server's thread only:
  // live connections, for stop() and for making room;
  std::unordered_map<HttpConnection*, std::weak_ptr<HttpConnection>> live;
  size_t open = 0;                                  // those holding a slot
  std::unordered_map<std::string, size_t> sources;  // slots held by source address
  std::once_flag stopped;

  void accept();
  // Whether a connection from `source` may have a slot, cutting the one
  // that has waited longest for a request when every slot is taken.
  bool make_room(const std::string& source);
};

// One connection: requests are read, answered and written one at a time
// (HTTP/1.1 keep-alive), each within the deadline. Lives on the server's
// single thread.
class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  using Clock = std::chrono::steady_clock;

  // Takes a slot for `source` (make_room said there is one).
  HttpConnection(std::shared_ptr<HttpServer::Impl> server, tcp::socket socket, std::string source)
      : server_(std::move(server)), stream_(std::move(socket)), source_(std::move(source)) {
    ++server_->open;
    ++server_->sources[source_];
  }
  ~HttpConnection() {
    server_->live.erase(this);
    release();
  }

  // Cuts the connection and frees its slot at once; its pending operation
  // completes with an error.
  void close() {
    release();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  // Waits for the next request (its first byte within the deadline, the
  // rest within the request deadline).
  void read() {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(server_->options.max_request_bytes));
    parser_->body_limit(0);  // GET has no body; anything else is refused
    waiting_since_ = Clock::now();
    writing_ = false;
    if (buffer_.size() > 0) return read_request();  // pipelined after the last one
    stream_.expires_after(server_->options.deadline);
    stream_.async_read_some(buffer_.prepare(server_->options.max_request_bytes),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              if (ec) return self->on_read(ec);
                              self->buffer_.commit(n);
                              self->read_request();
                            });
  }

  // May the server cut this one to make room: it holds a slot and waits
  // for a request, since `waiting_since()`.
  bool waiting() const { return slot_ && !writing_; }
  Clock::time_point waiting_since() const { return waiting_since_; }

 private:
  void release() {
    if (!slot_) return;
    slot_ = false;
    --server_->open;
    auto it = server_->sources.find(source_);
    if (it != server_->sources.end() && --it->second == 0) server_->sources.erase(it);
  }

  void read_request() {
    stream_.expires_after(server_->options.request_deadline);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

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
    writing_ = true;
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
  const std::string source_;
  bool slot_ = true;
  bool writing_ = false;
  Clock::time_point waiting_since_ = Clock::now();
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  std::optional<http::response<http::string_body>> response_;
};

void HttpServer::Impl::accept() {
  acceptor.async_accept([self = shared_from_this()](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !self->acceptor.is_open()) return;
    if (!ec) {
      beast::error_code peer_error;
      const auto peer = socket.remote_endpoint(peer_error);
      const std::string source = peer_error ? std::string() : peer.address().to_string();
      if (peer_error || !self->make_room(source)) {
        // Counted before the close: whoever sees the close sees the count.
        if (self->events.on_rejected) self->events.on_rejected();
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        auto conn = std::make_shared<HttpConnection>(self, std::move(socket), source);
        self->live.emplace(conn.get(), conn);
        conn->read();
      }
    }
    self->accept();
  });
}

bool HttpServer::Impl::make_room(const std::string& source) {
  if (auto it = sources.find(source); it != sources.end() && it->second >= options.max_per_source) {
    return false;
  }
  if (open < options.max_connections) return true;
  std::shared_ptr<HttpConnection> oldest;
  for (auto& [raw, weak] : live) {
    auto c = weak.lock();
    if (c && c->waiting() && (!oldest || c->waiting_since() < oldest->waiting_since())) {
      oldest = std::move(c);
    }
  }
  if (!oldest) return false;  // every slot is writing an answer
  oldest->close();
  return true;
}

Result<std::unique_ptr<HttpServer>> HttpServer::start(const HttpServerOptions& options,
                                                      HttpHandler handler,
                                                      HttpServerEvents events) {
  if (!handler) return Status(ErrorCode::kInvalidArgument, "the HTTP server needs a handler");
  if (options.deadline.count() <= 0 || options.request_deadline.count() <= 0 ||
      options.max_request_bytes < 256 || options.max_connections == 0 ||
      options.max_per_source == 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "HTTP deadlines must be positive, request limit at least 256 bytes, connection "
                  "limits at least 1");
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
