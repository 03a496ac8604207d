// Private to libtally: where the client's log lines go.
#pragma once

namespace tally::client_internal {

// Once per process, before the client first logs (reading its options,
// connecting): tally's lines go to stderr, beside the training script's own
// output rather than inside it. spdlog's own default logger (stdout) is
// replaced by one like it on stderr, at the same level; a default logger
// the process installed itself is kept.
void log_to_stderr();

}  // namespace tally::client_internal
