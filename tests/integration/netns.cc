#include "netns.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <sstream>

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

std::string join(const Args& args) {
  std::string s;
  for (auto& a : args) s += (s.empty() ? "" : " ") + a;
  return s;
}

constexpr const char* kNetnsPrefix = "tally-test-";

}  // namespace

std::unique_ptr<NetnsPair> NetnsPair::create(std::string* skip, std::string* error) {
  if (geteuid() != 0) {
    *skip = "needs root to create network namespaces (euid " + std::to_string(geteuid()) + ")";
    return nullptr;
  }
  if (bench::find_ip().empty()) {
    *skip = "iproute2's ip is not installed (deploy/dev.sh installs it)";
    return nullptr;
  }
  std::unique_ptr<NetnsPair> net(new NetnsPair());
  if (!net->dir_.ok()) {
    *error = "cannot create a temporary directory";
    return nullptr;
  }
  bench::remove_stale_namespaces(kNetnsPrefix);
  static int seq = 0;
  const std::string base = kNetnsPrefix + std::to_string(getpid()) + "-" + std::to_string(seq++);
  net->ns_a_ = base + "-a";
  net->ns_b_ = base + "-b";
  net->veth_a_ = "tt" + std::to_string(getpid() % 1000000) + "a";
  net->veth_b_ = "tt" + std::to_string(getpid() % 1000000) + "b";
  const std::string subnet = "10.231." + std::to_string(getpid() % 250 + 1) + ".";
  net->ip_a_ = subnet + "1";
  net->ip_b_ = subnet + "2";
  for (const std::string* ns : {&net->ns_a_, &net->ns_b_}) {
    Command c = net->ip({"netns", "add", *ns});
    if (!c.ok()) {
      *skip = "cannot create a network namespace (ip netns add): " + c.output;
      return nullptr;
    }
    net->created_.push_back(*ns);
  }
  // Created straight inside the namespaces: no name is ever taken in ours.
  Command veth = net->ip({"link", "add", net->veth_a_, "netns", net->ns_a_, "type", "veth", "peer",
                          "name", net->veth_b_, "netns", net->ns_b_});
  if (!veth.ok()) {
    *skip = "cannot create a veth pair: " + veth.output;
    return nullptr;
  }
  const std::vector<Args> steps = {
      {"-n", net->ns_a_, "addr", "add", net->ip_a_ + "/24", "dev", net->veth_a_},
      {"-n", net->ns_b_, "addr", "add", net->ip_b_ + "/24", "dev", net->veth_b_},
      {"-n", net->ns_a_, "link", "set", "lo", "up"},
      {"-n", net->ns_b_, "link", "set", "lo", "up"},
      {"-n", net->ns_a_, "link", "set", net->veth_a_, "up"},
      {"-n", net->ns_b_, "link", "set", net->veth_b_, "up"},
  };
  for (const Args& step : steps) {
    Command c = net->ip(step);
    if (!c.ok()) {
      *error = "ip " + join(step) + ": " + c.output;
      return nullptr;
    }
  }
  return net;
}

NetnsPair::~NetnsPair() {
  for (const std::string& ns : created_) {
    Command c = ip({"netns", "delete", ns});
    if (!c.ok()) ADD_FAILURE() << "ip netns delete " << ns << ": " << c.output;
  }
}

Command NetnsPair::ip(const Args& args) const { return bench::run_ip(args); }

Child NetnsPair::spawn_in(const std::string& ns, const std::string& name, const std::string& path,
                          const Args& args, const Env& env) const {
  Args full{"netns", "exec", ns, path};
  full.insert(full.end(), args.begin(), args.end());
  return spawn_child(dir_.path(), name, bench::find_ip(), full, env);
}

Command NetnsPair::set_link_b(bool up) const {
  return ip({"-n", ns_b_, "link", "set", veth_b_, up ? "up" : "down"});
}

Command NetnsPair::cap_link(const std::string& rate) const {
  const std::string tc = bench::find_tc();
  if (tc.empty()) return Command{std::nullopt, "iproute2's tc is not installed"};
  for (const auto& [ns, dev] : {std::pair{ns_a_, veth_a_}, std::pair{ns_b_, veth_b_}}) {
    Command c = bench::run_command(tc, {"-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                        rate, "burst", "64kb", "latency", "100ms"});
    if (!c.ok()) return c;
  }
  return Command{0, ""};
}

bool NetnsPair::listed(const std::string& ns) {
  const auto names = bench::netns_list();
  return std::find(names.begin(), names.end(), ns) != names.end();
}

}  // namespace tally::testing
