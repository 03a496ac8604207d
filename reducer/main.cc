// tally-reducer: one shard of a reduction server pool.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>

#include "tally/reducer/reducer.h"

namespace {

// How often --stats-file is rewritten: fine enough for a bench to read the
// counters between phases, rare enough to cost nothing.
constexpr auto kStatsInterval = std::chrono::milliseconds(100);

// The counters in Prometheus text format, written whole (via a rename) so a
// reader never sees a partial file.
void write_stats(const std::string& path, const tally::ReducerStats& s) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << "# tally-reducer counters; bytes are payload bytes\n"
        << "tally_worker_bytes_received_total " << s.bytes_received << "\n"
        << "tally_worker_bytes_sent_total " << s.bytes_sent << "\n"
        << "tally_replica_bytes_received_total " << s.replica_bytes_received << "\n"
        << "tally_replica_bytes_sent_total " << s.replica_bytes_sent << "\n"
        << "tally_chunks_finished_total " << s.chunks_finished << "\n"
        << "tally_ops_failed_total " << s.ops_failed << "\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  tally::ReducerOptions options;
  std::string listen = "127.0.0.1:7070";
  std::string log_level = "info";
  std::string ready_file;
  std::string stats_file;
  size_t memory_budget = options.memory_budget_bytes;
  size_t max_chunk = options.max_chunk_bytes;
  int64_t heartbeat_ms = options.connection.heartbeat_interval.count();
  int64_t peer_timeout_ms = options.connection.peer_timeout.count();
  int64_t hello_timeout_ms = options.hello_timeout.count();

  CLI::App app{
      "tally-reducer: sums gradient chunks from training workers and streams the results back"};
  app.add_option("--listen", listen, "address to listen on, host:port (port 0 picks one)")
      ->envname("TALLY_LISTEN")
      ->capture_default_str();
  app.add_option("--shard", options.shard, "this reducer's shard index")
      ->envname("TALLY_SHARD")
      ->capture_default_str();
  app.add_option("--shards", options.shard_count, "number of shards in the pool")
      ->envname("TALLY_SHARDS")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--group", options.group, "this reducer's replica group")
      ->envname("TALLY_GROUP")
      ->capture_default_str();
  app.add_option("--groups", options.group_count, "number of replica groups in the pool")
      ->envname("TALLY_GROUPS")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  // --peers / TALLY_PEERS: the names before replicas were named replicas.
  app.add_option("--pool,--peers", options.pool,
                 "with --groups > 1: the whole pool, host:port,... in (group, shard) order (the "
                 "workers' TALLY_POOL), or @FILE holding it")
      ->envname("TALLY_POOL");
  app.add_option("--stats-file", stats_file,
                 "rewrite the counters here (Prometheus text format) every 100 ms and at exit")
      ->envname("TALLY_STATS_FILE");
  app.add_option("--io-threads", options.io_threads, "I/O threads")
      ->envname("TALLY_IO_THREADS")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("--memory-budget", memory_budget, "chunk memory, e.g. 512MiB")
      ->envname("TALLY_MEMORY_BUDGET")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--max-chunk-bytes", max_chunk, "largest chunk accepted, e.g. 4MiB")
      ->envname("TALLY_MAX_CHUNK_BYTES")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--window", options.window_chunks, "chunks a worker may have in flight per stream")
      ->envname("TALLY_WINDOW")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-world-size", options.max_world_size, "largest world size a job may declare")
      ->envname("TALLY_MAX_WORLD_SIZE")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--heartbeat-ms", heartbeat_ms, "heartbeat interval on idle streams")
      ->envname("TALLY_HEARTBEAT_MS")
      ->capture_default_str()
      ->check(CLI::Range(10, 600000));
  app.add_option("--peer-timeout-ms", peer_timeout_ms, "a stream silent this long is dead")
      ->envname("TALLY_PEER_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(100, 3600000));
  app.add_option("--hello-timeout-ms", hello_timeout_ms,
                 "a stream that has not said hello by then is closed")
      ->envname("TALLY_HELLO_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(100, 3600000));
  app.add_option("--transport", options.transport,
                 "tcp, or fabric to also serve workers on the libfabric data path")
      ->envname("TALLY_TRANSPORT")
      ->capture_default_str()
      ->check(CLI::IsMember({"tcp", "fabric"}));
  // FI_PROVIDER, libfabric's own variable, is the fallback default.
  if (const char* fi = std::getenv("FI_PROVIDER"); fi && *fi) options.fabric.provider = fi;
  app.add_option("--fabric-provider", options.fabric.provider,
                 "libfabric provider for --transport fabric")
      ->envname("TALLY_FABRIC_PROVIDER")
      ->capture_default_str();
  app.add_flag(
         "--fabric-force-registration", options.fabric.force_registration,
         "register buffers even where the provider does not ask (tests the registration path)")
      ->envname("TALLY_FABRIC_FORCE_REGISTRATION");
  app.add_option(
         "--fabric-max-msg-bytes", options.fabric.max_msg_bytes,
         "split payloads into messages of at most this size (0: the provider's max_msg_size)")
      ->envname("TALLY_FABRIC_MAX_MSG_BYTES")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->envname("TALLY_LOG_LEVEL")
      ->capture_default_str();
  app.add_option("--ready-file", ready_file,
                 "write the bound host:port here once listening (for launchers)");
  CLI11_PARSE(app, argc, argv);
  if (const char* peers = std::getenv("TALLY_PEERS"); options.pool.empty() && peers) {
    options.pool = peers;
  }

  auto logger = spdlog::stderr_color_mt("tally-reducer");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(log_level));

  auto address = tally::parse_host_port(listen);
  if (!address) {
    spdlog::error("{}", address.status().to_string());
    return 2;
  }
  options.listen = *address;
  options.memory_budget_bytes = memory_budget;
  options.max_chunk_bytes = max_chunk;
  options.connection.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
  options.connection.peer_timeout = std::chrono::milliseconds(peer_timeout_ms);
  options.hello_timeout = std::chrono::milliseconds(hello_timeout_ms);

  // Signals are taken synchronously by this thread; the I/O threads inherit
  // the mask and never see them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  auto reducer = tally::Reducer::start(options);
  if (!reducer) {
    spdlog::error("cannot start: {}", reducer.status().to_string());
    return 1;
  }
  if (!ready_file.empty()) {
    const std::string tmp = ready_file + ".tmp";
    std::ofstream(tmp) << (*reducer)->address().to_string() << "\n";
    std::rename(tmp.c_str(), ready_file.c_str());  // readers never see a partial file
  }
  int sig = 0;
  if (stats_file.empty()) {
    sigwait(&signals, &sig);
  } else {
    const timespec interval{0, std::chrono::nanoseconds(kStatsInterval).count()};
    while ((sig = sigtimedwait(&signals, nullptr, &interval)) < 0)
      write_stats(stats_file, (*reducer)->stats());
  }
  spdlog::info("received {}, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
  auto stats = (*reducer)->stats();
  (*reducer)->stop();
  (*reducer)->wait();
  if (!stats_file.empty()) write_stats(stats_file, (*reducer)->stats());
  spdlog::info(
      "done: {} chunks summed, {} bytes in, {} bytes out, {} replica bytes in, {} replica bytes "
      "out, "
      "{} ops failed",
      stats.chunks_finished, stats.bytes_received, stats.bytes_sent, stats.replica_bytes_received,
      stats.replica_bytes_sent, stats.ops_failed);
  return 0;
}
