// A pool reached off loopback: two network namespaces joined by a veth pair,
// made and removed with iproute2's `ip`, and processes started inside them.
// Needs root and `ip`; NetnsPair::create says why it cannot run otherwise.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "tally/bench/netlab.h"

namespace tally::testing {

// The helpers are tally-bench's (tally/bench/netlab.h), shared with --netlab.
using Command = bench::CommandResult;

// Two namespaces, a and b, joined by a veth pair with 10.231.<n>.1/24 in a
// and .2/24 in b, links (and loopback) up. Everything is removed on
// destruction: the namespaces, and with them the veth pair, once the
// processes started in them have exited (destroy those first).
class NetnsPair {
 public:
  // Sets `skip` (this machine cannot do it: not root, no ip, no namespaces
  // or veth) or `error` (a later step failed) and returns null on failure.
  static std::unique_ptr<NetnsPair> create(std::string* skip, std::string* error);

  ~NetnsPair();

  const std::string& ns_a() const { return ns_a_; }
  const std::string& ns_b() const { return ns_b_; }
  const std::string& ip_a() const { return ip_a_; }
  const std::string& ip_b() const { return ip_b_; }
  const std::string& dir() const { return dir_.path(); }

  // Runs `ip args...` to completion (10 s at most).
  Command ip(const Args& args) const;

  // Starts `path args...` inside namespace `ns` (ip netns exec, which execs
  // in place: the child's pid is the program's).
  Child spawn_in(const std::string& ns, const std::string& name, const std::string& path,
                 const Args& args, const Env& env = {}) const;

  // Takes b's end of the link down (or up again): packets between the
  // namespaces are dropped silently, as on a cut cable.
  Command set_link_b(bool up) const;

  // Caps the link at `rate` (tc's units, "100mbit") both ways, with a tbf
  // qdisc on each end. Needs tc.
  Command cap_link(const std::string& rate) const;

  // Whether `ip netns list` shows `ns`.
  static bool listed(const std::string& ns);

 private:
  NetnsPair() = default;

  TempDir dir_;
  std::string ns_a_, ns_b_, veth_a_, veth_b_, ip_a_, ip_b_;
  std::vector<std::string> created_;
};

}  // namespace tally::testing
