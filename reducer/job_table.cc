#include "tally/reducer/job_table.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "tally.pb.h"
#include "tally/protocol/control.h"

namespace tally {

// Ended jobs whose ranks left with an error are remembered this long, and
// at most this many, to explain a late worker's timeout.
constexpr std::chrono::minutes kTombstoneLife{10};
constexpr size_t kTombstonesKept = 256;

JobTable::JobTable(const ReducerOptions& options, std::shared_ptr<SlabPool> pool,
                   ReducerCounters& counters, std::shared_ptr<ReplicaMesh> replicas)
    : options_(options),
      pool_(std::move(pool)),
      counters_(counters),
      replicas_(std::move(replicas)) {}

Result<std::shared_ptr<Job>> JobTable::admit(const wire::Hello& hello, bool authenticated,
                                             const std::shared_ptr<JobMember>& member) {
  if (hello.job().empty() || hello.job().size() > kMaxJobNameBytes) {
    return Status(ErrorCode::kInvalidArgument, "job name must have 1 to 256 bytes");
  }
  if (hello.world_size() > options_.max_world_size) {
    return Status(ErrorCode::kInvalidArgument, "world size " + std::to_string(hello.world_size()) +
                                                   " exceeds this reducer's maximum of " +
                                                   std::to_string(options_.max_world_size));
  }
  if (hello.world_size() == 0 || hello.rank() >= hello.world_size()) {
    return Status(ErrorCode::kInvalidArgument, "rank " + std::to_string(hello.rank()) +
                                                   " is not below world size " +
                                                   std::to_string(hello.world_size()));
  }
  std::chrono::milliseconds timeout(hello.op_timeout_ms());
  if (timeout.count() == 0 || timeout > options_.max_op_timeout) {
    return Status(
        ErrorCode::kInvalidArgument,
        "op timeout must be 1.." + std::to_string(options_.max_op_timeout.count()) + " ms");
  }
  const std::string who = "rank " + std::to_string(hello.rank());
  std::vector<uint32_t> sizes(hello.group_sizes().begin(), hello.group_sizes().end());
  if (sizes.empty() && options_.group_count > 1) {
    return Status(ErrorCode::kInvalidArgument,
                  who + " does not say its replica group, but this pool has " +
                      std::to_string(options_.group_count) +
                      " groups (set TALLY_GROUPS on every worker)");
  }
  if (!sizes.empty()) {
    uint64_t total = 0;
    for (uint32_t n : sizes) total += n;
    if (sizes.size() != options_.group_count || hello.group() != options_.group) {
      return Status(ErrorCode::kInvalidArgument,
                    who + " says it is in group " + std::to_string(hello.group()) + " of " +
                        std::to_string(sizes.size()) + ", but this reducer serves group " +
                        std::to_string(options_.group) + " of " +
                        std::to_string(options_.group_count) +
                        " (check TALLY_GROUPS, and that TALLY_POOL lists the reducers in (group, "
                        "shard) order)");
    }
    if (total != hello.world_size() || sizes[hello.group()] == 0) {
      return Status(ErrorCode::kInvalidArgument,
                    who + " gives group sizes that do not add up to its world size " +
                        std::to_string(hello.world_size()) + " or leave its own group empty");
    }
  }
  if (hello.deterministic() && hello.groups_explicit()) {
    // The replicas add the groups' parts of the sum tree by the ranks they
    // hold, which only the default groups tell every replica.
    size_t groups = 0;
    for (uint32_t n : sizes) groups += n > 0;
    if (groups > 1) {
      return Status(ErrorCode::kInvalidArgument,
                    who +
                        " asks for reproducible sums (TALLY_DETERMINISTIC) with groups set by "
                        "TALLY_GROUP; with more than one group they need the default groups "
                        "(contiguous blocks of ranks): unset TALLY_GROUP and TALLY_GROUP_SIZES");
    }
  }
  std::lock_guard lock(mu_);
  if (stopping_) return Status(ErrorCode::kUnavailable, "reducer is shutting down");
  std::shared_ptr<Job> job;
  auto it = jobs_.find(hello.job());
  if (it != jobs_.end() && authenticated && !it->second->settings().authenticated) {
    // A mixed pool (a job secret, --require-auth off): an authenticated
    // worker outranks the unauthenticated job that holds its name, so a
    // stranger who says a job's name first cannot keep the job out. That
    // job ends; this worker's starts afresh.
    const Status taken(
        ErrorCode::kUnauthenticated,
        "job '" + hello.job() + "' did not authenticate, and " + who + " of a job of that name " +
            "did: this reducer gives the name to the authenticated job (give every rank "
            "TALLY_JOB_SECRET_FILE or TALLY_JOB_SECRET)");
    spdlog::warn("{}; the unauthenticated job ends", taken.message());
    const std::shared_ptr<Job> squatter = it->second;
    erase_locked(squatter);
    squatter->evict(taken);
    it = jobs_.end();
  }
  if (it != jobs_.end()) {
    job = it->second;
    if (job->settings().authenticated != authenticated) {
      // Only without --require-auth can an unauthenticated stream get here.
      return Status(ErrorCode::kUnauthenticated,
                    who + " of job '" + hello.job() +
                        "' did not authenticate, but the job's other ranks did (give every rank "
                        "the same TALLY_JOB_SECRET_FILE or TALLY_JOB_SECRET)");
    }
    if (job->settings().world_size != hello.world_size()) {
      return Status(ErrorCode::kMismatch,
                    "rank " + std::to_string(hello.rank()) + " says job '" + hello.job() +
                        "' has world size " + std::to_string(hello.world_size()) +
                        ", other ranks said " + std::to_string(job->settings().world_size));
    }
    if (job->settings().group_sizes != sizes) {
      return Status(ErrorCode::kMismatch,
                    who + " gives job '" + hello.job() +
                        "' other group sizes than the ranks (or replicas) before it");
    }
    if (job->settings().deterministic != hello.deterministic()) {
      const auto asks = [](bool on) { return on ? "asks" : "does not ask"; };
      return Status(ErrorCode::kMismatch, who + " of job '" + hello.job() + "' " +
                                              asks(hello.deterministic()) +
                                              " for reproducible sums, and the ranks before it " +
                                              asks(job->settings().deterministic) +
                                              " (set TALLY_DETERMINISTIC the same on every rank)");
    }
  } else {
    JobSettings settings;
    settings.name = hello.job();
    settings.world_size = hello.world_size();
    settings.op_timeout = timeout;
    settings.group_sizes = sizes;
    settings.groups_explicit = hello.groups_explicit();
    settings.authenticated = authenticated;
    settings.deterministic = hello.deterministic();
    auto created = create_locked(std::move(settings));
    if (!created) return created.status();
    job = *created;
  }
  // Joined under mu_, so leave() cannot erase the job between finding and
  // joining it (which would leave this rank in an orphaned job).
  TALLY_RETURN_IF_ERROR(job->join(member, hello.resume() ? Arrival::kResuming : Arrival::kFresh));
  return job;
}

Result<std::shared_ptr<Job>> JobTable::create_locked(JobSettings settings) {
  settings.shard = options_.shard;
  settings.group = options_.group;
  settings.max_chunk_bytes = options_.max_chunk_bytes;
  size_t participants = 0;
  for (uint32_t n : settings.group_sizes) participants += n > 0;
  participants = std::max<size_t>(participants, 1);
  // A deterministic chunk holds a slab per rank of the group, and the
  // other groups' parts of the sum tree, until its tree is summed: its
  // window is what the free slabs allow, up to the reducer's.
  size_t slabs = Job::quota_slabs(options_.window_chunks, participants);
  std::string held;
  if (settings.deterministic) {
    const uint32_t local =
        settings.group_sizes.empty() ? settings.world_size : settings.group_sizes[settings.group];
    size_t received = 0;
    if (participants > 1) {
      const auto covers = sum_tree_covers(settings.group_sizes);
      for (uint32_t g = 0; g < covers.size(); ++g) {
        if (g != settings.group) received += covers[g].size();
      }
    }
    const uint32_t window =
        Job::deterministic_window(options_.window_chunks, local, received, pool_->available());
    settings.window_chunks = window;
    slabs = Job::deterministic_quota_slabs(window, local, received);
    held =
        " (reproducible sums hold a chunk buffer per rank and per part of the sum tree from "
        "another group: window " +
        std::to_string(window) + " x (" + std::to_string(local) + " + 2 x " +
        std::to_string(received) + ") + 2)";
    if (window < options_.window_chunks) {
      spdlog::info(
          "job '{}': reproducible sums get a window of {} chunks, not {} (the free chunk buffers "
          "hold {} = {} x ({} + 2 x {}) + 2; --memory-budget sets them)",
          settings.name, window, options_.window_chunks, slabs, window, local, received);
    }
  }
  auto quota = SlabQuota::reserve(pool_, slabs);
  if (!quota) return quota.status().with_context("job '" + settings.name + "'" + held);
  if (auto t = tombstones_.find(settings.name); t != tombstones_.end()) {
    if (std::chrono::steady_clock::now() - t->second.ended < kTombstoneLife) {
      settings.history = t->second.departures;
    }
    tombstones_.erase(t);
  }
  auto job = std::make_shared<Job>(std::move(settings), std::move(*quota), counters_,
                                   participants > 1 ? replicas_ : nullptr);
  jobs_.emplace(job->name(), job);
  if (participants > 1) {
    // Before any partial of it: each replica creates the job on hearing of it.
    auto announce = job->replica_job_message();
    for (uint32_t g : job->participants()) {
      if (g != options_.group) replicas_->send_control(g, announce);
    }
  }
  return job;
}

Result<std::shared_ptr<Job>> JobTable::admit_replica_job(const wire::ReplicaJob& rj,
                                                         uint32_t from_group) {
  std::vector<uint32_t> sizes(rj.group_sizes().begin(), rj.group_sizes().end());
  uint64_t total = 0;
  for (uint32_t n : sizes) total += n;
  const std::string who = replicas_->describe(from_group);
  if (rj.job().empty() || rj.job().size() > kMaxJobNameBytes || rj.world_size() == 0 ||
      rj.world_size() > options_.max_world_size || sizes.size() != options_.group_count ||
      total != rj.world_size() || sizes[from_group] == 0 || sizes[options_.group] == 0 ||
      rj.op_timeout_ms() == 0 ||
      std::chrono::milliseconds(rj.op_timeout_ms()) > options_.max_op_timeout) {
    return Status(ErrorCode::kInvalidArgument, who + " announced job '" +
                                                   utf8_prefix(rj.job(), kMaxJobNameBytes) +
                                                   "' with a shape this reducer cannot serve");
  }
  std::lock_guard lock(mu_);
  if (stopping_) return Status(ErrorCode::kUnavailable, "reducer is shutting down");
  auto it = jobs_.find(rj.job());
  if (it != jobs_.end()) {
    TALLY_RETURN_IF_ERROR(it->second->check_replica_settings(rj, who));
    return it->second;
  }
  JobSettings settings;
  settings.name = rj.job();
  settings.world_size = rj.world_size();
  settings.op_timeout = std::chrono::milliseconds(rj.op_timeout_ms());
  settings.group_sizes = sizes;
  settings.groups_explicit = rj.groups_explicit();
  settings.deterministic = rj.deterministic();
  settings.authenticated = rj.authenticated();
  settings.round = rj.round();
  return create_locked(std::move(settings));
}

std::shared_ptr<Job> JobTable::find(const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = jobs_.find(name);
  return it == jobs_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const wire::Control>> JobTable::announcements(uint32_t group) const {
  std::vector<std::shared_ptr<const wire::Control>> out;
  std::lock_guard lock(mu_);
  for (auto& [name, job] : jobs_) {
    const auto& p = job->participants();
    if (p.size() > 1 && std::find(p.begin(), p.end(), group) != p.end()) {
      out.push_back(job->replica_job_message());
    }
  }
  return out;
}

std::optional<std::vector<std::shared_ptr<Job>>> JobTable::snapshot() const {
  std::lock_guard lock(mu_);
  if (stopping_) return std::nullopt;
  std::vector<std::shared_ptr<Job>> out;
  for (auto& [name, job] : jobs_) out.push_back(job);
  return out;
}

void JobTable::on_replica_lost(uint32_t group, const Status& why) {
  auto jobs = snapshot();
  if (!jobs) return;  // stopping: every stream is closing anyway
  // Nothing is failed: what is sent to it meanwhile is dropped, and the
  // chunks that need it wait until it is back (on_replica_back) or their
  // op times out naming it (Job::sweep). The workers hear of it, for the
  // ops that time out meanwhile on other shards.
  spdlog::warn("{}; the chunks that need it wait for it", why.to_string());
  for (auto& job : *jobs) job->on_replica_lost(group, why);
}

void JobTable::on_replica_back(uint32_t group) {
  auto jobs = snapshot();
  if (!jobs) return;
  spdlog::info("{} is back", replicas_->describe(group));
  for (auto& job : *jobs) job->on_replica_back(group);
}

void JobTable::erase_locked(const std::shared_ptr<Job>& job) {
  auto it = jobs_.find(job->name());
  if (it == jobs_.end() || it->second != job) return;
  jobs_.erase(it);
  remember_departures_locked(*job);
  const std::string why = ended_job_note_locked(job->name());
  job->retire(why);
  if (job->participants().size() > 1) {
    // After every partial this replica sent for it (same streams, in order).
    auto left = replica_error_message(
        job->name(), job_gone_here(options_.shard, options_.group, job->name(), why), std::nullopt,
        {}, JobEnded::kYes);
    for (uint32_t g : job->participants()) {
      if (g != options_.group) replicas_->send_control(g, left);
    }
  }
}

std::string JobTable::ended_job_note(const std::string& name) const {
  std::lock_guard lock(mu_);
  return ended_job_note_locked(name);
}

std::string JobTable::ended_job_note_locked(const std::string& name) const {
  std::string note = "its workers have left";
  auto t = tombstones_.find(name);
  if (t == tombstones_.end()) return note;
  for (auto& [rank, reason] : t->second.departures) {
    note += " (rank " + std::to_string(rank) + ": " + reason + ")";
  }
  return note;
}

void JobTable::leave(const std::shared_ptr<Job>& job, const JobMember* member, const Status& why,
                     Departure how) {
  job->leave(member, why, how);
  std::lock_guard lock(mu_);
  // Checked again under mu_: a rank may have joined since leave() returned.
  if (!job->empty()) return;
  auto it = jobs_.find(job->name());
  if (it != jobs_.end() && it->second == job) {
    erase_locked(job);
    spdlog::info("job '{}' has no workers left on shard {}", job->name(), options_.shard);
  }
}

void JobTable::remember_departures_locked(const Job& job) {
  auto departures = job.departures();
  std::erase_if(departures, [](auto& d) { return d.second == kCleanGoodbyeReason; });
  if (departures.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  std::erase_if(tombstones_, [&](auto& t) { return now - t.second.ended >= kTombstoneLife; });
  if (tombstones_.size() >= kTombstonesKept) {
    tombstones_.erase(
        std::min_element(tombstones_.begin(), tombstones_.end(),
                         [](auto& a, auto& b) { return a.second.ended < b.second.ended; }));
  }
  tombstones_[job.name()] = {now, std::move(departures)};
}

void JobTable::sweep(Job::Clock::time_point now) {
  auto jobs = snapshot();
  if (!jobs) return;
  uint64_t straggling = 0;
  for (auto& job : *jobs) straggling += job->sweep(now);
  counters_.set(Level::kStragglerRanks, static_cast<int64_t>(straggling));
  // A job a replica announced whose workers never came here.
  for (auto& job : *jobs) {
    if (!job->abandoned(now)) continue;
    std::lock_guard lock(mu_);
    if (job->abandoned(now)) {
      spdlog::info("job '{}' never got workers on shard {} group {}", job->name(), options_.shard,
                   options_.group);
      erase_locked(job);
    }
  }
}

void JobTable::stop() {
  std::lock_guard lock(mu_);
  stopping_ = true;
}

bool JobTable::stopping() const {
  std::lock_guard lock(mu_);
  return stopping_;
}

size_t JobTable::size() const {
  std::lock_guard lock(mu_);
  return jobs_.size();
}

void JobTable::clear() {
  std::lock_guard lock(mu_);
  jobs_.clear();
}

}  // namespace tally
