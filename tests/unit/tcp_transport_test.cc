// The TCP transport over a real loopback stream: frames larger than one
// write or read call arrive whole and in order, whatever fragments the bytes
// come in; a posted receive is written only with a whole payload; control frames queued for a peer
// that does not read are capped per stream and across the streams that share a budget; a paced
// stream's socket carries its pacing rate, and the share and congestion control streams are paced
// with; a bounded stream's window stays at its bound through a transfer, and streams
// converging on one receiver share its budget.
#include "tally/protocol/tcp_transport.h"

#include <gtest/gtest.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <cstddef>
#include <deque>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/frame.h"
#include "tally/protocol/link_rate.h"
#include "tally/protocol/transport.h"

namespace tally {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

// Receives every data frame into a buffer of its own.
class Collector : public FrameHandler {
 public:
  PayloadAction on_data_header(const FrameHeader& h) override {
    buffers.emplace_back(h.length);
    return PayloadAction::receive(buffers.back(), nullptr);  // outlives the connection
  }
  void on_data(const FrameHeader& h, std::span<std::byte> payload) override {
    headers.push_back(h);
    received.emplace_back(payload.begin(), payload.end());
  }
  void on_control(const wire::Control&) override {}
  void on_closed(const Status& why) override { closed = why; }

  std::deque<std::vector<std::byte>> buffers;
  std::vector<FrameHeader> headers;
  std::vector<std::vector<std::byte>> received;
  std::optional<Status> closed;
};

std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return out;
}

FrameHeader data_header(uint64_t op, uint32_t chunk, size_t length) {
  FrameHeader h;
  h.kind = FrameKind::kContribution;
  h.op = op;
  h.chunk = chunk;
  h.chunks_on_shard = chunk + 1;
  h.length = length;
  h.dtype = DType::kFloat32;
  h.redop = RedOp::kSum;
  h.count = length / 4;
  return h;
}

// A connected loopback pair whose segments are `segment` bytes (the
// client's SYN offers it; 0: loopback's own, about 64 KiB).
struct LoopbackPair {
  asio::io_context io;
  tcp::socket server{io};
  tcp::socket client{io};
  explicit LoopbackPair(int segment = 0) {
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    client.open(tcp::v4());
    if (segment > 0) {
      EXPECT_EQ(
          ::setsockopt(client.native_handle(), IPPROTO_TCP, TCP_MAXSEG, &segment, sizeof segment),
          0);
    }
    client.connect(acceptor.local_endpoint());
    server = acceptor.accept();
  }
  // Runs the loop until `done` or a 20 s deadline.
  template <typename Pred>
  bool run_until(Pred done) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!done() && std::chrono::steady_clock::now() < deadline) io.run_for(10ms);
    return done();
  }
};

TEST(TcpTransport, FramesLargerThanOneCallArriveWholeAndInOrder) {
  LoopbackPair pair;
  ConnectionOptions options;
  options.max_data_bytes = 8u << 20;
  auto receiver = make_tcp_connection(std::move(pair.server), options);
  auto sender = make_tcp_connection(std::move(pair.client), options);
  auto collector = std::make_shared<Collector>();
  receiver->start(collector);
  sender->start(std::make_shared<Collector>());

  // Sizes around the old 64 KiB per-call cap and above the 1 MiB read fragment
  // (whole float32s, as the frame codec requires).
  const std::vector<size_t> sizes{(3u << 20) + 4, 4, 65532, 65540, 1u << 20, (1u << 20) + 4};
  std::vector<std::vector<std::byte>> payloads;
  for (size_t i = 0; i < sizes.size(); ++i) payloads.push_back(pattern(sizes[i], i));
  size_t sent_ok = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sender->send(data_header(7, static_cast<uint32_t>(i), sizes[i]), payloads[i],
                 [&](const Status& s) { sent_ok += s.is_ok() ? 1 : 0; });
  }
  ASSERT_TRUE(pair.run_until([&] { return collector->received.size() == sizes.size(); }))
      << collector->received.size() << " of " << sizes.size() << " frames arrived; "
      << (collector->closed ? collector->closed->to_string() : "open");
  EXPECT_FALSE(collector->closed.has_value());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(collector->headers[i].chunk, i);
    EXPECT_TRUE(collector->received[i] == payloads[i]) << "frame " << i << " differs";
  }
  ASSERT_TRUE(pair.run_until([&] { return sent_ok == sizes.size(); }));
  receiver->close(Status(ErrorCode::kCancelled, "test over"));
  sender->close(Status(ErrorCode::kCancelled, "test over"));
}

