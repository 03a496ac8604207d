// set_client_option (the name/value path of the C API and the Python module)
// must read every variable exactly as client_options_from_env() does.
#include "tally/client/option_names.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <string>
#include <vector>

#include "tally/client/client.h"

namespace tally {
namespace {

using Env = std::map<std::string, std::string>;

// A launcher's variables, read where the TALLY_* ones are unset.
const std::vector<std::string> kLauncherNames{"RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                              "TORCHELASTIC_RESTART_COUNT"};

// Sets `env` for the test's duration, clearing every other option variable
// (and a launcher's).
class ScopedEnv {
 public:
  explicit ScopedEnv(const Env& env) {
    clear();
    for (auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() { clear(); }

 private:
  static void clear() {
    for (auto name : client_option_names()) unsetenv(std::string(name).c_str());
    for (auto& name : kLauncherNames) unsetenv(name.c_str());
  }
};

Result<ClientOptions> from_names(const Env& env) {
  ClientOptions o;
  for (auto name : client_option_names()) {
    auto it = env.find(std::string(name));
    if (it == env.end()) continue;
    TALLY_RETURN_IF_ERROR(set_client_option(o, name, it->second));
  }
  TALLY_RETURN_IF_ERROR(validate(o));
  return o;
}

void expect_same(const ClientOptions& a, const ClientOptions& b) {
  EXPECT_EQ(a.pool, b.pool);
  EXPECT_EQ(a.groups, b.groups);
  EXPECT_EQ(a.group, b.group);
  EXPECT_EQ(a.group_sizes, b.group_sizes);
  EXPECT_EQ(a.job, b.job);
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.chunk_bytes, b.chunk_bytes);
  EXPECT_EQ(a.op_timeout, b.op_timeout);
  EXPECT_EQ(a.connect_timeout, b.connect_timeout);
  EXPECT_EQ(a.heartbeat_interval, b.heartbeat_interval);
  EXPECT_EQ(a.peer_timeout, b.peer_timeout);
  EXPECT_EQ(a.transport, b.transport);
  EXPECT_EQ(a.fabric.provider, b.fabric.provider);
  EXPECT_EQ(a.fabric.force_registration, b.fabric.force_registration);
  EXPECT_EQ(a.fabric.max_msg_bytes, b.fabric.max_msg_bytes);
  EXPECT_EQ(a.wire_dtype, b.wire_dtype);
  EXPECT_EQ(a.tcp_congestion, b.tcp_congestion);
  EXPECT_EQ(a.link_rate_bits, b.link_rate_bits);
  EXPECT_EQ(a.receive_budget_bytes, b.receive_budget_bytes);
}

const Env kBase{
    {"TALLY_POOL", "a:1,,b:2"}, {"TALLY_JOB", "j"}, {"TALLY_RANK", "1"}, {"TALLY_WORLD_SIZE", "3"}};

Env with(Env env, const Env& more) {
  for (auto& [k, v] : more) env[k] = v;
  return env;
}

TEST(OptionNames, AgreeWithTheEnvironmentReader) {
  const std::vector<Env> cases{
      kBase,
      with(kBase, {{"TALLY_CHUNK_BYTES", "4096"},
                   {"TALLY_OP_TIMEOUT_MS", "1234"},
                   {"TALLY_CONNECT_TIMEOUT_MS", "50"},
                   {"TALLY_HEARTBEAT_MS", "7"},
                   {"TALLY_PEER_TIMEOUT_MS", "70"}}),
      with(kBase, {{"TALLY_POOL", "a:1,b:2,c:3,d:4"},
                   {"TALLY_GROUPS", "2"},
                   {"TALLY_GROUP", "1"},
                   {"TALLY_GROUP_SIZES", "1,2"}}),
      with(kBase, {{"TALLY_TRANSPORT", "fabric"},
                   {"FI_PROVIDER", "tcp"},
                   {"TALLY_FABRIC_FORCE_REGISTRATION", "Yes"},
                   {"TALLY_FABRIC_MAX_MSG_BYTES", "99"}}),
      with(kBase, {{"TALLY_TRANSPORT", "fabric"},
                   {"FI_PROVIDER", "tcp"},
                   {"TALLY_FABRIC_PROVIDER", "verbs;ofi_rxm"}}),
      with(kBase, {{"TALLY_OP_TIMEOUT_MS", ""}}),  // empty counts as unset
      with(kBase, {{"TALLY_WIRE_DTYPE", "bfloat16"}}),
      with(kBase, {{"TALLY_LINK_RATE", "2.5gbit"}, {"TALLY_TCP_CONGESTION", "reno"}}),
      with(kBase, {{"TALLY_RECEIVE_BUDGET", "2MiB"}}),
      with(kBase, {{"TALLY_RECEIVE_BUDGET", "0"}}),
  };
  for (const Env& env : cases) {
    ScopedEnv scoped(env);
    auto from_env = client_options_from_env();
    auto named = from_names(env);
    ASSERT_TRUE(from_env.is_ok()) << from_env.status().to_string();
    ASSERT_TRUE(named.is_ok()) << named.status().to_string();
    expect_same(*from_env, *named);
  }
}

TEST(OptionNames, RejectWhatTheEnvironmentRejects) {
  const std::vector<Env> cases{
      with(kBase, {{"TALLY_RANK", "-1"}}),
      with(kBase, {{"TALLY_RANK", "4294967296"}}),
      with(kBase, {{"TALLY_CHUNK_BYTES", "1.5MiB"}}),
      with(kBase, {{"TALLY_RESUME_BYTES", "4 parsecs"}}),
      with(kBase, {{"TALLY_RECEIVE_BUDGET", "-1"}}),
      with(kBase, {{"TALLY_FABRIC_FORCE_REGISTRATION", "maybe"}}),
      with(kBase, {{"TALLY_GROUP_SIZES", "1,x"}}),
      // Only float32 tensors have another wire, and only bfloat16.
      with(kBase, {{"TALLY_WIRE_DTYPE", "float"}}),
      with(kBase, {{"TALLY_WIRE_DTYPE", "BFLOAT16"}}),
      with(kBase, {{"TALLY_WIRE_DTYPE", "half"}}),
      with(kBase, {{"TALLY_RANK", "3"}}),        // validate(): not below the world size
      with(kBase, {{"TALLY_LINK_RATE", "1G"}}),  // tc's units: 1gbit
      // A capped pacing rate under bbr stalls small transfers.
      with(kBase, {{"TALLY_LINK_RATE", "1gbit"}, {"TALLY_TCP_CONGESTION", "bbr"}}),
  };
  for (const Env& env : cases) {
    ScopedEnv scoped(env);
    EXPECT_EQ(client_options_from_env().status().code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(from_names(env).status().code(), ErrorCode::kInvalidArgument);
  }
}

TEST(OptionNames, WireDtypeIsUnsetByDefaultAndBfloat16WhenSet) {
  ClientOptions o;
  EXPECT_FALSE(o.wire_dtype.has_value());
  ASSERT_TRUE(set_client_option(o, "TALLY_WIRE_DTYPE", "bfloat16").is_ok());
  EXPECT_EQ(o.wire_dtype, DType::kBFloat16);
  Status s = set_client_option(o, "TALLY_WIRE_DTYPE", "float16");
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("TALLY_WIRE_DTYPE='float16'"), std::string::npos) << s.message();
  EXPECT_EQ(o.wire_dtype, DType::kBFloat16);  // a rejected value changes nothing
}

// Byte counts take the suffixes the reducer's flags take (--max-chunk-bytes 4MiB).
TEST(OptionNames, ByteCountsTakeSizeSuffixes) {
  ClientOptions o;
  ASSERT_TRUE(set_client_option(o, "TALLY_CHUNK_BYTES", "256KiB").is_ok());
  EXPECT_EQ(o.chunk_bytes, 256u << 10);
  ASSERT_TRUE(set_client_option(o, "TALLY_CHUNK_BYTES", "64k").is_ok());
  EXPECT_EQ(o.chunk_bytes, 64u << 10);
  ASSERT_TRUE(set_client_option(o, "TALLY_RESUME_BYTES", "1G").is_ok());
  EXPECT_EQ(o.resume_bytes, uint64_t{1} << 30);
  ASSERT_TRUE(set_client_option(o, "TALLY_FABRIC_MAX_MSG_BYTES", "8192").is_ok());
  EXPECT_EQ(o.fabric.max_msg_bytes, 8192u);
  Status s = set_client_option(o, "TALLY_CHUNK_BYTES", "4 furlongs");
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("TALLY_CHUNK_BYTES='4 furlongs' is not a byte count"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(o.chunk_bytes, 64u << 10);  // unchanged
}

// The job secret has the reducer's name on the workers too
// (TALLY_JOB_SECRET, TALLY_JOB_SECRET_FILE); the older TALLY_SECRET names
// are still read, and lose to the new ones.
TEST(OptionNames, TheJobSecretHasTheReducersNameAndTheOlderOneIsStillRead) {
  const std::string older(32, 'o'), newer(32, 'n');
  {
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"},
                   {"TALLY_JOB", "j"},
                   {"TALLY_RANK", "0"},
                   {"TALLY_WORLD_SIZE", "1"},
                   {"TALLY_SECRET", older}});
    auto o = client_options_from_env();
    ASSERT_TRUE(o) << o.status().to_string();
    EXPECT_EQ(o->secret.bytes(), older);
  }
  ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"},
                 {"TALLY_JOB", "j"},
                 {"TALLY_RANK", "0"},
                 {"TALLY_WORLD_SIZE", "1"},
                 {"TALLY_SECRET", older},
                 {"TALLY_JOB_SECRET", newer}});
  auto o = client_options_from_env();
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->secret.bytes(), newer);
}

