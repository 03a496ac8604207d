// A pool reached off loopback, over both transports: a reducer in one network
// namespace and its workers in another, joined by a veth pair (netns.h),
// including a link cut under a running job. The tests skip, with the reason,
// where they cannot create namespaces (not root, no iproute2) or where this
// machine has no usable libfabric provider.
#include "netns.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

// Short liveness settings so a cut link is noticed in about a second. (A
// fabric rank, silent between its TCP connect and its Hello while its
// endpoint opens, is bounded by the reducer's hello deadline, not this.)
constexpr auto kHeartbeat = 100ms;
constexpr auto kPeerTimeout = 1000ms;

class OffLoopback : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    TALLY_SKIP_UNLESS_TRANSPORT(GetParam());
    std::string skip, error;
    net_ = NetnsPair::create(&skip, &error);
    if (!skip.empty()) GTEST_SKIP() << skip;
    ASSERT_TRUE(net_) << error;
    ns_a_ = net_->ns_a();
    ns_b_ = net_->ns_b();
  }

  void TearDown() override {
    workers_.clear();
    if (reducer_) {
      reducer_->process->terminate(5000ms);
      reducer_.reset();
    }
    net_.reset();
    // Nothing the test created outlives it.
    for (const std::string& ns : {ns_a_, ns_b_}) {
      if (!ns.empty()) {
        EXPECT_FALSE(NetnsPair::listed(ns)) << ns << " is left behind";
      }
    }
  }

  // Starts tally-reducer in namespace a on the veth address; its address
  // ("10.231.n.1:port") once it listens, or "" (with a failure) if it does not.
  // With `secret` (as a pool reached off loopback needs, or it refuses those
  // workers) it requires the job secret in secret_file(), which the workers
  // are given.
  std::string start_reducer(bool secret = true, const Args& extra = {}) {
    const std::string ready = net_->dir() + "/ready";
    std::remove(ready.c_str());  // a reducer started before in this test wrote one
    Args args = {"--listen",          net_->ip_a() + ":0",
                 "--transport",       GetParam(),
                 "--ready-file",      ready,
                 "--heartbeat-ms",    std::to_string(kHeartbeat.count()),
                 "--peer-timeout-ms", std::to_string(kPeerTimeout.count()),
                 "--max-chunk-bytes", "4096",
                 "--memory-budget",   "1MiB",
                 "--window",          "4",
                 "--io-threads",      "2",
                 "--log-level",       "info"};
    // A flag in `extra` replaces its default above (flag and value).
    for (const std::string& flag : extra) {
      auto it = std::find(args.begin(), args.end(), flag);
      if (it != args.end()) args.erase(it, it + 2);
    }
    if (secret) {
      std::ofstream(secret_file()) << "netns-" << std::string(32, 's') << "\n";
      chmod(secret_file().c_str(), 0600);
      args.insert(args.end(), {"--job-secret-file", secret_file(), "--require-auth"});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    reducer_.emplace(net_->spawn_in(ns_a_, "reducer", TALLY_REDUCER_PATH, args));
    std::string address;
    const bool up = eventually(
        [&] {
          std::ifstream in(ready);
          if (in && std::getline(in, address) && !address.empty()) return true;
          return reducer_->process->wait_for(0ms).has_value();
        },
        15s);
    if (!up || address.empty()) {
      ADD_FAILURE() << "the reducer in " << ns_a_ << " did not listen:\n" << reducer_log();
      return "";
    }
    return address;
  }

  std::string reducer_log() const { return reducer_ ? reducer_->err() : ""; }
  std::string secret_file() const { return net_->dir() + "/job.secret"; }

  // Starts rank `rank` of `job` in namespace b, against the reducer at `pool`.
  Child& spawn_worker(const std::string& name, const std::string& pool, const std::string& job,
                      uint32_t rank, uint32_t world, const Args& args, const Env& extra = {}) {
    Env env = {{"TALLY_POOL", pool},
               {"TALLY_JOB", job},
               {"TALLY_RANK", std::to_string(rank)},
               {"TALLY_WORLD_SIZE", std::to_string(world)},
               {"TALLY_CHUNK_BYTES", "1024"},
               {"TALLY_OP_TIMEOUT_MS", "20000"},
               {"TALLY_CONNECT_TIMEOUT_MS", "10000"},
               {"TALLY_HEARTBEAT_MS", std::to_string(kHeartbeat.count())},
               {"TALLY_PEER_TIMEOUT_MS", std::to_string(kPeerTimeout.count())},
               {"TALLY_TRANSPORT", GetParam()},
               {"TALLY_JOB_SECRET_FILE", secret_file()}};
    for (auto& [name, value] : extra) env[name] = value;
    workers_.push_back(
        std::make_unique<Child>(net_->spawn_in(ns_b_, name, TALLY_TEST_WORKER_PATH, args, env)));
    return *workers_.back();
  }

  // Starts a job of `world` ranks in b running `ops` ops of 9477 floats, and
  // returns them once each has finished op 10 (none if that did not come).
  std::vector<Child*> start_job(const std::string& tag, const std::string& pool, uint32_t world,
                                const std::string& ops, const Env& extra = {}) {
    const std::string job = unique_job(tag);
    std::vector<Child*> ranks;
    for (uint32_t r = 0; r < world; ++r) {
      ranks.push_back(&spawn_worker(tag + std::to_string(r), pool, job, r, world,
                                    {"--count", "9477", "--ops", ops}, extra));
    }
    const bool going = eventually(
        [&] {
          for (Child* c : ranks) {
            if (!contains(c->out(), "op 10 ok")) return false;
          }
          return true;
        },
        30s);
    EXPECT_TRUE(going) << ranks[0]->out() << ranks[0]->err() << reducer_log();
    return going ? ranks : std::vector<Child*>{};
  }

  // Runs a job of `world` ranks in b to completion and expects exact sums.
  void expect_job_works(const std::string& pool, const std::string& tag, uint32_t world) {
    const std::string job = unique_job(tag);
    std::vector<Child*> ranks;
    for (uint32_t r = 0; r < world; ++r) {
      ranks.push_back(
          &spawn_worker(tag + std::to_string(r), pool, job, r, world,
                        {"--counts", "1,1009,9477", "--ops", "6", "--log-level", "info"}));
    }
    for (uint32_t r = 0; r < world; ++r) {
      std::string out;
      auto st = ranks[r]->wait(30s, &out);
      EXPECT_EQ(st, std::optional<int>(0)) << tag << " rank " << r << ":\n" << out << reducer_log();
      EXPECT_TRUE(contains(out, "op 5 ok hash ") && contains(out, "\nok\n")) << out;
      if (GetParam() == "fabric") {
        // The worker's endpoint sits on its veth address, not on loopback.
        EXPECT_TRUE(contains(out, "bound to " + net_->ip_b())) << out;
      }
    }
  }

  // Cuts the link under `ranks` (running, in b), restores it once every one
  // is reconnecting, and expects each to finish exactly through op
  // `last_op`, resumed, and the reducer to stop cleanly.
  void expect_resumed_after_cut(const std::vector<Child*>& ranks, int last_op) {
    Command cut = net_->set_link_b(false);
    ASSERT_TRUE(cut.ok()) << cut.output;
    const bool reconnecting = eventually(
        [&] {
          return std::all_of(ranks.begin(), ranks.end(),
                             [](Child* c) { return contains(c->err(), "reconnecting"); });
        },
        3 * kPeerTimeout + 5s);
    Command restore = net_->set_link_b(true);
    ASSERT_TRUE(restore.ok()) << restore.output;
    ASSERT_TRUE(reconnecting) << ranks[0]->err() << ranks.back()->err();
    for (Child* rank : ranks) {
      std::string out;
      EXPECT_EQ(rank->wait(60s, &out), std::optional<int>(0))
          << out << rank->err() << reducer_log();
      EXPECT_TRUE(contains(out, "op " + std::to_string(last_op) + " ok")) << out;
    }
    EXPECT_TRUE(contains(reducer_log(), "resumed")) << reducer_log();
    expect_clean_stop();
  }

  // SIGTERM; the reducer must shut down cleanly within 5 s.
  void expect_clean_stop() {
    reducer_->process->signal(SIGTERM);
    auto st = reducer_->process->wait_for(5000ms);
    EXPECT_EQ(st, std::optional<int>(0)) << reducer_log();
  }

  std::unique_ptr<NetnsPair> net_;
  std::string ns_a_, ns_b_;
  std::optional<Child> reducer_;
  std::vector<std::unique_ptr<Child>> workers_;
};