TEST(TcpTransport, PayloadTricklingInUnevenFragmentsIsAssembled) {
  LoopbackPair pair;
  ConnectionOptions options;
  options.max_data_bytes = 8u << 20;
  auto receiver = make_tcp_connection(std::move(pair.server), options);
  auto collector = std::make_shared<Collector>();
  receiver->start(collector);

  const size_t n = (2u << 20) + 4;
  const auto payload = pattern(n, 42);
  const auto header = encode_header(data_header(1, 0, n));
  // A raw peer on its own thread writes the header and then the payload in
  // fragments of 1, 65537, 3 and the rest bytes, so reads complete short.
  std::thread writer([&, socket = std::move(pair.client)]() mutable {
    boost::system::error_code ec;
    asio::write(socket, asio::buffer(header), ec);
    const size_t fragments[] = {1, 65537, 3};
    size_t at = 0;
    for (size_t p : fragments) {
      asio::write(socket, asio::buffer(payload.data() + at, p), ec);
      at += p;
      std::this_thread::sleep_for(20ms);  // let the reader see a short read
    }
    asio::write(socket, asio::buffer(payload.data() + at, n - at), ec);
    // Keep the stream open until the reader is done with it.
    char byte;
    socket.read_some(asio::buffer(&byte, 1), ec);
  });
  const bool arrived = pair.run_until([&] { return !collector->received.empty(); });
  receiver->close(Status(ErrorCode::kCancelled, "test over"));
  writer.join();
  ASSERT_TRUE(arrived) << (collector->closed ? collector->closed->to_string() : "open");
  EXPECT_TRUE(collector->received[0] == payload);
}

// A posted receive is written only with its whole payload: a stream that
// ends part-way through leaves the buffer as it was (a worker's buffer
// holds its input there, which it sends again after a reducer restart),
// and a receive cancelled while its payload arrives is never written nor
// reported. A whole payload for a posted receive arrives as it was sent.
TEST(TcpTransport, APostedReceiveIsWrittenOnlyWithItsWholePayload) {
  for (const bool cancel : {false, true}) {
    SCOPED_TRACE(cancel ? "cancelled mid-payload" : "stream lost mid-payload");
    LoopbackPair pair;
    ConnectionOptions options;
    options.max_data_bytes = 8u << 20;
    auto receiver = make_tcp_connection(std::move(pair.server), options);
    auto collector = std::make_shared<Collector>();
    receiver->start(collector);
    const size_t n = 1u << 20;
    const auto input = pattern(n, 5), result = pattern(n, 6), next = pattern(64, 7);
    std::vector<std::byte> buffer = input, other(next.size());
    FrameHeader h = data_header(3, 0, n);
    h.kind = FrameKind::kResult;
    FrameHeader h2 = data_header(3, 1, next.size());
    h2.kind = FrameKind::kResult;
    receiver->post_receive({FrameKind::kResult, 3, 0}, buffer);
    receiver->post_receive({FrameKind::kResult, 3, 1}, other);
    const auto header = encode_header(h), header2 = encode_header(h2);
    std::promise<void> half_sent, cancelled;
    std::thread writer([&, socket = std::move(pair.client)]() mutable {
      boost::system::error_code ec;
      asio::write(socket, asio::buffer(header), ec);
      asio::write(socket, asio::buffer(result.data(), n / 2), ec);
      half_sent.set_value();
      if (!cancel) return;  // the stream closes with half the payload sent
      cancelled.get_future().wait();
      asio::write(socket, asio::buffer(result.data() + n / 2, n - n / 2), ec);
      asio::write(socket, asio::buffer(header2), ec);
      asio::write(socket, asio::buffer(next), ec);
      char byte;
      socket.read_some(asio::buffer(&byte, 1), ec);  // open until the reader is done
    });
    half_sent.get_future().wait();
    if (cancel) {
      // Let the reader take part of the payload before the cancel.
      pair.io.run_for(50ms);
      receiver->cancel_receive({FrameKind::kResult, 3, 0});
      cancelled.set_value();
      EXPECT_TRUE(pair.run_until([&] { return !collector->received.empty(); }));
      ASSERT_EQ(collector->headers.size(), 1u) << "the cancelled receive was reported";
      EXPECT_EQ(collector->headers[0].chunk, 1u);
      EXPECT_TRUE(other == next) << "the next frame's receive is intact";
    } else {
      EXPECT_TRUE(pair.run_until([&] { return collector->closed.has_value(); }));
      EXPECT_TRUE(collector->received.empty());
    }
    receiver->close(Status(ErrorCode::kCancelled, "test over"));
    writer.join();
    EXPECT_TRUE(buffer == input) << "the posted buffer was written with part of a payload";
  }
}

