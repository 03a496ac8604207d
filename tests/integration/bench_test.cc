// tally-bench end to end: a sweep on a local pool (the table and --json),
// a 2 x 3 pool whose per-reducer bytes must match the formula, and driver
// mode against a pool that is already running; worker mode's --chunk-bytes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "tally/bench/table.h"
#include "tally/protocol/version.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

TEST(Bench, SweepPrintsTheTableWithNoWrongResults) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  const BenchRun run =
      run_bench(dir,
                {"-W", "3", "-r", "2", "-b", "4K", "-e", "256K", "-f", "4", "-w", "1", "-n", "2",
                 "--chunk-bytes", "64K", "--json", dir + "/out.json"},
                60s);
  const std::string& out = run.out;
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << out << run.err;
  EXPECT_TRUE(contains(out, "transport=tcp W=3 S=2 G=1 chunk=64KiB")) << out;
  EXPECT_TRUE(contains(out, "algbw(GB/s)")) << out;
  EXPECT_TRUE(contains(out, "# Out of bounds values : 0 OK")) << out;
  // The workers' CPU in the timed loops, over 3 ranks x (4 + 16 + 64 + 256
  // KiB) x 2 ops (the JSON has it unrounded).
  EXPECT_TRUE(std::regex_search(
      out, std::regex("# cpu of the workers in the timed loops: [0-9.]+ s = [0-9.]+ s/GB sent "
                      "\\(0.00 GB\\)")))
      << out;
  // Beside each CPU figure, the floor: a bare TCP stream measured here.
  EXPECT_TRUE(std::regex_search(out, std::regex("s/GB sent \\([0-9.]+ GB\\) = [0-9.]+x a bare TCP "
                                                "stream")))
      << out;
  EXPECT_TRUE(std::regex_search(
      out, std::regex("# cpu of a bare TCP stream here: [0-9.]+ s/GB \\(send plus receive, "
                      "loopback, a [0-9]+[KM]iB tensor, median of 5: [0-9.]+-[0-9.]+\\); reducers "
                      "[0-9.]+x of it")))
      << out;
  // The per-reducer bytes only with --bytes.
  EXPECT_FALSE(contains(out, "Payload bytes per op")) << out;
  EXPECT_EQ(bench::parse_rows(out).size(), 4u) << out;
  for (const char* size : {"4096", "16384", "65536", "262144"}) {
    EXPECT_TRUE(contains(out, std::string("  ") + size + " ")) << out;
  }
  const std::string text = read_file(dir + "/out.json");
  const auto json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(json.is_discarded()) << text;
  EXPECT_EQ(json["workers"], 3) << text;
  EXPECT_EQ(json["shards"], 2) << text;
  EXPECT_EQ(json["chunk_bytes"], 65536) << text;
  EXPECT_GT(json["bare_stream_cpu_s_per_gb"].get<double>(), 0.0) << text;
  ASSERT_EQ(json["rows"].size(), 4u) << text;
  EXPECT_EQ(json["rows"][3]["size"], 262144) << text;
  for (const auto& row : json["rows"]) EXPECT_EQ(row["wrong"], 0) << text;
  EXPECT_DOUBLE_EQ(json["timed_gb"].get<double>(), 0.00208896) << text;
  EXPECT_GT(json["timed_worker_cpu_s"].get<double>(), 0) << text;
}

// A local pool of 2 shards x 3 groups: the table is correct and each
// reducer's bytes per op match the formula (within the few bytes the
// barrier ops add).
TEST(Bench, GroupSweepReportsBytesPerReducer) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  const BenchRun run = run_bench(dir,
                                 {"-W", "6", "-r", "2", "-G", "3", "-b", "64K", "-e", "256K", "-f",
                                  "4", "-w", "1", "-n", "4", "--chunk-bytes", "16K", "--bytes"},
                                 90s);
  const std::string& out = run.out;
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << out << run.err;
  EXPECT_TRUE(contains(out, "transport=tcp W=6 S=2 G=3 chunk=16KiB")) << out;
  EXPECT_TRUE(contains(out, "# Out of bounds values : 0 OK")) << out;
  // One row per size and reducer.
  const auto rows = traffic_rows(out);
  for (const TrafficRow& r : rows) {
    EXPECT_EQ(r.workers, 2u) << r.line;
    EXPECT_NEAR(r.measured[0], r.formula[0], 64) << r.line;
    EXPECT_NEAR(r.measured[1], r.formula[0], 64) << r.line;
    EXPECT_NEAR(r.measured[2], r.formula[1], 64) << r.line;
    EXPECT_NEAR(r.measured[3], r.formula[2], 64) << r.line;
    EXPECT_GT(r.formula[1], 0) << r.line;
  }
  EXPECT_EQ(rows.size(), 2u * 6u) << out;
}

