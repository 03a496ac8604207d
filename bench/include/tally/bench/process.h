// Child processes for launchers and tests: spawn with arguments and extra
// environment, signal, and wait with a deadline.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tally/protocol/status.h"

namespace tally::bench {

struct ProcessSpec {
  std::string path;
  std::vector<std::string> args;           // without argv[0]
  std::map<std::string, std::string> env;  // added to (or replacing in) this process's environment
  std::string stdout_path;                 // empty: inherit
  std::string stderr_path;                 // empty: inherit
};

class Process {
 public:
  // Errors: kUnavailable when the program cannot be started.
  static Result<Process> spawn(const ProcessSpec& spec);
  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  // Kills (SIGKILL) and reaps a child still running.
  ~Process();

  pid_t pid() const { return pid_; }
  void signal(int sig) const;
  // The exit status (128 + signal number for a signal), or nullopt when it
  // is still running at the deadline.
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  // SIGTERM, then SIGKILL if it has not exited within `grace`.
  int terminate(std::chrono::milliseconds grace);

 private:
  explicit Process(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  std::optional<int> status_;
};

// User plus system CPU seconds a live process has used so far (from
// /proc/<pid>/stat), or nullopt when it cannot be read.
std::optional<double> process_cpu_seconds(pid_t pid);

// The directory holding the running executable (to find sibling binaries).
std::string self_dir();

}  // namespace tally::bench
