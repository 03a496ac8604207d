#include "tally/reducer/job_replica_state.h"

namespace tally {

std::optional<uint64_t> JobRound::of_wire(uint8_t wire) const {
  const int8_t ahead = static_cast<int8_t>(wire - static_cast<uint8_t>(number_));
  if (ahead < 0) return std::nullopt;
  return number_ + static_cast<uint64_t>(ahead);
}

void JobRound::start(uint64_t number, std::set<uint32_t> asked, Clock::time_point until) {
  number_ = number;
  rejoining_.insert(asked.begin(), asked.end());
  rejoin_until_ = until;
  finished_finals_.clear();
}

bool JobRound::awaiting_rejoin(Clock::time_point now) const {
  return !rejoining_.empty() && now < rejoin_until_;
}

void JobRound::forget_finals_below(uint64_t op) {
  finished_finals_.erase(finished_finals_.begin(), finished_finals_.lower_bound({op, 0}));
}

void EarlyPartials::add(uint32_t from_group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                        Clock::time_point now) {
  partials_[{header.op, header.chunk}].push_back({from_group, header, std::move(slab), now});
}

std::vector<EarlyPartials::Partial> EarlyPartials::take(const ChunkKey& key) {
  auto it = partials_.find(key);
  if (it == partials_.end()) return {};
  std::vector<Partial> out = std::move(it->second);
  partials_.erase(it);
  return out;
}

void EarlyPartials::drop_op(uint64_t op) {
  partials_.erase(partials_.lower_bound({op, 0}), partials_.lower_bound({op + 1, 0}));
}

void EarlyPartials::drop_below(uint64_t op) {
  partials_.erase(partials_.begin(), partials_.lower_bound({op, 0}));
}

std::set<uint64_t> EarlyPartials::ops() const {
  std::set<uint64_t> out;
  for (const auto& [key, partials] : partials_) out.insert(key.first);
  return out;
}

std::set<uint64_t> EarlyPartials::overdue(Clock::time_point now, Clock::duration timeout) const {
  std::set<uint64_t> out;
  for (const auto& [key, partials] : partials_) {
    if (!partials.empty() && now - partials.front().arrived > timeout) out.insert(key.first);
  }
  return out;
}

void LeftGroups::add(uint32_t group, const Status& why) {
  std::lock_guard lock(mu_);
  left_.emplace(group, why);
}

std::optional<Status> LeftGroups::find(uint32_t group) const {
  std::lock_guard lock(mu_);
  auto it = left_.find(group);
  if (it == left_.end()) return std::nullopt;
  return it->second;
}

}  // namespace tally
