// Slow HTTP clients, the way an attacker starves a probe: each drips a
// request a byte at a time from a 127.0.0.x source of its own and reopens
// the connection the server cuts, so that together they always hold what
// they can. Used by tally-bench chaos (--slow-http) and the HTTP server's
// tests. Runs on its own thread until destroyed or `limit` passes.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tally::bench {

class SlowHttpClients {
 public:
  // Client i connects from sources[i] to addresses[i mod addresses.size()]
  // ("127.0.0.1:port": loopback only).
  SlowHttpClients(std::vector<std::string> addresses, std::vector<std::string> sources,
                  std::chrono::seconds limit);
  ~SlowHttpClients();
  SlowHttpClients(const SlowHttpClients&) = delete;
  SlowHttpClients& operator=(const SlowHttpClients&) = delete;

  // Where the servers listen now (a restarted one on a new port); clients
  // reopen there once their connection is cut.
  void set_addresses(std::vector<std::string> addresses);
  // Connections the servers have cut (or refused) so far.
  int cut() const { return cut_.load(); }

  // `n` sources 127.0.0.2, 127.0.0.3, ... (at most kDistinctSources, then
  // again from the first).
  static constexpr size_t kDistinctSources = 200;
  static std::vector<std::string> sources(size_t n);

 private:
  void run(std::vector<std::string> sources, std::chrono::seconds limit);
  uint16_t port_for(size_t client);

  std::mutex mu_;
  std::vector<uint16_t> ports_;
  std::atomic<int> cut_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tally::bench
