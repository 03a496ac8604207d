// The sum tree of reproducible sums (tally/reducer/sum_tree.h): where nodes
// split, the path to a node, and the parts a group of ranks sums.
#include "tally/reducer/sum_tree.h"

#include <gtest/gtest.h>

#include <bit>
#include <vector>

namespace tally {
namespace {

using Nodes = std::vector<TreeNode>;

TEST(SumTree, ANodeSplitsAtTheLargestPowerOfTwoBelowItsSize) {
  EXPECT_EQ(sum_tree_mid(0, 2), 1u);
  EXPECT_EQ(sum_tree_mid(0, 3), 2u);
  EXPECT_EQ(sum_tree_mid(0, 4), 2u);
  EXPECT_EQ(sum_tree_mid(0, 5), 4u);
  EXPECT_EQ(sum_tree_mid(0, 8), 4u);
  EXPECT_EQ(sum_tree_mid(4, 7), 6u);
}

TEST(SumTree, AncestorsRunFromTheRootDown) {
  EXPECT_EQ(sum_tree_ancestors(4, {2, 3}), (Nodes{{0, 4}, {2, 4}}));
  EXPECT_EQ(sum_tree_ancestors(5, {4, 5}), (Nodes{{0, 5}}));
  EXPECT_EQ(sum_tree_ancestors(5, {2, 4}), (Nodes{{0, 5}, {0, 4}}));
  EXPECT_EQ(sum_tree_ancestors(5, {0, 5}), Nodes{});
  EXPECT_EQ(sum_tree_ancestors(1, {0, 1}), Nodes{});
}

TEST(SumTree, AGroupsCoverIsItsLargestWholeNodes) {
  EXPECT_EQ(sum_tree_cover(4, 0, 2), (Nodes{{0, 2}}));
  EXPECT_EQ(sum_tree_cover(4, 0, 4), (Nodes{{0, 4}}));
  EXPECT_EQ(sum_tree_cover(5, 1, 4), (Nodes{{1, 2}, {2, 4}}));
  EXPECT_EQ(sum_tree_cover(5, 2, 5), (Nodes{{2, 4}, {4, 5}}));
  EXPECT_EQ(sum_tree_covers({3, 0, 2}),
            (std::vector<Nodes>{{{0, 2}, {2, 3}}, {}, {{3, 4}, {4, 5}}}));
  EXPECT_EQ(sum_tree_covers({2, 2, 1}), (std::vector<Nodes>{{{0, 2}}, {{2, 4}}, {{4, 5}}}));
}

// Every block of every world up to 70: its cover is whole nodes, in rank
// order, exactly the block, each one's parent reaching outside it, and at
// most 2 log2(world) + 1 of them.
TEST(SumTree, EveryBlocksCoverIsExactAndSmall) {
  for (uint32_t world = 1; world <= 70; ++world) {
    const size_t most = 2 * std::bit_width(world) + 1;
    for (uint32_t begin = 0; begin < world; ++begin) {
      for (uint32_t end = begin + 1; end <= world; ++end) {
        const Nodes cover = sum_tree_cover(world, begin, end);
        ASSERT_LE(cover.size(), most) << world << " [" << begin << ", " << end << ")";
        uint32_t at = begin;
        for (const TreeNode& n : cover) {
          ASSERT_EQ(n.lo, at) << world << " [" << begin << ", " << end << ")";
          ASSERT_LT(n.lo, n.hi);
          at = n.hi;
          const Nodes above = sum_tree_ancestors(world, n);
          if (!above.empty()) {
            const TreeNode parent = above.back();
            EXPECT_TRUE(parent.lo < begin || parent.hi > end);
            const uint32_t mid = sum_tree_mid(parent.lo, parent.hi);
            EXPECT_TRUE((parent.lo == n.lo && mid == n.hi) || (mid == n.lo && parent.hi == n.hi));
          }
        }
        ASSERT_EQ(at, end) << world << " [" << begin << ", " << end << ")";
      }
    }
  }
}

}  // namespace
}  // namespace tally
