// The names the wire carries: job ids (FNV-1a 64 of the job's name), the
// host:port parser every address option uses, and a peer's string cut to a
// length without breaking a UTF-8 character.
#include <gtest/gtest.h>

#include <random>
#include <span>
#include <string>
#include <string_view>

#include "tally.pb.h"
#include "tally/protocol/address.h"
#include "tally/protocol/control.h"
#include "tally/protocol/frame.h"

namespace tally {
namespace {

// A peer's string shortened for an error message stays valid UTF-8 (a
// proto3 string that is not would make the receiver refuse the message).
TEST(Utf8Prefix, NeverCutsACharacter) {
  const std::string text = "ab\xc3\xa9\xe2\x82\xac";  // "ab", e-acute (2 bytes), euro (3 bytes)
  EXPECT_EQ(utf8_prefix(text, 100), text);
  EXPECT_EQ(utf8_prefix(text, 7), text);
  EXPECT_EQ(utf8_prefix(text, 6), "ab\xc3\xa9");
  EXPECT_EQ(utf8_prefix(text, 5), "ab\xc3\xa9");
  EXPECT_EQ(utf8_prefix(text, 4), "ab\xc3\xa9");
  EXPECT_EQ(utf8_prefix(text, 3), "ab");
  EXPECT_EQ(utf8_prefix(text, 2), "ab");
  EXPECT_EQ(utf8_prefix(text, 0), "");
  wire::Control m;
  m.mutable_goodbye()->set_reason(utf8_prefix(text, 5));
  const std::string bytes = m.SerializeAsString();
  EXPECT_TRUE(parse_control(std::as_bytes(std::span(bytes))).is_ok());
}

// ---------------------------------------------------------------------------
// job_id: FNV-1a 64, checked against published vectors and an independent
// implementation.

constexpr uint64_t reference_fnv1a64(std::string_view s) {
  constexpr uint64_t kOffsetBasis = 14695981039346656037ULL;
  constexpr uint64_t kPrime = 1099511628211ULL;  // 2^40 + 2^8 + 0xb3
  uint64_t h = kOffsetBasis;
  for (size_t i = 0; i < s.size(); ++i) {
    h = (h ^ static_cast<unsigned char>(s[i])) * kPrime;
  }
  return h;
}

TEST(JobId, MatchesPublishedFnv1a64Vectors) {
  EXPECT_EQ(job_id(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(job_id("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(job_id("foobar"), 0x85944171f73967e8ULL);
}

TEST(JobId, TreatsHighBitBytesAsUnsigned) {
  // A signed-char implementation would sign-extend 0xFF before the xor.
  EXPECT_EQ(job_id("\xff"), 0xaf64724c8602eb6eULL);
  EXPECT_EQ(job_id("job-\xc3\xbc"), reference_fnv1a64("job-\xc3\xbc"));
}

TEST(JobId, MatchesIndependentImplementationAndIsStable) {
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 1000; ++i) {
    std::string name(rng() % 40, '\0');
    for (char& c : name) c = static_cast<char>(rng() & 0xFF);
    ASSERT_EQ(job_id(name), reference_fnv1a64(name)) << "length " << name.size();
    ASSERT_EQ(job_id(name), job_id(std::string(name)));
  }
  EXPECT_EQ(job_id("job-0"), 0xf2c2e9802008f6a9ULL);
  EXPECT_NE(job_id("job-0"), job_id("job-1"));
  // Embedded NULs count: the name is a view, not a C string.
  EXPECT_NE(job_id(std::string_view("a\0b", 3)), job_id("a"));
}

// ---------------------------------------------------------------------------
// parse_host_port

TEST(ParseHostPort, AcceptsIpv4Address) {
  auto r = parse_host_port("127.0.0.1:7000");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->host, "127.0.0.1");
  EXPECT_EQ(r->port, 7000);
  EXPECT_EQ(r->to_string(), "127.0.0.1:7000");
}

TEST(ParseHostPort, AcceptsBracketedIpv6Address) {
  auto r = parse_host_port("[::1]:7000");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->host, "::1");
  EXPECT_EQ(r->port, 7000);
  EXPECT_EQ(r->to_string(), "[::1]:7000");
}

TEST(ParseHostPort, AcceptsHostNameWithPortZeroAndMaxPort) {
  auto r = parse_host_port("host:0");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->host, "host");
  EXPECT_EQ(r->port, 0);
  auto max = parse_host_port("reducer-0.tally.svc:65535");
  ASSERT_TRUE(max.is_ok()) << max.status().to_string();
  EXPECT_EQ(max->host, "reducer-0.tally.svc");
  EXPECT_EQ(max->port, 65535);
}

TEST(ParseHostPort, RejectsMalformedAddressesWithInvalidArgument) {
  for (std::string_view text :
       {"nohost", ":1", "h:70000", "h:65536", "h:x", "h:", "h:-1", "h:7000x", "h: 7000",
        "[::1]7000", "[::1]", "[::1", "[]:7000", "", ":"}) {
    SCOPED_TRACE(std::string(text));
    auto r = parse_host_port(text);
    ASSERT_FALSE(r.is_ok()) << r->host << " port " << r->port;
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(std::string(text)), std::string::npos)
        << r.status().message();
  }
}

}  // namespace
}  // namespace tally
