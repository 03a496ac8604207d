// A TCP relay between workers and one reducer that can cut a stream at an
// exact point of the protocol: part-way through the payload of a result.
// A reducer killed while it sends a result leaves its workers with part of
// it, a point that a kill from outside hits only by chance; the relay holds
// the rest back so a test can kill the reducer there, then cut the stream.
// Streams opened after the cut are relayed whole.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tally::testing {

class CutLink {
 public:
  // Listens on 127.0.0.1 (an ephemeral port) and relays each stream
  // accepted to `target` ("host:port").
  explicit CutLink(const std::string& target);
  ~CutLink();
  CutLink(const CutLink&) = delete;
  CutLink& operator=(const CutLink&) = delete;

  // "127.0.0.1:port", for a worker's pool list.
  const std::string& address() const { return address_; }

  // The next result frame of at least `min_payload` bytes going to a
  // worker is relayed up to half its payload; nothing more of that stream
  // is relayed in either direction until cut().
  void arm(size_t min_payload);
  // Waits until an armed stream has stopped part-way through a result.
  bool held_within(std::chrono::milliseconds timeout);
  // Closes every stream relayed so far, dropping what was held back.
  void cut();

 private:
  struct Session;
  void accept_loop();
  void relay_up(const std::shared_ptr<Session>& s);
  void relay_down(const std::shared_ptr<Session>& s);

  std::string target_host_;
  uint16_t target_port_ = 0;
  std::string address_;
  int listener_ = -1;
  std::thread acceptor_;

  std::mutex mu_;
  std::condition_variable cv_;
  size_t armed_min_ = 0;  // 0: not armed
  bool held_ = false;
  bool stopping_ = false;
  std::vector<std::shared_ptr<Session>> sessions_;
};

}  // namespace tally::testing
