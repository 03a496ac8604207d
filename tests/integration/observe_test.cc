// Observing a pool: real tally-reducer processes with --http-listen, real
// HTTP requests for /metrics, /healthz and /readyz; and workers finding a
// pool written as a pattern, started before their reducers.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <sstream>
#include <thread>

#include "harness.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/metrics_scrape.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

struct Pool {
  std::string dir;
  std::unique_ptr<bench::LocalPool> pool;

  Pool(uint32_t shards, uint32_t groups) {
    char tmpl[] = "/tmp/tally-observe-XXXXXX";
    EXPECT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
    bench::LocalPoolOptions o;
    o.shards = shards;
    o.groups = groups;
    o.http = true;
    o.reducer_path = TALLY_REDUCER_PATH;
    o.log_dir = dir;
    o.extra_args = {"--max-chunk-bytes", "4096", "--memory-budget", "1MiB",
                    "--window",          "4",    "--io-threads",    "2"};
    auto p = bench::LocalPool::start(o);
    EXPECT_TRUE(p) << p.status().to_string();
    if (p) pool = std::move(*p);
  }
  ~Pool() {
    pool.reset();
    std::filesystem::remove_all(dir);
  }
  std::map<std::string, double> metrics(uint32_t index) {
    auto text = bench::http_get(pool->http_addresses().at(index), "/metrics", 5s);
    EXPECT_TRUE(text) << text.status().to_string();
    return text ? bench::parse_metrics(*text) : std::map<std::string, double>{};
  }
  // GET `path`: the body of a 200, else an error naming the status.
  Result<std::string> get(uint32_t index, const std::string& path) {
    return bench::http_get(pool->http_addresses().at(index), path, 5s);
  }
};

std::map<std::string, std::string> worker_env(const std::string& pool, const std::string& job,
                                              uint32_t rank, uint32_t world) {
  return {{"TALLY_POOL", pool},
          {"TALLY_JOB", job},
          {"TALLY_RANK", std::to_string(rank)},
          {"TALLY_WORLD_SIZE", std::to_string(world)},
          {"TALLY_CHUNK_BYTES", "1024"},
          {"TALLY_OP_TIMEOUT_MS", "20000"},
          {"TALLY_CONNECT_TIMEOUT_MS", "20000"}};
}

// A reducer under load answers /metrics with byte counters that match what
// the workers moved: W workers x ops x bytes in, and the same out.
TEST(Observe, MetricsCountTheBytesTheWorkersMoved) {
  Pool p(2, 1);
  ASSERT_TRUE(p.pool);
  for (uint32_t i = 0; i < 2; ++i) {
    auto health = p.get(i, "/healthz");
    EXPECT_TRUE(health) << health.status().to_string();
    auto ready = p.get(i, "/readyz");
    EXPECT_TRUE(ready) << ready.status().to_string();
  }
  constexpr uint32_t kWorkers = 3;
  constexpr uint64_t kCount = 10007;  // float32: 40028 bytes, 40 chunks of 1 KiB
  constexpr uint64_t kOps = 6;
  std::vector<bench::Process> workers;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    workers.push_back(
        spawn_logged(TALLY_TEST_WORKER_PATH, p.dir, "w" + std::to_string(r),
                     {"--count", std::to_string(kCount), "--ops", std::to_string(kOps)},
                     worker_env(p.pool->pool_string(), "observe", r, kWorkers)));
  }
  // Scrape while the job runs: the HTTP side answers under load.
  size_t scrapes = 0;
  while (!workers[0].wait_for(0ms)) {
    auto m = p.get(0, "/metrics");
    ASSERT_TRUE(m) << m.status().to_string();
    ++scrapes;
    std::this_thread::sleep_for(5ms);
    if (scrapes > 4000) break;
  }
  for (uint32_t r = 0; r < kWorkers; ++r) {
    auto st = workers[r].wait_for(60s);
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(*st, 0) << read_file(p.dir + "/w" + std::to_string(r) + ".out")
                      << read_file(p.dir + "/w" + std::to_string(r) + ".err");
  }
  const double bytes = kCount * 4.0;
  double in = 0, out = 0, chunks = 0;
  for (uint32_t i = 0; i < 2; ++i) {
    auto m = p.metrics(i);
    in += m["tally_payload_bytes_received_total{peer=\"worker\"}"];
    out += m["tally_payload_bytes_sent_total{peer=\"worker\"}"];
    chunks += m["tally_chunks_completed_total"];
    EXPECT_EQ(m["tally_ops_completed_total"], kOps) << i;
    EXPECT_EQ(m["tally_op_duration_seconds_count"], kOps) << i;
    EXPECT_EQ(m["tally_payload_bytes_received_total{peer=\"replica\"}"], 0) << i;
    EXPECT_EQ(m["tally_ready"], 1) << i;
    EXPECT_EQ(m["tally_streams_paused"], 0) << i;
    // The process's own resources, as every Prometheus client names them.
    EXPECT_GT(m["process_resident_memory_bytes"], 1 << 20) << i;
    EXPECT_GE(m["process_virtual_memory_bytes"], m["process_resident_memory_bytes"]) << i;
    EXPECT_GT(m["process_cpu_seconds_total"], 0) << i;
    EXPECT_GE(m["process_open_fds"], 3) << i;
    EXPECT_LT(m["process_open_fds"], m["process_max_fds"]) << i;
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    EXPECT_GT(m["process_start_time_seconds"], now - 600) << i;
    EXPECT_LT(m["process_start_time_seconds"], now + 5) << i;
    EXPECT_TRUE(
        eventually([&] { return p.metrics(i)["tally_streams_active{kind=\"worker\"}"] == 0; }, 5s))
        << i;
  }
  EXPECT_EQ(in, kWorkers * kOps * bytes);
  EXPECT_EQ(out, kWorkers * kOps * bytes);
  EXPECT_EQ(chunks, kOps * ((kCount * 4 + 1023) / 1024));
  EXPECT_GT(scrapes, 0u);
}

