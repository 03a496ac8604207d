// parse_pool and pool_index: the pool list every worker, reducer and the
// bench read (TALLY_POOL, --peers, --pool).
#include "tally/protocol/pool.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

namespace tally {
namespace {

std::vector<std::string> names(const std::vector<HostPort>& pool) {
  std::vector<std::string> out;
  for (const HostPort& hp : pool) out.push_back(hp.to_string());
  return out;
}

TEST(ParsePool, CommaSeparatedInOrder) {
  auto r = parse_pool("127.0.0.1:7000,127.0.0.1:7001,reducer-2.svc:7002");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].host, "127.0.0.1");
  EXPECT_EQ((*r)[0].port, 7000);
  EXPECT_EQ((*r)[2].host, "reducer-2.svc");
  EXPECT_EQ((*r)[2].port, 7002);
}

TEST(ParsePool, BracketedIpv6) {
  auto r = parse_pool("[::1]:7000,[fe80::2]:7001");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].host, "::1");
  EXPECT_EQ((*r)[0].port, 7000);
  EXPECT_EQ((*r)[1].host, "fe80::2");
  EXPECT_EQ(names(*r), (std::vector<std::string>{"[::1]:7000", "[fe80::2]:7001"}));
}

TEST(ParsePool, NewlinesCarriageReturnsAndBlanks) {
  auto r = parse_pool("a:1\r\n  b:2 \n\tc:3,d:4\n");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(names(*r), (std::vector<std::string>{"a:1", "b:2", "c:3", "d:4"}));
}

TEST(ParsePool, EmptyItemsAndTrailingCommaAreSkipped) {
  auto r = parse_pool(",a:1,,b:2,\n\n , ");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(names(*r), (std::vector<std::string>{"a:1", "b:2"}));
}

TEST(ParsePool, EmptyTextIsAnEmptyPool) {
  for (std::string_view text : {"", ",", "\n", " , \r\n"}) {
    SCOPED_TRACE(std::string(text));
    auto r = parse_pool(text);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_TRUE(r->empty());
  }
}

TEST(ParsePool, BadItemIsInvalidArgumentNamingIt) {
  struct Case {
    std::string_view text;
    std::string_view message;
  };
  for (const Case& c : {
           Case{"a:1,b:70000", "bad address 'b:70000': port must be a number from 0 to 65535"},
           Case{"a:1,nohost", "bad address 'nohost': expected host:port"},
           Case{"a:1\n:7000", "bad address ':7000': empty host"},
           Case{"[::1]7000,a:1", "bad address '[::1]7000': expected [ipv6]:port"},
           Case{"a:1,b:x", "bad address 'b:x': port must be a number from 0 to 65535"},
           Case{"a: 1", "bad address 'a: 1': port must be a number from 0 to 65535"},
       }) {
    SCOPED_TRACE(std::string(c.text));
    auto r = parse_pool(c.text);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), c.message);
  }
}

TEST(PoolIndex, GroupMajorShardMinor) {
  EXPECT_EQ(pool_index(0, 0, 1), 0u);
  EXPECT_EQ(pool_index(0, 1, 2), 1u);
  EXPECT_EQ(pool_index(1, 0, 2), 2u);
  EXPECT_EQ(pool_index(2, 1, 2), 5u);
  EXPECT_EQ(pool_index(3, 2, 4), 14u);
  // No 32-bit overflow for the largest pools.
  EXPECT_EQ(pool_index(0xFFFFFFFFu, 0xFFFFFFFEu, 0xFFFFFFFFu),
            0xFFFFFFFFull * 0xFFFFFFFFull + 0xFFFFFFFEull);
}

TEST(PoolIndex, EveryReducerOnceInListOrder) {
  const uint32_t shards = 3, groups = 4;
  size_t expected = 0;
  for (uint32_t g = 0; g < groups; ++g) {
    for (uint32_t s = 0; s < shards; ++s) EXPECT_EQ(pool_index(g, s, shards), expected++);
  }
}

}  // namespace
}  // namespace tally
