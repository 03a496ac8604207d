// The TCP transport's framing over a real loopback stream: frames larger
// than one write or read call arrive whole and in order, whatever pieces
// the bytes come in.
#include "tally/protocol/tcp_transport.h"

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "tally.pb.h"
#include "tally/protocol/frame.h"

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
    return PayloadAction::receive(buffers.back());
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

struct LoopbackPair {
  asio::io_context io;
  tcp::socket server{io};
  tcp::socket client{io};
  LoopbackPair() {
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
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

  // Sizes around the old 64 KiB per-call cap and above the 1 MiB read piece
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

TEST(TcpTransport, PayloadTricklingInUnevenPiecesIsAssembled) {
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
  // pieces of 1, 65537, 3 and the rest bytes, so reads complete short.
  std::thread writer([&, socket = std::move(pair.client)]() mutable {
    boost::system::error_code ec;
    asio::write(socket, asio::buffer(header), ec);
    const size_t pieces[] = {1, 65537, 3};
    size_t at = 0;
    for (size_t p : pieces) {
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

}  // namespace
}  // namespace tally
