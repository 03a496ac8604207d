// /metrics content and the HTTP server's limits, over real sockets on
// 127.0.0.1 (the server runs on its own thread in this process).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <prometheus/histogram.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "tally/bench/metrics_scrape.h"
#include "tally/bench/slow_http.h"
#include "tally/reducer/http_server.h"
#include "tally/reducer/metrics.h"

namespace tally {
namespace {

using namespace std::chrono_literals;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

// Polls `pred` every 10 ms for up to 20 s (a loaded CI machine is slow).
bool eventually_ok(const std::function<bool()>& pred) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

bool eventually_equal(const std::atomic<int>& value, int want) {
  return eventually_ok([&] { return value.load() >= want; });
}

TEST(Metrics, FamiliesAreNamedByConventionAndSerialisedByPrometheusCpp) {
  ReducerStats s;
  s[Count::kWorkerBytesReceived] = 4096;
  s[Count::kWorkerBytesSent] = 8192;
  s[Count::kReplicaBytesReceived] = 12;
  s[Count::kReplicaBytesSent] = 34;
  s[Count::kChunksFinished] = 7;
  s[Count::kOpsCompleted] = 3;
  s.ops_failed_by_reason = {{"TIMEOUT", 2}};
  s.chunks_failed_by_reason = {{"TIMEOUT", 5}};
  prometheus::Histogram h({0.001, 0.01});
  h.Observe(0.0005);
  h.Observe(0.005);
  h.Observe(5);
  s.op_seconds = h.Collect().histogram;
  s[Level::kWorkerStreams] = 4;
  s[Level::kReplicaStreams] = 1;
  s.connections = 6;
  s.slabs_in_use = 2;
  s.slabs_reserved_idle = 8;
  s.slabs_free = 118;
  s.replica_links_expected = 1;
  const std::string text =
      metrics_text(reducer_metric_families(s, ReducerIdentity{1, 2, 0, 2, "tcp"}, false));
  for (const char* line : {
           "# TYPE tally_payload_bytes_received_total counter",
           "tally_payload_bytes_received_total{peer=\"worker\"} 4096",
           "tally_payload_bytes_received_total{peer=\"replica\"} 12",
           "tally_payload_bytes_sent_total{peer=\"worker\"} 8192",
           "tally_payload_bytes_sent_total{peer=\"replica\"} 34",
           "tally_chunks_completed_total 7",
           "tally_ops_completed_total 3",
           "tally_ops_failed_total{reason=\"TIMEOUT\"} 2",
           "tally_chunks_failed_total{reason=\"TIMEOUT\"} 5",
           "# TYPE tally_op_duration_seconds histogram",
           "tally_op_duration_seconds_count 3",
           "tally_op_duration_seconds_bucket{le=\"0.001\"} 1",
           "tally_op_duration_seconds_bucket{le=\"0.01\"} 2",
           "tally_op_duration_seconds_bucket{le=\"+Inf\"} 3",
           "tally_streams_active{kind=\"worker\"} 4",
           "tally_streams_active{kind=\"handshake\"} 1",
           "tally_slabs{state=\"free\"} 118",
           "tally_replica_links_up 0",
           "tally_replica_links 1",
           "tally_ready 0",
           "tally_straggler_ranks 0",
           "tally_streams_paused 0",
           "shard=\"1\"",
       }) {
    EXPECT_TRUE(contains(text, line)) << line << "\n" << text;
  }
  // What the bench reads back is what was written.
  auto m = bench::parse_metrics(text);
  EXPECT_EQ(m["tally_payload_bytes_sent_total{peer=\"worker\"}"], 8192);
  EXPECT_DOUBLE_EQ(m["tally_op_duration_seconds_sum"], 5.0055);
}

struct Server {
  std::unique_ptr<HttpServer> server;
  std::string address;
  std::atomic<int> timed_out{0};
  std::atomic<int> rejected{0};