TEST_P(OffLoopback, ExactSumsAcrossAVethPair) {
  const std::string pool = start_reducer();
  ASSERT_FALSE(pool.empty());
  ASSERT_EQ(pool.rfind(net_->ip_a() + ":", 0), 0u) << pool;
  expect_job_works(pool, "w", 3);
  const std::string log = reducer_log();
  EXPECT_TRUE(contains(log, "joined from " + net_->ip_b() + ":")) << log;
  if (GetParam() == "fabric") {
    EXPECT_TRUE(contains(log, "bound to " + net_->ip_a())) << log;
  }
  expect_clean_stop();
}

// Without a job secret a reducer is in protected mode: a worker from
// another host (namespace) is refused at its hello, told why and what
// fixes it, and --insecure-open-pool serves it.
TEST_P(OffLoopback, ProtectedModeRefusesWorkersFromAnotherHostNamingTheFix) {
  const std::string pool = start_reducer(/*secret=*/false);
  ASSERT_FALSE(pool.empty());
  EXPECT_TRUE(contains(reducer_log(), "protected mode: no job secret")) << reducer_log();
  Child& refused = spawn_worker("refused", pool, unique_job("protected"), 0, 1,
                                {"--count", "16", "--ops", "1"}, {{"TALLY_JOB_SECRET_FILE", ""}});
  std::string out;
  EXPECT_NE(refused.wait(30s, &out), std::optional<int>(0)) << out;
  EXPECT_TRUE(contains(out,
                       "this reducer has no job secret, so it serves loopback addresses only "
                       "(protected mode)") &&
              contains(out, "--insecure-open-pool"))
      << out;
  expect_clean_stop();
  const std::string open = start_reducer(/*secret=*/false, {"--insecure-open-pool"});
  ASSERT_FALSE(open.empty());
  EXPECT_TRUE(
      contains(reducer_log(), "--insecure-open-pool: no job secret, and anyone who reaches"))
      << reducer_log();
  Child& served = spawn_worker("served", open, unique_job("open"), 0, 1,
                               {"--count", "16", "--ops", "1"}, {{"TALLY_JOB_SECRET_FILE", ""}});
  EXPECT_EQ(served.wait(30s, &out), std::optional<int>(0)) << out << reducer_log();
  expect_clean_stop();
}

