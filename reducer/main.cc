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
#include <optional>
#include <string_view>

#include "tally/protocol/auth.h"
#include "tally/protocol/control.h"
#include "tally/protocol/link_rate.h"
#include "tally/protocol/log_level.h"
#include "tally/protocol/version.h"
#include "tally/reducer/http_server.h"
#include "tally/reducer/metrics.h"
#include "tally/reducer/reducer.h"

namespace {

// How often --stats-file is rewritten: fine enough for a bench to read the
// counters between phases, rare enough to cost nothing.
constexpr auto kStatsInterval = std::chrono::milliseconds(100);

// What /metrics serves (without the HTTP counters), written whole (via a
// rename) so a reader never sees a partial file.
void write_stats(const std::string& path, const tally::Reducer& reducer,
                 const tally::ReducerIdentity& identity) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << tally::metrics_text(tally::live_metric_families(reducer, identity));
  std::rename(tmp.c_str(), path.c_str());
}

// GET /metrics, /healthz, /readyz.
tally::HttpResponse serve(const tally::Reducer& reducer, const tally::ReducerMetrics& metrics,
                          std::string_view target) {
  const std::string_view path = target.substr(0, target.find('?'));
  if (path == "/metrics") return {200, tally::kMetricsContentType, metrics.scrape()};
  if (path == "/healthz" || path == "/readyz") {
    const tally::Status s = path == "/healthz" ? reducer.liveness() : reducer.readiness();
    if (s.is_ok()) return {200, "text/plain; charset=utf-8", "ok\n"};
    return {503, "text/plain; charset=utf-8", s.message() + "\n"};
  }
  return {404, "text/plain; charset=utf-8", "not found; try /metrics, /healthz or /readyz\n"};
}

}  // namespace

