// Two fabric streams in one process, each side on an I/O thread of its own,
// over the real provider on loopback: what a stream closed under a payload
// still in flight does with the buffers it was given.
#include <gtest/gtest.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "harness.h"
#include "tally.pb.h"
#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/frame.h"

namespace tally::testing {
namespace {

namespace asio = boost::asio;
using namespace std::chrono_literals;

constexpr auto kCallTimeout = 10s;

// A gate a held I/O thread waits at (up to kCallTimeout) until the test
// opens it; opening is idempotent, and a latch left shut opens as it goes.
class Latch {
 public:
  ~Latch() { open(); }
  void open() {
    if (!opened_.exchange(true)) promise_.set_value();
  }
  void wait() const {
    std::shared_future<void> opened = future_;  // its own hold on the state
    opened.wait_for(kCallTimeout);
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
  std::atomic<bool> opened_{false};
};

// A data frame of `bytes` of float32 to sum: op `op`'s only chunk.
FrameHeader float_frame(FrameKind kind, uint64_t op, size_t bytes) {
  FrameHeader h;
  h.kind = kind;
  h.op = op;
  h.chunks_on_shard = 1;
  h.count = bytes / 4;
  h.length = bytes;
  h.dtype = DType::kFloat32;
  h.redop = RedOp::kSum;
  return h;
}

// One I/O thread.
class IoThread {
 public:
  IoThread() : guard_(io_.get_executor()), thread_([this] { io_.run(); }) {}
  ~IoThread() { stop(); }
  void stop() {
    if (!thread_.joinable()) return;
    guard_.reset();
    io_.stop();
    thread_.join();
  }
  asio::io_context& io() { return io_; }
  // Runs `f` here and waits for it.
  void run(const std::function<void()>& f) {
    std::promise<void> done;
    asio::post(io_, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait_for(kCallTimeout);
  }

 private:
  asio::io_context io_{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard_;
  std::thread thread_;
};

// A stream's owner: takes payloads with `take`, remembers how it closed.
struct Side : FrameHandler {
  std::shared_ptr<Connection> conn;
  std::function<PayloadAction(const FrameHeader&)> take;
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Status> closed;

  PayloadAction on_data_header(const FrameHeader& h) override {
    return take ? take(h) : PayloadAction::discard();
  }
  void on_data(const FrameHeader&, std::span<std::byte>) override {}
  void on_control(const wire::Control&) override {}
  void on_closed(const Status& reason) override {
    {
      std::lock_guard lock(mu);
      closed = reason;
    }
    conn.reset();  // the connection holds this handler: break the cycle
    cv.notify_all();
  }
  bool wait_closed(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return closed.has_value(); });
  }
};

// A fabric stream from a sender's I/O thread to a receiver's, data path
// attached as a client and a reducer attach theirs.
class FabricPair {
 public:
  static Result<std::unique_ptr<FabricPair>> open(const ConnectionOptions& options) {
    auto fabric = Fabric::open(FabricOptions{});
    if (!fabric) return fabric.status();
    std::unique_ptr<FabricPair> pair(new FabricPair(*fabric));
    // Opened now, not in the handshake: opening one blocks its I/O thread
    // for up to a second, which a short peer timeout would take for a
    // silent peer.
    for (IoThread* io : {&pair->sender_io, &pair->receiver_io}) {
      TALLY_RETURN_IF_ERROR(pair->fabric_->prepare_endpoint(io->io().get_executor(), "127.0.0.1"));
    }
    TALLY_RETURN_IF_ERROR(pair->connect(options));
    return pair;
  }
  ~FabricPair() {
    for (Side* side : {sender.get(), receiver.get()}) {
      IoThread& io = side == sender.get() ? sender_io : receiver_io;
      io.run([&] {
        if (auto c = side->conn) c->close(Status(ErrorCode::kCancelled, "test over"));
      });
      side->wait_closed(kCallTimeout);
    }
    sender_io.stop();
    receiver_io.stop();
    fabric_->close();
  }

