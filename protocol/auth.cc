#include "tally/protocol/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace tally {

Secret::~Secret() {
  if (!bytes_.empty()) OPENSSL_cleanse(bytes_.data(), bytes_.size());
}

Result<Secret> load_secret(const std::string& file, const char* env_var, std::string_view what) {
  std::string bytes;
  std::string source;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      return Status(ErrorCode::kInvalidArgument,
                    "cannot read the " + std::string(what) + " file " + file);
    }
    std::ostringstream all;
    all << in.rdbuf();
    bytes = all.str();
    if (!bytes.empty() && bytes.back() == '\n') bytes.pop_back();
    if (!bytes.empty() && bytes.back() == '\r') bytes.pop_back();
    source = "the file " + file;
  } else if (const char* env = env_var ? std::getenv(env_var) : nullptr; env && *env) {
    bytes = env;
    source = std::string(env_var);
  } else {
    return Secret();
  }
  if (bytes.size() < kMinSecretBytes) {
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return Status(ErrorCode::kInvalidArgument,
                  "the " + std::string(what) + " from " + source + " is shorter than " +
                      std::to_string(kMinSecretBytes) + " bytes (use e.g. `openssl rand -hex 32`)");
  }
  return Secret(std::move(bytes));
}

std::string make_nonce() {
  std::string nonce(kAuthNonceBytes, '\0');
  TALLY_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()),
                         static_cast<int>(nonce.size())) == 1);
  return nonce;
}

namespace {

void append_field(std::string& out, std::string_view field) {
  const uint32_t n = static_cast<uint32_t>(field.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.append(field);
}

std::string_view role_label(AuthRole role) {
  switch (role) {
    case AuthRole::kWorker:
      return "tally-auth-v1 worker";
    case AuthRole::kReducer:
      return "tally-auth-v1 reducer";
    case AuthRole::kReplicaDialler:
      return "tally-auth-v1 replica-dialler";
    case AuthRole::kReplicaAcceptor:
      return "tally-auth-v1 replica-acceptor";
  }
  return "tally-auth-v1";
}

}  // namespace

std::string auth_identity(std::string_view job, uint32_t rank, uint32_t world_size,
                          uint32_t group) {
  return std::string(job) + '\0' + std::to_string(rank) + '/' + std::to_string(world_size) + '/' +
         std::to_string(group);
}

std::string auth_mac(const Secret& secret, AuthRole role, std::string_view challenger_nonce,
                     std::string_view responder_nonce, std::string_view identity) {
  std::string message;
  append_field(message, role_label(role));
  append_field(message, challenger_nonce);
  append_field(message, responder_nonce);
  append_field(message, identity);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  TALLY_CHECK(HMAC(EVP_sha256(), secret.bytes().data(), static_cast<int>(secret.bytes().size()),
                   reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
                   &mac_len) != nullptr);
  TALLY_CHECK(mac_len == kAuthMacBytes);
  return std::string(reinterpret_cast<const char*>(mac), mac_len);
}

bool auth_mac_matches(std::string_view received, std::string_view expected) {
  return received.size() == expected.size() &&
         CRYPTO_memcmp(received.data(), expected.data(), expected.size()) == 0;
}

}  // namespace tally
