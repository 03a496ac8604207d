#include "tally/bench/metrics_scrape.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdlib>

#include "tally/protocol/tcp_transport.h"

namespace tally::bench {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

Result<std::string> http_get(const std::string& host_port, const std::string& target,
                             std::chrono::milliseconds timeout) {
  auto address = parse_host_port(host_port);
  if (!address) return address.status();
  const std::string url = "http://" + host_port + target;
  asio::io_context io;
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  beast::flat_buffer buffer;
  http::request<http::empty_body> request{http::verb::get, target, 11};
  request.set(http::field::host, address->host);
  request.set(http::field::user_agent, "tally-bench");
  http::response<http::string_body> response;
  beast::error_code error;
  bool timed_out = false;
  // One deadline for the whole exchange: the resolver has no timer of its
  // own, so the stream's expiry also cancels it.
  asio::steady_timer deadline(io, timeout);
  deadline.async_wait([&](beast::error_code ec) {
    if (ec) return;
    timed_out = true;
    resolver.cancel();
    stream.close();
  });
  stream.expires_after(timeout);
  resolver.async_resolve(
      address->host, std::to_string(address->port),
      [&](beast::error_code ec, tcp::resolver::results_type results) {
        if (ec) {
          error = ec;
          deadline.cancel();
          return;
        }
        stream.async_connect(results, [&](beast::error_code ec, const tcp::endpoint&) {
          if (ec) {
            error = ec;
            deadline.cancel();
            return;
          }
          http::async_write(stream, request, [&](beast::error_code ec, size_t) {
            if (ec) {
              error = ec;
              deadline.cancel();
              return;
            }
            http::async_read(stream, buffer, response, [&](beast::error_code ec, size_t) {
              error = ec;
              deadline.cancel();
              beast::error_code ignored;
              stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
            });
          });
        });
      });
  io.run();
  if (timed_out || error == beast::error::timeout) {
    return Status(ErrorCode::kTimeout,
                  "GET " + url + " took longer than " + std::to_string(timeout.count()) + " ms");
  }
  if (error) return Status(ErrorCode::kUnavailable, "GET " + url + ": " + error.message());
  if (response.result_int() != 200) {
    return Status(ErrorCode::kUnavailable, "GET " + url + " answered " +
                                               std::to_string(response.result_int()) + ": " +
                                               response.body());
  }
  return std::move(response.body());
}

std::map<std::string, double> parse_metrics(std::string_view text) {
  std::map<std::string, double> out;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    if (line.empty() || line.front() == '#') continue;
    // The series ends at the closing brace of its labels, or at the first
    // space when it has none (label values may hold spaces).
    const size_t brace = line.find('{');
    const size_t space = line.find(' ');
    size_t end = space;
    if (brace != std::string_view::npos && brace < space) {
      const size_t close = line.rfind('}');
      if (close == std::string_view::npos) continue;
      end = close + 1;
    }
    if (end == std::string_view::npos || end >= line.size()) continue;
    const std::string value(line.substr(end + 1));
    char* parsed_end = nullptr;
    const double v = std::strtod(value.c_str(), &parsed_end);
    if (parsed_end == value.c_str()) continue;
    out[std::string(line.substr(0, end))] = v;
  }
  return out;
}

}  // namespace tally::bench