// Driver mode against a pool that is already running (--pool), as on a
// cluster; the bench starts no reducers of its own.
TEST(Bench, RunsAgainstAGivenPool) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  bench::ProcessSpec run;
  run.path = TALLY_BENCH_PATH;
  run.args = {"--pool",
              cluster.pool_string(),
              "-W",
              "2",
              "-b",
              "1K",
              "-e",
              "16K",
              "-f",
              "2",
              "-w",
              "1",
              "-n",
              "2",
              "--chunk-bytes",
              "4K",
              "-d",
              "int64",
              "-o",
              "avg"};
  run.env = {{"TALLY_REDUCER", "/nonexistent"}};  // proves no local pool is started
  run.stdout_path = cluster.dir() + "/bench.out";
  run.stderr_path = cluster.dir() + "/bench.err";
  auto p = bench::Process::spawn(run);
  ASSERT_TRUE(p) << p.status().to_string();
  auto st = p->wait_for(60s);
  const std::string out = read_file(cluster.dir() + "/bench.out");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(*st, 0) << out << read_file(cluster.dir() + "/bench.err");
  EXPECT_TRUE(contains(out, "W=2 S=2 G=1 chunk=4KiB")) << out;
  EXPECT_TRUE(contains(out, "int64    avg")) << out;
  EXPECT_TRUE(contains(out, "# Out of bounds values : 0 OK")) << out;
  EXPECT_TRUE(contains(cluster.reducer_log(0), "joined")) << cluster.reducer_log(0);
}

// Worker mode (one rank, configured by TALLY_*): --chunk-bytes overrides
// TALLY_CHUNK_BYTES (it used to be ignored), and with neither the
// automatic plan is used.
TEST(Bench, WorkerModeTakesChunkBytes) {
  PoolSpec spec;
  spec.shards = 2;
  TestCluster cluster(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  struct Run {
    std::vector<std::string> extra;
    std::map<std::string, std::string> env;
    std::string header;
  };
  const std::vector<Run> runs = {
      {{"--chunk-bytes", "2K"}, {{"TALLY_CHUNK_BYTES", "4096"}}, "chunk=2KiB"},
      {{}, {{"TALLY_CHUNK_BYTES", "4096"}}, "chunk=4KiB"},
      {{}, {}, "chunk=auto"},
  };
  int n = 0;
  for (const Run& r : runs) {
    SCOPED_TRACE(r.header);
    bench::ProcessSpec run;
    run.path = TALLY_BENCH_PATH;
    run.args = {"--worker", "-b", "1K", "-e", "8K", "-w", "1", "-n", "2"};
    run.args.insert(run.args.end(), r.extra.begin(), r.extra.end());
    run.env = r.env;
    run.env["TALLY_POOL"] = cluster.pool_string();
    run.env["TALLY_JOB"] = unique_job("bench-worker");
    run.env["TALLY_RANK"] = "0";
    run.env["TALLY_WORLD_SIZE"] = "1";
    const std::string base = cluster.dir() + "/worker" + std::to_string(n++);
    run.stdout_path = base + ".out";
    run.stderr_path = base + ".err";
    auto p = bench::Process::spawn(run);
    ASSERT_TRUE(p) << p.status().to_string();
    auto st = p->wait_for(60s);
    const std::string out = read_file(base + ".out");
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(*st, 0) << out << read_file(base + ".err");
    EXPECT_TRUE(contains(out, "W=1 S=2 G=1 " + r.header)) << out;
  }
}

// The ratio table's lines after its "# comparison" line, split in words;
// the first is the column header ("#" dropped).
std::vector<std::vector<std::string>> comparison_lines(const std::string& out) {
  std::vector<std::vector<std::string>> lines;
  const auto at = out.find("# comparison:");
  if (at == std::string::npos) return lines;
  std::istringstream in(out.substr(at));
  std::string line;
  std::getline(in, line);  // the title
  while (std::getline(in, line) && line != "#") {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string word; words >> word;) {
      if (word != "#") w.push_back(word);
    }
    lines.push_back(w);
  }
  return lines;
}