  // Sends one small frame and waits until it is sent: the sender's provider
  // is then connected to the peer (posts are refused while it connects, and
  // retried only as the sender's I/O thread progresses, which a test may
  // hold). The receiver's `take` sees it.
  Status connect_provider() {
    static const std::vector<std::byte> kPayload(64);
    std::promise<Status> sent;
    sender_io.run([&] {
      if (auto c = sender->conn) {
        c->send(float_frame(FrameKind::kContribution, 0, kPayload.size()), kPayload,
                [&sent](const Status& s) { sent.set_value(s); });
      } else {
        sent.set_value(Status(ErrorCode::kCancelled, "the stream closed before the first frame"));
      }
    });
    auto first = sent.get_future();
    if (first.wait_for(kCallTimeout) != std::future_status::ready) {
      return Status(ErrorCode::kTimeout, "the first frame was not sent");
    }
    return first.get();
  }

  IoThread sender_io, receiver_io;
  std::shared_ptr<Side> sender = std::make_shared<Side>();
  std::shared_ptr<Side> receiver = std::make_shared<Side>();

 private:
  explicit FabricPair(std::shared_ptr<Fabric> fabric) : fabric_(std::move(fabric)) {}

  Status connect(const ConnectionOptions& options) {
    asio::ip::tcp::acceptor acceptor(receiver_io.io(), {asio::ip::make_address("127.0.0.1"), 0});
    asio::ip::tcp::socket dialed(sender_io.io());
    boost::system::error_code ec;
    dialed.connect(acceptor.local_endpoint(), ec);
    if (ec) return Status(ErrorCode::kUnavailable, "connect: " + ec.message());
    asio::ip::tcp::socket accepted = acceptor.accept(ec);
    if (ec) return Status(ErrorCode::kUnavailable, "accept: " + ec.message());
    Status status;
    wire::DataPath offer, answer;
    sender_io.run([&] {
      sender->conn = fabric_->make_connection(std::move(dialed), options);
      sender->conn->start(sender);
      status = sender->conn->describe_data_path(&offer);
    });
    TALLY_RETURN_IF_ERROR(status);
    receiver_io.run([&] {
      receiver->conn = fabric_->make_connection(std::move(accepted), options);
      receiver->conn->start(receiver);
      status = receiver->conn->attach_data_path(offer);
      if (status.is_ok()) status = receiver->conn->describe_data_path(&answer);
    });
    TALLY_RETURN_IF_ERROR(status);
    sender_io.run([&] { status = sender->conn->attach_data_path(answer); });
    return status;
  }

  std::shared_ptr<Fabric> fabric_;
};

// A stream closed while a payload it chose a buffer for is still arriving
// (its sender stalled mid-transfer: a link cut, a stopped process) must keep
// that buffer until nothing will write into it again, even after on_closed:
// a provider that has matched a receive cannot always withdraw it, and
// finishes it whenever the sender's bytes come. Here the receiver gives up
// on a 4 MiB payload whose sender's I/O thread is held (libfabric moves a
// rendezvous only while both sides drive progress); its owner marks the
// buffer the moment the stream lets go of it, as reuse would, and the
// sender is then let go: not one byte may change after that. Before the
// stream held its receives' owners (Op::keep), every byte did: a reducer's
// chunk buffer, back in its pool, took a lost stream's late payload.
TEST(FabricStream, AClosedStreamKeepsAReceiveBufferUntilTheProviderLetsGo) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  constexpr size_t kBytes = 4u << 20;
  constexpr std::byte kGivenBack{0xAB};
  // Outlives the streams (declared before them): their threads use it.
  struct Stall {
    std::vector<std::byte> buffer = std::vector<std::byte>(kBytes, std::byte{0});
    std::vector<std::byte> payload = std::vector<std::byte>(kBytes, std::byte{0x5C});
    std::promise<void> given_back, sender_held;
    Latch sender_released;
    std::atomic<bool> header_seen{false};
  } stall;
  ConnectionOptions options;
  options.heartbeat_interval = 100ms;
  options.peer_timeout = 1000ms;
  auto opened = FabricPair::open(options);
  ASSERT_TRUE(opened) << opened.status().to_string();
  FabricPair& pair = **opened;

