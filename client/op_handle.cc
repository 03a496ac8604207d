#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "op_state.h"

namespace tally {

void OpHandle::State::end_one(const Status& s) {
  {
    std::lock_guard lock(mu);
    if (!s.is_ok() && status.is_ok()) status = s;
    TALLY_CHECK(pending > 0);
    if (--pending > 0) return;
  }
  // Every other op has ended, so nothing else reads `staged` or writes `status`.
  if (status.is_ok()) {
    for (const Staged& group : staged) {
      size_t offset = 0;
      for (auto [dst, nbytes] : group.parts) {
        std::memcpy(dst, group.bytes.data() + offset, nbytes);
        offset += nbytes;
      }
    }
  }
  staged.clear();
  // The callback runs before the waiters wake, so a caller that waited may
  // free what the callback uses.
  if (callback) {
    OpCallback run = std::move(callback);
    callback = nullptr;
    run(status);
  }
  {
    std::lock_guard lock(mu);
    done = true;
  }
  cv.notify_all();
}

OpHandle OpHandle::State::ended(Status s, OpCallback callback) {
  auto state = std::make_shared<State>();
  state->pending = 1;
  state->callback = std::move(callback);
  state->end_one(s);
  return OpHandle(std::move(state));
}

std::optional<uint64_t> OpHandle::op() const {
  if (!state_) return std::nullopt;
  return state_->first_op;
}

Status OpHandle::wait() const {
  if (!state_) return Status(ErrorCode::kInvalidArgument, "wait on an empty OpHandle");
  std::unique_lock lock(state_->mu);
  if (state_->cv.wait_for(lock, state_->wait_limit, [&] { return state_->done; })) {
    return state_->status;
  }
  // The I/O thread ends every op by its backstop plus the drain grace;
  // waiting much longer means a bug in tally, not a slow peer.
  std::fprintf(stderr, "tally: op %llu did not finish within %lld ms\n",
               static_cast<unsigned long long>(state_->first_op.value_or(0)),
               static_cast<long long>(state_->wait_limit.count()));
  std::abort();
}

std::optional<Status> OpHandle::wait_until(std::chrono::steady_clock::time_point deadline) const {
  if (!state_) return Status(ErrorCode::kInvalidArgument, "wait on an empty OpHandle");
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done; })) return std::nullopt;
  return state_->status;
}

std::optional<Status> OpHandle::test() const {
  if (!state_) return Status(ErrorCode::kInvalidArgument, "test on an empty OpHandle");
  std::lock_guard lock(state_->mu);
  if (!state_->done) return std::nullopt;
  return state_->status;
}

}  // namespace tally