// The names of the tables the driver parsed back from `out` (tally's, then
// the peers'), each checked to have `rows` rows and no wrong element.
std::vector<std::string> checked_table_names(const std::string& out, size_t rows) {
  std::vector<std::string> names;
  for (const auto& t : bench::parse_tables(out, "tally")) {
    names.push_back(t.name);
    EXPECT_EQ(t.rows.size(), rows) << t.name << "\n" << out;
    for (const auto& r : t.rows) EXPECT_EQ(r.wrong, 0) << t.name << "\n" << out;
  }
  return names;
}

// --compare gloo,mpi: the same sweep through Gloo's three algorithms and
// Open MPI, and a ratio table with a row per size and a column per peer.
TEST(Bench, CompareRunsGlooAndMpiAndPrintsTheRatios) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  const BenchRun run = run_bench(dir,
                                 {"--compare", "gloo,mpi", "-W", "2", "-r", "2", "-b", "64K", "-e",
                                  "256K", "-f", "4", "-w", "1", "-n", "2"},
                                 90s);
  const std::string& out = run.out;
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << out << run.err;
  for (const char* peer : {"gloo", "mpi"}) {
    const std::string missing = std::string("# ") + peer + ": unavailable: CMake did not find";
    if (contains(out, missing)) GTEST_SKIP() << peer << " was not built: " << out;
  }
  EXPECT_FALSE(contains(out, "unavailable")) << out;
  // Every table the driver parsed back: tally's and one per peer algorithm,
  // with both sizes and no wrong element.
  const std::vector<std::string> names = checked_table_names(out, 2);
  const std::vector<std::string> want = {"tally", "gloo:ring_chunked", "gloo:halving_doubling",
                                         "gloo:allreduce", "mpi"};
  EXPECT_EQ(names, want) << out;
  const auto lines = comparison_lines(out);
  ASSERT_EQ(lines.size(), 3u) << out;  // the header and a row per size
  std::vector<std::string> header = want;
  header.insert(header.begin(), "size");
  header.insert(header.end(), {"best-peer", "tally/best"});
  EXPECT_EQ(lines[0], header) << out;
  const char* sizes[] = {"65536", "262144"};
  for (size_t i = 1; i < lines.size(); ++i) {
    const auto& row = lines[i];
    ASSERT_EQ(row.size(), header.size()) << out;
    EXPECT_EQ(row[0], sizes[i - 1]) << out;
    double best = 0;
    for (size_t c = 1; c + 1 < row.size(); ++c) {
      const double v = std::stod(row[c]);
      EXPECT_GT(v, 0) << header[c] << "\n" << out;
      EXPECT_LT(v, 100) << header[c] << "\n" << out;  // GB/s on one machine
      if (c > 1 && c + 2 < row.size()) best = std::max(best, v);
    }
    EXPECT_DOUBLE_EQ(std::stod(row[row.size() - 2]), best) << out;
    const double ratio = std::stod(row.back());
    EXPECT_EQ(row.back().back(), 'x') << out;
    EXPECT_NEAR(ratio, std::stod(row[1]) / best, 0.01 + 0.01 * ratio) << out;
  }
}

