#include "tally/reducer/replicas.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "tally.pb.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/pool.h"
#include "tally/reducer/replica_link.h"

namespace tally {

Result<std::vector<HostPort>> read_pool_list(const ReducerOptions& o) {
  std::string text = o.pool;
  if (!text.empty() && text.front() == '@') {
    std::ifstream in(text.substr(1));
    if (!in) {
      return Status(ErrorCode::kUnavailable, "pool file " + text.substr(1) + " does not exist yet");
    }
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  // A pattern (tally-{0..7}.svc:7070) stands for its addresses (pool.h).
  auto out = parse_pool(text);
  if (!out) return out.status();
  const size_t want = size_t{o.shard_count} * o.group_count;
  if (out->size() != want) {
    return Status(ErrorCode::kInvalidArgument,
                  "the pool list has " + std::to_string(out->size()) + " addresses, a pool of " +
                      std::to_string(o.shard_count) + " shards x " + std::to_string(o.group_count) +
                      " groups has " + std::to_string(want) + " (in (group, shard) order)");
  }
  return out;
}

namespace {

uint64_t random_incarnation() {
  const std::string nonce = make_nonce();  // OpenSSL's RAND_bytes
  uint64_t out = 0;
  std::memcpy(&out, nonce.data(), std::min(nonce.size(), sizeof(out)));
  return out;
}

}  // namespace

Replicas::Replicas(ReducerOptions options, std::shared_ptr<Fabric> fabric)
    : options_(std::move(options)),
      fabric_(std::move(fabric)),
      incarnation_(random_incarnation()),
      replicas_(options_.group_count) {}

Replicas::~Replicas() = default;

void Replicas::set_callbacks(ReplicaCallbacks callbacks) { callbacks_ = std::move(callbacks); }

void Replicas::start(const std::vector<boost::asio::io_context*>& contexts) {
  links_.resize(options_.group_count);
  for (uint32_t g = 0; g < options_.group_count; ++g) {
    if (g == options_.group) continue;
    links_[g] = std::make_shared<ReplicaLink>(shared_from_this(), options_, g,
                                              *contexts[g % contexts.size()]);
    links_[g]->start();
  }
}

void Replicas::stop() {
  for (auto& link : links_) {
    if (link) link->stop();
  }
}

void Replicas::release() {
  for (auto& link : links_) {
    if (link) link->drop();
  }
  links_.clear();
}

void Replicas::send_partial(uint32_t group, const FrameHeader& header, std::shared_ptr<Slab> slab,
                            size_t byte_offset, std::chrono::steady_clock::time_point deadline,
                            std::function<bool()> current, SendDone done) {
  auto shared_done = std::make_shared<SendDone>(std::move(done));
  links_.at(group)->send(
      [header, slab, byte_offset, current = std::move(current), shared_done](Connection& conn) {
        if (current && !current()) {
          return (*shared_done)(Status(ErrorCode::kCancelled, "the chunk was dropped"));
        }
        conn.send(header, {slab->data() + byte_offset, header.length},
                  [slab, shared_done](const Status& s) { (*shared_done)(s); });
      },
      [shared_done](const Status& s) { (*shared_done)(s); }, deadline);
}

void Replicas::send_control(uint32_t group, std::shared_ptr<const wire::Control> message) {
  // Control messages hold no slab and a ReplicaJob must never be dropped
  // before its partials: they wait for the first connection however long.
  links_.at(group)->send([message](Connection& conn) { conn.send_control(*message); },
                         [](const Status&) {}, std::chrono::steady_clock::time_point::max());
}

std::optional<Status> Replicas::lost(uint32_t group) const {
  std::lock_guard lock(mu_);
  const Replica& r = replicas_.at(group);
  if (r.lost && !(r.out_up && r.in_up)) return r.lost;
  return std::nullopt;
}

std::string Replicas::describe(uint32_t group) const {
  std::string out = replica_name(options_.shard, group);
  std::lock_guard lock(mu_);
  if (!replicas_.at(group).address.empty()) out += " at " + replicas_.at(group).address;
  return out;
}

Result<HostPort> Replicas::address_of(uint32_t group) {
  auto pool = read_pool_list(options_);
  if (!pool) return pool.status();
  const HostPort hp = (*pool)[pool_index(group, options_.shard, options_.shard_count)];
  std::lock_guard lock(mu_);
  replicas_[group].address = hp.to_string();
  return hp;
}

std::vector<std::shared_ptr<const wire::Control>> Replicas::announcements(uint32_t group) const {
  return callbacks_.announcements ? callbacks_.announcements(group)
                                  : std::vector<std::shared_ptr<const wire::Control>>{};
}

void Replicas::stream_up(uint32_t group, StreamDirection direction,
                         std::optional<uint64_t> incarnation) {
  bool back = false;
  {
    std::lock_guard lock(mu_);
    Replica& r = replicas_.at(group);
    if (incarnation) {
      // Restarted while its old streams still look up here: as good as
      // lost and back (once lost, its return says so below).
      if (r.incarnation && *r.incarnation != *incarnation && !r.lost) {
        spdlog::warn("{} was restarted (a new incarnation dialled in)",
                     replica_name(options_.shard, group));
        back = true;
      }
      r.incarnation = incarnation;
    }
    if (direction == StreamDirection::kOutbound) {
      r.out_up = true;
    } else {
      ++r.in_up;
    }
    if (r.out_up && r.in_up && r.lost) {
      r.lost.reset();
      back = true;
    }
    count_links_locked();
  }
  if (back && callbacks_.on_back) callbacks_.on_back(group);
}

void Replicas::count_links_locked() {
  size_t up = 0;
  for (const Replica& r : replicas_) up += r.out_up && r.in_up;
  links_up_.store(up, std::memory_order_relaxed);
}

void Replicas::stream_down(uint32_t group, StreamDirection direction, const Status& why) {
  std::optional<Status> lost_now;
  {
    std::lock_guard lock(mu_);
    Replica& r = replicas_.at(group);
    if (direction == StreamDirection::kOutbound) {
      r.out_up = false;
    } else if (r.in_up > 0) {
      --r.in_up;
    }
    count_links_locked();
    if (!r.lost && !(r.out_up && r.in_up)) {
      std::string who = replica_name(options_.shard, group);
      if (!r.address.empty()) who += " at " + r.address;
      r.lost = Status(ErrorCode::kPeerLost, who + " lost: " + why.message());
      lost_now = r.lost;
    }
  }
  if (lost_now && callbacks_.on_lost) callbacks_.on_lost(group, *lost_now);
}

}  // namespace tally
