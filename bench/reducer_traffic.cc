#include "reducer_traffic.h"

#include <fstream>

#include "tally/reducer/butterfly.h"

namespace tally::bench {

Counters read_counters(const std::string& path) {
  Counters c;
  std::ifstream in(path);
  std::string name;
  double value = 0;
  while (in >> name) {
    if (name == "#") {
      std::string rest;
      std::getline(in, rest);
      continue;
    }
    if (!(in >> value)) break;
    if (name == "tally_worker_bytes_received_total") c.worker_in = value;
    if (name == "tally_worker_bytes_sent_total") c.worker_out = value;
    if (name == "tally_replica_bytes_received_total") c.replica_in = value;
    if (name == "tally_replica_bytes_sent_total") c.replica_out = value;
  }
  return c;
}

Expected expected_bytes(const ChunkPlan& plan, size_t esize, uint32_t shard, uint32_t group,
                        const std::vector<uint32_t>& sizes) {
  Expected e;
  uint32_t n = 0, index = 0;
  for (uint32_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] == 0) continue;
    if (g == group) index = n;
    ++n;
  }
  for (uint64_t k = shard; k < plan.chunk_count(); k += plan.shards()) {
    const double len = static_cast<double>(plan.chunk(k).length);
    e.worker += sizes[group] * len;
    if (n <= 1) continue;
    const double replica = butterfly_traffic(n, index, plan.chunk(k).length / esize) * len;
    e.replica_in += replica;
    e.replica_out += replica;
  }
  return e;
}

}  // namespace tally::bench
