#include "tally/bench/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace tally::bench {

Result<Process> Process::spawn(const ProcessSpec& spec) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (auto& [k, v] : spec.env) env[k] = v;
  std::vector<std::string> env_strings;
  for (auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);

  std::vector<std::string> args{spec.path};
  args.insert(args.end(), spec.args.begin(), spec.args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!spec.stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, spec.stdout_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  if (spec.stderr_to_stdout) {
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  } else if (!spec.stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, spec.stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  // Children start with default signal handling and an empty mask, whatever
  // the launcher blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, spec.path.c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return Status(ErrorCode::kUnavailable, "cannot start " + spec.path + ": " + std::strerror(rc));
  }
  return Process(pid);
}

Process::Process(Process&& other) noexcept : pid_(other.pid_), status_(other.status_) {
  other.pid_ = -1;
}

Process& Process::operator=(Process&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0 && !status_) terminate(std::chrono::milliseconds(0));
    pid_ = other.pid_;
    status_ = other.status_;
    other.pid_ = -1;
  }
  return *this;
}

Process::~Process() {
  if (pid_ > 0 && !status_) {
    ::kill(pid_, SIGKILL);
    int st = 0;
    waitpid(pid_, &st, 0);
  }
}

void Process::signal(int sig) const {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

std::optional<int> Process::wait_for(std::chrono::milliseconds timeout) {
  if (status_) return status_;
  if (pid_ <= 0) return std::nullopt;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return status_;
    }
    if (r < 0 && errno != EINTR) {
      status_ = -1;
      return status_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

int Process::terminate(std::chrono::milliseconds grace) {
  if (status_) return *status_;
  signal(SIGTERM);
  if (auto st = wait_for(grace)) return *st;
  signal(SIGKILL);
  auto st = wait_for(std::chrono::milliseconds(10000));
  return st ? *st : -1;
}

WaitAll wait_all(std::vector<Process>& processes, std::chrono::steady_clock::time_point deadline,
                 const volatile int* stop, const std::function<void()>& tick) {
  WaitAll result;
  std::vector<bool> finished(processes.size(), false);
  size_t left = processes.size();
  auto pause = std::chrono::milliseconds(1);
  while (left > 0) {
    for (size_t i = 0; i < processes.size(); ++i) {
      if (finished[i]) continue;
      if (auto st = processes[i].wait_for(std::chrono::milliseconds(0))) {
        finished[i] = true;
        --left;
        if (*st != 0 && result.first_failed < 0) {
          result.first_failed = static_cast<int>(i);
          result.status = *st;
        }
      }
    }
    if (left == 0) break;
    result.stopped = stop && *stop != 0;
    result.timed_out = std::chrono::steady_clock::now() > deadline;
    if (result.stopped || result.timed_out) {
      for (auto& p : processes) p.signal(SIGTERM);
      for (auto& p : processes) p.terminate(std::chrono::milliseconds(2000));
      break;
    }
    if (tick) tick();
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(10));
  }
  if (tick) tick();
  return result;
}

CommandResult run_command(const std::string& path, const std::vector<std::string>& args,
                          std::chrono::milliseconds timeout) {
  CommandResult result;
  char tmpl[] = "/tmp/tally-command-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) {
    result.output = std::string("cannot create a temporary file: ") + std::strerror(errno);
    return result;
  }
  close(fd);
  ProcessSpec spec;
  spec.path = path;
  spec.args = args;
  spec.stdout_path = tmpl;
  spec.stderr_to_stdout = true;
  auto p = Process::spawn(spec);
  if (!p) {
    unlink(tmpl);
    result.output = p.status().to_string();
    return result;
  }
  result.status = p->wait_for(timeout);
  if (!result.status) p->terminate(std::chrono::milliseconds(0));
  std::ifstream in(tmpl);
  result.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  unlink(tmpl);
  if (!result.status)
    result.output += "\n(killed after " + std::to_string(timeout.count()) + " ms)";
  return result;
}

std::optional<double> process_cpu_seconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name (field 2) may hold spaces: fields are counted after its ')'.
  const auto close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  if (!fields) return std::nullopt;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double rusage_cpu_seconds(int who) {
  rusage ru{};
  getrusage(who, &ru);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

Result<std::unique_ptr<ScratchDir>> ScratchDir::make(const std::string& prefix) {
  std::string tmpl = "/tmp/" + prefix + "XXXXXX";
  if (!mkdtemp(tmpl.data())) {
    return Status(ErrorCode::kUnavailable,
                  "cannot create a temporary directory: " + std::string(std::strerror(errno)));
  }
  return std::unique_ptr<ScratchDir>(new ScratchDir(tmpl));
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {

// A "<field>: <n> kB" line of /proc/<pid>/status, in bytes.
std::optional<uint64_t> status_bytes(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0 && line.size() > field.size() && line[field.size()] == ':') {
      const char* begin = line.c_str() + field.size() + 1;
      char* end = nullptr;
      const unsigned long long kb = std::strtoull(begin, &end, 10);
      if (end == begin) return std::nullopt;
      return uint64_t{kb} * 1024;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<uint64_t> process_rss_bytes(pid_t pid) { return status_bytes(pid, "VmRSS"); }

std::optional<uint64_t> process_peak_rss_bytes(pid_t pid) { return status_bytes(pid, "VmHWM"); }

std::optional<uint32_t> process_open_fds(pid_t pid) {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec);
  if (ec) return std::nullopt;
  uint32_t n = 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) return std::nullopt;
    ++n;
  }
  return n;
}

std::string self_dir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace tally::bench