// A 1 KiB control frame: charged 1 KiB + its protobuf framing + kQueuedFrameOverhead.
wire::Control kib_error() {
  wire::Control m;
  m.mutable_error()->set_message(std::string(1024, 'x'));
  return m;
}

// Queues `message` on `conn` until it closes (or `most` frames); returns
// how many were queued before it did.
size_t queue_until_closed(Connection& conn, const wire::Control& message, size_t most) {
  size_t n = 0;
  while (conn.is_open() && n < most) {
    conn.send_control(message);
    if (conn.is_open()) ++n;
  }
  return n;
}

// The io_context is never run, so nothing but the first frame is written:
// the peers do not read, as far as the queues can tell.
TEST(TcpTransport, ControlFramesForAPeerThatDoesNotReadAreCappedPerStreamAndShared) {
  const wire::Control frame = kib_error();
  const size_t cost = frame.ByteSizeLong() + kQueuedFrameOverhead;

  {  // Alone, a stream queues up to kMaxQueuedControlBytes, charged what frames cost.
    LoopbackPair pair;
    auto conn = make_tcp_connection(std::move(pair.server), ConnectionOptions{});
    auto handler = std::make_shared<Collector>();
    conn->start(handler);
    const size_t queued = queue_until_closed(*conn, frame, 100000);
    EXPECT_EQ(queued, kMaxQueuedControlBytes / cost);
    ASSERT_TRUE(handler->closed.has_value());
    EXPECT_NE(handler->closed->to_string().find("does not read"), std::string::npos)
        << handler->closed->to_string();
  }

  // Two streams share a 64 KiB budget beyond their 16 KiB floors.
  auto budget = std::make_shared<ControlBudget>(64u << 10);
  ConnectionOptions shared;
  shared.control_budget = budget;
  LoopbackPair first_pair, second_pair;
  auto first = make_tcp_connection(std::move(first_pair.server), shared);
  auto second = make_tcp_connection(std::move(second_pair.server), shared);
  auto first_handler = std::make_shared<Collector>();
  auto second_handler = std::make_shared<Collector>();
  first->start(first_handler);
  second->start(second_handler);

  // The first takes its floor and the whole budget, and is cut at the next frame.
  const size_t first_queued = queue_until_closed(*first, frame, 100000);
  EXPECT_EQ(first_queued, (kControlBytesFloor + budget->limit()) / cost);
  ASSERT_TRUE(first_handler->closed.has_value());
  EXPECT_NE(first_handler->closed->to_string().find("for all streams' control messages are spent"),
            std::string::npos)
      << first_handler->closed->to_string();
  // Closing it gave back what it drew.
  EXPECT_EQ(budget->used(), 0u);

  // While a stranger holds the budget, a stream still queues its floor.
  ASSERT_TRUE(budget->take(budget->limit()));
  const size_t second_queued = queue_until_closed(*second, frame, 100000);
  EXPECT_EQ(second_queued, kControlBytesFloor / cost);
  ASSERT_TRUE(second_handler->closed.has_value());
  budget->give(budget->limit());
  EXPECT_EQ(budget->used(), 0u);
}

