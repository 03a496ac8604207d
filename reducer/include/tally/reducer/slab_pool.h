// Chunk memory: a fixed pool of equal slabs carved from one mapping made at
// start-up, and per-job quotas drawn from it. No payload memory is allocated
// on the data path; when a job's quota is empty its connections stop reading until
// a slab comes back (back-pressure), they never grow memory or drop data.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "tally/protocol/status.h"

namespace tally {

// Thread-safe. Owns the mapping; must outlive every quota drawn from it.
class SlabPool {
 public:
  // Maps slab_bytes * count bytes (huge pages advised, not pre-touched).
  // Errors: kResourceExhausted when the mapping fails.
  static Result<std::shared_ptr<SlabPool>> create(size_t slab_bytes, size_t count);
  ~SlabPool();
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  size_t slab_bytes() const { return slab_bytes_; }
  size_t total() const { return count_; }
  size_t available() const;
  // Slabs holding data now (taken from a quota, not yet given back);
  // lock-free, for /metrics.
  size_t in_use() const { return in_use_.load(std::memory_order_relaxed); }
  // Takes n slabs, or none (empty result) if fewer are free.
  std::vector<std::byte*> take(size_t n);
  void give_back(const std::vector<std::byte*>& slabs);

 private:
  friend class SlabQuota;  // counts in_use_
  SlabPool(std::byte* base, size_t slab_bytes, size_t count);
  std::byte* base_;
  size_t slab_bytes_;
  size_t count_;
  mutable std::mutex mu_;
  std::vector<std::byte*> free_;
  std::atomic<size_t> in_use_{0};
};

class SlabQuota;

// One slab in use; returns to its quota when destroyed. Shared by the sends
// of a finished chunk to all workers.
class Slab {
 public:
  Slab(std::shared_ptr<SlabQuota> quota, std::byte* data, size_t bytes)
      : quota_(std::move(quota)), data_(data), bytes_(bytes) {}
  ~Slab();
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  std::byte* data() const { return data_; }
  std::span<std::byte> first(size_t n) const {
    TALLY_CHECK_LE(n, bytes_);
    return {data_, n};
  }

 private:
  std::shared_ptr<SlabQuota> quota_;
  std::byte* data_;
  size_t bytes_;
};

// A job's reserved slabs. Thread-safe.
class SlabQuota : public std::enable_shared_from_this<SlabQuota> {
 public:
  // Reserves n slabs from `pool`. Errors: kResourceExhausted.
  static Result<std::shared_ptr<SlabQuota>> reserve(std::shared_ptr<SlabPool> pool, size_t n);
  ~SlabQuota();  // returns the reservation to the pool

  // A free slab, or null after registering `waiter`, which is called once
  // (from whichever thread frees a slab, never under a lock of ours) when
  // one may be available. The waiter must not block.
  std::shared_ptr<Slab> try_take(std::function<void()> waiter);
  size_t in_use() const;
  // Its job is gone: the free slabs go back to the pool now, and each one
  // still out as it comes back, instead of all of them when the last one
  // does. A fabric provider may hold a slab for minutes after its stream
  // was given up (docs/fabric.md, "Failure"); it keeps that slab out, not
  // the job's reservation. try_take takes none after this.
  void retire();

 private:
  friend class Slab;
  SlabQuota(std::shared_ptr<SlabPool> pool, std::vector<std::byte*> slabs);
  void give(std::byte* data);

  std::shared_ptr<SlabPool> pool_;
  std::vector<std::byte*> reserved_;
  mutable std::mutex mu_;
  std::vector<std::byte*> free_;
  std::deque<std::function<void()>> waiters_;
  bool retired_ = false;
};

}  // namespace tally
