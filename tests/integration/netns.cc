#include "netns.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <sstream>

namespace tally::testing {
namespace {

using namespace std::chrono_literals;

std::string find_ip() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// Runs `ip args...` to completion (10 s at most).
Command run_ip(const std::string& ip, const std::string& dir, const Args& args) {
  Child c = spawn_child(dir, "ip", ip, args);
  Command r;
  r.status = c.wait(10s, &r.output);
  return r;
}

std::string join(const Args& args) {
  std::string s;
  for (auto& a : args) s += (s.empty() ? "" : " ") + a;
  return s;
}

constexpr const char* kNetnsPrefix = "tally-test-";

// Network namespaces named "tally-test-<pid>-..." whose process is gone: the
// leftovers of a test that could not clean up (killed, crashed).
void remove_stale_namespaces(const std::string& ip, const std::string& dir) {
  Command list = run_ip(ip, dir, {"netns", "list"});
  std::istringstream lines(list.output);
  std::string line;
  while (std::getline(lines, line)) {
    const std::string name = line.substr(0, line.find(' '));
    if (name.rfind(kNetnsPrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::string(kNetnsPrefix).size());
    const pid_t pid = static_cast<pid_t>(std::atoi(rest.c_str()));
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) run_ip(ip, dir, {"netns", "delete", name});
  }
}

}  // namespace

std::unique_ptr<NetnsPair> NetnsPair::create(std::string* skip, std::string* error) {
  if (geteuid() != 0) {
    *skip = "needs root to create network namespaces (euid " + std::to_string(geteuid()) + ")";
    return nullptr;
  }
  const std::string ip = find_ip();
  if (ip.empty()) {
    *skip = "iproute2's ip is not installed (deploy/dev.sh installs it)";
    return nullptr;
  }
  std::unique_ptr<NetnsPair> net(new NetnsPair(ip));
  if (!net->dir_.ok()) {
    *error = "cannot create a temporary directory";
    return nullptr;
  }
  remove_stale_namespaces(ip, net->dir_.path());
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

Command NetnsPair::ip(const Args& args) const { return run_ip(ip_, dir_.path(), args); }

Child NetnsPair::spawn_in(const std::string& ns, const std::string& name, const std::string& path,
                          const Args& args, const Env& env) const {
  Args full{"netns", "exec", ns, path};
  full.insert(full.end(), args.begin(), args.end());
  return spawn_child(dir_.path(), name, ip_, full, env);
}

Command NetnsPair::set_link_b(bool up) const {
  return ip({"-n", ns_b_, "link", "set", veth_b_, up ? "up" : "down"});
}

bool NetnsPair::listed(const std::string& ns) {
  TempDir dir;
  Command list = run_ip(find_ip(), dir.path(), {"netns", "list"});
  std::istringstream lines(list.output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.substr(0, line.find(' ')) == ns) return true;
  }
  return false;
}

}  // namespace tally::testing
