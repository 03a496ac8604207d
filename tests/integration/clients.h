// Ranks as Clients in the test process (one thread each) against a real
// pool: what the async and resume tests share.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "tally/client/client.h"

namespace tally::testing {

// Rank `rank` of a `world`-sized job on `cluster`: 1 KiB chunks (small
// tensors make many chunks), a 10 s op timeout.
ClientOptions options_for(const TestCluster& cluster, const std::string& job, uint32_t rank,
                          uint32_t world);

// Connects `world` clients concurrently (each connect waits for the job);
// `tweak`, if given, changes rank r's options first.
std::vector<std::unique_ptr<Client>> connect_all(
    const TestCluster& cluster, const std::string& job, uint32_t world,
    const std::function<void(ClientOptions&, uint32_t)>& tweak = {});

// Runs fn(rank) on one thread per rank and joins them.
void on_every_rank(uint32_t world, const std::function<void(uint32_t)>& fn);

}  // namespace tally::testing
