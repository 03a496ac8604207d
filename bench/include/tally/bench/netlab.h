// Network namespaces for the bench and the tests, made and removed with
// iproute2's `ip` and `tc` (root only).
//
// The helpers (find_ip, netns_list, remove_stale_namespaces) are shared by
// tally-bench's --netlab and by tests/integration/netns. Netlab is the
// bench's lab: one namespace per host, all joined by a Linux bridge in a
// lab namespace, each host's link capped both ways with tc htb.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tally/bench/process.h"
#include "tally/protocol/status.h"

namespace tally::bench {

// iproute2's ip and tc, or "" when not installed.
std::string find_ip();
std::string find_tc();

// Runs `ip args...` to completion (10 s at most).
CommandResult run_ip(const std::vector<std::string>& args);

// The names `ip netns list` shows.
std::vector<std::string> netns_list();

// Deletes the namespaces named "<prefix><pid>-..." whose process <pid> is
// gone: the leftovers of a run that could not clean up (SIGKILL, a crash).
// Returns the names it deleted.
std::vector<std::string> remove_stale_namespaces(const std::string& prefix);

// Why this process cannot make a lab ("" when it can): not root, no ip or
// no tc. Checked before anything is made.
std::string netlab_refusal();

struct NetlabOptions {
  uint32_t hosts = 2;
  std::string rate = "1gbit";  // each host's link, both ways (tc htb)
  // Namespaces are "<prefix><pid>-lab" and "<prefix><pid>-h<i>".
  std::string prefix = "tally-bench-";
};

// hosts namespaces, each with eth0 = 10.233.<i / 250>.<i % 250 + 1>/16 on a
// veth pair whose other end is port p<i> of bridge br0 in the lab
// namespace (which has lab_address() on br0). Egress of eth0 (host to bridge) and of p<i> (bridge
// to host) each has an htb class at the rate with a bfifo of 5 ms of it. Removed on destruction
// (delete the namespaces, and with them every link and qdisc), once the processes in the namespaces
// have exited.
class Netlab {
 public:
  // Errors: kUnavailable (the refusal, checked first), kUnavailable
  // with the failing command and its output; nothing is left behind.
  static Result<std::unique_ptr<Netlab>> create(const NetlabOptions& options);
  // create() for a tally-bench run of `hosts` hosts at `rate`, after
  // removing (and logging) the namespaces that runs which are gone left.
  static Result<std::unique_ptr<Netlab>> for_run(uint32_t hosts, const std::string& rate);
  ~Netlab();
  Netlab(const Netlab&) = delete;
  Netlab& operator=(const Netlab&) = delete;

  uint32_t hosts() const { return static_cast<uint32_t>(hosts_.size()); }
  const std::string& ns(uint32_t host) const { return hosts_[host]; }
  const std::string& address(uint32_t host) const { return addresses_[host]; }
  const std::string& lab_ns() const { return lab_; }
  // "10.233.0.0/16", for tools that pick interfaces by subnet.
  static std::string subnet() { return "10.233.0.0/16"; }
  uint64_t rate_bps() const { return rate_bps_; }
  const std::string& rate() const { return rate_; }

  // The lab namespace's own address, on the bridge (unshaped): for a
  // launcher that runs there and must be reached by every host (mpirun's
  // PMIx server).
  static std::string lab_address() { return "10.233.255.254"; }

  // Sets host's link, both ways, to `rate` (tc units) instead of the lab's.
  // Errors: the failing tc command and its output.
  Status set_rate(uint32_t host, const std::string& rate);

  // Makes `spec` run inside host's namespace (ip netns exec, which execs
  // in place: the child's pid is the program's).
  void place(uint32_t host, ProcessSpec& spec) const;
  // The same, in the lab namespace.
  void place_in_lab(ProcessSpec& spec) const;
  // The command words that do the same, for launchers (mpirun).
  std::vector<std::string> exec_prefix(uint32_t host) const;

  struct LinkStats {
    uint32_t host = 0;
    uint64_t to_host_sent = 0, to_host_dropped = 0;      // bridge port p<i> egress, packets
    uint64_t from_host_sent = 0, from_host_dropped = 0;  // host eth0 egress, packets
  };
  // Every link's counters (tc -s qdisc), read now. Errors: the tc output.
  Result<std::vector<LinkStats>> link_stats() const;

  // Deletes every namespace now (the destructor does it too); returns the
  // first failure.
  Status remove();

 private:
  Netlab() = default;
  std::string ip_, tc_, rate_, lab_;
  uint64_t rate_bps_ = 0;
  std::vector<std::string> hosts_, addresses_, created_;
};

}  // namespace tally::bench
