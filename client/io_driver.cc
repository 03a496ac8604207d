#include "io_driver.h"

#include <boost/asio/post.hpp>

namespace tally {
namespace client_internal {

void IoDriver::start() {
  guard_.emplace(boost::asio::make_work_guard(io_));
  thread_ = std::thread([this] { thread_main(); });
}

void IoDriver::join() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    quit_ = true;
    lent_ = false;
  }
  cv_.notify_all();
  // Posted, not called: the handlers posted before it run first.
  boost::asio::post(io_, [this] {
    drained_ = true;
    io_.stop();
  });
  guard_.reset();
  thread_.join();
}

void IoDriver::thread_main() {
  std::unique_lock lock(mu_);
  for (;;) {
    if (lent_) {
      if (!inside_ && std::chrono::steady_clock::now() - given_back_ >= kReclaimAfter) {
        lent_ = false;  // no call has run it for a while: take it back
        continue;
      }
      cv_.wait_for(lock, kReclaimAfter);
      continue;
    }
    // restart() under the lock: a borrow's stop() after it ends the run below.
    io_.restart();
    running_ = true;
    lock.unlock();
    io_.run();
    lock.lock();
    running_ = false;
    cv_.notify_all();
    if (drained_) return;
  }
}

bool IoDriver::borrow() {
  std::unique_lock lock(mu_);
  if (quit_ || inside_ || !thread_.joinable()) return false;
  inside_ = true;
  lent_ = true;
  if (running_) {
    io_.stop();
    cv_.wait(lock, [&] { return !running_; });
  }
  io_.restart();
  return true;
}

void IoDriver::give_back(bool idle) {
  {
    std::lock_guard lock(mu_);
    inside_ = false;
    given_back_ = std::chrono::steady_clock::now();
    if (idle && !wanted_ && !quit_) return;
    wanted_ = false;
    lent_ = false;
  }
  cv_.notify_all();
}

void IoDriver::kick() {
  {
    std::lock_guard lock(mu_);
    if (!lent_) return;
    if (inside_) {
      wanted_ = true;
      return;
    }
    lent_ = false;
  }
  cv_.notify_all();
}

}  // namespace client_internal
}  // namespace tally
