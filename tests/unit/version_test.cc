// The commit every binary prints (bench header, reducer log, metrics,
// tally.version()) is taken at each build, not when CMake first configured
// the tree: an incremental build after a commit once kept printing the old
// one, and benchmark tables quoted it.
#include "tally/protocol/version.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace tally {
namespace {

TEST(Version, GitShaIsTheCommitOfTheSourceTree) {
  std::string head;
  if (FILE* git =
          ::popen("git -C '" TALLY_SOURCE_DIR "' rev-parse --short HEAD 2>/dev/null", "r")) {
    char line[64] = {};
    if (std::fgets(line, sizeof line, git)) head = line;
    ::pclose(git);
  }
  while (!head.empty() && (head.back() == '\n' || head.back() == '\r')) head.pop_back();
  if (head.empty()) GTEST_SKIP() << "the source tree is not a git checkout";
  EXPECT_EQ(std::string(git_sha()), head) << "rebuilt since the last commit?";
}

}  // namespace
}  // namespace tally
