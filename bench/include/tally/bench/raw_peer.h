// A raw TCP peer speaking (or not speaking) the protocol to a reducer,
// without the client library: the hostile-input, bounded-resource and
// authentication tests act as strangers with it, and tally-bench chaos
// --liar as a lying rank (bench/liar.h). Writes to a stream the reducer has closed are not errors
// here: what the reducer sent before closing is read back afterwards.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "tally.pb.h"
#include "tally/protocol/frame.h"

namespace tally::bench {

class RawPeer {
 public:
  // Connects to `address`, from the local address `source` when given
  // (another 127.0.0.x: a different host, as the reducer counts sources).
  explicit RawPeer(const std::string& address, const std::string& source = "");

  void send(const void* data, size_t n);
  void send_frame(const FrameHeader& h, const std::string& payload);
  void send_control(const wire::Control& message);
  // Sends one frame without blocking past `deadline`; false once the
  // reducer has closed the stream (or the deadline passed with it full).
  bool try_send_frame(const FrameHeader& h, const std::string& payload,
                      std::chrono::steady_clock::time_point deadline);
  // The same for bytes already framed (a batch of frames, say).
  bool try_send(const std::string& bytes, std::chrono::steady_clock::time_point deadline);

  // Reads until `received` contains `what`, the stream closes or `timeout`
  // passes; returns whether `what` came.
  bool received_within(const std::string& what, std::chrono::milliseconds timeout,
                       std::string* received);
  // Reads until the reducer closes the stream or `timeout` passes; returns
  // whether it closed, and what it sent in `received`.
  bool closed_within(std::chrono::milliseconds timeout, std::string* received = nullptr);

  // A whole frame the reducer sent.
  struct Frame {
    FrameHeader header;
    std::string payload;
  };
  // The next frame, read whole; nullopt when the stream ends, a header does
  // not decode, or `timeout` passes first. Not to be mixed with the reads
  // above on one stream (they do not split what they read into frames).
  std::optional<Frame> read_frame(std::chrono::milliseconds timeout);
  // Whether a read found the stream's end (the reducer closed it): tells
  // a read_frame that came back empty for that from one that timed out.
  bool ended() const { return ended_; }

 private:
  // Reads into `received` until `done()`, the stream's end (returns true)
  // or `timeout` (returns false).
  bool read_until(const std::function<bool()>& done, std::chrono::milliseconds timeout,
                  std::string* received);

  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket socket_;
  std::string unframed_;  // read_frame's bytes not yet taken as a frame
  bool ended_ = false;
};

// `message` as a control frame: header and payload.
std::string control_frame(const wire::Control& message);

// Rank `rank`'s contribution to op 0 of `count` elements of `dtype`, the
// whole op in one chunk.
FrameHeader whole_op_contribution(const std::string& job, uint32_t rank, uint64_t count,
                                  DType dtype = DType::kFloat32);

// A worker's Hello for `job` (op timeout 5 s).
wire::Control raw_hello(const std::string& job, uint32_t rank, uint32_t world,
                        uint32_t version = kProtocolVersion);

// A ReplicaHello from group 1 of 2 to shard 0 of 1, without authentication.
wire::Control raw_replica_hello();

}  // namespace tally::bench
