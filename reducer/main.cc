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

// The command line: ReducerOptions, and what is read into other forms
// first (sizes, milliseconds, files, addresses).
struct CommandLine {
  tally::ReducerOptions options;
  std::string listen = "127.0.0.1:7070";
  std::string log_level = "info";
  std::string ready_file;
  std::string stats_file;
  std::string http_listen;
  std::optional<tally::HostPort> http_address;  // http_listen, resolved
  size_t memory_budget = options.memory_budget_bytes;
  size_t max_chunk = options.max_chunk_bytes;
  size_t ingress_window = options.ingress_window_bytes;
  size_t receive_budget = options.receive_budget_bytes;
  int64_t heartbeat_ms = options.connection.heartbeat_interval.count();
  int64_t peer_timeout_ms = options.connection.peer_timeout.count();
  int64_t hello_timeout_ms = options.hello_timeout.count();
  std::string job_secret_file, pool_secret_file;
  std::string print_job_secret;
  std::string link_rate;
};

// This reducer's place in its pool, and how to reach it.
void add_place_options(CLI::App& app, CommandLine& c) {
  app.add_option("--listen", c.listen, "address to listen on, host:port (port 0 picks one)")
      ->envname("TALLY_LISTEN")
      ->capture_default_str();
  app.add_option("--shard", c.options.shard, "this reducer's shard index")
      ->envname("TALLY_SHARD")
      ->capture_default_str();
  app.add_option("--shards", c.options.shard_count, "number of shards in the pool")
      ->envname("TALLY_SHARDS")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--group", c.options.group, "this reducer's replica group")
      ->envname("TALLY_GROUP")
      ->capture_default_str();
  app.add_option("--groups", c.options.group_count, "number of replica groups in the pool")
      ->envname("TALLY_GROUPS")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  // --peers / TALLY_PEERS: the names before replicas were named replicas.
  app.add_option("--pool,--peers", c.options.pool,
                 "with --groups > 1: the whole pool, host:port,... in (group, shard) order (the "
                 "workers' TALLY_POOL), or @FILE holding it")
      ->envname("TALLY_POOL");
}

// Where it reports: metrics, health, logs, the bound address.
void add_report_options(CLI::App& app, CommandLine& c) {
  app.add_option("--stats-file", c.stats_file,
                 "rewrite the metrics here (Prometheus text format) every 100 ms and at exit")
      ->envname("TALLY_STATS_FILE");
  app.add_option(
         "--http-listen", c.http_listen,
         "serve /metrics, /healthz and /readyz over HTTP here, host:port (port 0 picks one); "
         "unset: no HTTP")
      ->envname("TALLY_HTTP_LISTEN");
  app.add_option("--log-level", c.log_level, "trace, debug, info, warn, error, critical or off")
      ->envname("TALLY_LOG_LEVEL")
      ->capture_default_str()
      ->check(CLI::IsMember(tally::log_level_names()));
  app.add_option("--ready-file", c.ready_file,
                 "write the bound host:port here once listening (for launchers)");
}

// Its threads, memory and limits per job.
void add_capacity_options(CLI::App& app, CommandLine& c) {
  app.add_option("--io-threads", c.options.io_threads, "I/O threads")
      ->envname("TALLY_IO_THREADS")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("--memory-budget", c.memory_budget, "chunk memory, e.g. 512MiB")
      ->envname("TALLY_MEMORY_BUDGET")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--max-chunk-bytes", c.max_chunk, "largest chunk accepted, e.g. 4MiB")
      ->envname("TALLY_MAX_CHUNK_BYTES")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--window", c.options.window_chunks,
                 "chunks a worker may have in flight per stream")
      ->envname("TALLY_WINDOW")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--ingress-window", c.ingress_window,
                 "bytes of contributions a job's workers together may have in flight to this "
                 "reducer, e.g. 16MiB")
      ->envname("TALLY_INGRESS_WINDOW")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--max-world-size", c.options.max_world_size,
                 "largest world size a job may declare")
      ->envname("TALLY_MAX_WORLD_SIZE")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
}

