#include "mr_cache.h"

#include <unistd.h>

#include <string>

#include "libfabric.h"

namespace tally::fabric {
namespace {

// Registrations kept per endpoint; least recently used idle ones go first.
constexpr size_t kMrCacheEntries = 512;

}  // namespace

Result<MrCache::Entry*> MrCache::acquire(const void* p, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (auto& [start, e] : entries_) {
    if (e.start <= a && a + n <= e.end) {
      e.last_use = ++clock_;
      e.in_use++;
      hits_++;
      return &e;
    }
  }
  evict();
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  Entry e;
  e.start = a & ~(page - 1);
  e.end = (a + n + page - 1) & ~(page - 1);
  int rc = fi_mr_reg(domain_, reinterpret_cast<void*>(e.start), e.end - e.start, FI_SEND | FI_RECV,
                     0, keys_ == MrKeys::kFromProvider ? 0 : next_key_++, 0, &e.mr, nullptr);
  if (rc != 0) return fi_status("fi_mr_reg", rc, std::to_string(e.end - e.start) + " bytes");
  e.last_use = ++clock_;
  e.in_use = 1;
  registrations_++;
  auto [it, inserted] = entries_.emplace(std::make_pair(e.start, e.end), e);
  if (!inserted) {  // same range registered twice: keep the older one
    fi_close(&e.mr->fid);
    it->second.in_use++;
  }
  return &it->second;
}

void MrCache::close() {
  for (auto& [range, e] : entries_) fi_close(&e.mr->fid);
  entries_.clear();
}

void MrCache::evict() {
  while (entries_.size() >= kMrCacheEntries) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.in_use == 0 &&
          (victim == entries_.end() || it->second.last_use < victim->second.last_use)) {
        victim = it;
      }
    }
    if (victim == entries_.end()) return;  // all in use: grow past the bound
    fi_close(&victim->second.mr->fid);
    entries_.erase(victim);
  }
}

}  // namespace tally::fabric
