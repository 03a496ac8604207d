// The challenge-response primitives: secrets from files and the
// environment, nonces, and what a MAC binds.
#include "tally/protocol/auth.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
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

// As ssh refuses a private key: a secret file others may read, one a group
// this process is not in may read, and anything but a regular file (which
// could be read for ever) are refused, and no file is read past the
// longest secret.
TEST(Auth, SecretFilesOthersMayReadOrThatAreNotFilesAreRefused) {
  const std::string file = temp_file("0123456789abcdef0123\n");
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  auto open_to_all = load_secret(file, nullptr, "job secret");
  ASSERT_FALSE(open_to_all);
  EXPECT_NE(open_to_all.status().message().find("every user may read it (mode 0644): chmod 600"),
            std::string::npos)
      << open_to_all.status().message();
  // The process's own group may read it (Kubernetes: the pod's fsGroup).
  ASSERT_EQ(chmod(file.c_str(), 0440), 0);
  EXPECT_TRUE(load_secret(file, nullptr, "job secret"));
  // A group this process is not in may not (only root may give it one).
  if (chown(file.c_str(), static_cast<uid_t>(-1), 54321) == 0) {
    auto other_group = load_secret(file, nullptr, "job secret");
    ASSERT_FALSE(other_group);
    EXPECT_NE(other_group.status().message().find("group 54321, which this process is not in"),
              std::string::npos)
        << other_group.status().message();
  }
  unlink(file.c_str());

  auto device = load_secret("/dev/zero", nullptr, "pool secret");
  ASSERT_FALSE(device);
  EXPECT_NE(device.status().message().find("/dev/zero: it is not a regular file"),
            std::string::npos)
      << device.status().message();
  char fifo[] = "/tmp/tally-auth-fifo-XXXXXX";
  ASSERT_NE(mkdtemp(fifo), nullptr);
  const std::string pipe = std::string(fifo) + "/secret";
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  auto from_pipe = load_secret(pipe, nullptr, "job secret");  // returns: nothing is read
  ASSERT_FALSE(from_pipe);
  EXPECT_NE(from_pipe.status().message().find("not a regular file"), std::string::npos);
  unlink(pipe.c_str());
  rmdir(fifo);

  const std::string huge = temp_file(std::string(kMaxSecretBytes + 1, 'x'));
  auto too_long = load_secret(huge, nullptr, "job secret");
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.status().message().find("is longer than 4096 bytes"), std::string::npos)
      << too_long.status().message();
  unlink(huge.c_str());
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

#include "tally/protocol/log_limiter.h"

namespace tally {
namespace {

TEST(LogLimiter, SaysABurstPerIntervalWithTheCountSinceTheLastLine) {
  LogLimiter limiter(std::chrono::seconds(10), /*burst=*/2);
  const auto t0 = LogLimiter::Clock::now();
  EXPECT_EQ(limiter.allow(t0), 0u);
  EXPECT_EQ(limiter.allow(t0 + std::chrono::seconds(1)), 0u);
  for (int i = 2; i <= 4; ++i) EXPECT_EQ(limiter.allow(t0 + std::chrono::seconds(i)), std::nullopt);
  EXPECT_EQ(limiter.allow(t0 + std::chrono::seconds(10)), 3u);  // a new interval
  EXPECT_EQ(limiter.allow(t0 + std::chrono::seconds(11)), 0u);
  EXPECT_EQ(limiter.allow(t0 + std::chrono::seconds(12)), std::nullopt);
  EXPECT_EQ(limiter.allow(t0 + std::chrono::seconds(25)), 1u);
}

}  // namespace
}  // namespace tally
