#include "tally/client/option_names.h"

#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>

#include "logging.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/link_rate.h"
#include "tally/protocol/log_level.h"
#include "tally/protocol/pool.h"
#include "tally/protocol/split.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {
namespace {

constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();

Status bad(std::string_view name, std::string_view value, std::string_view what) {
  return Status(ErrorCode::kInvalidArgument,
                std::string(name) + "='" + std::string(value) + "' " + std::string(what));
}

Result<uint64_t> parse_number(std::string_view name, std::string_view text, uint64_t max) {
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && v > max)) {
    return Status(ErrorCode::kInvalidArgument, std::string(name) + " is too large");
  }
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    return bad(name, text, "is not a non-negative integer");
  }
  return v;
}

// A byte count, bare or with a size suffix as the reducer's flags take it
// (CLI11's AsSizeValue, 1024-based: 4MiB, 4M, 64k, 1G).
Result<uint64_t> parse_bytes(std::string_view name, std::string_view text) {
  std::string converted(text);
  std::string error;
  try {
    error = CLI::AsSizeValue(false)(converted);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) {
    return bad(name, text, "is not a byte count (a number, or with a suffix: 64k, 4MiB, 1G)");
  }
  return parse_number(name, converted, kU64);
}

// How one option's value is parsed into ClientOptions; `name` is for errors.
using Setter = Status (*)(ClientOptions& o, std::string_view name, std::string_view value);

template <typename T, T ClientOptions::*Field, uint64_t Max>
Status set_number(ClientOptions& o, std::string_view name, std::string_view value) {
  auto v = parse_number(name, value, Max);
  if (!v) return v.status();
  o.*Field = static_cast<T>(*v);
  return Status::ok();
}

template <uint64_t ClientOptions::*Field>
Status set_bytes(ClientOptions& o, std::string_view name, std::string_view value) {
  auto v = parse_bytes(name, value);
  if (!v) return v.status();
  o.*Field = *v;
  return Status::ok();
}

template <std::chrono::milliseconds ClientOptions::*Field>
Status set_ms(ClientOptions& o, std::string_view name, std::string_view value) {
  auto v = parse_number(name, value, kU64);
  if (!v) return v.status();
  o.*Field = std::chrono::milliseconds(*v);
  return Status::ok();
}

template <std::string ClientOptions::*Field>
Status set_text(ClientOptions& o, std::string_view, std::string_view value) {
  o.*Field = std::string(value);
  return Status::ok();
}

Status set_pool(ClientOptions& o, std::string_view, std::string_view value) {
  auto addresses = parse_pool(value);  // a list, or a pattern standing for one
  if (!addresses) return addresses.status();
  o.pool.clear();
  for (const HostPort& address : *addresses) o.pool.push_back(address.to_string());
  return Status::ok();
}

Status set_group(ClientOptions& o, std::string_view name, std::string_view value) {
  auto v = parse_number(name, value, kU32);
  if (!v) return v.status();
  o.group = static_cast<uint32_t>(*v);
  return Status::ok();
}

Status set_group_sizes(ClientOptions& o, std::string_view name, std::string_view value) {
  std::vector<uint32_t> sizes;
  for (std::string_view item : split_list(value)) {
    auto v = parse_number(name, item, kU32);
    if (!v) return v.status();
    sizes.push_back(static_cast<uint32_t>(*v));
  }
  o.group_sizes = std::move(sizes);
  return Status::ok();
}

Status set_wire_dtype(ClientOptions& o, std::string_view name, std::string_view value) {
  if (value != "bfloat16") return bad(name, value, "is not a wire dtype (bfloat16, or unset)");
  o.wire_dtype = DType::kBFloat16;
  return Status::ok();
}

Status set_wire_result(ClientOptions& o, std::string_view name, std::string_view value) {
  if (value == "float32") {
    o.wire_result = DType::kFloat32;
  } else if (value == "bfloat16") {
    o.wire_result = DType::kBFloat16;
  } else {
    return bad(name, value, "is not a result dtype of the wire (float32 or bfloat16)");
  }
  return Status::ok();
}

Status set_fabric_provider(ClientOptions& o, std::string_view, std::string_view value) {
  o.fabric.provider = std::string(value);
  return Status::ok();
}

