// The timeout sweep of one job (Job::sweep, run by the reducer's sweep
// timer): chunks waited on for longer than half the op timeout are logged
// once per op, and the ops of those waited on for longer than the timeout
// fail, naming the ranks or the replica they wait for and why ranks of an
// earlier job of the name left.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "tally/protocol/groups.h"
#include "tally/reducer/job.h"

namespace tally {

namespace {

// Departure reasons quoted in one error.
constexpr size_t kHistoryQuoted = 4;

}  // namespace

struct Job::Overdue {
  std::vector<uint32_t> ranks;
  std::vector<bool> marked;  // by rank: in `ranks` already
  std::string note;
  std::optional<uint32_t> replica;  // waiting for this group's partial
};

size_t Job::sweep(Clock::time_point now) {
  if (give_up_stalled(now)) end_released_ops();
  std::lock_guard lock(mu_);
  // Linear in world size per chunk: ranks are marked, never searched.
  std::vector<bool> straggler(settings_.world_size, false);  // waited on past half the op timeout
  size_t straggling_ranks = 0;
  std::map<uint64_t, Overdue> overdue;  // op -> what it waits for, for timed-out ops
  for (auto& [key, chunk] : chunks_) {
    const auto age = now - chunk->created();
    const bool timed_out = age > settings_.op_timeout;
    const bool straggling = age > settings_.op_timeout / 2;
    if (!straggling) continue;
    std::vector<uint32_t> ranks;
    std::string note;
    const Chunk::Waiting waiting = chunk->waiting(butterfly_);
    const std::optional<uint32_t> replica = waiting.replica;
    if (!waiting.local_done) ranks = missing_locked(waiting.seen, &note);
    for (uint32_t r : ranks) {
      if (r < straggler.size() && !straggler[r]) {
        straggler[r] = true;
        ++straggling_ranks;
      }
    }
    if (!timed_out && !op_timings_.first_straggle(key.first)) continue;  // logged once
    if (timed_out) {
      Overdue& o = overdue[key.first];
      if (o.marked.empty()) o.marked.resize(settings_.world_size, false);
      for (uint32_t r : ranks) {
        if (r < o.marked.size() && !o.marked[r]) {
          o.marked[r] = true;
          o.ranks.push_back(r);
        }
      }
      if (!note.empty()) o.note = note;
      if (replica && !o.replica) o.replica = replica;
    } else {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(age).count();
      if (replica) {
        spdlog::warn("job '{}' shard {} op {} chunk {}: still waiting for {} after {} ms", name(),
                     settings_.shard, key.first, key.second, mesh_->describe(*replica), ms);
      } else {
        spdlog::warn("job '{}' shard {} op {} chunk {}: still waiting for ranks [{}]{} after {} ms",
                     name(), settings_.shard, key.first, key.second, ranks_string(ranks), note, ms);
      }
    }
  }
  // Partials whose chunk never got a local contribution: every rank of
  // this group is missing.
  for (uint64_t op : early_.overdue(now, settings_.op_timeout)) {
    if (overdue.count(op)) continue;
    Overdue& o = overdue[op];
    o.ranks = missing_locked(std::vector<bool>(settings_.world_size, false), &o.note);
  }
  for (auto& [op, o] : overdue) fail_overdue_locked(op, o);
  return straggling_ranks;
}

void Job::fail_overdue_locked(uint64_t op, Overdue& o) {
  std::sort(o.ranks.begin(), o.ranks.end());
  std::string what = "ranks [" + ranks_string(o.ranks) + "]" + o.note;
  if (o.ranks.empty() && o.replica) {
    // The partner waited for may itself wait for a lost replica: that
    // one is named.
    what = mesh_->describe(*o.replica);
    for (uint32_t g : participants_) {
      if (g == settings_.group) continue;
      if (auto lost = mesh_->lost(g)) {
        what = lost->message();
        break;
      }
    }
  }
  fail_op_locked(
      op,
      Status(ErrorCode::kTimeout,
             "op " + std::to_string(op) + " of job '" + name() + "' timed out after " +
                 std::to_string(settings_.op_timeout.count()) + " ms on shard " +
                 std::to_string(settings_.shard) +
                 (participants_.size() > 1 ? " group " + std::to_string(settings_.group) : "") +
                 " waiting for " + what + history_of(o.ranks)),
      o.ranks);
}

std::vector<uint32_t> Job::missing_locked(const std::vector<bool>& seen, std::string* note) const {
  std::vector<uint32_t> ranks;
  if (!settings_.groups_explicit) {
    const uint32_t groups =
        settings_.group_sizes.empty() ? 1 : static_cast<uint32_t>(settings_.group_sizes.size());
    for (uint32_t r = 0; r < seen.size(); ++r) {
      if (!seen[r] &&
          (groups == 1 || default_group_of(r, settings_.world_size, groups) == settings_.group)) {
        ranks.push_back(r);
      }
    }
    return ranks;
  }
  // Explicit groups: only the ranks that joined are known to be ours.
  for (uint32_t r : marks_.ranks()) {
    if (!seen[r]) ranks.push_back(r);
  }
  if (marks_.ranks().size() < local_size_ && note) {
    *note = " and " + std::to_string(local_size_ - marks_.ranks().size()) + " worker(s) of group " +
            std::to_string(settings_.group) + " that never joined";
  }
  return ranks;
}

std::string Job::history_of(const std::vector<uint32_t>& ranks) const {
  std::string out;
  size_t quoted = 0, more = 0;
  for (uint32_t r : ranks) {
    auto it = settings_.history.find(r);
    if (it == settings_.history.end()) continue;
    if (quoted == kHistoryQuoted) {
      ++more;
      continue;
    }
    ++quoted;
    out += " (rank " + std::to_string(r) + " left earlier: " + it->second + ")";
  }
  if (more > 0) out += " (and " + std::to_string(more) + " more ranks that left earlier)";
  return out;
}

}  // namespace tally
