// The memory-registration cache of one endpoint. Private to protocol/fabric/.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <cstdint>
#include <map>
#include <utility>

#include "tally/protocol/status.h"

namespace tally::fabric {

// Who picks a registration's key: the provider (FI_MR_PROV_KEY) or we do.
enum class MrKeys { kFromProvider, kOurs };

// Registrations by address range, for providers that want local memory
// registered (FI_MR_LOCAL) or when forced. A registration covers whole
// pages and is reused for any buffer inside it. Owned by its endpoint and
// used only on the endpoint's I/O thread.
class MrCache {
 public:
  MrCache(fid_domain* domain, MrKeys keys) : domain_(domain), keys_(keys) {}

  // A registration; the descriptor for [p, p+n) is fi_mr_desc(mr). The
  // entry stays pinned while `in_use` counts it (released with release()).
  struct Entry {
    uintptr_t start = 0;
    uintptr_t end = 0;
    fid_mr* mr = nullptr;
    uint64_t last_use = 0;
    uint32_t in_use = 0;
  };

  // Registers on first use. Errors: kUnavailable from fi_mr_reg.
  Result<Entry*> acquire(const void* p, size_t n);

  void release(Entry* e) { e->in_use--; }

  // Deregisters everything; before the domain closes.
  void close();

  uint64_t registrations() const { return registrations_; }
  uint64_t hits() const { return hits_; }

 private:
  // Drops least recently used idle entries down to the bound.
  void evict();

  fid_domain* domain_;
  MrKeys keys_;
  uint64_t next_key_ = 1;
  uint64_t clock_ = 0;
  uint64_t registrations_ = 0;
  uint64_t hits_ = 0;
  std::map<std::pair<uintptr_t, uintptr_t>, Entry> entries_;
};

}  // namespace tally::fabric
