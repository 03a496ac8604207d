// What the fabric transport takes from libfabric itself: the provider
// query and libfabric's errors, translated into Status values at this
// boundary. Private to protocol/fabric/.
#pragma once

#include <rdma/fabric.h>

#include <memory>
#include <string>
#include <string_view>

#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/status.h"

namespace tally::fabric {

// kUnavailable naming the libfabric call, its error text (rc is -FI_*) and
// `context` when given.
Status fi_status(std::string_view call, ssize_t rc, std::string_view context = {});

struct FiInfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
// An fi_info list from fi_getinfo, owned.
using InfoPtr = std::unique_ptr<fi_info, FiInfoDeleter>;

// What `provider` offers for tagged RDM messaging, with the source bound to
// `node` ("": the provider's default). Blocks for up to a second; any
// thread. Errors: kUnavailable when the provider is missing here (naming it
// and libfabric's reason); kUnimplemented when its tags have fewer than
// `tag_bits` bits.
Result<InfoPtr> get_info(const std::string& provider, const std::string& node, int tag_bits);

// Buffers are registered where the provider asks (FI_MR_LOCAL) or when forced.
bool needs_registration(const FabricOptions& options, const fi_info* info);

}  // namespace tally::fabric
