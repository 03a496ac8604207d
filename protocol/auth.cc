#include "tally/protocol/auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

namespace tally {

Secret::~Secret() {
  if (!bytes_.empty()) OPENSSL_cleanse(bytes_.data(), bytes_.size());
}

namespace {

// Whether this process is in group `gid` (its own or a supplementary one).
bool in_group(gid_t gid) {
  if (gid == getegid()) return true;
  const int n = getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  const int got = getgroups(n, groups.data());
  return std::find(groups.begin(), groups.begin() + std::max(got, 0), gid) !=
         groups.begin() + std::max(got, 0);
}

// Why a secret may not be read from `file`, if it may not: not a regular
// file (a device or a pipe could be read for ever), readable by others, or
// readable by a group this process is not in, as ssh refuses a private key.
// A group this process is in may read it: Kubernetes mounts a Secret
// root-owned with the pod's fsGroup, mode 0440.
std::optional<std::string> unsafe_secret_file(const std::string& file, int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return std::string(strerror(errno));
  if (!S_ISREG(st.st_mode)) return std::string("it is not a regular file");
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  if (st.st_mode & S_IROTH) {
    return "every user may read it (mode " + std::string(mode) + "): chmod 600 " + file;
  }
  if ((st.st_mode & S_IRGRP) && !in_group(st.st_gid)) {
    return "group " + std::to_string(st.st_gid) +
           ", which this process is not in, may read it (mode " + mode + "): chmod 600 " + file;
  }
  return std::nullopt;
}

}  // namespace

Result<Secret> load_secret(const std::string& file, const char* env_var, std::string_view what) {
  std::string bytes;
  std::string source;
  if (!file.empty()) {
    const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      return Status(ErrorCode::kInvalidArgument, "cannot read the " + std::string(what) + " file " +
                                                     file + ": " + strerror(errno));
    }
    if (auto why = unsafe_secret_file(file, fd)) {
      close(fd);
      return Status(ErrorCode::kInvalidArgument,
                    "refusing the " + std::string(what) + " file " + file + ": " + *why);
    }
    // Read at most one byte past the longest secret: a file that long is
    // refused, whatever its size.
    bytes.resize(kMaxSecretBytes + 2);
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t n = read(fd, bytes.data() + got, bytes.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    close(fd);
    bytes.resize(got);
    if (!bytes.empty() && bytes.back() == '\n') bytes.pop_back();
    if (!bytes.empty() && bytes.back() == '\r') bytes.pop_back();
    source = "the file " + file;
  } else if (const char* env = env_var ? std::getenv(env_var) : nullptr; env && *env) {
    bytes = env;
    source = std::string(env_var);
  } else {
    return Secret();
  }
  if (bytes.size() > kMaxSecretBytes) {
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return Status(ErrorCode::kInvalidArgument,
                  "the " + std::string(what) + " from " + source + " is longer than " +
                      std::to_string(kMaxSecretBytes) +
                      " bytes: it should hold one secret (e.g. `openssl rand -hex 32`)");
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

Secret derive_job_secret(const Secret& master, std::string_view job) {
  std::string message;
  append_field(message, "tally job secret v1");
  append_field(message, job);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  TALLY_CHECK(HMAC(EVP_sha256(), master.bytes().data(), static_cast<int>(master.bytes().size()),
                   reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
                   &mac_len) != nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < mac_len; ++i) {
    hex += kHex[mac[i] >> 4];
    hex += kHex[mac[i] & 15];
  }
  return Secret(std::move(hex));
}

bool auth_mac_matches(std::string_view received, std::string_view expected) {
  return received.size() == expected.size() &&
         CRYPTO_memcmp(received.data(), expected.data(), expected.size()) == 0;
}

}  // namespace tally