// Who it serves: secrets, authentication.
void add_secret_options(CLI::App& app, CommandLine& c) {
  app.add_option("--job-secret-file", c.job_secret_file,
                 "file holding the job secret workers authenticate with (else $TALLY_JOB_SECRET)")
      ->envname("TALLY_JOB_SECRET_FILE");
  app.add_flag("--per-job-secrets", c.options.per_job_secrets,
               "the job secret is a master: each job authenticates with its own secret, "
               "derived from it and the job's name (--print-job-secret prints one)")
      ->envname("TALLY_PER_JOB_SECRETS");
  app.add_option("--print-job-secret", c.print_job_secret,
                 "print the secret of the job with this name, derived from the job secret (the "
                 "master of --per-job-secrets), and exit");
  app.add_option("--pool-secret-file", c.pool_secret_file,
                 "file holding the secret replicas authenticate their links with (else "
                 "$TALLY_POOL_SECRET)")
      ->envname("TALLY_POOL_SECRET_FILE");
  app.add_flag("--require-auth", c.options.require_auth,
               "refuse workers that do not authenticate with the job secret")
      ->envname("TALLY_REQUIRE_AUTH");
  app.add_flag("--insecure-open-pool", c.options.insecure_open_pool,
               "serve workers from any address without a job secret, and replicas without a "
               "pool secret (by default, without one, only loopback addresses are served)")
      ->envname("TALLY_INSECURE_OPEN_POOL");
}

