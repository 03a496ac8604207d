#include "libfabric.h"

#include <rdma/fi_errno.h>

#include <cstring>

namespace tally::fabric {
namespace {

// The libfabric API this code is written against (FI_CONTEXT2, fi_trywait).
constexpr uint32_t kFiVersion = FI_VERSION(1, 9);

// What we can do, so the provider tells us what it requires of us.
InfoPtr make_hints(const std::string& provider) {
  InfoPtr hints(fi_allocinfo());
  TALLY_CHECK(hints);
  hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  // Local registration we can do; the RMA-related bits cost nothing to
  // accept because tally never exposes memory for remote access.
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->resource_mgmt = FI_RM_ENABLED;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  return hints;
}

}  // namespace

Status fi_status(std::string_view call, ssize_t rc, std::string_view context) {
  std::string msg = std::string(call) + ": " + fi_strerror(static_cast<int>(-rc));
  if (!context.empty()) msg += " (" + std::string(context) + ")";
  return Status(ErrorCode::kUnavailable, std::move(msg));
}

Result<InfoPtr> get_info(const std::string& provider, const std::string& node, int tag_bits) {
  InfoPtr hints = make_hints(provider);
  fi_info* info = nullptr;
  int rc = fi_getinfo(kFiVersion, node.empty() ? nullptr : node.c_str(), nullptr,
                      node.empty() ? 0 : FI_SOURCE, hints.get(), &info);
  if (rc != 0 || !info) {
    return Status(ErrorCode::kUnavailable,
                  "libfabric provider '" + provider + "' is not available" +
                      (node.empty() ? "" : " on " + node) + ": fi_getinfo: " + fi_strerror(-rc) +
                      " (fi_info -l lists the providers this machine has)");
  }
  InfoPtr out(info);
  const uint64_t fmt = out->ep_attr->mem_tag_format;
  const int bits = fmt == 0 ? 64 : 64 - __builtin_clzll(fmt);
  if (bits < tag_bits) {
    return Status(ErrorCode::kUnimplemented, "libfabric provider '" + provider + "' offers " +
                                                 std::to_string(bits) + "-bit tags; tally needs " +
                                                 std::to_string(tag_bits));
  }
  return out;
}

// Buffers are registered where the provider asks (FI_MR_LOCAL) or when forced.
bool needs_registration(const FabricOptions& options, const fi_info* info) {
  return options.force_registration || (info->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
}

}  // namespace tally::fabric