// `out` = `value`, in the spellings CLI11 accepts for a reducer's boolean
// flag.
Status set_bool(std::string_view name, std::string_view value, bool& out) {
  static const std::vector<std::string> on{"1", "true", "on", "yes", "enable", "t", "y", "+"};
  static const std::vector<std::string> off{"0", "false", "off", "no", "disable", "f", "n", "-"};
  std::string v(value);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  const bool is_on = std::find(on.begin(), on.end(), v) != on.end();
  if (!is_on && std::find(off.begin(), off.end(), v) == off.end()) {
    return bad(name, value, "is not a boolean (1/0, true/false, on/off, yes/no)");
  }
  out = is_on;
  return Status::ok();
}

Status set_force_registration(ClientOptions& o, std::string_view name, std::string_view value) {
  return set_bool(name, value, o.fabric.force_registration);
}

Status set_deterministic(ClientOptions& o, std::string_view name, std::string_view value) {
  return set_bool(name, value, o.deterministic);
}

Status set_fabric_max_msg_bytes(ClientOptions& o, std::string_view name, std::string_view value) {
  auto v = parse_bytes(name, value);
  if (!v) return v.status();
  o.fabric.max_msg_bytes = *v;
  return Status::ok();
}

Status set_link_rate(ClientOptions& o, std::string_view name, std::string_view value) {
  auto rate = parse_link_rate(std::string(value));
  if (!rate) return rate.status().with_context(std::string(name));
  o.link_rate_bits = *rate;
  return Status::ok();
}

Status set_log_level(ClientOptions& o, std::string_view name, std::string_view value) {
  const auto& names = log_level_names();
  if (std::find(names.begin(), names.end(), value) == names.end()) {
    std::string accepted;
    for (const auto& n : names) accepted += (accepted.empty() ? "" : ", ") + n;
    return Status(ErrorCode::kInvalidArgument, std::string(name) + ": '" + std::string(value) +
                                                   "' is not a log level (" + accepted + ")");
  }
  o.log_level = std::string(value);
  // At once, for what the next options say (an older name's warning), and
  // again when a client connects with these options.
  client_internal::log_to_stderr();
  spdlog::set_level(spdlog::level::from_str(o.log_level));
  return Status::ok();
}

// The secret's value never appears in an error.
Status set_secret(ClientOptions& o, std::string_view name, std::string_view value) {
  if (value.size() < kMinSecretBytes || value.size() > kMaxSecretBytes) {
    return Status(ErrorCode::kInvalidArgument,
                  std::string(name) + " is not " + std::to_string(kMinSecretBytes) + " to " +
                      std::to_string(kMaxSecretBytes) + " bytes (use e.g. `openssl rand -hex 32`)");
  }
  o.secret = Secret(std::string(value));
  return Status::ok();
}

Status set_secret_file(ClientOptions& o, std::string_view name, std::string_view value) {
  auto secret = load_secret(std::string(value), nullptr, "job secret");
  if (!secret) return secret.status().with_context(std::string(name));
  o.secret = std::move(*secret);
  return Status::ok();
}

// TALLY_SECRET and TALLY_SECRET_FILE, the workers' older names of the job
// secret: still read, with a warning once per process naming the one
// the reducer reads too.
void warn_older_name(std::string_view name) {
  static std::once_flag once;
  std::call_once(once, [name] {
    spdlog::warn(
        "{} is an older name, still read: name the job secret TALLY_JOB_SECRET_FILE (or "
        "TALLY_JOB_SECRET), as the reducers do",
        name);
  });
}

Status set_older_secret(ClientOptions& o, std::string_view name, std::string_view value) {
  warn_older_name(name);
  return set_secret(o, name, value);
}

Status set_older_secret_file(ClientOptions& o, std::string_view name, std::string_view value) {
  warn_older_name(name);
  return set_secret_file(o, name, value);
}

struct Option {
  std::string_view name;
  Setter set;
};

