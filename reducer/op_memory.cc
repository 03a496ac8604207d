#include "tally/reducer/op_memory.h"

namespace tally {

bool FailedOps::add(uint64_t op, std::shared_ptr<const wire::Control> error) {
  if (!errors_.emplace(op, std::move(error)).second) return false;
  order_.push_back(op);
  if (order_.size() > capacity_) {
    errors_.erase(order_.front());
    order_.pop_front();
  }
  return true;
}

std::shared_ptr<const wire::Control> FailedOps::find(uint64_t op) const {
  auto it = errors_.find(op);
  return it == errors_.end() ? nullptr : it->second;
}

void OpTimings::began(uint64_t op, Clock::time_point now, uint64_t chunks_on_shard, uint32_t rank) {
  auto [it, added] = ops_.try_emplace(op);
  if (!added) return;
  it->second.began = now;
  it->second.expected = chunks_on_shard;
  it->second.first_rank = rank;
  if (ops_.size() > capacity_) ops_.erase(ops_.begin());
}

const OpTimings::Op* OpTimings::find(uint64_t op) const {
  auto it = ops_.find(op);
  return it == ops_.end() ? nullptr : &it->second;
}

bool OpTimings::first_straggle(uint64_t op) {
  auto it = ops_.find(op);
  if (it == ops_.end() || it->second.straggle_logged) return false;
  it->second.straggle_logged = true;
  return true;
}

std::optional<OpTimings::Clock::time_point> OpTimings::chunk_finished(uint64_t op) {
  auto it = ops_.find(op);
  if (it == ops_.end()) return std::nullopt;
  it->second.straggle_logged = false;
  if (++it->second.finished < it->second.expected) return std::nullopt;
  const Clock::time_point began = it->second.began;
  ops_.erase(it);
  return began;
}

}  // namespace tally
