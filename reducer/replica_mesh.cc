#include "tally/reducer/replica_mesh.h"

#include "tally.pb.h"
#include "tally/protocol/control.h"

namespace tally {

std::string replica_identity(uint32_t shard, uint32_t shard_count, uint32_t from_group,
                             uint32_t to_group, uint32_t group_count) {
  return "shard " + std::to_string(shard) + "/" + std::to_string(shard_count) + " group " +
         std::to_string(from_group) + "->" + std::to_string(to_group) + "/" +
         std::to_string(group_count);
}

std::string replica_name(uint32_t shard, uint32_t group) {
  return "replica (shard " + std::to_string(shard) + ", group " + std::to_string(group) + ")";
}

std::shared_ptr<const wire::Control> replica_error_message(const std::string& job,
                                                           const wire::Error& error,
                                                           JobEnded ended) {
  auto message = std::make_shared<wire::Control>();
  auto* replica_error = message->mutable_replica_error();
  replica_error->set_job(job);
  if (ended == JobEnded::kYes) replica_error->set_workers_left(true);
  *replica_error->mutable_error() = error;
  return message;
}

std::shared_ptr<const wire::Control> replica_error_message(const std::string& job,
                                                           const Status& status,
                                                           std::optional<uint64_t> op,
                                                           const std::vector<uint32_t>& ranks,
                                                           JobEnded ended) {
  return replica_error_message(job, make_error(status, op, ranks).error(), ended);
}

Status job_gone_here(uint32_t shard, uint32_t group, const std::string& job, const std::string& why,
                     JobGone how) {
  return Status(ErrorCode::kPeerLost,
                replica_name(shard, group) + " no longer has job '" + job + "'" +
                    (how == JobGone::kMaybeRefused ? " (or refused it)" : "") + ": " + why);
}

}  // namespace tally