  pair.receiver->take = [&stall, &pair](const FrameHeader& h) {
    if (stall.header_seen.exchange(true)) return PayloadAction::discard();
    // Hold the sender's I/O thread before the receive is posted.
    asio::post(pair.sender_io.io(), [&stall] {
      stall.sender_held.set_value();
      stall.sender_released.wait();
    });
    stall.sender_held.get_future().wait_for(kCallTimeout);
    // What the buffer's owner does once the stream lets go of it: reuse it.
    std::shared_ptr<const void> owner(stall.buffer.data(), [&stall](const void*) {
      std::memset(stall.buffer.data(), static_cast<int>(kGivenBack), stall.buffer.size());
      stall.given_back.set_value();
    });
    return PayloadAction::receive(std::span(stall.buffer).first(h.length), std::move(owner));
  };
  const FrameHeader h = float_frame(FrameKind::kContribution, 0, kBytes);
  bool open = false;
  pair.sender_io.run([&] {
    if (auto c = pair.sender->conn) {
      open = true;
      c->send(h, stall.payload, [](const Status&) {});
    }
  });
  ASSERT_TRUE(open) << "the stream closed before the test sent on it: "
                    << pair.sender->closed.value_or(Status::ok()).to_string();
  // The receiver's watchdog closes the stream: the payload stops arriving
  // (and the sender's heartbeats with it).
  ASSERT_TRUE(pair.receiver->wait_closed(kCallTimeout));
  ASSERT_TRUE(stall.header_seen) << pair.receiver->closed.value_or(Status::ok()).to_string();
  stall.sender_released.open();
  // The sender finds its stream closed and finishes what its provider had
  // begun: the rendezvous completes into the buffer, after which the
  // receiver's provider lets it go.
  ASSERT_TRUE(pair.sender->wait_closed(kCallTimeout));
  ASSERT_EQ(stall.given_back.get_future().wait_for(kCallTimeout), std::future_status::ready)
      << "the buffer was never given back";
  size_t changed = 0;
  for (std::byte b : stall.buffer) changed += b != kGivenBack;
  EXPECT_EQ(changed, 0u) << "bytes written after the stream gave its buffer back";
}

// The sending side of the same stall: a stream closed while its payload is
// still being sent answers the send's caller (with the close's reason)
// within the close grace, as it must for a worker's op to end by its
// deadline (an op waits for its sends before it ends; unanswered, a worker
// whose link was cut under large payloads hung past every deadline). What
// owns the payload stays with the provider's op until the provider lets go
// of it: here the receiver's I/O thread is held, so the rendezvous cannot
// finish, and the owner goes only when the endpoint closes.
TEST(FabricStream, AClosedStreamAnswersASendItGaveUpOnAndKeepsItsPayload) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  constexpr size_t kBytes = 4u << 20;
  struct Stall {
    std::vector<std::byte> payload = std::vector<std::byte>(kBytes, std::byte{0x5C});
    std::promise<void> receiver_held;
    Latch receiver_released;
    std::promise<Status> answered;
    std::atomic<bool> owner_gone{false};
  } stall;
  ConnectionOptions options;
  options.heartbeat_interval = 100ms;
  options.peer_timeout = 5000ms;
  auto opened = FabricPair::open(options);
  ASSERT_TRUE(opened) << opened.status().to_string();
  FabricPair& pair = **opened;
  // A refused post (the provider still connecting) is no send in flight.
  const Status connected = pair.connect_provider();
  ASSERT_TRUE(connected.is_ok()) << connected.to_string();
  asio::post(pair.receiver_io.io(), [&stall] {
    stall.receiver_held.set_value();
    stall.receiver_released.wait();
  });
  ASSERT_EQ(stall.receiver_held.get_future().wait_for(kCallTimeout), std::future_status::ready);
  const FrameHeader h = float_frame(FrameKind::kContribution, 1, kBytes);
  std::shared_ptr<const void> owner(stall.payload.data(),
                                    [&stall](const void*) { stall.owner_gone = true; });
  const auto t0 = Clock::now();
  pair.sender_io.run([&] {
    auto c = pair.sender->conn;
    ASSERT_TRUE(c);
    c->send(h, stall.payload,
            [&stall, owner = std::move(owner)](const Status& s) { stall.answered.set_value(s); });
    c->close(Status(ErrorCode::kCancelled, "given up"));
  });
  auto answer = stall.answered.get_future();
  ASSERT_EQ(answer.wait_for(kCallTimeout), std::future_status::ready)
      << "the send was never answered";
  const Status status = answer.get();
  EXPECT_FALSE(status.is_ok());
  EXPECT_TRUE(contains(status.message(), "given up")) << status.to_string();
  EXPECT_LT(since(t0), 3s);
  ASSERT_TRUE(pair.sender->wait_closed(kCallTimeout));
  EXPECT_FALSE(stall.owner_gone) << "the payload's owner went while the provider still had it";
  stall.receiver_released.open();
  opened->reset();  // the endpoints close: the provider lets go of everything
  EXPECT_TRUE(stall.owner_gone);
}

// A posted destination (a worker's tensor, where a result lands) is written
// only with a whole payload, and never once its stream has closed: a worker
// sends a contribution again from that tensor after the stream is reopened,
// so bytes written into it late become the contribution. Here a result's
// payload is still on its way (its sender's I/O thread is held) when the
// receiver closes the stream, at the header of the frame sent after it.
// Before a closed stream stopped delivering, a receive completing within
// the close grace (cancelled, or finished late as here) had its landing
// copied into the destination: here all 4 MiB changed; after a link cut, a
// worker resent such bytes as its input, and every rank got that chunk
// wrong.
TEST(FabricStream, AClosedStreamLeavesAPostedDestinationAsItWas) {
  TALLY_SKIP_UNLESS_TRANSPORT("fabric");
  constexpr size_t kBytes = 4u << 20;
  constexpr std::byte kUntouched{0x11};  // the destination before and after
  struct Stall {
    std::vector<std::byte> dst = std::vector<std::byte>(kBytes, std::byte{0x11});
    std::vector<std::byte> payload = std::vector<std::byte>(kBytes, std::byte{0x5C});
    Latch sender_released;
    std::atomic<bool> next_header_seen{false};
  } stall;
  ConnectionOptions options;
  options.heartbeat_interval = 100ms;
  options.peer_timeout = 5000ms;
  auto opened = FabricPair::open(options);
  ASSERT_TRUE(opened) << opened.status().to_string();
  FabricPair& pair = **opened;
  const ReceiveKey key{FrameKind::kResult, 1, 0};
  // Frames are taken in order: the next frame's header comes once the
  // result's header has been matched to the posted receive. The receiver
  // then starts a send its peer never takes (it pauses at its header), so
  // the closed stream waits out its grace for that operation, as a
  // worker's stream waits for its sends; it closes, and just after, the
  // sender is let go and the result's payload arrives within the grace.
  pair.sender->take = [](const FrameHeader&) { return PayloadAction::pause(); };
  pair.receiver->take = [&stall, &pair](const FrameHeader& h) {
    if (h.op != 2) return PayloadAction::discard();  // connect_provider's frame
    stall.next_header_seen = true;
    pair.receiver->conn->send(float_frame(FrameKind::kContribution, 3, kBytes), stall.payload,
                              nullptr);
    asio::post(pair.receiver_io.io(), [&stall] { stall.sender_released.open(); });
    return PayloadAction::close(Status(ErrorCode::kCancelled, "given up mid-payload"));
  };
  const Status connected = pair.connect_provider();
  ASSERT_TRUE(connected.is_ok()) << connected.to_string();
  pair.receiver_io.run([&] {
    if (auto c = pair.receiver->conn) c->post_receive(key, stall.dst);
  });
  const FrameHeader result = float_frame(FrameKind::kResult, key.op, kBytes);
  const FrameHeader small = float_frame(FrameKind::kContribution, 2, 64);
  bool open = false;
  pair.sender_io.run([&] {
    auto c = pair.sender->conn;
    if (!c) return;
    open = true;
    c->send(result, stall.payload, [](const Status&) {});
    c->send(small, std::span(stall.payload).first(64), [](const Status&) {});
    asio::post(pair.sender_io.io(), [&stall] { stall.sender_released.wait(); });
  });
  ASSERT_TRUE(open) << "the stream closed before the test sent on it";
  ASSERT_TRUE(pair.receiver->wait_closed(kCallTimeout));
  ASSERT_TRUE(stall.next_header_seen) << pair.receiver->closed.value_or(Status::ok()).to_string();
  ASSERT_TRUE(pair.sender->wait_closed(kCallTimeout));
  opened->reset();
  size_t changed = 0;
  for (std::byte b : stall.dst) changed += b != kUntouched;
  EXPECT_EQ(changed, 0u) << "bytes written into a posted destination after its stream closed";
}

}  // namespace
}  // namespace tally::testing