// Beside tally's bfloat16 wire, Gloo carries the tensor as float16 (DDP's
// fp16_compress_hook): every algorithm's table is its -f16 one, checked
// within float16's rounding; MPI, with no 16-bit float type, says so.
TEST(Bench, CompareOnTheBfloat16WireRunsGlooInFloat16) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const BenchRun run =
      run_bench(tmp.path(),
                {"--compare", "gloo,mpi", "--wire-dtype", "bfloat16", "-W", "2", "-r", "2", "-b",
                 "64K", "-e", "256K", "-f", "4", "-w", "1", "-n", "2"},
                90s);
  const std::string& out = run.out;
  ASSERT_TRUE(run.status.has_value());
  EXPECT_EQ(*run.status, 0) << out << run.err;
  if (contains(out, "# gloo: unavailable: CMake did not find")) GTEST_SKIP() << out;
  const std::vector<std::string> names = checked_table_names(out, 2);
  const std::vector<std::string> want = {"tally", "gloo:ring_chunked-f16",
                                         "gloo:halving_doubling-f16", "gloo:allreduce-f16"};
  EXPECT_EQ(names, want) << out;
  EXPECT_TRUE(contains(out, "float32 sum carried in 16 bits (tally bfloat16, peers float16)"))
      << out;
  EXPECT_TRUE(contains(out, "# mpi: unavailable: MPI has no 16-bit float type")) << out;
  // The header, a row per size, and the line saying why MPI did not run.
  const auto lines = comparison_lines(out);
  ASSERT_EQ(lines.size(), 4u) << out;
  EXPECT_EQ(lines[1].front(), "65536") << out;
  EXPECT_EQ(lines[2].front(), "262144") << out;
}

// --netlab is root only, and says so before making anything.
TEST(Bench, NetlabRefusesWithoutRoot) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to drop to another user";
  if (access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "setpriv (util-linux) is missing";
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string& dir = tmp.path();
  chmod(dir.c_str(), 0777);
  auto c = bench::run_command("/usr/bin/setpriv",
                              {"--reuid=65534", "--regid=65534", "--clear-groups", TALLY_BENCH_PATH,
                               "--netlab", "1gbit", "-W", "2", "-b", "4K", "-e", "4K"},
                              30s);
  ASSERT_TRUE(c.status.has_value()) << c.output;
  EXPECT_EQ(*c.status, 2) << c.output;
  EXPECT_TRUE(contains(c.output, "tally-bench: --netlab needs root")) << c.output;
  EXPECT_TRUE(contains(c.output, "(euid 65534)")) << c.output;
  EXPECT_FALSE(contains(c.output, "algbw")) << c.output;  // nothing ran
}

// tally-bench run: the command runs as W ranks with torchrun's environment
// and the local pool's (the test worker reads RANK and WORLD_SIZE where no
// TALLY_RANK is set, and the job secret the run wrote), doing checked
// all-reduces; a rank that fails makes the run fail, naming it and showing
// its output.
TEST(Bench, RunStartsTheRanksBesideALocalPool) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const BenchRun ok = run_bench(
      tmp.path(),
      {"run", "-W", "2", "-r", "2", "--", TALLY_TEST_WORKER_PATH, "--count", "1009", "--ops", "3"},
      60s);
  ASSERT_TRUE(ok.status.has_value());
  EXPECT_EQ(*ok.status, 0) << ok.out << ok.err;
  EXPECT_TRUE(contains(ok.out, "op 2 ok")) << ok.out;
  EXPECT_TRUE(contains(ok.err, "2 ranks beside a pool of S=2 x G=1")) << ok.err;
  const BenchRun failed =
      run_bench(tmp.path(),
                {"run", "-W", "2", "-r", "1", "--", "/bin/sh", "-c",
                 "test \"$RANK\" = 0 || { echo \"rank $RANK of $WORLD_SIZE gives up\"; exit 3; }"},
                60s);
  ASSERT_TRUE(failed.status.has_value());
  EXPECT_EQ(*failed.status, 1) << failed.out << failed.err;
  EXPECT_TRUE(contains(failed.err, "rank 1 exited with status 3")) << failed.err;
  EXPECT_TRUE(contains(failed.err, "rank 1 of 2 gives up")) << failed.err;
}

