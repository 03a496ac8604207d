#include "tally/bench/slow_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "tally/protocol/address.h"

namespace tally::bench {
namespace {

// A connection from `source` to 127.0.0.1:`port`, or -1; the connect
// waits at most 500 ms (a server whose backlog is full answers no SYN).
int open_from(const std::string& source, uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
    close(fd);
    return -1;
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0) return fd;
  pollfd p{fd, POLLOUT, 0};
  int error = 0;
  socklen_t len = sizeof(error);
  if (errno != EINPROGRESS || poll(&p, 1, 500) != 1 ||
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0 || error != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::vector<uint16_t> ports_of(const std::vector<std::string>& addresses) {
  std::vector<uint16_t> ports;
  for (const std::string& a : addresses) {
    auto hp = parse_host_port(a);
    ports.push_back(hp ? hp->port : 0);
  }
  return ports;
}

}  // namespace

SlowHttpClients::SlowHttpClients(std::vector<std::string> addresses,
                                 std::vector<std::string> sources, std::chrono::seconds limit)
    : ports_(ports_of(addresses)) {
  thread_ = std::thread([this, sources = std::move(sources), limit] { run(sources, limit); });
}

SlowHttpClients::~SlowHttpClients() {
  stop_ = true;
  thread_.join();
}

void SlowHttpClients::set_addresses(std::vector<std::string> addresses) {
  std::lock_guard lock(mu_);
  ports_ = ports_of(addresses);
}

uint16_t SlowHttpClients::port_for(size_t client) {
  std::lock_guard lock(mu_);
  return ports_.empty() ? 0 : ports_[client % ports_.size()];
}

std::vector<std::string> SlowHttpClients::sources(size_t n) {
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back("127.0.0." + std::to_string(2 + i % kDistinctSources));
  return out;
}

void SlowHttpClients::run(std::vector<std::string> sources, std::chrono::seconds limit) {
  std::vector<int> fds(sources.size(), -1);
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!stop_ && std::chrono::steady_clock::now() < until) {
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i] < 0) {
        const uint16_t port = port_for(i);
        if (port == 0) continue;
        fds[i] = open_from(sources[i], port);
        if (fds[i] < 0) {
          ++cut_;
          continue;
        }
      }
      // One byte of a request line that never ends.
      if (send(fds[i], "G", 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
        close(fds[i]);
        fds[i] = -1;
        ++cut_;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace tally::bench
