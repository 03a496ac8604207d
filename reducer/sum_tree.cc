#include "tally/reducer/sum_tree.h"

#include <bit>
#include <numeric>

namespace tally {
namespace {

void cover(TreeNode node, uint32_t begin, uint32_t end, std::vector<TreeNode>& out) {
  if (node.hi <= begin || end <= node.lo) return;
  if (begin <= node.lo && node.hi <= end) {
    out.push_back(node);
    return;
  }
  const uint32_t mid = sum_tree_mid(node.lo, node.hi);
  cover({node.lo, mid}, begin, end, out);
  cover({mid, node.hi}, begin, end, out);
}

}  // namespace

uint32_t sum_tree_mid(uint32_t lo, uint32_t hi) { return lo + std::bit_floor(hi - lo - 1); }

std::vector<TreeNode> sum_tree_ancestors(uint32_t world, TreeNode node) {
  std::vector<TreeNode> path;
  TreeNode at{0, world};
  while (at != node && at.hi - at.lo > 1) {
    path.push_back(at);
    const uint32_t mid = sum_tree_mid(at.lo, at.hi);
    at = node.lo < mid ? TreeNode{at.lo, mid} : TreeNode{mid, at.hi};
  }
  return path;
}

std::vector<TreeNode> sum_tree_cover(uint32_t world, uint32_t begin, uint32_t end) {
  std::vector<TreeNode> out;
  if (world > 0 && begin < end) cover({0, world}, begin, end, out);
  return out;
}

std::vector<std::vector<TreeNode>> sum_tree_covers(const std::vector<uint32_t>& group_sizes) {
  const uint32_t world = std::accumulate(group_sizes.begin(), group_sizes.end(), 0u);
  std::vector<std::vector<TreeNode>> out;
  uint32_t begin = 0;
  for (uint32_t size : group_sizes) {
    out.push_back(sum_tree_cover(world, begin, begin + size));
    begin += size;
  }
  return out;
}

}  // namespace tally
