#include "compare.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tally/bench/process.h"

namespace tally::bench {

volatile int g_stop = 0;

void stop_on_signals() {
  struct sigaction sa {};
  sa.sa_handler = [](int) { g_stop = 1; };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
}

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The first line of `text` that says something (Open MPI frames its
// messages in lines of dashes), or "(nothing)".
std::string first_error(const std::string& text) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find_first_not_of(" -*\t") != std::string::npos) return line;
  }
  return "(nothing)";
}

std::vector<std::string> sweep_args(const SweepOptions& s) {
  return {"-b", std::to_string(s.min_bytes), "-e", std::to_string(s.max_bytes),
          "-f", std::to_string(s.factor),    "-w", std::to_string(s.warmup),
          "-n", std::to_string(s.iters),     "-c", s.check ? "1" : "0"};
}

std::string find_mpirun() {
  for (const char* p : {"/usr/bin/mpirun", "/usr/local/bin/mpirun"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// Runs the processes, waits for them up to the deadline (or a signal),
// and returns rank 0's output parsed, or why it failed.
PeerResult finish(const std::string& peer, std::vector<Process>& procs, const PeerContext& ctx,
                  const std::string& out_path, const std::string& err_path) {
  PeerResult result;
  result.peer = peer;
  FileEcho echo(out_path);
  const WaitAll waited = wait_all(procs, ctx.deadline, &g_stop, [&] { echo.poll(); });
  const std::string out = read_text(out_path);
  if (waited.stopped) {
    result.unavailable = "interrupted";
  } else if (waited.timed_out) {
    result.unavailable = "passed the run's --timeout-s deadline";
  } else if (!waited.ok()) {
    result.unavailable = "rank " + std::to_string(waited.first_failed) + " exited with status " +
                         std::to_string(waited.status) +
                         "; its stderr ends: " + first_error(read_text(err_path));
  }
  result.tables = parse_tables(out, peer);
  return result;
}

PeerResult run_gloo(const PeerContext& ctx) {
  PeerResult result{"gloo", "", {}};
  const std::string missing = TALLY_PEER_GLOO_MISSING;
  const std::string binary = self_dir() + "/tally-peer-gloo";
  if (!missing.empty()) {
    result.unavailable = missing;
    return result;
  }
  if (access(binary.c_str(), X_OK) != 0) {
    result.unavailable = binary + " is missing (build the tally-peer-gloo target)";
    return result;
  }
  const std::string store = ctx.dir + "/gloo-store";
  std::filesystem::create_directories(store);
  std::vector<Process> procs;
  for (uint32_t r = 0; r < ctx.workers; ++r) {
    ProcessSpec spec;
    spec.path = binary;
    spec.args = sweep_args(ctx.sweep);
    const std::string host = ctx.lab ? ctx.lab->address(r) : "127.0.0.1";
    spec.args.insert(spec.args.end(),
                     {"--rank", std::to_string(r), "--size", std::to_string(ctx.workers), "--store",
                      store, "--host", host, "--wire", ctx.wire});
    spec.stdout_path = ctx.dir + "/gloo-" + std::to_string(r) + ".out";
    spec.stderr_path = ctx.dir + "/gloo-" + std::to_string(r) + ".err";
    if (ctx.lab) ctx.lab->place(r, spec);
    auto p = Process::spawn(spec);
    if (!p) {
      result.unavailable = p.status().to_string();
      return result;
    }
    procs.push_back(std::move(*p));
  }
  return finish("gloo", procs, ctx, ctx.dir + "/gloo-0.out", ctx.dir + "/gloo-0.err");
}

PeerResult run_mpi(const PeerContext& ctx) {
  PeerResult result{"mpi", "", {}};
  const std::string missing = TALLY_PEER_MPI_MISSING;
  const std::string binary = self_dir() + "/tally-peer-mpi";
  const std::string mpirun = find_mpirun();
  if (!missing.empty()) {
    result.unavailable = missing;
    return result;
  }
  if (access(binary.c_str(), X_OK) != 0) {
    result.unavailable = binary + " is missing (build the tally-peer-mpi target)";
    return result;
  }
  if (mpirun.empty()) {
    result.unavailable = "mpirun is not installed (Debian openmpi-bin)";
    return result;
  }
  if (ctx.wire != "float32") {
    result.unavailable = "MPI has no 16-bit float type to carry the tensor in";
    return result;
  }
  // Open MPI's tcp btl only (no shared memory), across the interfaces the
  // other ranks are on; no core binding, as tally's processes have none.
  ProcessSpec spec;
  spec.path = mpirun;
  spec.args = {"--allow-run-as-root",
               "--oversubscribe",
               "--bind-to",
               "none",
               "--mca",
               "pml",
               "ob1",
               "--mca",
               "btl",
               "tcp,self",
               "--mca",
               "btl_tcp_if_include",
               ctx.lab ? Netlab::subnet() : "lo"};
  const std::vector<std::string> args = sweep_args(ctx.sweep);
  if (!ctx.lab) {
    spec.args.insert(spec.args.end(), {"-np", std::to_string(ctx.workers), binary});
    spec.args.insert(spec.args.end(), args.begin(), args.end());
  } else {
    // One app context per rank, each started in its host's namespace (ip
    // netns exec execs in place, so mpirun's child is the rank itself).
    // PMIx (Open MPI 4.1's launcher channel) is TCP only and listens on
    // loopback by default, which a rank in another namespace cannot reach:
    // mpirun runs in the lab namespace and its PMIx server takes remote
    // connections on the bridge's address. Only that launch traffic
    // crosses the bridge uncapped; the ranks' data goes host to host.
    for (uint32_t r = 0; r < ctx.workers; ++r) {
      if (r) spec.args.push_back(":");
      spec.args.insert(spec.args.end(), {"-np", "1"});
      const auto prefix = ctx.lab->exec_prefix(r);
      spec.args.insert(spec.args.end(), prefix.begin(), prefix.end());
      spec.args.push_back(binary);
      spec.args.insert(spec.args.end(), args.begin(), args.end());
    }
  }
  spec.stdout_path = ctx.dir + "/mpi.out";
  spec.stderr_path = ctx.dir + "/mpi.err";
  if (ctx.lab) {
    spec.env["PMIX_MCA_ptl_tcp_remote_connections"] = "1";
    spec.env["PMIX_MCA_ptl_tcp_if_include"] = Netlab::subnet();
    ctx.lab->place_in_lab(spec);
  }
  auto p = Process::spawn(spec);
  if (!p) {
    result.unavailable = p.status().to_string();
    return result;
  }
  std::vector<Process> procs;
  procs.push_back(std::move(*p));
  result = finish("mpi", procs, ctx, spec.stdout_path, spec.stderr_path);
  if (!result.unavailable.empty() && ctx.lab) {
    result.unavailable = "unavailable under --netlab: " + result.unavailable;
  }
  return result;
}

}  // namespace

const std::vector<std::string>& known_peers() {
  static const std::vector<std::string> peers{"gloo", "mpi"};
  return peers;
}

PeerResult run_peer(const std::string& peer, const PeerContext& ctx) {
  if (peer == "gloo") return run_gloo(ctx);
  if (peer == "mpi") return run_mpi(ctx);
  return PeerResult{peer, "unknown peer (known: gloo, mpi)", {}};
}

void print_comparison(const std::vector<NamedTable>& tally, const std::vector<PeerResult>& peers,
                      uint32_t workers, const std::string& what, const std::string& where) {
  std::vector<const NamedTable*> peer_tables;
  for (const PeerResult& p : peers) {
    for (const NamedTable& t : p.tables) peer_tables.push_back(&t);
  }
  std::printf(
      "# comparison: algbw (GB/s) at W=%u, %s, %s; best = the best peer algorithm at "
      "that size; tally/best = %s's algbw / best's\n",
      workers, what.c_str(), where.c_str(), tally.empty() ? "tally" : tally.front().name.c_str());
  std::vector<std::string> columns;
  for (const NamedTable& t : tally) columns.push_back(t.name);
  for (const NamedTable* t : peer_tables) columns.push_back(t->name);
  auto width = [](const std::string& name) { return std::max<size_t>(12, name.size()); };
  std::printf("# %10s", "size");
  for (const std::string& c : columns) std::printf(" %*s", static_cast<int>(width(c)), c.c_str());
  std::printf(" %12s %12s\n", "best-peer", "tally/best");
  // Sizes in tally's order (every table runs the same sweep).
  std::vector<size_t> sizes;
  for (const NamedTable& t : tally) {
    for (const TableRow& r : t.rows) {
      if (std::find(sizes.begin(), sizes.end(), r.bytes) == sizes.end()) sizes.push_back(r.bytes);
    }
  }
  auto algbw = [](const NamedTable& t, size_t bytes) -> double {
    for (const TableRow& r : t.rows) {
      if (r.bytes == bytes) return r.algbw;
    }
    return -1;
  };
  for (size_t bytes : sizes) {
    std::printf("  %10zu", bytes);
    for (const NamedTable& t : tally) {
      const double v = algbw(t, bytes);
      if (v < 0) {
        std::printf(" %*s", static_cast<int>(width(t.name)), "-");
      } else {
        std::printf(" %*.3f", static_cast<int>(width(t.name)), v);
      }
    }
    double best = -1;
    for (const NamedTable* t : peer_tables) {
      const double v = algbw(*t, bytes);
      best = std::max(best, v);
      if (v < 0) {
        std::printf(" %*s", static_cast<int>(width(t->name)), "-");
      } else {
        std::printf(" %*.3f", static_cast<int>(width(t->name)), v);
      }
    }
    const double mine = tally.empty() ? -1 : algbw(tally.front(), bytes);
    if (best > 0 && mine >= 0) {
      std::printf(" %12.3f %11.2fx\n", best, mine / best);
    } else {
      std::printf(" %12s %12s\n", "-", "-");
    }
  }
  for (const PeerResult& p : peers) {
    if (!p.unavailable.empty())
      std::printf("# %s: unavailable: %s\n", p.peer.c_str(), p.unavailable.c_str());
  }
  std::printf("#\n");
  std::fflush(stdout);
}

void print_link_drops(const std::string& phase, const std::vector<Netlab::LinkStats>& before,
                      const std::vector<Netlab::LinkStats>& after,
                      const std::vector<std::string>& role) {
  std::printf(
      "# links during %s (tc -s qdisc, packets): to-host = the bridge port's egress toward the "
      "host (incast drops show here), from-host = the host's own egress\n",
      phase.c_str());
  std::printf("# %5s %-12s %14s %10s %14s %10s\n", "host", "role", "to-host-sent", "dropped",
              "from-host-sent", "dropped");
  for (size_t i = 0; i < after.size() && i < before.size(); ++i) {
    const auto& a = after[i];
    const auto& b = before[i];
    std::printf("# %5zu %-12s %14llu %10llu %14llu %10llu\n", i,
                i < role.size() ? role[i].c_str() : "",
                static_cast<unsigned long long>(a.to_host_sent - b.to_host_sent),
                static_cast<unsigned long long>(a.to_host_dropped - b.to_host_dropped),
                static_cast<unsigned long long>(a.from_host_sent - b.from_host_sent),
                static_cast<unsigned long long>(a.from_host_dropped - b.from_host_dropped));
  }
  std::printf("#\n");
  std::fflush(stdout);
}

}  // namespace tally::bench