int main(int argc, char** argv) {
  tally::ReducerOptions options;
  std::string listen = "127.0.0.1:7070";
  std::string log_level = "info";
  std::string ready_file;
  std::string stats_file;
  std::string http_listen;
  size_t memory_budget = options.memory_budget_bytes;
  size_t max_chunk = options.max_chunk_bytes;
  size_t ingress_window = options.ingress_window_bytes;
  int64_t heartbeat_ms = options.connection.heartbeat_interval.count();
  int64_t peer_timeout_ms = options.connection.peer_timeout.count();
  int64_t hello_timeout_ms = options.hello_timeout.count();

  CLI::App app{
      "tally-reducer: sums gradient chunks from training workers and streams the results back"};
  app.set_version_flag("--version", "tally-reducer " + tally::version_string());
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
                 "rewrite the metrics here (Prometheus text format) every 100 ms and at exit")
      ->envname("TALLY_STATS_FILE");
  app.add_option(
         "--http-listen", http_listen,
         "serve /metrics, /healthz and /readyz over HTTP here, host:port (port 0 picks one); "
         "unset: no HTTP")
      ->envname("TALLY_HTTP_LISTEN");
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
  app.add_option("--ingress-window", ingress_window,
                 "bytes of contributions a job's workers together may have in flight to this "
                 "reducer, e.g. 16MiB")
      ->envname("TALLY_INGRESS_WINDOW")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--max-world-size", options.max_world_size, "largest world size a job may declare")
      ->envname("TALLY_MAX_WORLD_SIZE")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  std::string job_secret_file, pool_secret_file;
  app.add_option("--job-secret-file", job_secret_file,
                 "file holding the job secret workers authenticate with (else $TALLY_JOB_SECRET)")
      ->envname("TALLY_JOB_SECRET_FILE");
  app.add_flag("--per-job-secrets", options.per_job_secrets,
               "the job secret is a master: each job authenticates with its own secret, "
               "derived from it and the job's name (--print-job-secret prints one)")
      ->envname("TALLY_PER_JOB_SECRETS");
  std::string print_job_secret;
  app.add_option("--print-job-secret", print_job_secret,
                 "print the secret of the job with this name, derived from the job secret (the "
                 "master of --per-job-secrets), and exit");
  app.add_option("--pool-secret-file", pool_secret_file,
                 "file holding the secret replicas authenticate their links with (else "
                 "$TALLY_POOL_SECRET)")
      ->envname("TALLY_POOL_SECRET_FILE");
  app.add_flag("--require-auth", options.require_auth,
               "refuse workers that do not authenticate with the job secret")
      ->envname("TALLY_REQUIRE_AUTH");
  app.add_flag("--insecure-open-pool", options.insecure_open_pool,
               "serve workers from any address without a job secret, and replicas without a "
               "pool secret (by default, without one, only loopback addresses are served)")
      ->envname("TALLY_INSECURE_OPEN_POOL");
  app.add_option("--tcp-congestion", options.connection.congestion_control,
                 "TCP congestion control of every stream (e.g. cubic; default: the system's)")
      ->envname("TALLY_TCP_CONGESTION");
  std::string link_rate;
  app.add_option("--link-rate", link_rate,
                 "this reducer's link rate in tc's units (e.g. 10gbit): each worker stream of a "
                 "job is paced to an equal share of it; with cubic unless --tcp-congestion names "
                 "another (default: not paced)")
      ->envname("TALLY_LINK_RATE");
  app.add_option("--max-connections", options.max_connections,
                 "open streams at most; a new one past it cuts the oldest stream not yet "
                 "admitted (no hello, or not yet authenticated), or is closed when every open "
                 "one is admitted")
      ->envname("TALLY_MAX_CONNECTIONS")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
  app.add_option("--max-pending-per-source", options.max_pending_per_source,
                 "streams from one source address not yet admitted; more from it are closed "
                 "as they are accepted")
      ->envname("TALLY_MAX_PENDING_PER_SOURCE")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
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
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, critical or off")
      ->envname("TALLY_LOG_LEVEL")
      ->capture_default_str()
      ->check(CLI::IsMember(tally::log_level_names()));
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
  std::optional<tally::HostPort> http_address;
  if (!http_listen.empty()) {
    auto hp = tally::parse_host_port(http_listen);
    if (!hp) {
      spdlog::error("--http-listen: {}", hp.status().to_string());
      return 2;
    }
    http_address = *hp;
  }
  options.memory_budget_bytes = memory_budget;
  options.max_chunk_bytes = max_chunk;
  options.ingress_window_bytes = ingress_window;
  if (!link_rate.empty()) {
    auto rate = tally::parse_link_rate(link_rate);
    if (!rate) {
      spdlog::error("--link-rate: {}", rate.status().to_string());
      return 2;
    }
    options.link_rate_bits = *rate;
  }
  options.connection.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
  options.connection.peer_timeout = std::chrono::milliseconds(peer_timeout_ms);
  options.hello_timeout = std::chrono::milliseconds(hello_timeout_ms);
  auto job_secret = tally::load_secret(job_secret_file, "TALLY_JOB_SECRET", "job secret");
  auto pool_secret = tally::load_secret(pool_secret_file, "TALLY_POOL_SECRET", "pool secret");
  for (auto* secret : {&job_secret, &pool_secret}) {
    if (!*secret) {
      spdlog::error("{}", secret->status().to_string());
      return 2;
    }
  }
  options.job_secret = std::move(*job_secret);
  options.pool_secret = std::move(*pool_secret);
  if (!print_job_secret.empty()) {
    if (options.job_secret.empty()) {
      spdlog::error("--print-job-secret needs the master (--job-secret-file or TALLY_JOB_SECRET)");
      return 2;
    }
    std::printf("%s\n",
                tally::derive_job_secret(options.job_secret, print_job_secret).bytes().c_str());
    return 0;
  }
  if (options.per_job_secrets && options.job_secret.empty()) {
    spdlog::error("--per-job-secrets needs the master (--job-secret-file or TALLY_JOB_SECRET)");
    return 2;
  }
  // The variables are read: do not leave them to children or /proc readers.
  unsetenv("TALLY_JOB_SECRET");
  unsetenv("TALLY_POOL_SECRET");
  if (options.require_auth && options.job_secret.empty()) {
    spdlog::error("--require-auth needs the job secret (--job-secret-file or TALLY_JOB_SECRET)");
    return 2;
  }

  tally::route_protobuf_logs();  // before any I/O thread parses

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
  const std::string bound = (*reducer)->address().to_string();
  if (options.job_secret.empty() && !options.insecure_open_pool) {
    spdlog::info(
        "protected mode: no job secret, so workers are served from loopback addresses only "
        "(give --job-secret-file, or --insecure-open-pool to serve any address without one)");
  } else if (options.job_secret.empty()) {
    spdlog::warn(
        "--insecure-open-pool: no job secret, and anyone who reaches {} can join any job, read "
        "its results and change them",
        bound);
  } else if (!options.require_auth) {
    spdlog::warn(
        "authentication is not required (--require-auth is off): anyone who reaches {} can join "
        "a job whose workers hold no secret",
        bound);
  }
  if (options.per_job_secrets) {
    spdlog::info(
        "per-job secrets: each job authenticates with its own secret, derived from the master "
        "(tally-reducer --job-secret-file MASTER --print-job-secret JOB prints it)");
  }
  if (options.group_count > 1 && options.pool_secret.empty()) {
    if (options.insecure_open_pool) {
      spdlog::warn(
          "--insecure-open-pool: no pool secret, and anyone who reaches {} can speak as another "
          "replica of shard {}",
          bound, options.shard);
    } else {
      spdlog::info(
          "protected mode: no pool secret, so replicas are served from loopback addresses only "
          "(give --pool-secret-file, or --insecure-open-pool)");
    }
  }
  const tally::ReducerIdentity identity{options.shard, options.shard_count, options.group,
                                        options.group_count, options.transport};
  tally::ReducerMetrics metrics(**reducer, identity);
  std::unique_ptr<tally::HttpServer> http;
  if (http_address) {
    tally::HttpServerOptions http_options;
    http_options.listen = *http_address;
    const tally::Reducer& r = **reducer;
    auto started = tally::HttpServer::start(
        http_options, [&r, &metrics](std::string_view target) { return serve(r, metrics, target); },
        {[&metrics](const std::string& path, unsigned status) {
           const bool known = path == "/metrics" || path == "/healthz" || path == "/readyz";
           metrics.count_request(known ? path : "other", status);
         },
         [&metrics] { metrics.count_rejected(); }, [&metrics] { metrics.count_timed_out(); }});
    if (!started) {
      spdlog::error("cannot start: {}", started.status().to_string());
      return 1;
    }
    http = std::move(*started);
    spdlog::info("serving /metrics, /healthz and /readyz on http://{}",
                 http->address().to_string());
  }
  if (!ready_file.empty()) {
    const std::string tmp = ready_file + ".tmp";
    {
      std::ofstream out(tmp);
      out << (*reducer)->address().to_string() << "\n";
      if (http) out << "http " << http->address().to_string() << "\n";
    }
    std::rename(tmp.c_str(), ready_file.c_str());  // readers never see a partial file
  }
  int sig = 0;
  if (stats_file.empty()) {
    sigwait(&signals, &sig);
  } else {
    const timespec interval{0, std::chrono::nanoseconds(kStatsInterval).count()};
    while ((sig = sigtimedwait(&signals, nullptr, &interval)) < 0)
      write_stats(stats_file, **reducer, identity);
  }
  spdlog::info("received {}, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
  auto stats = (*reducer)->stats();
  // /healthz and /readyz answer 503 while the streams close.
  (*reducer)->stop();
  (*reducer)->wait();
  if (http) http->stop();
  if (!stats_file.empty()) write_stats(stats_file, **reducer, identity);
  spdlog::info(
      "done: {} chunks summed, {} bytes in, {} bytes out, {} replica bytes in, {} replica bytes "
      "out, "
      "{} ops failed",
      stats[tally::Count::kChunksFinished], stats[tally::Count::kWorkerBytesReceived],
      stats[tally::Count::kWorkerBytesSent], stats[tally::Count::kReplicaBytesReceived],
      stats[tally::Count::kReplicaBytesSent], stats[tally::Count::kOpsFailed]);
  return 0;
}