// Every client option, in the order the environment is applied: of two
// names for one option, the later wins (TALLY_FABRIC_PROVIDER over
// FI_PROVIDER, a file over the secret itself, the job secret's names over
// their older ones).
const std::vector<Option>& options_table() {
  static const std::vector<Option> table{
      {"TALLY_LOG_LEVEL", set_log_level},
      {"TALLY_POOL", set_pool},
      {"TALLY_JOB", set_text<&ClientOptions::job>},
      {"TALLY_RANK", set_number<uint32_t, &ClientOptions::rank, kU32>},
      {"TALLY_WORLD_SIZE", set_number<uint32_t, &ClientOptions::world_size, kU32>},
      {"TALLY_GROUPS", set_number<uint32_t, &ClientOptions::groups, kU32>},
      {"TALLY_GROUP", set_group},
      {"TALLY_GROUP_SIZES", set_group_sizes},
      {"TALLY_CHUNK_BYTES", set_bytes<&ClientOptions::chunk_bytes>},
      {"TALLY_OP_TIMEOUT_MS", set_ms<&ClientOptions::op_timeout>},
      {"TALLY_CONNECT_TIMEOUT_MS", set_ms<&ClientOptions::connect_timeout>},
      {"TALLY_HEARTBEAT_MS", set_ms<&ClientOptions::heartbeat_interval>},
      {"TALLY_PEER_TIMEOUT_MS", set_ms<&ClientOptions::peer_timeout>},
      {"TALLY_TRANSPORT", set_text<&ClientOptions::transport>},
      {"FI_PROVIDER", set_fabric_provider},
      {"TALLY_FABRIC_PROVIDER", set_fabric_provider},
      {"TALLY_FABRIC_FORCE_REGISTRATION", set_force_registration},
      {"TALLY_FABRIC_MAX_MSG_BYTES", set_fabric_max_msg_bytes},
      {"TALLY_TCP_CONGESTION", set_text<&ClientOptions::tcp_congestion>},
      {"TALLY_LINK_RATE", set_link_rate},
      {"TALLY_RECEIVE_BUDGET", set_bytes<&ClientOptions::receive_budget_bytes>},
      {"TALLY_WIRE_DTYPE", set_wire_dtype},
      {"TALLY_WIRE_RESULT", set_wire_result},
      {"TALLY_RESUME_BYTES", set_bytes<&ClientOptions::resume_bytes>},
      {"TALLY_DETERMINISTIC", set_deterministic},
      {"TALLY_SECRET", set_older_secret},
      {"TALLY_SECRET_FILE", set_older_secret_file},
      {"TALLY_JOB_SECRET", set_secret},
      {"TALLY_JOB_SECRET_FILE", set_secret_file},
  };
  return table;
}

}  // namespace

const std::vector<std::string_view>& client_option_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> out;
    for (const Option& option : options_table()) out.push_back(option.name);
    return out;
  }();
  return names;
}

Status set_client_option(ClientOptions& o, std::string_view name, std::string_view value) {
  if (value.empty()) return Status::ok();
  for (const Option& option : options_table()) {
    if (option.name == name) return option.set(o, name, value);
  }
  return Status(ErrorCode::kInvalidArgument, "unknown client option '" + std::string(name) +
                                                 "' (the TALLY_* names of docs/configuration.md)");
}

Status apply_environment(ClientOptions& o, std::set<std::string>& given) {
  client_internal::log_to_stderr();
  // One parser for every name; the later of two names for one option wins
  // (TALLY_FABRIC_PROVIDER over FI_PROVIDER).
  for (std::string_view name : client_option_names()) {
    const char* value = std::getenv(std::string(name).c_str());
    if (!value || !*value) continue;
    TALLY_RETURN_IF_ERROR(set_client_option(o, name, value));
    given.insert(std::string(name));
  }
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  // A launcher's variables, for what TALLY_* leaves unset.
  for (auto [option, launcher] :
       {std::pair{"TALLY_RANK", "RANK"}, std::pair{"TALLY_WORLD_SIZE", "WORLD_SIZE"}}) {
    if (given.count(option) || env(launcher).empty()) continue;
    TALLY_RETURN_IF_ERROR(
        set_client_option(o, option, env(launcher))
            .with_context(std::string(launcher) + " (the launcher's, for " + option + ")"));
    given.insert(option);
  }
  if (!given.count("TALLY_JOB") && !env("TORCHELASTIC_RUN_ID").empty()) {
    const std::string restart = env("TORCHELASTIC_RESTART_COUNT");
    o.job = env("TORCHELASTIC_RUN_ID") + "-" + (restart.empty() ? "0" : restart);
    given.insert("TALLY_JOB");
  }
  return Status::ok();
}

std::vector<std::string> missing_required(const std::set<std::string>& given) {
  std::vector<std::string> missing;
  for (const char* name : {"TALLY_POOL", "TALLY_JOB", "TALLY_RANK", "TALLY_WORLD_SIZE"}) {
    if (!given.count(name)) missing.emplace_back(name);
  }
  return missing;
}

