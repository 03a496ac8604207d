#include "tally/bench/netlab.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <tuple>

#include "tally/protocol/link_rate.h"

namespace tally::bench {
namespace {

std::string find_binary(const char* name) {
  for (const char* dir : {"/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"}) {
    const std::string p = std::string(dir) + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

std::string join(const std::vector<std::string>& words) {
  std::string s;
  for (auto& w : words) s += (s.empty() ? "" : " ") + w;
  return s;
}

// Packets sent and dropped by the root qdisc in `tc -s qdisc show dev X`
// output: "qdisc htb 1: root ... \n Sent B bytes P pkt (dropped D, ...".
std::pair<uint64_t, uint64_t> root_counters(const std::string& out) {
  const auto root = out.find(" root ");
  const std::string rest = root == std::string::npos ? out : out.substr(root);
  uint64_t packets = 0, dropped = 0;
  if (const auto at = rest.find(" bytes "); at != std::string::npos) {
    packets = std::strtoull(rest.c_str() + at + 7, nullptr, 10);
  }
  if (const auto at = rest.find("(dropped "); at != std::string::npos) {
    dropped = std::strtoull(rest.c_str() + at + 9, nullptr, 10);
  }
  return {packets, dropped};
}

}  // namespace

std::string find_ip() { return find_binary("ip"); }
std::string find_tc() { return find_binary("tc"); }

CommandResult run_ip(const std::vector<std::string>& args) {
  const std::string ip = find_ip();
  if (ip.empty()) return CommandResult{std::nullopt, "iproute2's ip is not installed"};
  return run_command(ip, args);
}

std::vector<std::string> netns_list() {
  std::vector<std::string> names;
  CommandResult list = run_ip({"netns", "list"});
  std::istringstream lines(list.output);
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.empty()) names.push_back(line.substr(0, line.find(' ')));
  }
  return names;
}

std::vector<std::string> remove_stale_namespaces(const std::string& prefix) {
  std::vector<std::string> removed;
  for (const std::string& name : netns_list()) {
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    if (rest.empty() || !std::isdigit(static_cast<unsigned char>(rest[0]))) continue;
    const pid_t pid = static_cast<pid_t>(std::atoi(rest.c_str()));
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      if (run_ip({"netns", "delete", name}).ok()) removed.push_back(name);
    }
  }
  return removed;
}

std::string netlab_refusal() {
  if (geteuid() != 0) {
    return "--netlab needs root: it creates network namespaces, a bridge and tc qdiscs (euid " +
           std::to_string(geteuid()) + ")";
  }
  if (find_ip().empty()) return "--netlab needs iproute2's ip (apt-get install iproute2)";
  if (find_tc().empty()) return "--netlab needs iproute2's tc (apt-get install iproute2)";
  return "";
}

