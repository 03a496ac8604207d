#include "bare_stream.h"

#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tally/bench/process.h"
#include "tally/bench/table.h"

namespace tally::bench {
namespace {

constexpr uint64_t kIoBytes = 1u << 20;

// Closes a descriptor when it goes.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Status errno_status(const std::string& what) {
  return Status(ErrorCode::kUnavailable, "bare stream: " + what + ": " + std::strerror(errno));
}

void set_deadlines(int fd) {
  const timeval ten{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &ten, sizeof ten);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &ten, sizeof ten);
}

// Moves `bytes` through `fd` one way, walking a buffer of `span` bytes;
// the CPU seconds this thread spent on the moving.
void pump(int fd, uint64_t span, uint64_t bytes, bool send, double* cpu, bool* ok) {
  std::vector<char> buf(span, 'x');
  const double before = rusage_cpu_seconds(RUSAGE_THREAD);  // the buffer's page faults left out
  uint64_t done = 0;
  while (done < bytes) {
    const uint64_t at = done % span;
    const size_t want = static_cast<size_t>(std::min({kIoBytes, bytes - done, span - at}));
    const ssize_t n = send ? ::send(fd, buf.data() + at, want, MSG_NOSIGNAL)
                           : ::recv(fd, buf.data() + at, want, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<uint64_t>(n);
  }
  *cpu = rusage_cpu_seconds(RUSAGE_THREAD) - before;
  *ok = true;
}

}  // namespace

Result<double> bare_stream_cpu_s_per_gb(uint64_t span, uint64_t bytes) {
  span = std::max(span, kIoBytes);
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  if (listener.fd < 0) return errno_status("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener.fd, 1) != 0 ||
      ::getsockname(listener.fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return errno_status("listen on loopback");
  }
  Fd sender(::socket(AF_INET, SOCK_STREAM, 0));
  if (sender.fd < 0 || ::connect(sender.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return errno_status("connect");
  }
  Fd receiver(::accept(listener.fd, nullptr, nullptr));
  if (receiver.fd < 0) return errno_status("accept");
  set_deadlines(sender.fd);
  set_deadlines(receiver.fd);
  double send_cpu = 0, receive_cpu = 0;
  bool sent = false, received = false;
  // Fresh threads, so that each one's CPU is the stream's alone.
  std::thread out(pump, sender.fd, span, bytes, true, &send_cpu, &sent);
  std::thread in(pump, receiver.fd, span, bytes, false, &receive_cpu, &received);
  out.join();
  in.join();
  if (!sent || !received) {
    return Status(ErrorCode::kTimeout, "bare stream: " + std::to_string(bytes) +
                                           " bytes did not cross loopback within the deadlines");
  }
  return (send_cpu + receive_cpu) / (static_cast<double>(bytes) / 1e9);
}

std::string CpuFloor::spread() const {
  char text[128];
  std::snprintf(text, sizeof text, "a %s tensor, median of %d: %.2f-%.2f",
                human_bytes(span).c_str(), runs, low, high);
  return text;
}

Result<CpuFloor> bare_stream_floor(uint64_t span, int runs) {
  span = std::max(span, kIoBytes);
  std::vector<double> figures;
  for (int i = 0; i < std::max(runs, 1); ++i) {
    auto figure = bare_stream_cpu_s_per_gb(span);
    if (!figure) return figure.status();
    figures.push_back(*figure);
  }
  std::sort(figures.begin(), figures.end());
  const size_t n = figures.size();
  const double median = n % 2 == 1 ? figures[n / 2] : (figures[n / 2 - 1] + figures[n / 2]) / 2;
  return CpuFloor{median, figures.front(), figures.back(), static_cast<int>(n), span};
}

}  // namespace tally::bench