Result<std::string> validated_congestion_control(const ClientOptions& o) {
  auto bad = [](std::string m) { return Status(ErrorCode::kInvalidArgument, std::move(m)); };
  if (o.pool.empty()) return bad("the pool is empty (set TALLY_POOL to host:port,...)");
  for (auto& a : o.pool) {
    auto hp = parse_host_port(a);
    if (!hp) return hp.status();
  }
  if (o.job.empty() || o.job.size() > 256) return bad("job name must have 1 to 256 bytes");
  if (o.world_size == 0) return bad("world size must be at least 1");
  if (o.rank >= o.world_size) {
    return bad("rank " + std::to_string(o.rank) + " is not below world size " +
               std::to_string(o.world_size));
  }
  if (o.groups == 0) return bad("TALLY_GROUPS must be at least 1");
  if (o.pool.size() % o.groups != 0) {
    return bad("TALLY_POOL lists " + std::to_string(o.pool.size()) +
               " reducers, which is not a multiple of " +
               "TALLY_GROUPS=" + std::to_string(o.groups) +
               " (the pool lists the S reducers of each group, in (group, shard) order)");
  }
  if (o.group) {
    if (*o.group >= o.groups) {
      return bad("rank " + std::to_string(o.rank) + " is in group " + std::to_string(*o.group) +
                 " but the pool has " + std::to_string(o.groups) + " groups (0.." +
                 std::to_string(o.groups - 1) + ")");
    }
    uint64_t total = 0;
    for (uint32_t n : o.group_sizes) total += n;
    if (o.group_sizes.size() != o.groups || total != o.world_size || o.group_sizes[*o.group] == 0) {
      return bad("TALLY_GROUP needs TALLY_GROUP_SIZES: " + std::to_string(o.groups) +
                 " worker counts, one per group, that add up to the world size " +
                 std::to_string(o.world_size) + " and give group " + std::to_string(*o.group) +
                 " at least one worker");
    }
  } else if (!o.group_sizes.empty()) {
    return bad("TALLY_GROUP_SIZES is only used with TALLY_GROUP");
  }
  if (o.chunk_bytes != 0 && o.chunk_bytes < 8) {
    return bad("chunk size must be 0 (automatic) or at least 8 bytes");
  }
  if (o.op_timeout.count() <= 0 || o.op_timeout.count() > std::numeric_limits<uint32_t>::max()) {
    return bad("op timeout must be positive (milliseconds)");
  }
  if (o.connect_timeout.count() <= 0) return bad("connect timeout must be positive");
  if (o.heartbeat_interval.count() <= 0 || o.peer_timeout <= o.heartbeat_interval) {
    return bad("peer timeout must exceed the heartbeat interval");
  }
  if (o.wire_result && *o.wire_result != DType::kBFloat16) {
    if (*o.wire_result != DType::kFloat32) {
      return bad("the wire's results are float32 or bfloat16 (TALLY_WIRE_RESULT)");
    }
    if (!o.wire_dtype) {
      return bad(
          "TALLY_WIRE_RESULT=float32 is for the bfloat16 wire: set TALLY_WIRE_DTYPE=bfloat16");
    }
  }
  if (o.transport != "tcp" && o.transport != "fabric") {
    return bad("transport must be 'tcp' or 'fabric', not '" + o.transport + "'");
  }
  if (o.transport == "fabric" && o.fabric.provider.empty()) return bad("fabric provider is empty");
  return stream_congestion_control(o.tcp_congestion, o.link_rate_bits, "TALLY_TCP_CONGESTION",
                                   "TALLY_LINK_RATE");
}

Status validate(const ClientOptions& o) { return validated_congestion_control(o).status(); }

Result<ClientOptions> client_options_from_env() {
  ClientOptions o;
  std::set<std::string> given;
  TALLY_RETURN_IF_ERROR(apply_environment(o, given));
  const std::vector<std::string> missing = missing_required(given);
  if (!missing.empty()) {
    const std::string& name = missing.front();
    const std::string what = name == "TALLY_POOL"   ? " (host:port,... in (group, shard) order)"
                             : name == "TALLY_JOB"  ? " (nor torchrun's TORCHELASTIC_RUN_ID)"
                             : name == "TALLY_RANK" ? " (nor a launcher's RANK)"
                                                    : " (nor a launcher's WORLD_SIZE)";
    return Status(ErrorCode::kInvalidArgument, name + " is not set" + what);
  }
  TALLY_RETURN_IF_ERROR(validate(o));
  return o;
}

}  // namespace tally