// Its streams: congestion control, pacing, admission, timeouts.
void add_stream_options(CLI::App& app, CommandLine& c) {
  app.add_option("--tcp-congestion", c.options.connection.congestion_control,
                 "TCP congestion control of every stream (e.g. cubic; default: the system's)")
      ->envname("TALLY_TCP_CONGESTION");
  app.add_option("--link-rate", c.link_rate,
                 "this reducer's link rate in tc's units (e.g. 10gbit): each worker stream of a "
                 "job is paced to an equal share of it; with cubic unless --tcp-congestion names "
                 "another (default: not paced)")
      ->envname("TALLY_LINK_RATE");
  app.add_option("--receive-budget", c.receive_budget,
                 "bytes the streams sending to this reducer may have in flight towards it "
                 "together, e.g. 512KiB: each bounds its receive window to an equal share, and "
                 "the results sent back to a job's workers are bounded the same way (0: not "
                 "bounded)")
      ->envname("TALLY_RECEIVE_BUDGET")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--max-connections", c.options.max_connections,
                 "open streams at most; a new one past it cuts the oldest stream not yet "
                 "admitted (no hello, or not yet authenticated), or is closed when every open "
                 "one is admitted")
      ->envname("TALLY_MAX_CONNECTIONS")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
  app.add_option("--max-pending-per-source", c.options.max_pending_per_source,
                 "streams from one source address not yet admitted; more from it are closed "
                 "as they are accepted")
      ->envname("TALLY_MAX_PENDING_PER_SOURCE")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
  app.add_option("--heartbeat-ms", c.heartbeat_ms, "heartbeat interval on idle streams")
      ->envname("TALLY_HEARTBEAT_MS")
      ->capture_default_str()
      ->check(CLI::Range(10, 600000));
  app.add_option("--peer-timeout-ms", c.peer_timeout_ms, "a stream silent this long is dead")
      ->envname("TALLY_PEER_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(100, 3600000));
  app.add_option("--hello-timeout-ms", c.hello_timeout_ms,
                 "a stream that has not said hello by then is closed")
      ->envname("TALLY_HELLO_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(100, 3600000));
}

// The data path: TCP, or libfabric beside it.
void add_transport_options(CLI::App& app, CommandLine& c) {
  app.add_option("--transport", c.options.transport,
                 "tcp, or fabric to also serve workers on the libfabric data path")
      ->envname("TALLY_TRANSPORT")
      ->capture_default_str()
      ->check(CLI::IsMember({"tcp", "fabric"}));
  // FI_PROVIDER, libfabric's own variable, is the fallback default.
  if (const char* fi = std::getenv("FI_PROVIDER"); fi && *fi) c.options.fabric.provider = fi;
  app.add_option("--fabric-provider", c.options.fabric.provider,
                 "libfabric provider for --transport fabric")
      ->envname("TALLY_FABRIC_PROVIDER")
      ->capture_default_str();
  app.add_flag(
         "--fabric-force-registration", c.options.fabric.force_registration,
         "register buffers even where the provider does not ask (tests the registration path)")
      ->envname("TALLY_FABRIC_FORCE_REGISTRATION");
  app.add_option(
         "--fabric-max-msg-bytes", c.options.fabric.max_msg_bytes,
         "split payloads into messages of at most this size (0: the provider's max_msg_size)")
      ->envname("TALLY_FABRIC_MAX_MSG_BYTES")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
}

// Reads what the command line holds into c.options; false (logged) when
// something is unusable.
bool resolve(CommandLine& c) {
  auto address = tally::parse_host_port(c.listen);
  if (!address) {
    spdlog::error("{}", address.status().to_string());
    return false;
  }
  c.options.listen = *address;
  if (!c.http_listen.empty()) {
    auto hp = tally::parse_host_port(c.http_listen);
    if (!hp) {
      spdlog::error("--http-listen: {}", hp.status().to_string());
      return false;
    }
    c.http_address = *hp;
  }
  c.options.memory_budget_bytes = c.memory_budget;
  c.options.max_chunk_bytes = c.max_chunk;
  c.options.ingress_window_bytes = c.ingress_window;
  c.options.receive_budget_bytes = c.receive_budget;
  if (!c.link_rate.empty()) {
    auto rate = tally::parse_link_rate(c.link_rate);
    if (!rate) {
      spdlog::error("--link-rate: {}", rate.status().to_string());
      return false;
    }
    c.options.link_rate_bits = *rate;
  }
  c.options.connection.heartbeat_interval = std::chrono::milliseconds(c.heartbeat_ms);
  c.options.connection.peer_timeout = std::chrono::milliseconds(c.peer_timeout_ms);
  c.options.hello_timeout = std::chrono::milliseconds(c.hello_timeout_ms);
  auto job_secret = tally::load_secret(c.job_secret_file, "TALLY_JOB_SECRET", "job secret");
  auto pool_secret = tally::load_secret(c.pool_secret_file, "TALLY_POOL_SECRET", "pool secret");
  for (auto* secret : {&job_secret, &pool_secret}) {
    if (!*secret) {
      spdlog::error("{}", secret->status().to_string());
      return false;
    }
  }
  c.options.job_secret = std::move(*job_secret);
  c.options.pool_secret = std::move(*pool_secret);
  if (!c.print_job_secret.empty()) {
    if (c.options.job_secret.empty()) {
      spdlog::error("--print-job-secret needs the master (--job-secret-file or TALLY_JOB_SECRET)");
      return false;
    }
    return true;  // main prints it and exits
  }
  if (c.options.per_job_secrets && c.options.job_secret.empty()) {
    spdlog::error("--per-job-secrets needs the master (--job-secret-file or TALLY_JOB_SECRET)");
    return false;
  }
  // The variables are read: do not leave them to children or /proc readers.
  unsetenv("TALLY_JOB_SECRET");
  unsetenv("TALLY_POOL_SECRET");
  if (c.options.require_auth && c.options.job_secret.empty()) {
    spdlog::error("--require-auth needs the job secret (--job-secret-file or TALLY_JOB_SECRET)");
    return false;
  }
  return true;
}

// The start-up lines on who may reach this reducer.
void log_exposure(const tally::ReducerOptions& o, const std::string& bound) {
  if (o.job_secret.empty() && !o.insecure_open_pool) {
    spdlog::info(
        "protected mode: no job secret, so workers are served from loopback addresses only "
        "(give --job-secret-file, or --insecure-open-pool to serve any address without one)");
  } else if (o.job_secret.empty()) {
    spdlog::warn(
        "--insecure-open-pool: no job secret, and anyone who reaches {} can join any job, read "
        "its results and change them",
        bound);
  } else if (!o.require_auth) {
    spdlog::warn(
        "authentication is not required (--require-auth is off): anyone who reaches {} can join "
        "a job whose workers hold no secret",
        bound);
  }
  if (o.per_job_secrets) {
    spdlog::info(
        "per-job secrets: each job authenticates with its own secret, derived from the master "
        "(tally-reducer --job-secret-file MASTER --print-job-secret JOB prints it)");
  }
  if (o.group_count > 1 && o.pool_secret.empty()) {
    if (o.insecure_open_pool) {
      spdlog::warn(
          "--insecure-open-pool: no pool secret, and anyone who reaches {} can speak as another "
          "replica of shard {}",
          bound, o.shard);
    } else {
      spdlog::info(
          "protected mode: no pool secret, so replicas are served from loopback addresses only "
          "(give --pool-secret-file, or --insecure-open-pool)");
    }
  }
}

// /metrics, /healthz and /readyz on c.http_address, if given.
tally::Result<std::unique_ptr<tally::HttpServer>> start_http(const CommandLine& c,
                                                             const tally::Reducer& r,
                                                             tally::ReducerMetrics& metrics) {
  if (!c.http_address) return std::unique_ptr<tally::HttpServer>();
  tally::HttpServerOptions http_options;
  http_options.listen = *c.http_address;
  return tally::HttpServer::start(
      http_options, [&r, &metrics](std::string_view target) { return serve(r, metrics, target); },
      {[&metrics](const std::string& path, unsigned status) {
         const bool known = path == "/metrics" || path == "/healthz" || path == "/readyz";
         metrics.count_request(known ? path : "other", status);
       },
       [&metrics] { metrics.count_rejected(); }, [&metrics] { metrics.count_timed_out(); }});
}

// The bound addresses, written whole for launchers.
void write_ready_file(const std::string& path, const tally::Reducer& reducer,
                      const tally::HttpServer* http) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << reducer.address().to_string() << "\n";
    if (http) out << "http " << http->address().to_string() << "\n";
  }
  std::rename(tmp.c_str(), path.c_str());  // readers never see a partial file
}

}  // namespace

