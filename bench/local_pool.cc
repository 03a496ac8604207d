#include "tally/bench/local_pool.h"

#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tally/protocol/auth.h"

namespace tally::bench {

namespace fs = std::filesystem;

std::string find_reducer_binary() {
  if (const char* env = std::getenv("TALLY_REDUCER"); env && *env) return env;
  const std::string dir = self_dir();
  for (const std::string& candidate : {dir + "/tally-reducer", dir + "/../reducer/tally-reducer",
                                       dir + "/../../reducer/tally-reducer"}) {
    if (access(candidate.c_str(), X_OK) == 0) return fs::weakly_canonical(candidate).string();
  }
  return dir + "/tally-reducer";
}

Result<std::unique_ptr<LocalPool>> LocalPool::start(const LocalPoolOptions& options) {
  std::unique_ptr<LocalPool> pool(new LocalPool());
  auto scratch = ScratchDir::make("tally-pool-");
  if (!scratch) return scratch.status();
  pool->scratch_ = std::move(*scratch);
  pool->shards_ = options.shards;
  pool->groups_ = options.groups;
  const std::string binary =
      options.reducer_path.empty() ? find_reducer_binary() : options.reducer_path;
  const uint32_t count = options.shards * options.groups;
  const std::string pool_file = pool->scratch_->path() + "/pool";
  std::vector<std::string> ready_files;
  for (uint32_t i = 0; i < count; ++i) {
    ProcessSpec spec;
    spec.path = binary;
    ready_files.push_back(pool->scratch_->path() + "/ready-" + std::to_string(i));
    const std::string host = i < options.hosts.size() ? options.hosts[i] : "127.0.0.1";
    spec.args = {"--listen",     host + ":0",
                 "--shard",      std::to_string(i % options.shards),
                 "--shards",     std::to_string(options.shards),
                 "--ready-file", ready_files.back()};
    if (options.groups > 1) {
      spec.args.insert(spec.args.end(),
                       {"--group", std::to_string(i / options.shards), "--groups",
                        std::to_string(options.groups), "--pool", "@" + pool_file});
    }
    if (options.stats) spec.args.insert(spec.args.end(), {"--stats-file", pool->stats_path(i)});
    if (options.http) spec.args.insert(spec.args.end(), {"--http-listen", host + ":0"});
    spec.args.insert(spec.args.end(), options.extra_args.begin(), options.extra_args.end());
    if (!options.log_dir.empty()) {
      // Both streams: a reducer holding its launcher's stdout would keep a
      // pipe open after the launcher died (a test halted by a sanitizer
      // then reads as a timeout to whoever waits for that pipe's end).
      spec.stdout_path = options.log_dir + "/reducer-" + std::to_string(i) + ".log";
      spec.stderr_to_stdout = true;
    }
    if (options.place) options.place(i, spec);
    auto p = Process::spawn(spec);
    if (!p) return p.status();
    pool->processes_.push_back(std::move(*p));
    pool->specs_.push_back(std::move(spec));
    pool->restarts_.push_back(0);
  }
  const auto deadline = std::chrono::steady_clock::now() + options.start_timeout;
  pool->addresses_.resize(count);
  if (options.http) pool->http_addresses_.resize(count);
  for (uint32_t s = 0; s < count; ++s) {
    while (true) {
      std::ifstream in(ready_files[s]);
      std::string address;
      if (in && std::getline(in, address) && !address.empty()) {
        pool->addresses_[s] = address;
        // The ready file's second line: "http HOST:PORT" (--http-listen).
        std::string http;
        if (options.http && std::getline(in, http) && http.rfind("http ", 0) == 0) {
          pool->http_addresses_[s] = http.substr(5);
        }
        break;
      }
      if (auto st = pool->processes_[s].wait_for(std::chrono::milliseconds(0))) {
        return Status(ErrorCode::kUnavailable, "reducer " + std::to_string(s) + " (" + binary +
                                                   ") exited with status " + std::to_string(*st) +
                                                   " before listening");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return Status(ErrorCode::kTimeout,
                      "reducer " + std::to_string(s) + " did not listen within " +
                          std::to_string(options.start_timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (options.groups > 1) {
    // The reducers dial each other once this appears (written whole).
    const std::string tmp = pool_file + ".tmp";
    std::ofstream(tmp) << pool->pool_string() << "\n";
    std::rename(tmp.c_str(), pool_file.c_str());
  }
  return pool;
}

namespace {

// A fresh random secret (hex) in `path`, mode 0600.
Status write_secret(const std::string& path) {
  std::string hex;
  for (unsigned char c : make_nonce()) {
    static const char* digits = "0123456789abcdef";
    hex += digits[c >> 4];
    hex += digits[c & 15];
  }
  std::ofstream out(path);
  out << hex << "\n";
  out.close();
  if (!out || chmod(path.c_str(), 0600) != 0) {
    return Status(ErrorCode::kUnavailable, "cannot write the secret " + path);
  }
  return Status::ok();
}

}  // namespace

Status LocalPoolOptions::require_secret(const std::string& path) {
  const std::string pool_path = path + ".pool";
  TALLY_RETURN_IF_ERROR(write_secret(path));
  TALLY_RETURN_IF_ERROR(write_secret(pool_path));
  extra_args.insert(extra_args.end(),
                    {"--job-secret-file", path, "--require-auth", "--pool-secret-file", pool_path});
  return Status::ok();
}

void LocalPoolOptions::place_in(const Netlab& lab, uint32_t first_host) {
  hosts.clear();
  for (uint32_t i = 0; i < shards * groups; ++i) hosts.push_back(lab.address(first_host + i));
  const Netlab* l = &lab;
  place = [l, first_host](uint32_t i, ProcessSpec& spec) { l->place(first_host + i, spec); };
}

Status LocalPool::restart(uint32_t index, std::chrono::milliseconds timeout) {
  processes_[index].terminate(std::chrono::milliseconds(0));  // reaps it if already dead
  ProcessSpec spec = specs_[index];
  // Each incarnation has its own ready file and log: the wait below must
  // not see an earlier one's file, nor the log overwrite an earlier one's.
  const std::string incarnation = std::to_string(++restarts_[index]);
  const std::string ready =
      scratch_->path() + "/ready-" + std::to_string(index) + "-" + incarnation;
  for (size_t i = 0; i + 1 < spec.args.size(); ++i) {
    if (spec.args[i] == "--listen") spec.args[i + 1] = addresses_[index];
    if (spec.args[i] == "--ready-file") spec.args[i + 1] = ready;
  }
  if (!spec.stdout_path.empty()) spec.stdout_path += "." + incarnation;
  auto p = Process::spawn(spec);
  if (!p) return p.status();
  processes_[index] = std::move(*p);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (access(ready.c_str(), F_OK) != 0) {
    if (auto st = processes_[index].wait_for(std::chrono::milliseconds(0))) {
      return Status(ErrorCode::kUnavailable, "reducer " + std::to_string(index) +
                                                 " exited with status " + std::to_string(*st) +
                                                 " on restart");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status(ErrorCode::kTimeout,
                    "reducer " + std::to_string(index) + " did not listen again");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!http_addresses_.empty()) {
    std::ifstream in(ready);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("http ", 0) == 0) http_addresses_[index] = line.substr(5);
    }
  }
  return Status::ok();
}

std::vector<int> LocalPool::stop(std::chrono::milliseconds grace) {
  for (auto& p : processes_) p.signal(SIGTERM);
  std::vector<int> statuses;
  for (auto& p : processes_) statuses.push_back(p.terminate(grace));
  return statuses;
}

LocalPool::~LocalPool() { stop(); }  // then scratch_ goes, with the reducers' files

std::string LocalPool::pool_string() const {
  std::string out;
  for (size_t i = 0; i < addresses_.size(); ++i) {
    if (i) out += ",";
    out += addresses_[i];
  }
  return out;
}

}  // namespace tally::bench