// The link goes dead under a running job (no FIN, no RST: packets vanish).
// Workers that do not resume (TALLY_RESUME_BYTES=0) fail naming the reducer
// once the peer timeout passes, the reducer drops the workers' streams and
// stays up, and once the link is back it serves a new job and still shuts
// down cleanly.
TEST_P(OffLoopback, CutLinkFailsEveryWorkerNamingTheReducer) {
  const std::string pool = start_reducer();
  ASSERT_FALSE(pool.empty());
  constexpr uint32_t kWorld = 2;
  std::vector<Child*> ranks =
      start_job("cut", pool, kWorld, "200000", {{"TALLY_RESUME_BYTES", "0"}});
  ASSERT_EQ(ranks.size(), kWorld);
  Command cut = net_->set_link_b(false);
  ASSERT_TRUE(cut.ok()) << cut.output;
  const auto t0 = Clock::now();
  // Peer timeout, plus a heartbeat period to notice, plus the fabric
  // stream's grace for sends the provider never completes (1 s): under 3x.
  const auto bound = 3 * kPeerTimeout;
  for (uint32_t r = 0; r < kWorld; ++r) {
    std::string out;
    auto st = ranks[r]->wait(bound + 5s, &out);
    const auto took = since(t0);
    EXPECT_EQ(st, std::optional<int>(3)) << out;
    EXPECT_TRUE(contains(out, "lost reducer " + pool + " (shard 0)")) << out;
    EXPECT_LT(took, bound) << out;
  }
  EXPECT_TRUE(eventually(
      [&] { return contains(reducer_log(), "no data or heartbeat from " + net_->ip_b()); }, bound))
      << reducer_log();
  EXPECT_FALSE(reducer_->process->wait_for(0ms).has_value()) << reducer_log();

  Command restore = net_->set_link_b(true);
  ASSERT_TRUE(restore.ok()) << restore.output;
  expect_job_works(pool, "after-cut", 2);
  expect_clean_stop();
}

// The same cut, with workers that resume (the default): they reconnect
// while the link is dead, and once it is back (within their op timeout) the
// job goes on where it stopped and every op completes exactly.
TEST_P(OffLoopback, CutLinkRestoredWithinTheOpTimeoutIsResumed) {
  const std::string pool = start_reducer();
  ASSERT_FALSE(pool.empty());
  constexpr uint32_t kWorld = 2;
  std::vector<Child*> ranks = start_job("cutr", pool, kWorld, "60");
  ASSERT_EQ(ranks.size(), kWorld);
  expect_resumed_after_cut(ranks, 59);
}

// The same cut, on a capped link that payloads of 1 MiB chunks keep full:
// the cut lands in the middle of payloads on the wire. A receive the
// reducer's provider has begun cannot be withdrawn when the stream is given
// up, and finishes when the link is back; the job resumes meanwhile, and
// every op completes exactly.
TEST_P(OffLoopback, CutLinkUnderLargePayloadsIsResumedExactly) {
  Command cap = net_->cap_link("400mbit");
  ASSERT_TRUE(cap.ok()) << cap.output;
  const std::string pool =
      start_reducer(true, {"--max-chunk-bytes", "1048576", "--memory-budget", "64MiB"});
  ASSERT_FALSE(pool.empty());
  constexpr uint32_t kWorld = 2;
  const std::string job = unique_job("cutbig");
  std::vector<Child*> ranks;
  for (uint32_t r = 0; r < kWorld; ++r) {
    ranks.push_back(&spawn_worker("cutbig" + std::to_string(r), pool, job, r, kWorld,
                                  {"--count", "1000000", "--ops", "12"},
                                  {{"TALLY_CHUNK_BYTES", "1048576"}}));
  }
  auto going = [&] {
    return contains(ranks[0]->out(), "op 1 ok") && contains(ranks[1]->out(), "op 1 ok");
  };
  eventually(
      [&] {
        return going() || ranks[0]->process->wait_for(0ms) || ranks[1]->process->wait_for(0ms);
      },
      30s);
  ASSERT_TRUE(going()) << ranks[0]->out() << ranks[1]->out() << reducer_log();
  expect_resumed_after_cut(ranks, 11);
}

INSTANTIATE_TEST_SUITE_P(Netns, OffLoopback, ::testing::Values("tcp", "fabric"), transport_name);

}  // namespace
}  // namespace tally::testing