int main(int argc, char** argv) {
  CommandLine c;
  CLI::App app{
      "tally-reducer: sums gradient chunks from training workers and streams the results back"};
  app.set_version_flag("--version", "tally-reducer " + tally::version_string());
  add_place_options(app, c);
  add_report_options(app, c);
  add_capacity_options(app, c);
  add_secret_options(app, c);
  add_stream_options(app, c);
  add_transport_options(app, c);
  CLI11_PARSE(app, argc, argv);
  if (const char* peers = std::getenv("TALLY_PEERS"); c.options.pool.empty() && peers) {
    c.options.pool = peers;
  }

  auto logger = spdlog::stderr_color_mt("tally-reducer");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(c.log_level));
  if (!resolve(c)) return 2;
  const tally::ReducerOptions& options = c.options;
  if (!c.print_job_secret.empty()) {
    std::printf("%s\n",
                tally::derive_job_secret(options.job_secret, c.print_job_secret).bytes().c_str());
    return 0;
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
  log_exposure(options, (*reducer)->address().to_string());
  const tally::ReducerIdentity identity{options.shard, options.shard_count, options.group,
                                        options.group_count, options.transport};
  tally::ReducerMetrics metrics(**reducer, identity);
  auto http = start_http(c, **reducer, metrics);
  if (!http) {
    spdlog::error("cannot start: {}", http.status().to_string());
    return 1;
  }
  if (*http) {
    spdlog::info("serving /metrics, /healthz and /readyz on http://{}",
                 (*http)->address().to_string());
  }
  if (!c.ready_file.empty()) write_ready_file(c.ready_file, **reducer, http->get());
  int sig = 0;
  if (c.stats_file.empty()) {
    sigwait(&signals, &sig);
  } else {
    const timespec interval{0, std::chrono::nanoseconds(kStatsInterval).count()};
    while ((sig = sigtimedwait(&signals, nullptr, &interval)) < 0)
      write_stats(c.stats_file, **reducer, identity);
  }
  spdlog::info("received {}, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
  auto stats = (*reducer)->stats();
  // /healthz and /readyz answer 503 while the streams close.
  (*reducer)->stop();
  (*reducer)->wait();
  if (*http) (*http)->stop();
  if (!c.stats_file.empty()) write_stats(c.stats_file, **reducer, identity);
  spdlog::info(
      "done: {} chunks summed, {} bytes in, {} bytes out, {} replica bytes in, {} replica bytes "
      "out, {} ops failed",
      stats[tally::Count::kChunksFinished], stats[tally::Count::kWorkerBytesReceived],
      stats[tally::Count::kWorkerBytesSent], stats[tally::Count::kReplicaBytesReceived],
      stats[tally::Count::kReplicaBytesSent], stats[tally::Count::kOpsFailed]);
  return 0;
}