// The rate reaches the kernel (SO_MAX_PACING_RATE), which paces the socket;
// 0 lifts it.
TEST(TcpTransport, PaceSetsTheSocketsMaximumPacingRate) {
  LoopbackPair pair;
  const int fd = pair.server.native_handle();
  auto conn = make_tcp_connection(std::move(pair.server), ConnectionOptions{});
  auto max_pacing_rate = [fd] {
    uint64_t rate = 0;
    socklen_t len = sizeof rate;
    EXPECT_EQ(::getsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, &len), 0);
    return rate;
  };
  const uint64_t unpaced = max_pacing_rate();
  conn->pace(29687500);
  EXPECT_EQ(max_pacing_rate(), 29687500u);
  conn->pace(0);
  EXPECT_EQ(max_pacing_rate(), unpaced);
  conn->close(Status(ErrorCode::kCancelled, "done"));
}

// An int socket option of `fd`.
int socket_option(int fd, int level, int name) {
  int value = 0;
  socklen_t len = sizeof value;
  EXPECT_EQ(::getsockopt(fd, level, name, &value, &len), 0);
  return value;
}

int window_clamp(int fd) { return socket_option(fd, IPPROTO_TCP, TCP_WINDOW_CLAMP); }
int receive_buffer(int fd) { return socket_option(fd, SOL_SOCKET, SO_RCVBUF); }

// The bound is the window clamp, set again after every read: after 24 MiB
// through, the clamp and the window the receiver may advertise
// (rcv_ssthresh) are still the bound, though the receive buffer has grown
// by autotuning past what it started at. Ethernet-sized segments, as on a
// real link. That the receivers then drop nothing for want of memory
// (TCPRcvQDrop, a counter of the whole network namespace) is measured in
// the bench (benchmarking.md, "Receive budget"); the socket's own drop
// counter also counts duplicates of a spurious retransmission, which a
// slow receiver (a sanitizer build) draws.
TEST(TcpTransport, BoundReceiveWindowHoldsTheWindowThroughATransfer) {
  LoopbackPair pair(1448);
  const int fd = pair.server.native_handle();
  ConnectionOptions options;
  options.max_data_bytes = 1u << 20;
  auto receiver = make_tcp_connection(std::move(pair.server), options);
  auto sender = make_tcp_connection(std::move(pair.client), options);
  constexpr uint64_t kBound = 96 * 1024;
  const int initial_buffer = receive_buffer(fd);
  receiver->bound_receive_window(kBound);
  EXPECT_EQ(static_cast<uint64_t>(window_clamp(fd)), kBound);
  auto collector = std::make_shared<Collector>();
  receiver->start(collector);
  sender->start(std::make_shared<Collector>());

  constexpr size_t kFrames = 24;
  const auto payload = pattern(1u << 20, 3);
  for (size_t i = 0; i < kFrames; ++i) {
    sender->send(data_header(1, static_cast<uint32_t>(i), payload.size()), payload, nullptr);
  }
  ASSERT_TRUE(pair.run_until([&] { return collector->received.size() == kFrames; }))
      << collector->received.size() << " of " << kFrames << " frames arrived";
  EXPECT_TRUE(collector->received.back() == payload);

  EXPECT_EQ(static_cast<uint64_t>(window_clamp(fd)), kBound);
  tcp_info info{};
  socklen_t len = sizeof info;
  ASSERT_EQ(::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len), 0);
  EXPECT_LE(info.tcpi_rcv_ssthresh, kBound);
  EXPECT_GT(receive_buffer(fd), initial_buffer) << "the receive buffer was not left to autotuning";
  receiver->close(Status(ErrorCode::kCancelled, "test over"));
  sender->close(Status(ErrorCode::kCancelled, "test over"));
}

// A bound never leaves a stream fewer than kMinWindowSegments segments:
// loopback's are about 64 KiB, so a 96 KiB bound there becomes about 1 MiB.
TEST(TcpTransport, BoundReceiveWindowKeepsRoomForItsSegments) {
  LoopbackPair pair;
  const int fd = pair.server.native_handle();
  const int segment = socket_option(fd, IPPROTO_TCP, TCP_MAXSEG);
  ASSERT_GT(segment, 16 * 1024) << "loopback's segments are expected to be large";
  auto receiver = make_tcp_connection(std::move(pair.server), ConnectionOptions{});
  receiver->bound_receive_window(96 * 1024);
  EXPECT_EQ(static_cast<uint64_t>(window_clamp(fd)),
            kMinWindowSegments * static_cast<uint64_t>(segment));
  receiver->close(Status(ErrorCode::kCancelled, "test over"));
}

