#include "worker.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "reducer_traffic.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/metrics_scrape.h"
#include "tally/bench/pattern.h"
#include "tally/bench/process.h"
#include "tally/bench/table.h"
#include "tally/client/client.h"
#include "tally/client/option_names.h"
#include "tally/protocol/chunking.h"
#include "tally/protocol/groups.h"
#include "tally/protocol/pool.h"
#include "tally/protocol/pool_pattern.h"
#include "tally/protocol/version.h"
#include "tally/reducer/butterfly.h"
#include "worker.h"

namespace tally::bench {
namespace {

struct ReducerRow {
  uint32_t shard, group;
  Counters measured;  // per op
  Expected expected;
};

struct Row {
  size_t bytes;
  size_t count;
  double time_us;
  double algbw;
  double wrong;
  // The ranks' CPU over the timed loop, summed. The driver's `# cpu` line
  // counts each worker's whole life: start-up, the buffer, and the checks'
  // fill and compare, which are the bench's work.
  double timed_cpu;
  std::vector<ReducerRow> reducers;
};

// The checked op of a row: inputs seeded by the row's number (pattern.h),
// so a result of an earlier row's op does not pass for this one's.
template <typename T>
size_t run_check(Client& client, T* data, size_t count, DType dtype, RedOp redop, uint64_t seed,
                 Status& status, double relative = 0) {
  fill_pattern(data, count, client.rank(), seed);
  status = client.allreduce(data, count, dtype, redop);
  if (!status) return count;
  return count_wrong(data, count, client.world_size(), redop, seed, relative);
}

// TALLY_LINK_RATE as tc writes it ("1gbit"), or "none".
std::string link_rate_string(uint64_t bits) {
  if (bits == 0) return "none";
  for (auto [scale, unit] :
       {std::pair{1000000000ull, "gbit"}, {1000000ull, "mbit"}, {1000ull, "kbit"}}) {
    if (bits % scale == 0) return std::to_string(bits / scale) + unit;
  }
  return std::to_string(bits) + "bit";
}

}  // namespace

int run_worker(const SweepOptions& sweep) {
  auto options = client_options_from_env();
  if (!options) {
    spdlog::error("{}", options.status().to_string());
    return 2;
  }
  if (sweep.chunk_bytes) options->chunk_bytes = *sweep.chunk_bytes;
  if (Status s = set_client_option(*options, "TALLY_WIRE_DTYPE", sweep.wire_dtype); !s) {
    spdlog::error("{}", s.to_string());
    return 2;
  }
  auto dtype = parse_dtype(sweep.dtype);
  auto redop = parse_redop(sweep.redop);
  if (!dtype || !redop) {
    spdlog::error("unknown dtype '{}' or reduction '{}'", sweep.dtype, sweep.redop);
    return 2;
  }
  auto connected = Client::connect(*options);
  if (!connected) {
    spdlog::error("rank {}: {}", options->rank, connected.status().to_string());
    return 2;
  }
  Client& client = **connected;
  const size_t esize = dtype_size(*dtype);
  // One buffer for the whole sweep, in huge pages, touched once up front.
  const size_t capacity = (sweep.max_bytes + 4095) / 4096 * 4096 + 4096;
  void* mem = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    spdlog::error("cannot map {} bytes", capacity);
    return 2;
  }
  madvise(mem, capacity, MADV_HUGEPAGE);
  std::memset(mem, 0, capacity);