// /readyz is 503 while a replica link is down and 200 once both streams to
// every other replica are up; /healthz stays 200 throughout.
TEST(Observe, ReadyzFollowsTheReplicaLinks) {
  Pool p(1, 2);
  ASSERT_TRUE(p.pool);
  EXPECT_TRUE(eventually([&] { return p.get(0, "/readyz").is_ok(); }, 10s));
  EXPECT_EQ(p.metrics(0)["tally_replica_links_up"], 1);
  EXPECT_EQ(p.metrics(0)["tally_replica_links"], 1);
  p.pool->reducer(1).signal(SIGKILL);
  EXPECT_TRUE(eventually([&] { return !p.get(0, "/readyz").is_ok(); }, 10s));
  auto ready = p.get(0, "/readyz");
  ASSERT_FALSE(ready);
  EXPECT_NE(ready.status().message().find("503"), std::string::npos) << ready.status().to_string();
  EXPECT_NE(ready.status().message().find("0 of 1 replica links up"), std::string::npos)
      << ready.status().to_string();
  EXPECT_EQ(p.metrics(0)["tally_replica_links_up"], 0);
  EXPECT_EQ(p.metrics(0)["tally_ready"], 0);
  EXPECT_TRUE(p.get(0, "/healthz").is_ok());
  p.pool->restart(1);
  EXPECT_TRUE(eventually([&] { return p.get(0, "/readyz").is_ok(); }, 10s));
}

// tally-bench against a running pool (--pool) reads its reducers' /metrics
// (--metrics, a pattern here) and prints bytes per op at each reducer that
// match the formula: N_s each way from and to the workers of the group.
TEST(Observe, BenchWithAGivenPoolReadsItsMetrics) {
  Pool p(2, 1);
  ASSERT_TRUE(p.pool);
  std::string metrics;
  for (auto& a : p.pool->http_addresses()) metrics += (metrics.empty() ? "" : ",") + a;
  bench::ProcessSpec run;
  run.path = TALLY_BENCH_PATH;
  run.args = {"--pool",
              p.pool->pool_string(),
              "--metrics",
              metrics,
              "-W",
              "3",
              "-b",
              "64K",
              "-e",
              "256K",
              "-f",
              "4",
              "-w",
              "1",
              "-n",
              "3",
              "--chunk-bytes",
              "4K"};
  run.env = {{"TALLY_REDUCER", "/nonexistent"}};  // no local pool
  run.stdout_path = p.dir + "/bench.out";
  run.stderr_path = p.dir + "/bench.err";
  auto b = bench::Process::spawn(run);
  ASSERT_TRUE(b) << b.status().to_string();
  auto st = b->wait_for(90s);
  const std::string out = read_file(p.dir + "/bench.out");
  ASSERT_TRUE(st.has_value());
  ASSERT_EQ(*st, 0) << out << read_file(p.dir + "/bench.err");
  const auto rows = traffic_rows(out);
  for (const TrafficRow& r : rows) {
    EXPECT_EQ(r.workers, 3u) << r.line;
    EXPECT_NEAR(r.measured[0], r.formula[0], 64) << r.line;  // the barrier ops add a few bytes
    EXPECT_NEAR(r.measured[1], r.formula[0], 64) << r.line;
    EXPECT_GT(r.measured[0], 0) << r.line;
    EXPECT_EQ(r.measured[2], 0) << r.line;
  }
  EXPECT_EQ(rows.size(), 2u * 2u) << out;
}