// A test process that dies without its destructors (a sanitizer halting
// it) leaves its reducers running; they must not hold its output open, or
// ctest, waiting for that pipe's end, reports a timeout instead of the
// report. The test runs itself as the child, its stdout a FIFO read here.
TEST(LocalPool, ReducersDoNotHoldTheLaunchersOutputOpen) {
  if (const char* pids = std::getenv("TALLY_TEST_POOL_PIDS")) {
    TestCluster cluster(PoolSpec{.shards = 2});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    std::ofstream out(pids);
    for (uint32_t i = 0; i < 2; ++i) out << cluster.reducer(i).pid() << "\n";
    out.close();
    std::fflush(nullptr);
    _exit(3);  // as a sanitizer's halt: no destructor stops the pool
  }
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string fifo = tmp.path() + "/stdout";
  const std::string pids = tmp.path() + "/pids";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const int fd = open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(fd, 0);
  bench::ProcessSpec spec;
  spec.path = "/proc/self/exe";
  spec.args = {"--gtest_filter=LocalPool.ReducersDoNotHoldTheLaunchersOutputOpen"};
  spec.env = {{"TALLY_TEST_POOL_PIDS", pids}};
  spec.stdout_path = fifo;
  spec.stderr_to_stdout = true;
  auto child = bench::Process::spawn(spec);
  ASSERT_TRUE(static_cast<bool>(child)) << child.status().to_string();
  // The FIFO ends once every writer has closed it: the child and whatever
  // it started that kept it.
  bool ended = false;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  char buf[4096];
  while (!ended && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 100);
    const ssize_t n = read(fd, buf, sizeof buf);
    // 0 once a writer has been and every writer is gone.
    ended = n == 0 && child->wait_for(0ms).has_value();
  }
  close(fd);
  EXPECT_EQ(child->wait_for(10s), std::optional<int>(3));
  std::ifstream in(pids);
  for (pid_t pid; in >> pid;) ::kill(pid, SIGKILL);  // the orphans
  EXPECT_TRUE(ended) << "the child's output stayed open after it died";
}

}  // namespace
}  // namespace tally::testing

namespace tally {
namespace {

// Every binary says its version and commit, and refuses a log level spdlog
// would read as "off" (a typo must not silence a reducer).
TEST(Cli, BinariesPrintTheirVersionAndRefuseAnUnknownLogLevel) {
  const std::string version = std::string(TALLY_VERSION) + " (" + git_sha() + ")";
  for (const auto& [path, name] : {std::pair{std::string(TALLY_REDUCER_PATH), "tally-reducer"},
                                   std::pair{std::string(TALLY_BENCH_PATH), "tally-bench"}}) {
    auto shown = bench::run_command(path, {"--version"});
    EXPECT_TRUE(shown.ok()) << shown.output;
    EXPECT_EQ(shown.output, std::string(name) + " " + version + "\n");
    auto typo = bench::run_command(path, {"--log-level", "warnig"});
    EXPECT_NE(typo.status, 0) << name;
    EXPECT_NE(typo.output.find("--log-level: warnig not in {trace,debug,info,warn,warning,error,"
                               "critical,off}"),
              std::string::npos)
        << typo.output;
  }
  auto load = bench::run_command(TALLY_BENCH_PATH, {"load", "--log-level", "loud"});
  EXPECT_NE(load.status, 0);
  EXPECT_NE(load.output.find("loud not in"), std::string::npos) << load.output;
}

// The --compare peers beside tally-bench say theirs too (mpirun is not
// needed for that). Built where Gloo and Open MPI are, as the compare test
// needs them, and not in sanitizer builds: "Compare" in the name gives this
// test the `extended` label, which those builds leave out.
TEST(Cli, ComparePeersPrintTheirVersion) {
  const std::string version = std::string(TALLY_VERSION) + " (" + git_sha() + ")";
  const std::string dir = std::filesystem::path(TALLY_BENCH_PATH).parent_path().string();
  for (const char* name : {"tally-peer-gloo", "tally-peer-mpi"}) {
    auto shown = bench::run_command(dir + "/" + name, {"--version"});
    EXPECT_TRUE(shown.ok()) << name << ": " << shown.output;
    EXPECT_NE(shown.output.find(std::string(name) + " " + version + "\n"), std::string::npos)
        << shown.output;
  }
}

}  // namespace
}  // namespace tally
