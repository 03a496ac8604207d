#include "tally/reducer/slab_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace tally {

Result<std::shared_ptr<SlabPool>> SlabPool::create(size_t slab_bytes, size_t count) {
  TALLY_CHECK(slab_bytes > 0 && count > 0);
  if (count > SIZE_MAX / slab_bytes) {
    return Status(ErrorCode::kResourceExhausted, std::to_string(count) + " buffers of " +
                                                     std::to_string(slab_bytes) +
                                                     " bytes overflow the address space");
  }
  const size_t bytes = slab_bytes * count;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status(ErrorCode::kResourceExhausted, "cannot map " + std::to_string(bytes) +
                                                     " bytes of chunk memory: " + strerror(errno));
  }
  // Huge pages move large buffers through TCP 3-5x faster here (machine-perf.md).
  madvise(p, bytes, MADV_HUGEPAGE);
  return std::shared_ptr<SlabPool>(new SlabPool(static_cast<std::byte*>(p), slab_bytes, count));
}

SlabPool::SlabPool(std::byte* base, size_t slab_bytes, size_t count)
    : base_(base), slab_bytes_(slab_bytes), count_(count) {
  free_.reserve(count);
  for (size_t i = count; i-- > 0;) free_.push_back(base_ + i * slab_bytes);
}

SlabPool::~SlabPool() { munmap(base_, slab_bytes_ * count_); }

size_t SlabPool::available() const {
  std::lock_guard lock(mu_);
  return free_.size();
}

std::vector<std::byte*> SlabPool::take(size_t n) {
  std::lock_guard lock(mu_);
  if (free_.size() < n) return {};
  std::vector<std::byte*> out(free_.end() - static_cast<ptrdiff_t>(n), free_.end());
  free_.resize(free_.size() - n);
  return out;
}

void SlabPool::give_back(const std::vector<std::byte*>& slabs) {
  std::lock_guard lock(mu_);
  free_.insert(free_.end(), slabs.begin(), slabs.end());
}

Slab::~Slab() { quota_->give(data_); }

Result<std::shared_ptr<SlabQuota>> SlabQuota::reserve(std::shared_ptr<SlabPool> pool, size_t n) {
  auto slabs = pool->take(n);
  if (slabs.size() != n) {
    return Status(ErrorCode::kResourceExhausted, "reducer memory budget exhausted: a job needs " +
                                                     std::to_string(n) + " chunk buffers, " +
                                                     std::to_string(pool->available()) + " of " +
                                                     std::to_string(pool->total()) + " are free");
  }
  return std::shared_ptr<SlabQuota>(new SlabQuota(std::move(pool), std::move(slabs)));
}

SlabQuota::SlabQuota(std::shared_ptr<SlabPool> pool, std::vector<std::byte*> slabs)
    : pool_(std::move(pool)), reserved_(slabs), free_(std::move(slabs)) {}

SlabQuota::~SlabQuota() { pool_->give_back(reserved_); }

std::shared_ptr<Slab> SlabQuota::try_take(std::function<void()> waiter) {
  std::lock_guard lock(mu_);
  if (retired_) return nullptr;
  if (free_.empty()) {
    waiters_.push_back(std::move(waiter));
    return nullptr;
  }
  std::byte* data = free_.back();
  free_.pop_back();
  pool_->in_use_.fetch_add(1, std::memory_order_relaxed);
  return std::make_shared<Slab>(shared_from_this(), data, pool_->slab_bytes());
}

size_t SlabQuota::in_use() const {
  std::lock_guard lock(mu_);
  return reserved_.size() - free_.size();
}

void SlabQuota::retire() {
  std::lock_guard lock(mu_);
  if (retired_) return;
  retired_ = true;
  waiters_.clear();
  std::erase_if(reserved_, [&](std::byte* slab) {
    return std::find(free_.begin(), free_.end(), slab) != free_.end();
  });
  pool_->give_back(free_);
  free_.clear();
}

void SlabQuota::give(std::byte* data) {
  // Wake every waiter: one that was woken but has closed meanwhile must not
  // swallow the wake-up of the others; the losers simply wait again.
  std::deque<std::function<void()>> wake;
  {
    std::lock_guard lock(mu_);
    if (retired_) {
      std::erase(reserved_, data);
      pool_->give_back({data});
      pool_->in_use_.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
    free_.push_back(data);
    wake.swap(waiters_);
    pool_->in_use_.fetch_sub(1, std::memory_order_relaxed);
  }
  for (auto& w : wake) w();
}

}  // namespace tally
