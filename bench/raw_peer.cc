#include "tally/bench/raw_peer.h"

#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/write.hpp>
#include <cstring>
#include <thread>

#include "tally/protocol/chunking.h"
#include "tally/protocol/tcp_transport.h"

namespace tally::bench {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

RawPeer::RawPeer(const std::string& address, const std::string& source) : socket_(io_) {
  auto hp = parse_host_port(address);
  tcp::resolver resolver(io_);
  if (source.empty()) {
    asio::connect(socket_, resolver.resolve(hp->host, std::to_string(hp->port)));
    return;
  }
  socket_.open(tcp::v4());
  socket_.bind(tcp::endpoint(asio::ip::make_address(source), 0));
  socket_.connect(*resolver.resolve(hp->host, std::to_string(hp->port)).begin());
}

void RawPeer::send(const void* data, size_t n) {
  boost::system::error_code ec;  // a closed stream: read what came instead
  socket_.non_blocking(false);
  asio::write(socket_, asio::buffer(data, n), ec);
}

void RawPeer::send_frame(const FrameHeader& h, const std::string& payload) {
  auto bytes = encode_header(h);
  send(bytes.data(), bytes.size());
  if (!payload.empty()) send(payload.data(), payload.size());
}

void RawPeer::send_control(const wire::Control& message) {
  const std::string frame = control_frame(message);
  send(frame.data(), frame.size());
}

std::string control_frame(const wire::Control& message) {
  const std::string payload = message.SerializeAsString();
  FrameHeader h;
  h.kind = FrameKind::kControl;
  h.length = payload.size();
  const auto header = encode_header(h);
  return std::string(reinterpret_cast<const char*>(header.data()), header.size()) + payload;
}

bool RawPeer::try_send_frame(const FrameHeader& h, const std::string& payload,
                             std::chrono::steady_clock::time_point deadline) {
  auto bytes = encode_header(h);
  std::string frame(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  frame += payload;
  return try_send(frame, deadline);
}

bool RawPeer::try_send(const std::string& bytes, std::chrono::steady_clock::time_point deadline) {
  socket_.non_blocking(true);
  size_t sent = 0;
  while (sent < bytes.size()) {
    boost::system::error_code ec;
    sent += socket_.write_some(asio::buffer(bytes.data() + sent, bytes.size() - sent), ec);
    if (ec == asio::error::would_block) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(5ms);
      continue;
    }
    if (ec) return false;
  }
  return true;
}

bool RawPeer::read_until(const std::function<bool()>& done, std::chrono::milliseconds timeout,
                         std::string* received) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  socket_.non_blocking(true);
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline && !done()) {
    boost::system::error_code ec;
    size_t n = socket_.read_some(asio::buffer(buf), ec);
    if (ec == asio::error::would_block) {
      std::this_thread::sleep_for(5ms);
      continue;
    }
    if (ec) {  // eof or reset
      ended_ = true;
      return true;
    }
    received->append(buf, n);
  }
  return false;
}

bool RawPeer::received_within(const std::string& what, std::chrono::milliseconds timeout,
                              std::string* received) {
  auto found = [&] { return received->find(what) != std::string::npos; };
  read_until(found, timeout, received);
  return found();
}

std::optional<RawPeer::Frame> RawPeer::read_frame(std::chrono::milliseconds timeout) {
  std::optional<Frame> frame;
  auto whole = [&] {
    if (unframed_.size() < kFrameHeaderBytes) return false;
    std::array<std::byte, kFrameHeaderBytes> bytes;
    std::memcpy(bytes.data(), unframed_.data(), kFrameHeaderBytes);
    auto h = decode_header(bytes, FrameLimits{.max_data_bytes = kMaxChunkBytesLimit});
    if (!h) return true;  // nothing more can be framed
    if (unframed_.size() < kFrameHeaderBytes + h->length) return false;
    frame = Frame{*h, unframed_.substr(kFrameHeaderBytes, h->length)};
    unframed_.erase(0, kFrameHeaderBytes + h->length);
    return true;
  };
  if (!whole()) read_until(whole, timeout, &unframed_);
  return frame;
}

bool RawPeer::closed_within(std::chrono::milliseconds timeout, std::string* received) {
  std::string ignored;
  return read_until([] { return false; }, timeout, received ? received : &ignored);
}

FrameHeader whole_op_contribution(const std::string& job, uint32_t rank, uint64_t count,
                                  DType dtype) {
  FrameHeader h;
  h.kind = FrameKind::kContribution;
  h.dtype = dtype;
  h.redop = RedOp::kSum;
  h.rank = rank;
  h.job = job_id(job);
  h.count = count;
  h.chunks_on_shard = 1;
  h.length = count * dtype_size(dtype);
  return h;
}

wire::Control raw_hello(const std::string& job, uint32_t rank, uint32_t world, uint32_t version) {
  wire::Control m;
  auto* h = m.mutable_hello();
  h->set_protocol_version(version);
  h->set_job(job);
  h->set_rank(rank);
  h->set_world_size(world);
  h->set_op_timeout_ms(5000);
  return m;
}

wire::Control raw_replica_hello() {
  wire::Control m;
  auto* h = m.mutable_replica_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_shard(0);
  h->set_shard_count(1);
  h->set_group(1);
  h->set_group_count(2);
  return m;
}

}  // namespace tally::bench
