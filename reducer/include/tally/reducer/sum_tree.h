// The sum tree of reproducible sums (docs/architecture.md, "Determinism"):
// one fixed binary tree over the ranks 0..W-1 in which every element of a
// result is added up, whichever reducer adds which part of it.
//
// Node [lo, hi) (hi - lo >= 2) splits at mid = lo + the largest power of
// two below hi - lo: its left child [lo, mid) is a whole power-of-two
// subtree, and [mid, hi)'s sum is added into [lo, mid)'s. So W = 4 gives
// (x0 + x1) + (x2 + x3), and W = 3 gives (x0 + x1) + x2.
//
// With replica groups, the group of ranks [begin, end) sums the nodes that
// cover its ranks whole and whose parent does not (its cover), and sends
// each to every other replica of the shard; every replica then adds the
// groups' nodes up the same tree, so each ends with the same bits, and the
// same as a pool of one group would.
#pragma once

#include <cstdint>
#include <vector>

namespace tally {

struct TreeNode {
  uint32_t lo = 0;
  uint32_t hi = 0;
  bool operator==(const TreeNode&) const = default;
};

// Where node [lo, hi) splits (hi - lo >= 2).
uint32_t sum_tree_mid(uint32_t lo, uint32_t hi);
// The nodes strictly above `node` in the tree over [0, world), from the
// root down. Requires `node` to be a node of that tree.
std::vector<TreeNode> sum_tree_ancestors(uint32_t world, TreeNode node);
// The cover of the ranks [begin, end) in the tree over [0, world), in rank
// order: at most 2 log2(world) nodes for a block.
std::vector<TreeNode> sum_tree_cover(uint32_t world, uint32_t begin, uint32_t end);
// By group, the cover of each group's ranks, groups being the contiguous
// blocks of `group_sizes` in order (empty for a group without workers).
std::vector<std::vector<TreeNode>> sum_tree_covers(const std::vector<uint32_t>& group_sizes);

}  // namespace tally
