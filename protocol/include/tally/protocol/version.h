// What every binary says it is: the release (TALLY_VERSION, from the
// project's version) and the commit it was built from.
#pragma once

#include <string>

namespace tally {

// The short commit hash of the tree this binary was built from, taken at
// build time (protocol/git_sha.cmake), or "unknown" outside a git checkout.
const char* git_sha();

// "<release> (<commit>)": what tally.version() and tally_version() say.
inline std::string version_string() { return std::string(TALLY_VERSION) + " (" + git_sha() + ")"; }

}  // namespace tally
