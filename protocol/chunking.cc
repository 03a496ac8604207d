#include "tally/protocol/chunking.h"

#include <algorithm>

#include "tally/protocol/status.h"

namespace tally {

ChunkPlan::ChunkPlan(uint64_t nbytes, DType dtype, uint32_t shards, const PlanSettings& settings)
    : esize_(dtype_size(dtype)), shards_(shards) {
  TALLY_CHECK(esize_ > 0 && shards > 0);
  elements_ = nbytes / esize_;
  base_ = elements_ / shards_;
  rem_ = static_cast<uint32_t>(elements_ % shards_);
  if (settings.chunk_bytes > 0) {
    piece_ = std::max<uint64_t>(1, settings.chunk_bytes / esize_);
  } else {
    const uint64_t largest = base_ + (rem_ > 0 ? 1 : 0);
    const uint64_t target = std::max<uint32_t>(settings.target_pieces, 1);
    const uint64_t hi =
        std::max<uint64_t>(1, std::min(max_piece_elements(settings.max_chunk_bytes, dtype),
                                       settings.max_piece_bytes / esize_));
    const uint64_t lo = std::clamp<uint64_t>(settings.min_piece_bytes / esize_, 1, hi);
    piece_ = std::clamp<uint64_t>(largest / target + (largest % target != 0), lo, hi);
  }
  big_pieces_ = pieces_of(base_ + 1);
  small_pieces_ = pieces_of(base_);
  // No wrap: pieces <= elements.
  count_ = big_pieces_ * rem_ + small_pieces_ * (shards_ - rem_);
}

uint64_t ChunkPlan::first_chunk(uint32_t shard) const {
  TALLY_CHECK(shard < shards_);
  const uint64_t big = std::min(shard, rem_);
  return big * big_pieces_ + (shard - big) * small_pieces_;
}

uint64_t ChunkPlan::chunks_on_shard(uint32_t shard) const {
  TALLY_CHECK(shard < shards_);
  return shard < rem_ ? big_pieces_ : small_pieces_;
}

uint64_t ChunkPlan::shard_offset(uint32_t shard) const {
  TALLY_CHECK(shard < shards_);
  return (shard * base_ + std::min(shard, rem_)) * esize_;
}

uint64_t ChunkPlan::shard_bytes(uint32_t shard) const {
  TALLY_CHECK(shard < shards_);
  return range_elements(shard) * esize_;
}

ChunkExtent ChunkPlan::chunk(uint64_t index) const {
  TALLY_CHECK(index < count_);
  const uint64_t in_big = big_pieces_ * rem_;
  uint32_t shard;
  uint64_t k;  // the piece's index within its shard
  if (index < in_big) {
    shard = static_cast<uint32_t>(index / big_pieces_);
    k = index % big_pieces_;
  } else {
    // small_pieces_ > 0 here: every index past in_big is a short range's piece.
    shard = rem_ + static_cast<uint32_t>((index - in_big) / small_pieces_);
    k = (index - in_big) % small_pieces_;
  }
  const uint64_t range = range_elements(shard);
  ChunkExtent e;
  e.index = static_cast<uint32_t>(index);
  e.shard = shard;
  e.offset = shard_offset(shard) + k * piece_ * esize_;
  e.length = std::min(piece_, range - k * piece_) * esize_;
  return e;
}

}  // namespace tally