TEST(OptionNames, UnknownNameIsNamed) {
  ClientOptions o;
  Status s = set_client_option(o, "TALLY_POOLS", "a:1");
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("TALLY_POOLS"), std::string::npos);
}

// With TALLY_RANK, TALLY_WORLD_SIZE and TALLY_JOB unset, the client takes
// torchrun's (and Kubeflow's PyTorchJob's) RANK and WORLD_SIZE, and a job
// name per elastic incarnation; TALLY_* still wins where it is set.
TEST(LauncherEnvironment, StandsInForTheUnsetTallyNames) {
  {
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"},
                   {"RANK", "3"},
                   {"WORLD_SIZE", "8"},
                   {"TORCHELASTIC_RUN_ID", "abc123"},
                   {"TORCHELASTIC_RESTART_COUNT", "2"}});
    auto o = client_options_from_env();
    ASSERT_TRUE(o.is_ok()) << o.status().to_string();
    EXPECT_EQ(o->rank, 3u);
    EXPECT_EQ(o->world_size, 8u);
    EXPECT_EQ(o->job, "abc123-2");
  }
  {
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"},
                   {"TALLY_RANK", "1"},
                   {"TALLY_WORLD_SIZE", "2"},
                   {"TALLY_JOB", "mine"},
                   {"RANK", "3"},
                   {"WORLD_SIZE", "8"},
                   {"TORCHELASTIC_RUN_ID", "abc123"}});
    auto o = client_options_from_env();
    ASSERT_TRUE(o.is_ok()) << o.status().to_string();
    EXPECT_EQ(o->rank, 1u);
    EXPECT_EQ(o->world_size, 2u);
    EXPECT_EQ(o->job, "mine");
  }
  {  // The first incarnation has no restart count yet.
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"},
                   {"RANK", "0"},
                   {"WORLD_SIZE", "1"},
                   {"TORCHELASTIC_RUN_ID", "r"}});
    auto o = client_options_from_env();
    ASSERT_TRUE(o.is_ok()) << o.status().to_string();
    EXPECT_EQ(o->job, "r-0");
  }
}

TEST(LauncherEnvironment, ErrorsNameTheVariablesReadAndTheOnesMissing) {
  {
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"}, {"RANK", "x"}, {"WORLD_SIZE", "2"}});
    auto o = client_options_from_env();
    ASSERT_FALSE(o.is_ok());
    EXPECT_NE(o.status().message().find("RANK (the launcher's, for TALLY_RANK)"), std::string::npos)
        << o.status().to_string();
  }
  {
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}});
    auto o = client_options_from_env();
    ASSERT_FALSE(o.is_ok());
    EXPECT_EQ(o.status().message(), "TALLY_JOB is not set (nor torchrun's TORCHELASTIC_RUN_ID)");
  }
  {
    ScopedEnv env({{"TALLY_POOL", "127.0.0.1:7070"}, {"TALLY_JOB", "j"}});
    auto o = client_options_from_env();
    ASSERT_FALSE(o.is_ok());
    EXPECT_EQ(o.status().message(), "TALLY_RANK is not set (nor a launcher's RANK)");
  }
}

}  // namespace
}  // namespace tally
