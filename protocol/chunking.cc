#include "tally/protocol/chunking.h"

#include <algorithm>

#include "tally/protocol/link_rate.h"
#include "tally/protocol/status.h"

namespace tally {

uint64_t max_chunk_elements(uint64_t max_chunk_bytes, DType dtype) {
  const uint64_t esize = dtype_size(dtype);
  TALLY_CHECK(esize > 0);
  // 16-bit types are summed in float32 accumulators (kernels.h), 4 bytes of
  // slab per element.
  return std::max<uint64_t>(1, max_chunk_bytes / (esize == 2 ? 4 : esize));
}

namespace {

// What one of `streams` streams paced to their shares of a link moves in a
// millisecond (paced_share; at least one stream).
uint64_t paced_bytes_per_ms(uint64_t link_rate_bits, uint32_t streams) {
  return paced_share(link_rate_bits, std::max<uint32_t>(1, streams)) / 1000;
}

}  // namespace

uint64_t chunk_ceiling_for_link(uint64_t link_rate_bits, uint32_t streams) {
  if (link_rate_bits == 0) return kPlanChunkCeilingBytes;
  const uint64_t bytes =
      kPlanPacedChunkCeilingMs * paced_bytes_per_ms(link_rate_bits, streams) / 4096 * 4096;
  return std::clamp<uint64_t>(bytes, kPlanChunkFloorBytes, kPlanChunkCeilingBytes);
}

ChunkPlan::ChunkPlan(uint64_t nbytes, DType dtype, uint32_t shards, const PlanSettings& settings,
                     uint64_t op)
    : esize_(dtype_size(dtype)), shards_(shards) {
  TALLY_CHECK(esize_ > 0 && shards > 0);
  elements_ = nbytes / esize_;
  spread_ = shards_;
  if (settings.chunk_bytes == 0 && settings.min_shard_bytes > 0) {
    const uint64_t bytes = elements_ * esize_;
    const uint64_t wanted =
        bytes / settings.min_shard_bytes + (bytes % settings.min_shard_bytes != 0);
    spread_ = static_cast<uint32_t>(std::clamp<uint64_t>(wanted, 1, shards_));
  }
  first_ = spread_ < shards_ ? static_cast<uint32_t>(op % shards_) : 0;
  base_ = elements_ / spread_;
  rem_ = static_cast<uint32_t>(elements_ % spread_);
  if (settings.chunk_bytes > 0) {
    chunk_ = std::max<uint64_t>(1, settings.chunk_bytes / esize_);
  } else {
    const uint64_t largest = base_ + (rem_ > 0 ? 1 : 0);
    const uint64_t target = std::max<uint32_t>(settings.target_chunks, 1);
    const uint64_t hi =
        std::max<uint64_t>(1, std::min(max_chunk_elements(settings.max_chunk_bytes, dtype),
                                       settings.chunk_ceiling_bytes / esize_));
    const uint64_t lo = std::clamp<uint64_t>(settings.chunk_floor_bytes / esize_, 1, hi);
    chunk_ = std::clamp<uint64_t>(largest / target + (largest % target != 0), lo, hi);
  }
  big_chunks_ = chunks_of(base_ + 1);
  small_chunks_ = chunks_of(base_);
  // No wrap: chunks <= elements.
  count_ = big_chunks_ * rem_ + small_chunks_ * (spread_ - rem_);
}

uint32_t ChunkPlan::range_of(uint32_t shard) const {
  TALLY_CHECK(shard < shards_);
  const uint32_t range = (shard + shards_ - first_) % shards_;
  return range < spread_ ? range : spread_;
}

uint64_t ChunkPlan::first_chunk(uint32_t shard) const {
  const uint32_t range = range_of(shard);
  const uint64_t big = std::min(range, rem_);
  return big * big_chunks_ + (range - big) * small_chunks_;
}

uint64_t ChunkPlan::chunks_on_shard(uint32_t shard) const {
  const uint32_t range = range_of(shard);
  if (range == spread_) return 0;
  return range < rem_ ? big_chunks_ : small_chunks_;
}

uint64_t ChunkPlan::shard_offset(uint32_t shard) const {
  const uint32_t range = range_of(shard);
  if (range == spread_) return 0;
  return (range * base_ + std::min(range, rem_)) * esize_;
}

uint64_t ChunkPlan::shard_bytes(uint32_t shard) const {
  const uint32_t range = range_of(shard);
  if (range == spread_) return 0;
  return range_elements(range) * esize_;
}

ChunkExtent ChunkPlan::chunk(uint64_t index) const {
  TALLY_CHECK(index < count_);
  const uint64_t in_big = big_chunks_ * rem_;
  uint32_t range;
  uint64_t k;  // the chunk's index within its range
  if (index < in_big) {
    range = static_cast<uint32_t>(index / big_chunks_);
    k = index % big_chunks_;
  } else {
    // small_chunks_ > 0 here: every index past in_big is a short range's chunk.
    range = rem_ + static_cast<uint32_t>((index - in_big) / small_chunks_);
    k = (index - in_big) % small_chunks_;
  }
  ChunkExtent e;
  e.index = static_cast<uint32_t>(index);
  e.shard = static_cast<uint32_t>((first_ + range) % shards_);
  e.offset = (range * base_ + std::min(range, rem_)) * esize_ + k * chunk_ * esize_;
  e.length = std::min(chunk_, range_elements(range) - k * chunk_) * esize_;
  return e;
}

}  // namespace tally
