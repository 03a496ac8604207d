// StreamAdmission over real loopback streams: at the --max-connections
// limit the oldest stream not yet admitted is cut, and the choice of the
// stream to cut and a stream's admission exclude each other: a stream
// chosen to be cut is not admitted (its session joins nothing), and an
// admitted stream is never chosen.
#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tally/protocol/connection_factory.h"
#include "tally/reducer/inbound_stream.h"
#include "tally/reducer/reducer_counters.h"
#include "tally/reducer/reducer_options.h"

namespace tally {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

// Accepted streams from one loopback client each, as a reducer holds them
// before their hello.
struct Streams {
  asio::io_context io;
  tcp::acceptor acceptor{io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)};
  std::vector<tcp::socket> clients;
  std::vector<std::shared_ptr<InboundStream>> accepted;

  std::shared_ptr<InboundStream> accept_one() {
    clients.emplace_back(io).connect(acceptor.local_endpoint());
    auto conn = make_connection(nullptr, acceptor.accept(), ConnectionOptions{});
    auto stream = std::make_shared<InboundStream>(
        conn, "127.0.0.1", InboundStream::Refused{}, 10s, std::make_shared<ReducerCounters>(),
        [](const wire::Control&, std::shared_ptr<Connection>, InboundStream::Admit) {
          return std::shared_ptr<FrameHandler>();
        },
        [](const std::shared_ptr<InboundStream>&) { return true; },
        [](const std::shared_ptr<InboundStream>&) {});
    stream->start();
    accepted.push_back(stream);
    return stream;
  }

  // Whether the client side of stream `i` reads the end of its stream
  // within 5 s.
  bool closed_by_reducer(size_t i) {
    tcp::socket& s = clients.at(i);
    s.non_blocking(true);
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < deadline) {
      io.run_for(10ms);
      char byte;
      boost::system::error_code ec;
      s.read_some(asio::buffer(&byte, 1), ec);
      if (ec && ec != asio::error::would_block) return true;
    }
    return false;
  }

  ~Streams() {
    for (auto& s : accepted) s->cut(Status(ErrorCode::kCancelled, "test over"));
    io.run_for(50ms);
  }
};

// One stream accepted and opened, not yet admitted, under these limits.
struct OneOpen {
  ReducerOptions options;
  std::optional<StreamAdmission> admission;
  Streams streams;
  std::shared_ptr<InboundStream> first;

  OneOpen(size_t max_connections, size_t max_pending_per_source) {
    options.max_connections = max_connections;
    options.max_pending_per_source = max_pending_per_source;
    admission.emplace(options);
    first = streams.accept_one();
    admission->opened(first);
  }
};

TEST(StreamAdmission, AStreamChosenToBeCutIsNotAdmitted) {
  OneOpen t(1, 64);
  // A second stream at the limit of one: the first, not yet admitted, is cut.
  EXPECT_TRUE(t.admission->make_room("127.0.0.1", 1));
  auto second = t.streams.accept_one();
  t.admission->opened(second);
  // Its hello was read before the cut landed: it may not join anything.
  EXPECT_TRUE(t.first->evicted);
  EXPECT_FALSE(t.admission->admit(*t.first));
  EXPECT_TRUE(t.streams.closed_by_reducer(0));
  t.admission->closed(*t.first);
  EXPECT_TRUE(t.admission->admit(*second));
}

TEST(StreamAdmission, AnAdmittedStreamIsNeverCut) {
  OneOpen t(1, 64);
  EXPECT_TRUE(t.admission->admit(*t.first));
  // Every open stream is admitted: the new one is refused, the first kept.
  EXPECT_FALSE(t.admission->make_room("127.0.0.1", 1));
  EXPECT_FALSE(t.first->evicted);
}

TEST(StreamAdmission, AdmittedStreamsLeaveTheirSourcesShare) {
  OneOpen t(4096, 1);
  EXPECT_FALSE(t.admission->make_room("127.0.0.1", 1));
  EXPECT_TRUE(t.admission->make_room("127.0.0.2", 1));
  EXPECT_TRUE(t.admission->admit(*t.first));
  EXPECT_TRUE(t.admission->make_room("127.0.0.1", 1));
}

}  // namespace
}  // namespace tally
