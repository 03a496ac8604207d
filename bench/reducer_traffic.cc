#include "reducer_traffic.h"

#include "tally/bench/metrics_scrape.h"
#include "tally/reducer/butterfly.h"
#include "tally/reducer/sum_tree.h"

namespace tally::bench {

Result<Counters> read_counters(const std::string& http_address) {
  auto text = http_get(http_address, "/metrics");
  if (!text) return text.status();
  const auto samples = parse_metrics(*text);
  Counters c;
  auto get = [&](const char* series, double& out) {
    if (auto it = samples.find(series); it != samples.end()) out = it->second;
  };
  get("tally_payload_bytes_received_total{peer=\"worker\"}", c.worker_in);
  get("tally_payload_bytes_sent_total{peer=\"worker\"}", c.worker_out);
  get("tally_payload_bytes_received_total{peer=\"replica\"}", c.replica_in);
  get("tally_payload_bytes_sent_total{peer=\"replica\"}", c.replica_out);
  return c;
}

Expected expected_bytes(const ChunkPlan& plan, size_t esize, uint32_t shard, uint32_t group,
                        const std::vector<uint32_t>& sizes, bool deterministic) {
  Expected e;
  // Reproducible sums: cover nodes sent (to each of n - 1) and received.
  double nodes_out = 0, nodes_in = 0;
  if (deterministic) {
    const auto covers = sum_tree_covers(sizes);
    for (uint32_t g = 0; g < covers.size(); ++g) {
      (g == group ? nodes_out : nodes_in) += static_cast<double>(covers[g].size());
    }
  }
  uint32_t n = 0, index = 0;
  for (uint32_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] == 0) continue;
    if (g == group) index = n;
    ++n;
  }
  const uint64_t first = plan.first_chunk(shard);
  for (uint64_t k = first; k < first + plan.chunks_on_shard(shard); ++k) {
    const double len = static_cast<double>(plan.chunk(k).length);
    e.worker += sizes[group] * len;
    if (n <= 1) continue;
    if (deterministic) {
      e.replica_out += nodes_out * (n - 1) * len;
      e.replica_in += nodes_in * len;
      continue;
    }
    const double replica = butterfly_traffic(n, index, plan.chunk(k).length / esize) * len;
    e.replica_in += replica;
    e.replica_out += replica;
  }
  return e;
}

}  // namespace tally::bench
