// A small HTTP/1.1 server (Boost.Beast) for /metrics, /healthz and /readyz.
// It runs on its own thread and io_context, never on an I/O thread of the
// data path, so a slow scrape cannot delay a chunk. Hostile clients are
// bounded, so that none can starve a health probe:
// - a request, once its first byte is in, must be whole within
//   `request_deadline`; an idle connection waits `deadline` for one, and an
//   answer must be written within `deadline` (the connection is cut
//   otherwise);
// - request headers are limited in size, and bodies are refused;
// - one source address holds at most `max_per_source` connections (more
//   from it are closed at once);
// - at most `max_connections` are open: a new one past that cuts the open
//   connection that has waited longest for a request, or is closed at once
//   when every open one is writing an answer.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "tally/protocol/status.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {

struct HttpServerOptions {
  HostPort listen{"127.0.0.1", 9090};
  // Reading one request and writing its answer, and an idle keep-alive
  // connection's wait for the next request. Prometheus's default scrape
  // timeout is 10 s; our answers take microseconds.
  std::chrono::milliseconds deadline{5000};
  // From a request's first byte to its last header: a scraper or probe
  // sends it in one segment.
  std::chrono::milliseconds request_deadline{1000};
  // Request line plus headers; a scraper sends a few hundred bytes.
  size_t max_request_bytes = 8192;
  // Open connections; a scraper and two kubelet probes need three.
  size_t max_connections = 32;
  // Open connections from one source address (the kubelet probes from its
  // node's address, a scraper from its own).
  size_t max_per_source = 8;
};

struct HttpResponse {
  unsigned status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// What the server reports about itself (for /metrics); may be called on the
// server's thread. `on_request(path, status)`, `on_rejected()`,
// `on_timed_out()`; any may be empty.
struct HttpServerEvents {
  std::function<void(const std::string& target, unsigned status)> on_request;
  std::function<void()> on_rejected;
  std::function<void()> on_timed_out;
};

// Answers a GET for `target` (path and query as sent). Runs on the server's
// thread: it must not block for long.
using HttpHandler = std::function<HttpResponse(std::string_view target)>;

class HttpServer {
 public:
  // Binds and starts the server's thread. Errors: kInvalidArgument (an
  // option), kUnavailable (the address cannot be bound).
  static Result<std::unique_ptr<HttpServer>> start(const HttpServerOptions& options,
                                                   HttpHandler handler,
                                                   HttpServerEvents events = {});
  // Stops and joins (stop() then the thread).
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound address (the real port when options.listen.port was 0).
  HostPort address() const;
  // Closes the listener and every connection and joins the thread;
  // idempotent, thread-safe (not from the handler).
  void stop();

 private:
  friend class HttpConnection;  // one client connection, in http_server.cc
  struct Impl;
  explicit HttpServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace tally