Result<std::unique_ptr<Netlab>> Netlab::create(const NetlabOptions& options) {
  if (std::string why = netlab_refusal(); !why.empty()) {
    return Status(ErrorCode::kUnavailable, why);
  }
  auto bps = parse_link_rate(options.rate);
  if (!bps) return bps.status();
  if (options.hosts == 0 || options.hosts > 250 * 250) {
    return Status(ErrorCode::kInvalidArgument, "a lab holds 1 to 62500 hosts");
  }
  std::unique_ptr<Netlab> lab(new Netlab());
  lab->ip_ = find_ip();
  lab->tc_ = find_tc();
  lab->rate_ = options.rate;
  lab->rate_bps_ = *bps;
  const std::string base = options.prefix + std::to_string(getpid()) + "-";
  lab->lab_ = base + "lab";
  // Each leaf queue holds 5 ms at the rate (and at least 2 full frames).
  const uint64_t queue_bytes = std::max<uint64_t>(2 * 1514, *bps / 8 / 200);
  std::vector<std::vector<std::string>> ip_steps, tc_steps;
  auto shape = [&](const std::string& ns, const std::string& dev) {
    tc_steps.push_back(
        {"-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"});
    tc_steps.push_back({"-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10",
                        "htb", "rate", options.rate, "ceil", options.rate});
    tc_steps.push_back({"-n", ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle",
                        "10:", "bfifo", "limit", std::to_string(queue_bytes)});
  };
  ip_steps.push_back({"netns", "add", lab->lab_});
  ip_steps.push_back({"-n", lab->lab_, "link", "add", "br0", "type", "bridge"});
  ip_steps.push_back({"-n", lab->lab_, "addr", "add", lab_address() + "/16", "dev", "br0"});
  ip_steps.push_back({"-n", lab->lab_, "link", "set", "br0", "up"});
  ip_steps.push_back({"-n", lab->lab_, "link", "set", "lo", "up"});
  for (uint32_t i = 0; i < options.hosts; ++i) {
    const std::string ns = base + "h" + std::to_string(i);
    const std::string port = "p" + std::to_string(i);
    const std::string address =
        "10.233." + std::to_string(i / 250) + "." + std::to_string(i % 250 + 1);
    lab->hosts_.push_back(ns);
    lab->addresses_.push_back(address);
    ip_steps.push_back({"netns", "add", ns});
    // Created straight inside the namespaces: no name is taken in ours.
    ip_steps.push_back({"link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                        "netns", lab->lab_});
    ip_steps.push_back({"-n", lab->lab_, "link", "set", port, "master", "br0"});
    ip_steps.push_back({"-n", lab->lab_, "link", "set", port, "up"});
    ip_steps.push_back({"-n", ns, "addr", "add", address + "/16", "dev", "eth0"});
    ip_steps.push_back({"-n", ns, "link", "set", "lo", "up"});
    ip_steps.push_back({"-n", ns, "link", "set", "eth0", "up"});
    shape(ns, "eth0");
    shape(lab->lab_, port);
  }
  for (const auto& step : ip_steps) {
    CommandResult c = run_command(lab->ip_, step);
    if (!c.ok()) return Status(ErrorCode::kUnavailable, "ip " + join(step) + ": " + c.output);
    if (step.size() == 3 && step[0] == "netns" && step[1] == "add") {
      lab->created_.push_back(step[2]);
    }
  }
  for (const auto& step : tc_steps) {
    CommandResult c = run_command(lab->tc_, step);
    if (!c.ok()) return Status(ErrorCode::kUnavailable, "tc " + join(step) + ": " + c.output);
  }
  return lab;
}

Result<std::unique_ptr<Netlab>> Netlab::for_run(uint32_t hosts, const std::string& rate) {
  NetlabOptions no;
  for (const std::string& name : remove_stale_namespaces(no.prefix)) {
    spdlog::warn("removed namespace {}, left by a bench that is gone", name);
  }
  no.hosts = hosts;
  no.rate = rate;
  return create(no);
}

Netlab::~Netlab() { remove(); }

Status Netlab::remove() {
  Status first;
  // Hosts first: deleting a host's namespace deletes its veth pair, the
  // bridge port included; the lab (and the bridge) last.
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
    CommandResult c = run_command(ip_, {"netns", "delete", *it});
    if (!c.ok() && first) {
      first = Status(ErrorCode::kInternal, "ip netns delete " + *it + ": " + c.output);
    }
  }
  created_.clear();
  return first;
}

Status Netlab::set_rate(uint32_t host, const std::string& rate) {
  const std::string port = "p" + std::to_string(host);
  for (const auto& [ns, dev] :
       {std::pair{hosts_[host], std::string("eth0")}, std::pair{lab_, port}}) {
    const std::vector<std::string> step = {"-n",  ns,       "class", "change",  "dev",
                                           dev,   "parent", "1:",    "classid", "1:10",
                                           "htb", "rate",   rate,    "ceil",    rate};
    CommandResult c = run_command(tc_, step);
    if (!c.ok()) return Status(ErrorCode::kUnavailable, "tc " + join(step) + ": " + c.output);
  }
  return Status::ok();
}

void Netlab::place(uint32_t host, ProcessSpec& spec) const {
  std::vector<std::string> args = {"netns", "exec", hosts_[host], spec.path};
  args.insert(args.end(), spec.args.begin(), spec.args.end());
  spec.path = ip_;
  spec.args = std::move(args);
}

void Netlab::place_in_lab(ProcessSpec& spec) const {
  std::vector<std::string> args = {"netns", "exec", lab_, spec.path};
  args.insert(args.end(), spec.args.begin(), spec.args.end());
  spec.path = ip_;
  spec.args = std::move(args);
}

std::vector<std::string> Netlab::exec_prefix(uint32_t host) const {
  return {ip_, "netns", "exec", hosts_[host]};
}

Result<std::vector<Netlab::LinkStats>> Netlab::link_stats() const {
  std::vector<LinkStats> out;
  for (uint32_t i = 0; i < hosts(); ++i) {
    LinkStats s;
    s.host = i;
    CommandResult to =
        run_command(tc_, {"-n", lab_, "-s", "qdisc", "show", "dev", "p" + std::to_string(i)});
    CommandResult from = run_command(tc_, {"-n", hosts_[i], "-s", "qdisc", "show", "dev", "eth0"});
    if (!to.ok()) return Status(ErrorCode::kUnavailable, "tc -s qdisc (bridge): " + to.output);
    if (!from.ok()) return Status(ErrorCode::kUnavailable, "tc -s qdisc (host): " + from.output);
    std::tie(s.to_host_sent, s.to_host_dropped) = root_counters(to.output);
    std::tie(s.from_host_sent, s.from_host_dropped) = root_counters(from.output);
    out.push_back(s);
  }
  return out;
}

}  // namespace tally::bench