uint16_t free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  close(fd);
  return ntohs(sa.sin_port);
}

// Workers given a pool pattern (as from the chart's NOTES) start before
// any reducer listens, keep retrying within their connect timeout, and
// finish their ops once the reducers come up.
TEST(Observe, WorkersStartedBeforeThePoolJoinItWhenItComesUp) {
  char tmpl[] = "/tmp/tally-observe-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const uint16_t port = free_port();
  // Two reducers on one port, on two loopback addresses: 127.0.0.1 and .2.
  const std::string pattern = "127.0.0.{1..2}:" + std::to_string(port);
  std::vector<bench::Process> workers;
  for (uint32_t r = 0; r < 2; ++r) {
    workers.push_back(spawn_logged(TALLY_TEST_WORKER_PATH, dir, "w" + std::to_string(r),
                                   {"--count", "3001", "--ops", "3"},
                                   worker_env(pattern, "late-pool", r, 2)));
  }
  std::this_thread::sleep_for(1500ms);
  for (uint32_t r = 0; r < 2; ++r)
    EXPECT_FALSE(workers[r].wait_for(0ms).has_value()) << "rank " << r;
  std::vector<bench::Process> reducers;
  for (uint32_t s = 0; s < 2; ++s) {
    reducers.push_back(
        spawn_logged(TALLY_REDUCER_PATH, dir, "r" + std::to_string(s),
                     {"--listen", "127.0.0." + std::to_string(s + 1) + ":" + std::to_string(port),
                      "--shard", std::to_string(s), "--shards", "2", "--memory-budget", "64MiB"},
                     {}));
  }
  for (uint32_t r = 0; r < 2; ++r) {
    auto st = workers[r].wait_for(30s);
    ASSERT_TRUE(st.has_value()) << "rank " << r;
    EXPECT_EQ(*st, 0) << read_file(dir + "/w" + std::to_string(r) + ".out")
                      << read_file(dir + "/w" + std::to_string(r) + ".err");
  }
  for (auto& r : reducers) {
    r.signal(SIGTERM);
    EXPECT_EQ(r.terminate(5s), 0);
  }
  std::filesystem::remove_all(dir);
}

// A name that does not resolve (a pod not yet in DNS) is retried, not
// fatal, until the connect timeout; the error then names the address and
// the resolver's answer (the last attempt's error, or the timeout's with it
// when the deadline passed between attempts).
TEST(Observe, UnresolvedNamesAreRetriedUntilTheConnectTimeout) {
  char tmpl[] = "/tmp/tally-observe-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  auto env = worker_env("tally-{0..1}.tally.nowhere.invalid:7070", "no-dns", 0, 1);
  env["TALLY_CONNECT_TIMEOUT_MS"] = "1500";
  const auto t0 = std::chrono::steady_clock::now();
  auto w = spawn_logged(TALLY_TEST_WORKER_PATH, dir, "w", {"--count", "10", "--ops", "1"}, env);
  auto st = w.wait_for(20s);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(*st, 2);
  EXPECT_GE(took, 1400ms);
  const std::string out = read_file(dir + "/w.out") + read_file(dir + "/w.err");
  EXPECT_NE(out.find("tally.nowhere.invalid:7070"), std::string::npos) << out;
  EXPECT_NE(out.find("resolving"), std::string::npos) << out;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tally::testing
