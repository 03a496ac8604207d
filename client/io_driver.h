// Who runs a Client's io_context: its I/O thread, or a caller blocked in a
// synchronous all-reduce. Private to libtally.
//
// Everything a Client does on its streams runs on one io_context, by one
// thread at a time. Most of the time that is the I/O thread. A blocking call
// (Client::allreduce) may borrow the context instead and run it on its own
// thread until its op has ended: its frames are sent from the caller's
// thread and its results end the op there, so the op costs no wake-up of the
// I/O thread to start it and none of the caller to end it. On a loaded host
// those wake-ups are most of a small op's time.
//
// The context stays with the last borrower between blocking calls (a loop
// of them borrows without waking anyone). The I/O thread takes it back when
// an asynchronous op is submitted (kick), when a borrower leaves ops in
// flight, or once no call has run it for kReclaimAfter; borrowing from a
// running I/O thread stops it and waits for it to leave the context.
//
// Thread-safety: every method may be called from any thread; the state is
// under mu_. Whoever holds the context (the I/O thread inside run(), or a
// borrower between borrow and give_back) is the only thread that touches
// the client's I/O-thread-only state, and each hand-over passes through mu_.
#pragma once

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

namespace tally {
namespace client_internal {

class IoDriver {
 public:
  // How long a context lent to callers stays lent with no call running it,
  // and how often the I/O thread looks: between calls, incoming control
  // frames and timers wait at most twice this. Each look wakes the thread,
  // so not much shorter: at 2 ms, a 16 MiB op's looks cost it 10% of its
  // time on a 2-core host.
  static constexpr std::chrono::milliseconds kReclaimAfter{20};

  explicit IoDriver(boost::asio::io_context& io) : io_(io) {}
  ~IoDriver() { join(); }
  IoDriver(const IoDriver&) = delete;
  IoDriver& operator=(const IoDriver&) = delete;

  // Starts the I/O thread, which runs the context until join().
  void start();
  // Runs the handlers posted before it (the streams' goodbyes), then stops
  // the context and joins the I/O thread. Idempotent.
  void join();

  // Takes the context for the calling thread without waiting for any op:
  // false when another caller holds it or the client is closing (then the
  // caller waits for the I/O thread as usual).
  bool borrow();
  // Runs the borrowed context until `done()`, `deadline`, or the context is
  // stopped under the borrower (the caller then waits as usual).
  template <typename Done>
  void run_until(Done done, std::chrono::steady_clock::time_point deadline) {
    while (!done()) {
      if (io_.run_one_until(deadline) == 0 &&
          (io_.stopped() || std::chrono::steady_clock::now() >= deadline)) {
        return;
      }
    }
  }
  // Hands a borrowed context back: kept lent for the next blocking call when
  // `idle` (nothing in flight), else at once to the I/O thread.
  void give_back(bool idle);
  // Someone needs the I/O thread to run the context (an asynchronous op was
  // posted, the client is closing): a lent context goes back to it now, or
  // when its borrower gives it back.
  void kick();

 private:
  void thread_main();

  boost::asio::io_context& io_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> guard_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool lent_ = false;     // a caller holds the context, or it waits for the next one
  bool inside_ = false;   // a caller is between borrow and give_back
  bool running_ = false;  // the I/O thread is inside io_.run()
  bool wanted_ = false;   // kick() while a caller was inside
  bool quit_ = false;
  // Set by join()'s last handler, on whichever thread runs it.
  std::atomic<bool> drained_{false};
  std::chrono::steady_clock::time_point given_back_{};
};

}  // namespace client_internal
}  // namespace tally
