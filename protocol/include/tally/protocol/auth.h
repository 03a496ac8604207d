// Authentication of a stream by a shared secret: challenge-response with
// HMAC-SHA256 (OpenSSL's libcrypto). The secret itself never travels; each
// side sends a fresh 32-byte nonce, and the MAC covers both nonces, the role
// (worker or replica) and the stream's identity (docs/protocol.md,
// "Authentication"), so a MAC cannot be replayed on another stream or for
// another rank, job or direction.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tally/protocol/status.h"

namespace tally {

inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthMacBytes = 32;
// A secret shorter than this is refused: it could be guessed offline from
// one recorded exchange.
inline constexpr size_t kMinSecretBytes = 16;
// A secret file or variable longer than this is refused (a file is read no
// further).
inline constexpr size_t kMaxSecretBytes = 4096;

// What a MAC proves: who computes it over what.
enum class AuthRole {
  kWorker,          // a worker proves it holds the job secret
  kReducer,         // the reducer proves it holds the job secret (mutual)
  kReplicaDialler,  // the dialling replica proves it holds the pool secret
  kReplicaAcceptor  // the accepting replica proves it holds the pool secret
};

// A secret held in memory. It is never printed: to_string-like helpers do
// not exist, and the value is wiped on destruction.
class Secret {
 public:
  Secret() = default;
  explicit Secret(std::string bytes) : bytes_(std::move(bytes)) {}
  ~Secret();
  Secret(const Secret&) = default;
  Secret& operator=(const Secret&) = default;
  bool empty() const { return bytes_.empty(); }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// The secret from `file` (its contents less one trailing newline) if not
// empty, else from the environment variable `env_var` if set. `what` names
// the secret in errors ("job secret"). Errors: kInvalidArgument (unreadable
// file; not a regular file; readable by others, or by a group this process
// is not in; shorter than kMinSecretBytes or longer than kMaxSecretBytes);
// an empty Secret when neither is set.
Result<Secret> load_secret(const std::string& file, const char* env_var, std::string_view what);

// kAuthNonceBytes from the OS's random source (RAND_bytes).
std::string make_nonce();

// What a worker stream's MACs cover beside the nonces: the job and the
// worker's place in it, as its Hello says them (job NUL rank/world/group).
// The one builder, for the worker and the reducer alike.
std::string auth_identity(std::string_view job, uint32_t rank, uint32_t world_size, uint32_t group);

// HMAC-SHA256 over the role, both nonces and `identity` (length-prefixed).
std::string auth_mac(const Secret& secret, AuthRole role, std::string_view challenger_nonce,
                     std::string_view responder_nonce, std::string_view identity);

// A job's own secret under a pool's master secret (the reducers'
// --per-job-secrets): the hex HMAC-SHA256, under the master, of a label and
// the job's name. Holding one job's secret gives nothing on another's, nor
// on the master.
Secret derive_job_secret(const Secret& master, std::string_view job);

// Constant-time comparison of a received MAC with the expected one.
bool auth_mac_matches(std::string_view received, std::string_view expected);

}  // namespace tally
