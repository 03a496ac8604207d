// The challenge-response primitives: secrets from files and the
// environment, nonces, and what a MAC binds.
#include "tally/protocol/auth.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <string>

namespace tally {
namespace {

std::string temp_file(const std::string& contents) {
  char path[] = "/tmp/tally-auth-test-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

TEST(Auth, SecretComesFromTheFileLessOneNewlineThenTheEnvironment) {
  const std::string file = temp_file("0123456789abcdef0123\n");
  auto s = load_secret(file, nullptr, "job secret");
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(s->bytes(), "0123456789abcdef0123");
  unlink(file.c_str());

  setenv("TALLY_AUTH_TEST_SECRET", "fedcba9876543210fedc", 1);
  auto e = load_secret("", "TALLY_AUTH_TEST_SECRET", "job secret");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->bytes(), "fedcba9876543210fedc");
  unsetenv("TALLY_AUTH_TEST_SECRET");
  auto none = load_secret("", "TALLY_AUTH_TEST_SECRET", "job secret");
  ASSERT_TRUE(none);
  EXPECT_TRUE(none->empty());
}

TEST(Auth, ShortOrUnreadableSecretsAreRefusedWithoutShowingThem) {
  const std::string file = temp_file("short-secret\n");
  auto s = load_secret(file, nullptr, "job secret");
  ASSERT_FALSE(s);
  EXPECT_EQ(s.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("shorter than 16 bytes"), std::string::npos);
  EXPECT_EQ(s.status().message().find("short-secret"), std::string::npos);
  unlink(file.c_str());
  auto missing = load_secret("/nonexistent/tally/secret", nullptr, "pool secret");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("cannot read the pool secret file"), std::string::npos);
}

TEST(Auth, NoncesAreFreshAndFullLength) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string n = make_nonce();
    EXPECT_EQ(n.size(), kAuthNonceBytes);
    EXPECT_TRUE(seen.insert(n).second);
  }
}

TEST(Auth, TheMacBindsSecretRoleNoncesAndIdentity) {
  const Secret secret("0123456789abcdef0123");
  const std::string a = make_nonce(), b = make_nonce();
  const std::string mac = auth_mac(secret, AuthRole::kWorker, a, b, "job/1/4/0");
  EXPECT_EQ(mac.size(), kAuthMacBytes);
  EXPECT_TRUE(auth_mac_matches(mac, auth_mac(secret, AuthRole::kWorker, a, b, "job/1/4/0")));
  const std::string others[] = {
      auth_mac(Secret("0123456789abcdef0124"), AuthRole::kWorker, a, b, "job/1/4/0"),
      auth_mac(secret, AuthRole::kReducer, a, b, "job/1/4/0"),
      auth_mac(secret, AuthRole::kWorker, b, a, "job/1/4/0"),
      auth_mac(secret, AuthRole::kWorker, a, b, "job/2/4/0"),
      // Length prefixes: moving a byte between fields changes the MAC.
      auth_mac(secret, AuthRole::kWorker, a + b.substr(0, 1), b.substr(1), "job/1/4/0"),
  };
  for (const std::string& other : others) EXPECT_FALSE(auth_mac_matches(mac, other));
  EXPECT_FALSE(auth_mac_matches(mac, mac.substr(0, 31)));
  EXPECT_FALSE(auth_mac_matches("", mac));
}

}  // namespace
}  // namespace tally

namespace tally {
namespace {

TEST(AuthIdentity, IsTheJobThenTheWorkersPlaceInIt) {
  using namespace std::string_literals;
  EXPECT_EQ(auth_identity("train", 3, 8, 1),
            "train\0"s
            "3/8/1");
  // A job name cannot run into the rank: the NUL ends it.
  EXPECT_NE(auth_identity("a1", 2, 4, 0), auth_identity("a", 12, 4, 0));
}

}  // namespace
}  // namespace tally
