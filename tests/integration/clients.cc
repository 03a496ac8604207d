#include "clients.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

namespace tally::testing {

ClientOptions options_for(const TestCluster& cluster, const std::string& job, uint32_t rank,
                          uint32_t world) {
  ClientOptions o;
  o.pool = cluster.addresses();
  o.job = job;
  o.rank = rank;
  o.world_size = world;
  o.chunk_bytes = 1024;
  o.op_timeout = std::chrono::milliseconds(10000);
  return o;
}

std::vector<std::unique_ptr<Client>> connect_all(
    const TestCluster& cluster, const std::string& job, uint32_t world,
    const std::function<void(ClientOptions&, uint32_t)>& tweak) {
  std::vector<std::future<Result<std::unique_ptr<Client>>>> pending;
  for (uint32_t r = 0; r < world; ++r) {
    pending.push_back(std::async(std::launch::async, [&, r] {
      ClientOptions o = options_for(cluster, job, r, world);
      if (tweak) tweak(o, r);
      return Client::connect(o);
    }));
  }
  std::vector<std::unique_ptr<Client>> clients;
  for (auto& p : pending) {
    auto c = p.get();
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    if (c) clients.push_back(std::move(*c));
  }
  return clients;
}

void on_every_rank(uint32_t world, const std::function<void(uint32_t)>& fn) {
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

}  // namespace tally::testing