  explicit Server(HttpServerOptions options = {}) {
    options.listen = HostPort{"127.0.0.1", 0};
    auto s = HttpServer::start(options,
                               [](std::string_view target) -> HttpResponse {
                                 if (target == "/hello") return {200, "text/plain", "hi\n"};
                                 return {404, "text/plain", "no\n"};
                               },
                               {nullptr, [this] { ++rejected; }, [this] { ++timed_out; }});
    EXPECT_TRUE(s) << s.status().to_string();
    if (!s) return;
    server = std::move(*s);
    address = server->address().to_string();
  }
};

// A raw client: connect, send `request`, read until the server closes or
// `timeout`; returns what came back.
std::string raw_exchange(const std::string& address, const std::string& request,
                         std::chrono::milliseconds timeout, bool* closed = nullptr) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  auto hp = parse_host_port(address);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp->port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  if (!request.empty()) {
    EXPECT_EQ(write(fd, request.data(), request.size()), ssize_t(request.size()));
  }
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[4096];
  if (closed) *closed = false;
  while (true) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n == 0) {
      if (closed) *closed = true;
      break;
    }
    if (n < 0) break;  // timeout
    out.append(buf, size_t(n));
  }
  close(fd);
  return out;
}

TEST(HttpServer, AnswersGetAndRefusesOtherMethods) {
  Server s;
  ASSERT_TRUE(s.server);
  auto body = bench::http_get(s.address, "/hello", 2s);
  ASSERT_TRUE(body) << body.status().to_string();
  EXPECT_EQ(*body, "hi\n");
  auto missing = bench::http_get(s.address, "/nope", 2s);
  ASSERT_FALSE(missing);
  EXPECT_TRUE(contains(missing.status().message(), "404")) << missing.status().to_string();
  const std::string post = raw_exchange(
      s.address,
      "POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", 2s);
  EXPECT_TRUE(contains(post, "HTTP/1.1 405")) << post;
  EXPECT_TRUE(contains(post, "Allow: GET")) << post;
}

