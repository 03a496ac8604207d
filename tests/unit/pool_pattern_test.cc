#include "tally/protocol/pool_pattern.h"

#include <gtest/gtest.h>

#include "tally/protocol/split.h"

namespace tally {
namespace {

std::vector<std::string> expand_ok(std::string_view spec) {
  auto r = expand_pool_pattern(spec);
  EXPECT_TRUE(r) << r.status().to_string();
  return r ? *r : std::vector<std::string>{};
}

TEST(PoolPattern, ExplicitListIsUnchanged) {
  EXPECT_EQ(expand_ok("a:1,b:2"), (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_EQ(expand_ok(" a:1 , ,b:2\n c:3\r\n"), (std::vector<std::string>{"a:1", "b:2", "c:3"}));
  EXPECT_EQ(expand_ok("[::1]:7070"), (std::vector<std::string>{"[::1]:7070"}));
  EXPECT_TRUE(expand_ok("").empty());
}

TEST(PoolPattern, RangeExpandsInOrder) {
  EXPECT_EQ(expand_ok("tally-{0..3}.tally.ns.svc:7070"),
            (std::vector<std::string>{"tally-0.tally.ns.svc:7070", "tally-1.tally.ns.svc:7070",
                                      "tally-2.tally.ns.svc:7070", "tally-3.tally.ns.svc:7070"}));
  EXPECT_EQ(expand_ok("h{7..7}:1"), (std::vector<std::string>{"h7:1"}));
  EXPECT_EQ(expand_ok("127.0.0.{1..2}:7070"),
            (std::vector<std::string>{"127.0.0.1:7070", "127.0.0.2:7070"}));
}

TEST(PoolPattern, SeveralItemsMixPatternsAndAddresses) {
  EXPECT_EQ(expand_ok("g0-{0..1}:1,extra:2,g1-{0..1}:1"),
            (std::vector<std::string>{"g0-0:1", "g0-1:1", "extra:2", "g1-0:1", "g1-1:1"}));
}

TEST(PoolPattern, LeadingZeroPadsToTheWiderBound) {
  EXPECT_EQ(expand_ok("r{08..11}:1"),
            (std::vector<std::string>{"r08:1", "r09:1", "r10:1", "r11:1"}));
  EXPECT_EQ(expand_ok("r{0..10}:1").at(0), "r0:1");  // a lone 0 is not padding
}

TEST(PoolPattern, JoinedIsTheExplicitList) {
  auto r = expand_pool_pattern_joined("t-{0..2}.s:7070");
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(*r, "t-0.s:7070,t-1.s:7070,t-2.s:7070");
}

TEST(PoolPattern, BadPatternsNameTheItem) {
  for (const char* spec :
       {"t-{0..3:1", "t-0..3}:1", "t-{3..0}:1", "t-{a..3}:1", "t-{0-3}:1", "t-{0..1}-{0..1}:1",
        "t-{{0..1}}:1", "t-{..3}:1", "t-{0..}:1", "t-{0..9999999999}:1", "t-{-1..3}:1"}) {
    auto r = expand_pool_pattern(std::string("ok:1,") + spec);
    ASSERT_FALSE(r) << spec;
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(spec), std::string::npos) << r.status().to_string();
  }
}

TEST(PoolPattern, HugeRangeIsRefusedNotAllocated) {
  auto r = expand_pool_pattern("t-{0..999999999}:1");
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("more than"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace tally

namespace tally {
namespace {

TEST(SplitList, GivesTheItemsBetweenSeparatorsUntrimmed) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(split_list(""), V{});
  EXPECT_EQ(split_list("a"), V{"a"});
  EXPECT_EQ(split_list("a,b"), (V{"a", "b"}));
  EXPECT_EQ(split_list("a,"), (V{"a", ""}));
  EXPECT_EQ(split_list(",a"), (V{"", "a"}));
  EXPECT_EQ(split_list(" a ,b"), (V{" a ", "b"}));
  EXPECT_EQ(split_list("a\nb,c", ",\n"), (V{"a", "b", "c"}));
}

}  // namespace
}  // namespace tally
