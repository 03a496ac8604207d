// Child processes for launchers and tests: spawn with arguments and extra
// environment, signal, and wait with a deadline.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
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
  bool stderr_to_stdout = false;           // stderr joins stdout (stderr_path unused)
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

// What wait_all saw.
struct WaitAll {
  int first_failed = -1;   // index of the first process to exit non-zero, or -1
  int status = 0;          // its exit status
  bool timed_out = false;  // the deadline passed (every process was terminated)
  bool stopped = false;    // *stop became non-zero (every process was terminated)
  bool ok() const { return first_failed < 0 && !timed_out && !stopped; }
};

// Waits until every process has exited, or the deadline passes, or *stop
// (if given; e.g. set by a signal handler) becomes non-zero; then
// terminates the rest (SIGTERM, SIGKILL after 2 s). `tick`, if set, runs
// between polls (every 10 ms at most), and once more at the end.
WaitAll wait_all(std::vector<Process>& processes, std::chrono::steady_clock::time_point deadline,
                 const volatile int* stop = nullptr, const std::function<void()>& tick = {});

// A command run to completion by run_command.
struct CommandResult {
  std::optional<int> status;  // nullopt: killed at the deadline, or could not start
  std::string output;         // stdout and stderr together
  bool ok() const { return status == 0; }
};

// Runs `path args...` to completion, at most `timeout` (then SIGKILL), and
// returns its exit status and output.
CommandResult run_command(const std::string& path, const std::vector<std::string>& args,
                          std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));

// User plus system CPU seconds a live process has used so far (from
// /proc/<pid>/stat, in clock ticks), or nullopt when it cannot be read.
std::optional<double> process_cpu_seconds(pid_t pid);

// User plus system CPU seconds from getrusage(`who`), to the microsecond:
// RUSAGE_SELF, every thread of this process; RUSAGE_CHILDREN, its children
// that have exited and been waited for.
double rusage_cpu_seconds(int who);

// A directory made under /tmp for one run (`prefix` + six random
// characters), removed with everything in it when this goes.
class ScratchDir {
 public:
  // Errors: kUnavailable, with errno's words.
  static Result<std::unique_ptr<ScratchDir>> make(const std::string& prefix);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Resident memory (VmRSS, bytes), its peak so far (VmHWM) and open
// descriptors (entries of /proc/<pid>/fd) of a live process, or nullopt when
// they cannot be read.
std::optional<uint64_t> process_rss_bytes(pid_t pid);
std::optional<uint64_t> process_peak_rss_bytes(pid_t pid);
std::optional<uint32_t> process_open_fds(pid_t pid);

// The directory holding the running executable (to find sibling binaries).
std::string self_dir();

}  // namespace tally::bench