// docs/architecture.md, "The receive budget": an equal share, never 0 (the
// transport keeps room for a few segments); a budget of 0 bounds nothing.
TEST(TcpTransport, StreamsConvergingOnAReceiverShareItsReceiveBudget) {
  EXPECT_EQ(receive_share(512 * 1024, 8), 64u * 1024);
  EXPECT_EQ(receive_share(512 * 1024, 0), 512u * 1024);
  EXPECT_EQ(receive_share(512 * 1024, 1000), 524u);
  EXPECT_EQ(receive_share(512 * 1024, 1u << 20), 1u);  // never 0, which means not bounded
  EXPECT_EQ(receive_share(0, 8), 0u);
}

TEST(TcpTransport, StreamsSharingALinkArePacedToEqualSharesOf95Percent) {
  EXPECT_EQ(paced_share(1000000000, 4), 29687500u);  // 1gbit / 8 x 0.95 / 4
  EXPECT_EQ(paced_share(10000000000, 1), 1187500000u);
  EXPECT_EQ(paced_share(8000, 1000000), 1u);  // never 0, which would mean unpaced
  EXPECT_EQ(*parse_link_rate("10gbit"), 10000000000u);
  EXPECT_FALSE(parse_link_rate("10G").is_ok());
  EXPECT_FALSE(parse_link_rate("").is_ok());
}

// bbr with a capped pacing rate stalled small transfers (architecture.md,
// "Pacing to the link"): paced streams take cubic, or what is named, and
// never bbr.
TEST(TcpTransport, PacedStreamsTakeCubicOrWhatIsNamedButNotBbr) {
  auto named = paced_congestion_control("reno");
  ASSERT_TRUE(named.is_ok()) << named.status().to_string();
  EXPECT_EQ(*named, "reno");
  auto bbr = paced_congestion_control("bbr");
  ASSERT_FALSE(bbr.is_ok());
  EXPECT_EQ(bbr.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bbr.status().message().find("name a loss-based congestion control"), std::string::npos)
      << bbr.status().to_string();
  std::string system_default;
  std::ifstream("/proc/sys/net/ipv4/tcp_congestion_control") >> system_default;
  auto chosen = paced_congestion_control("");
  if (check_congestion_control("cubic").is_ok()) {
    ASSERT_TRUE(chosen.is_ok()) << chosen.status().to_string();
    EXPECT_EQ(*chosen, "cubic");
  } else if (system_default == "bbr") {
    EXPECT_FALSE(chosen.is_ok());
  } else {
    ASSERT_TRUE(chosen.is_ok()) << chosen.status().to_string();
    EXPECT_EQ(*chosen, "");
  }
}

// The reducer and the client choose through one function; its errors name
// the option at fault, and without a rate the named algorithm stands.
TEST(TcpTransport, StreamCongestionControlNamesTheOptionAtFault) {
  auto unpaced = stream_congestion_control("reno", 0, "--tcp-congestion", "--link-rate");
  ASSERT_TRUE(unpaced.is_ok()) << unpaced.status().to_string();
  EXPECT_EQ(*unpaced, "reno");
  auto bogus =
      stream_congestion_control("no-such-cc", 1000000000, "--tcp-congestion", "--link-rate");
  ASSERT_FALSE(bogus.is_ok());
  EXPECT_EQ(bogus.status().message().find("--tcp-congestion"), 0u) << bogus.status().to_string();
  auto paced_bbr = stream_congestion_control("bbr", 1000000000, "--tcp-congestion", "--link-rate");
  ASSERT_FALSE(paced_bbr.is_ok());
  EXPECT_EQ(paced_bbr.status().message().find("--link-rate"), 0u) << paced_bbr.status().to_string();
  auto paced = stream_congestion_control("reno", 1000000000, "--tcp-congestion", "--link-rate");
  ASSERT_TRUE(paced.is_ok()) << paced.status().to_string();
  EXPECT_EQ(*paced, "reno");
}

}  // namespace
}  // namespace tally