  const bool leader = client.rank() == 0;
  const bool measure = !sweep.reducer_metrics.empty();
  if (measure && sweep.reducer_metrics.size() != size_t{client.shards()} * client.groups()) {
    spdlog::error("--reducer-metrics lists {} addresses for {} reducers",
                  sweep.reducer_metrics.size(), client.shards() * client.groups());
    return 2;
  }
  const std::vector<uint32_t> group_sizes =
      default_group_sizes(client.world_size(), client.groups());
  // Every rank takes part; rank 0 reads the counters while the others wait.
  double barrier_value = 0;
  auto barrier = [&] { return client.allreduce(&barrier_value, 1, DType::kFloat64, RedOp::kSum); };
  // The counters are live: results are counted before they are sent, so
  // once every rank has its results the counters hold them.
  Status scraped;
  auto snapshot = [&] {
    std::vector<Counters> out;
    if (!leader) return out;
    for (auto& address : sweep.reducer_metrics) {
      auto c = read_counters(address);
      if (!c) scraped = c.status();
      out.push_back(c ? *c : Counters{});
    }
    return out;
  };
  std::vector<Row> rows;
  if (leader) {
    std::string wire = "native";
    if (options->wire_dtype) {
      wire = std::string(dtype_name(*options->wire_dtype));
      if (options->wire_result == DType::kFloat32) wire += " (float32 results)";
    }
    std::printf("# tally-bench %s (%s) transport=%s W=%u S=%u G=%u chunk=%s wire=%s link-rate=%s\n",
                TALLY_VERSION, git_sha(), options->transport.c_str(), client.world_size(),
                client.shards(), client.groups(),
                options->chunk_bytes ? human_bytes(options->chunk_bytes).c_str() : "auto",
                wire.c_str(), link_rate_string(options->link_rate_bits).c_str());
    std::printf(
        "# reduction server: every worker sends and receives the buffer once, so busbw = algbw\n");
    std::printf(
        "# warm-up %d, timed %d iterations; time is the mean over ranks; #wrong is checked "
        "outside the timed loop\n#\n",
        sweep.warmup, sweep.iters);
    std::fputs(table_header().c_str(), stdout);
    std::fflush(stdout);
  }
  int exit_code = 0;
  uint64_t row = 0;
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes;
       bytes = sweep.factor > 1 ? bytes * sweep.factor : bytes + 1) {
    const size_t count = bytes / esize;
    if (count == 0) continue;
    const uint64_t seed = row++;
    Status status;
    size_t wrong = 0;
    if (sweep.check) {
      switch (*dtype) {
        case DType::kFloat32:
          // On the bfloat16 wire the inputs are rounded: checked within its bound.
          wrong = run_check(client, static_cast<float*>(mem), count, *dtype, *redop, seed, status,
                            options->wire_dtype ? kBfloat16WireRelativeError : 0);
          break;
        case DType::kFloat64:
          wrong = run_check(client, static_cast<double*>(mem), count, *dtype, *redop, seed, status);
          break;
        case DType::kInt32:
          wrong =
              run_check(client, static_cast<int32_t*>(mem), count, *dtype, *redop, seed, status);
          break;
        case DType::kInt64:
          wrong =
              run_check(client, static_cast<int64_t*>(mem), count, *dtype, *redop, seed, status);
          break;
        default:
          status = Status(ErrorCode::kUnimplemented, "bench cannot check " + sweep.dtype);
      }
    }
    for (int i = 0; status && i < sweep.warmup; ++i)
      status = client.allreduce(mem, count, *dtype, *redop);
    std::vector<Counters> before;
    if (measure && status) {
      status = barrier();
      before = snapshot();
      if (status) status = barrier();
    }
    const double cpu0 = rusage_cpu_seconds(RUSAGE_SELF);
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t first_timed = 0;  // the timed ops' numbers follow it
    for (int i = 0; status && i < sweep.iters; ++i) {
      const OpHandle op = client.allreduce_async(mem, count, *dtype, *redop);
      if (i == 0) first_timed = op.op().value_or(0);
      status = op.wait();
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double cpu1 = rusage_cpu_seconds(RUSAGE_SELF);
    if (!status) {
      spdlog::error("rank {}: all-reduce of {} bytes failed: {}", client.rank(), bytes,
                    status.to_string());
      return 1;
    }
    double stats[3] = {
        std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(1, sweep.iters),
        static_cast<double>(wrong), cpu1 - cpu0};
    status = client.allreduce(stats, 3, DType::kFloat64, RedOp::kSum);
    std::vector<Counters> after;
    if (measure && status) {
      after = snapshot();
      status = barrier();
    }
    if (!status) {
      spdlog::error("rank {}: gathering results failed: {}", client.rank(), status.to_string());
      return 1;
    }
    if (!scraped) {
      spdlog::error("reading the reducers' /metrics failed: {}", scraped.to_string());
      return 1;
    }
    Row row{count * esize, count, stats[0] / client.world_size(), 0, stats[1], stats[2], {}};
    row.algbw = row.time_us > 0 ? static_cast<double>(row.bytes) / row.time_us / 1e3 : 0;
    if (measure && leader) {
      const double n = sweep.iters;
      for (uint32_t g = 0; g < client.groups(); ++g) {
        for (uint32_t s = 0; s < client.shards(); ++s) {
          const size_t i = pool_index(g, s, client.shards());
          ReducerRow rr;
          rr.shard = s;
          rr.group = g;
          rr.measured.worker_in = (after[i].worker_in - before[i].worker_in) / n;
          rr.measured.worker_out = (after[i].worker_out - before[i].worker_out) / n;
          rr.measured.replica_in = (after[i].replica_in - before[i].replica_in) / n;
          rr.measured.replica_out = (after[i].replica_out - before[i].replica_out) / n;
          // A small op's plan turns over the shards with its number (op %
          // S): the mean over the timed ops, one plan per turn weighed by
          // how many timed ops take it.
          const int turns = std::min<int>(sweep.iters, static_cast<int>(client.shards()));
          for (int i = 0; i < turns; ++i) {
            const double ops = (sweep.iters - i + turns - 1) / turns;
            const Expected e = expected_bytes(client.plan(count, *dtype, first_timed + i), esize, s,
                                              g, group_sizes);
            rr.expected.worker += e.worker * ops / n;
            rr.expected.replica_in += e.replica_in * ops / n;
            rr.expected.replica_out += e.replica_out * ops / n;
          }
          row.reducers.push_back(rr);
        }
      }
    }
    if (row.wrong > 0) exit_code = 3;
    if (leader) {
      rows.push_back(row);
      TableRow line{row.bytes,
                    row.count,
                    std::string(dtype_name(*dtype)),
                    std::string(redop_name(*redop)),
                    row.time_us,
                    row.algbw,
                    row.algbw,
                    row.wrong};
      std::fputs(format_row(line).c_str(), stdout);
      std::fflush(stdout);
    }
    if (sweep.factor <= 1 && bytes == sweep.max_bytes) break;
  }
  if (leader) {
    double avg = 0;
    double timed_cpu = 0;
    double timed_bytes = 0;  // sent by the ranks in the timed loops
    for (auto& r : rows) {
      avg += r.algbw;
      timed_cpu += r.timed_cpu;
      timed_bytes += static_cast<double>(r.bytes) * sweep.iters * client.world_size();
    }
    if (!rows.empty()) avg /= static_cast<double>(rows.size());
    std::printf("# Out of bounds values : %s\n", exit_code == 0 ? "0 OK" : "FAILED");
    std::printf("# Avg bus bandwidth    : %.3f\n", avg);
    const double gb = timed_bytes / 1e9;
    std::printf("# cpu of the workers in the timed loops: %.2f s = %.2f s/GB sent (%.2f GB)\n#\n",
                timed_cpu, gb > 0 ? timed_cpu / gb : 0.0, gb);
    if (measure) {
      std::printf(
          "# Payload bytes per op at each reducer (shard s, group g; w = workers of the group), "
          "measured from its counters over the timed loop,\n"
          "# and the formula's: workers w x N_s each way (N_s: shard s's bytes of the tensor); "
          "replicas 2(P-1)/P x N_s each way\n"
          "# (P: largest power of two <= groups with workers; +N_s for a replica paired with an "
          "extra; an extra sends and receives N_s)\n");
      std::printf("# %10s %3s %3s %3s %12s %12s %12s %12s | %12s %12s %12s\n", "size", "s", "g",
                  "w", "worker-in", "worker-out", "replica-in", "replica-out", "f:worker",
                  "f:replica-in", "f:replica-out");
      for (const Row& r : rows) {
        for (const ReducerRow& rr : r.reducers) {
          std::printf("  %10zu %3u %3u %3u %12.0f %12.0f %12.0f %12.0f | %12.0f %12.0f %12.0f\n",
                      r.bytes, rr.shard, rr.group, group_sizes[rr.group], rr.measured.worker_in,
                      rr.measured.worker_out, rr.measured.replica_in, rr.measured.replica_out,
                      rr.expected.worker, rr.expected.replica_in, rr.expected.replica_out);
        }
      }
      std::printf("#\n");
    }
    if (!sweep.json_path.empty()) {
      std::ofstream out(sweep.json_path);
      out << "{\n  \"tool\": \"tally-bench\",\n  \"version\": \"" << TALLY_VERSION
          << "\",\n  \"git\": \"" << git_sha() << "\",\n  \"transport\": \"" << options->transport
          << "\",\n"
          << "  \"workers\": " << client.world_size() << ",\n  \"shards\": " << client.shards()
          << ",\n  \"groups\": " << client.groups()
          << ",\n  \"chunk_bytes\": " << options->chunk_bytes << ",\n  \"wire_dtype\": \""
          << (options->wire_dtype ? dtype_name(*options->wire_dtype) : "native") << "\""
          << ",\n  \"busbw_factor\": 1.0,\n  \"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        char line[512];
        std::snprintf(
            line, sizeof(line),
            "    {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", "
            "\"time_us\": %.3f, \"algbw_gbps\": %.6f, \"busbw_gbps\": %.6f, \"wrong\": %.0f",
            r.bytes, r.count, std::string(dtype_name(*dtype)).c_str(),
            std::string(redop_name(*redop)).c_str(), r.time_us, r.algbw, r.algbw, r.wrong);
        out << line;
        if (!r.reducers.empty()) {
          out << ", \"reducers\": [";
          for (size_t j = 0; j < r.reducers.size(); ++j) {
            const ReducerRow& rr = r.reducers[j];
            std::snprintf(
                line, sizeof(line),
                "%s{\"shard\": %u, \"group\": %u, \"worker_in\": %.0f, \"worker_out\": %.0f, "
                "\"replica_in\": %.0f, \"replica_out\": %.0f, \"expected_worker\": %.0f, "
                "\"expected_replica_in\": %.0f, \"expected_replica_out\": %.0f}",
                j ? ", " : "", rr.shard, rr.group, rr.measured.worker_in, rr.measured.worker_out,
                rr.measured.replica_in, rr.measured.replica_out, rr.expected.worker,
                rr.expected.replica_in, rr.expected.replica_out);
            out << line;
          }
          out << "]";
        }
        out << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
      }
      out << "  ],\n  \"avg_busbw_gbps\": " << avg << ",\n  \"timed_worker_cpu_s\": " << timed_cpu
          << ",\n  \"timed_gb\": " << gb << "\n}\n";
      if (!out) {
        spdlog::error("cannot write {}", sweep.json_path);
        return 2;
      }
    }
  }
  munmap(mem, capacity);
  return exit_code;
}

// One transport's sweep from the driver: W worker processes against the
// pool, and the CPU the reducers and the workers spent on it.

}  // namespace tally::bench
