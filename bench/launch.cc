#include "launch.h"

#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "compare.h"
#include "tally/bench/local_pool.h"
#include "tally/bench/netlab.h"
#include "tally/bench/process.h"
#include "tally/protocol/log_level.h"

namespace tally::bench {
namespace {

// torch's default rendezvous port, where rank 0 has a namespace of its own.
constexpr int kLabMasterPort = 29500;

// A port nothing listens on now, on loopback (rank 0 binds it next).
int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

std::string tail_of(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  std::stringstream all;
  all << in.rdbuf();
  const std::string s = all.str();
  return s.size() > bytes ? "..." + s.substr(s.size() - bytes) : s;
}

}  // namespace

namespace {

// Where the ranks find each other and the pool: torch's rendezvous
// (MASTER_ADDR/PORT, on rank 0's host) and the pool's environment.
struct Rendezvous {
  std::string master;
  int port = 0;
  std::string pool;
  std::string secret_file;
  std::string dir;  // where ranks other than 0 write their output
};

// Starts rank `r` of `o.command` with torchrun's environment and the pool's,
// in its own host of `lab` if there is one.
Result<Process> spawn_rank(const LaunchOptions& o, uint32_t r, const Rendezvous& rv, Netlab* lab) {
  ProcessSpec spec;
  spec.path = o.command.front();
  spec.args.assign(o.command.begin() + 1, o.command.end());
  spec.env = {{"RANK", std::to_string(r)},
              {"WORLD_SIZE", std::to_string(o.workers)},
              {"LOCAL_RANK", lab ? "0" : std::to_string(r)},
              {"LOCAL_WORLD_SIZE", lab ? "1" : std::to_string(o.workers)},
              {"MASTER_ADDR", rv.master},
              {"MASTER_PORT", std::to_string(rv.port)},
              {"TALLY_POOL", rv.pool},
              {"TALLY_GROUPS", std::to_string(o.groups)},
              {"TALLY_JOB", "run-" + std::to_string(getpid())},
              {"TALLY_JOB_SECRET_FILE", rv.secret_file}};
  // In the lab a rank reaches the others through its host's eth0; gloo
  // (torch.distributed's CPU backend) would otherwise pick the address its
  // hostname resolves to, 127.0.0.1, which is the rank's own namespace.
  if (lab) spec.env["GLOO_SOCKET_IFNAME"] = "eth0";
  if (!o.link_rate.empty()) spec.env["TALLY_LINK_RATE"] = o.link_rate;
  if (r > 0) {  // rank 0 writes to ours; the others to files, shown if they fail
    spec.stdout_path = rv.dir + "/rank-" + std::to_string(r) + ".out";
    spec.stderr_to_stdout = true;
  }
  if (lab) lab->place(r, spec);
  return Process::spawn(spec);
}

// Waits for every rank until the run's timeout: 0 when all exited 0, 130
// when stopped by a signal, else 1 with the first failure (and its output).
int wait_ranks(std::vector<Process>& ranks, const LaunchOptions& o, const std::string& dir) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout_s);
  const WaitAll w = wait_all(ranks, deadline, &g_stop);
  if (w.stopped) return 130;
  if (w.timed_out) {
    spdlog::error("the ranks did not end within {} s", o.timeout_s);
    return 1;
  }
  if (w.first_failed >= 0) {
    spdlog::error("rank {} exited with status {}", w.first_failed, w.status);
    if (w.first_failed > 0) {
      std::fprintf(stderr, "%s\n",
                   tail_of(dir + "/rank-" + std::to_string(w.first_failed) + ".out", 6000).c_str());
    }
    return 1;
  }
  return 0;
}

}  // namespace

int run_launch(const LaunchOptions& o) {
  stop_on_signals();
  auto scratch = ScratchDir::make("tally-run-");
  if (!scratch) {
    spdlog::error("{}", scratch.status().to_string());
    return 1;
  }
  const std::string dir = (*scratch)->path();
  std::unique_ptr<Netlab> lab;
  if (!o.netlab_rate.empty()) {
    auto made = Netlab::for_run(o.workers + o.shards * o.groups, o.netlab_rate);
    if (!made) {
      spdlog::error("--netlab: {}", made.status().to_string());
      return 1;
    }
    lab = std::move(*made);
  }
  const std::string secret = dir + "/job.secret";
  LocalPoolOptions lo;
  lo.shards = o.shards;
  lo.groups = o.groups;
  lo.log_dir = dir;
  lo.extra_args = {"--log-level", o.log_level};
  if (Status st = lo.require_secret(secret); !st) {
    spdlog::error("{}", st.to_string());
    return 1;
  }
  if (!o.link_rate.empty()) lo.extra_args.insert(lo.extra_args.end(), {"--link-rate", o.link_rate});
  if (lab) lo.place_in(*lab, o.workers);  // reducer i on host W + i
  auto pool = LocalPool::start(lo);
  if (!pool) {
    spdlog::error("cannot start the local pool: {}", pool.status().to_string());
    return 1;
  }
  const Rendezvous rv{lab ? lab->address(0) : "127.0.0.1",
                      lab ? kLabMasterPort : free_loopback_port(), (*pool)->pool_string(), secret,
                      dir};
  std::fprintf(stderr, "# tally-bench run: %u ranks beside a pool of S=%u x G=%u (%s)%s\n",
               o.workers, o.shards, o.groups, rv.pool.c_str(),
               lab ? (", in a network lab at " + o.netlab_rate + " per host").c_str() : "");
  std::vector<Process> ranks;
  for (uint32_t r = 0; r < o.workers; ++r) {
    auto p = spawn_rank(o, r, rv, lab.get());
    if (!p) {
      spdlog::error("rank {}: {}", r, p.status().to_string());
      return 1;
    }
    ranks.push_back(std::move(*p));
  }
  return wait_ranks(ranks, o, dir);
}

int launch_main(int argc, char** argv) {
  LaunchOptions o;
  CLI::App app{
      "tally-bench run: runs a command as W ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
      "as torchrun sets them) beside a local pool (TALLY_POOL, TALLY_JOB, TALLY_JOB_SECRET_FILE), "
      "each rank and reducer on a host of its own with --netlab"};
  app.add_option("-W,--workers", o.workers, "ranks")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("-r,--reducers", o.shards, "shards of the local pool")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("-G,--groups", o.groups, "replica groups of the local pool")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  app.add_option("--netlab", o.netlab_rate,
                 "every rank and reducer on a host of its own in a network lab, each link capped "
                 "both ways at RATE (tc units, e.g. 1gbit; root)");
  app.add_option("--link-rate", o.link_rate,
                 "tell the pool and the ranks their links' rate (--link-rate, TALLY_LINK_RATE; "
                 "tc units); default: not told");
  app.add_option("--timeout-s", o.timeout_s, "the ranks are stopped after this long")
      ->capture_default_str();
  app.add_option("--log-level", o.log_level, "log level of the local reducers")
      ->capture_default_str()
      ->check(CLI::IsMember(log_level_names()));
  app.add_option("command", o.command, "the command each rank runs (after --)")->required();
  if (auto code = parse_command_line(app, argc, argv)) return *code;
  log_to_stderr("info");
  if (!o.netlab_rate.empty() && netlab_refused()) return 2;
  return run_launch(o);
}

}  // namespace tally::bench
