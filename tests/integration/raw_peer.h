// The bench's raw peer (tally/bench/raw_peer.h) under the tests' namespace.
#pragma once

#include "tally/bench/raw_peer.h"

namespace tally::testing {

using bench::control_frame;
using bench::raw_hello;
using bench::raw_replica_hello;
using bench::RawPeer;
using bench::whole_op_contribution;

}  // namespace tally::testing
