// Built instead of fabric_transport.cc when CMake's TALLY_WITH_FABRIC is off
// (no libfabric-dev): the fabric transport reports itself missing.
#include "tally/protocol/fabric_transport.h"

namespace tally {

bool fabric_available() { return false; }

Result<std::shared_ptr<Fabric>> Fabric::open(const FabricOptions&) {
  return Status(ErrorCode::kUnimplemented,
                "this build has no libfabric transport (rebuild with libfabric-dev installed "
                "and -DTALLY_WITH_FABRIC=ON)");
}

}  // namespace tally