TEST(HttpServer, KeepAliveServesSeveralRequestsOnOneConnection) {
  Server s;
  ASSERT_TRUE(s.server);
  bool closed = false;
  const std::string out =
      raw_exchange(s.address,
                   "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
                   "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                   3s, &closed);
  EXPECT_TRUE(closed);
  size_t answers = 0;
  for (size_t at = out.find("HTTP/1.1 200"); at != std::string::npos;
       at = out.find("HTTP/1.1 200", at + 1)) {
    ++answers;
  }
  EXPECT_EQ(answers, 2u) << out;
}

TEST(HttpServer, SlowClientIsCutAtTheDeadline) {
  HttpServerOptions o;
  o.request_deadline = 300ms;
  Server s(o);
  ASSERT_TRUE(s.server);
  bool closed = false;
  const auto t0 = std::chrono::steady_clock::now();
  // Half a request, then nothing: the server must hang up, not wait.
  raw_exchange(s.address, "GET /hello HTTP/1.1\r\nHost:", 5s, &closed);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(closed);
  EXPECT_LT(took, 3s);
  EXPECT_GE(took, 250ms);
  EXPECT_TRUE(eventually_equal(s.timed_out, 1));
}

TEST(HttpServer, OversizedRequestIsRefused) {
  HttpServerOptions o;
  o.max_request_bytes = 1024;
  Server s(o);
  ASSERT_TRUE(s.server);
  const std::string out = raw_exchange(
      s.address, "GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4096, 'a') + "\r\n\r\n",
      3s);
  EXPECT_TRUE(contains(out, "HTTP/1.1 431")) << out;
  // A request with a body is refused too (GET carries none).
  const std::string body = raw_exchange(
      s.address, "GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", 3s);
  EXPECT_TRUE(contains(body, "HTTP/1.1 4")) << body;
}

// A full server makes room for a new connection by cutting the one that
// has waited longest for a request; the others are kept.
TEST(HttpServer, AFullServerCutsTheConnectionWaitingLongest) {
  HttpServerOptions o;
  o.max_connections = 2;
  // Far beyond the test's waits: a close seen here is the cut, never the
  // deadline (no wall-clock bound on a loaded machine).
  o.deadline = 60000ms;
  Server s(o);
  ASSERT_TRUE(s.server);
  auto hp = parse_host_port(s.address);
  asio::io_context io;
  const tcp::endpoint server(asio::ip::make_address("127.0.0.1"), hp->port);
  tcp::socket oldest(io), newer(io);
  oldest.connect(server);
  // The server has taken the first before the second arrives.
  ASSERT_TRUE(eventually_ok([&] {
    auto body = bench::http_get(s.address, "/hello", 1s);
    return body.is_ok();
  }));
  newer.connect(server);
  auto body = bench::http_get(s.address, "/hello", 20s);
  ASSERT_TRUE(body) << body.status().to_string();
  // `oldest` was cut (its read ends), `newer` was not.
  char byte;
  boost::system::error_code ec;
  oldest.read_some(asio::buffer(&byte, 1), ec);
  EXPECT_EQ(ec, asio::error::eof) << ec.message();
  newer.non_blocking(true);
  newer.read_some(asio::buffer(&byte, 1), ec);
  EXPECT_EQ(ec, asio::error::would_block) << ec.message();
}

// One source holds at most max_per_source connections: more from it are
// closed at once, while another source is still served.
TEST(HttpServer, OneSourceHoldsAtMostItsShare) {
  HttpServerOptions o;
  o.max_per_source = 3;
  o.deadline = 60000ms;
  Server s(o);
  ASSERT_TRUE(s.server);
  auto hp = parse_host_port(s.address);
  asio::io_context io;
  std::vector<tcp::socket> held;
  for (int i = 0; i < 4; ++i) {
    held.emplace_back(io);
    held.back().open(tcp::v4());
    held.back().bind(tcp::endpoint(asio::ip::make_address("127.0.0.2"), 0));
    held.back().connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), hp->port));
  }
  // The fourth is closed at once (the server accepts in arrival order).
  char byte;
  boost::system::error_code ec;
  held[3].read_some(asio::buffer(&byte, 1), ec);
  EXPECT_EQ(ec, asio::error::eof) << ec.message();
  EXPECT_EQ(s.rejected.load(), 1);
  auto body = bench::http_get(s.address, "/hello", 20s);
  ASSERT_TRUE(body) << body.status().to_string();
}

// At the server's defaults, slow clients cannot starve a probe: 48 of
// them from 40 sources (8 more from one of those) drip their requests and
// reopen what is cut, and a kubelet-style probe (1 s timeout) from
// another source is answered every time. One source holds at most its
// share; a full server cuts the connection that has waited longest for a
// request; a request begun must be whole within a short deadline.
TEST(HttpServer, SlowClientsCannotStarveAProbe) {
  Server s;
  ASSERT_TRUE(s.server);
  std::vector<std::string> sources;
  for (int i = 2; i < 42; ++i) sources.push_back("127.0.0." + std::to_string(i));
  for (int i = 0; i < 8; ++i) sources.push_back("127.0.0.2");
  bench::SlowHttpClients drippers({s.address}, sources, 60s);
  // Until the drippers hold the server: some of theirs were cut already.
  ASSERT_TRUE(eventually_ok([&] { return drippers.cut() >= 8; }));
  for (int probe = 0; probe < 10; ++probe) {
    auto body = bench::http_get(s.address, "/hello", 1s);
    ASSERT_TRUE(body) << "probe " << probe << ": " << body.status().to_string();
    EXPECT_EQ(*body, "hi\n");
    std::this_thread::sleep_for(200ms);
  }
}

TEST(HttpServer, StopsPromptlyWithOpenConnections) {
  HttpServerOptions o;
  o.deadline = 60000ms;  // stop must not wait for an idle connection's deadline
  Server s(o);
  ASSERT_TRUE(s.server);
  auto hp = parse_host_port(s.address);
  asio::io_context io;
  tcp::socket idle(io);
  idle.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), hp->port));
  const auto t0 = std::chrono::steady_clock::now();
  s.server->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
}

}  // namespace
}  // namespace tally
