// How an op's tensor is cut into pieces ("chunks") and spread over shards.
//
// The plan is a pure function of (nbytes, dtype, S, PlanSettings), so every
// rank computes the same one (docs/architecture.md, "The chunk plan"):
//
// 1. Every op spreads over all S shards. Its E elements are split into S
//    contiguous ranges of E / S elements, the first E % S shards taking one
//    more; so a shard gets nothing only when E < S.
// 2. Each shard's range is cut into pieces of P elements (the last piece of a
//    range may be shorter). Automatic: P = clamp(ceil(R / target_pieces),
//    min_piece, max_piece), R the largest range, so a shard's pipeline has
//    about `target_pieces` pieces (fill and drain are a small part of the op)
//    but no piece is so small that per-frame cost dominates. With
//    `chunk_bytes` set (TALLY_CHUNK_BYTES) P is exactly that many bytes,
//    rounded down to whole elements (at least one).
// 3. Chunks are numbered shard after shard: shard 0's pieces first, in offset
//    order, then shard 1's; so chunk k+1 starts where chunk k ends, and the
//    chunks tile the tensor in index order.
//
// A tensor of 0 bytes has no chunks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tally/protocol/dtype.h"

namespace tally {

// Defaults of the automatic plan; the reasons (measurements) are in
// docs/architecture.md, "The chunk plan".
inline constexpr uint32_t kPlanTargetPieces = 16;            // per shard
inline constexpr uint64_t kPlanMinPieceBytes = 64u << 10;    // per-frame cost floor
inline constexpr uint64_t kPlanMaxPieceBytes = 1u << 20;     // keeps byte windows a few pieces deep
inline constexpr uint64_t kDefaultMaxChunkBytes = 4u << 20;  // the reducer's --max-chunk-bytes
// The largest --max-chunk-bytes a reducer may have (so the largest data frame
// a worker may be sent, known before the Welcome says the actual limit).
inline constexpr uint64_t kMaxChunkBytesLimit = 1u << 30;

// The most elements of `dtype` one piece may hold at a reducer whose
// Welcome says `max_chunk_bytes` (its slab size): 16-bit types are summed in
// float32 accumulators (4 bytes each), others in their own size. At least 1.
// The one place that knows how a reducer's slab relates to a piece.
uint64_t max_piece_elements(uint64_t max_chunk_bytes, DType dtype);

struct PlanSettings {
  // The smallest max_chunk_bytes among the reducers the worker talks to.
  uint64_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // 0: automatic; else the override's piece size in bytes (TALLY_CHUNK_BYTES).
  uint64_t chunk_bytes = 0;
  uint32_t target_pieces = kPlanTargetPieces;
  uint64_t min_piece_bytes = kPlanMinPieceBytes;
  uint64_t max_piece_bytes = kPlanMaxPieceBytes;  // automatic plans only
};

struct ChunkExtent {
  uint32_t index = 0;
  uint32_t shard = 0;
  uint64_t offset = 0;  // bytes
  uint64_t length = 0;  // bytes, > 0
};

class ChunkPlan {
 public:
  // Requires a known dtype and shards > 0. `nbytes` is rounded down to
  // whole elements.
  ChunkPlan(uint64_t nbytes, DType dtype, uint32_t shards, const PlanSettings& settings = {});

  uint64_t nbytes() const { return elements_ * esize_; }
  uint32_t shards() const { return shards_; }
  // Bytes of a full piece (every piece but a range's last is full).
  uint64_t piece_bytes() const { return piece_ * esize_; }
  uint64_t chunk_count() const { return count_; }
  // Requires index < chunk_count().
  ChunkExtent chunk(uint64_t index) const;
  // How many chunks go to `shard` (requires shard < shards()).
  uint64_t chunks_on_shard(uint32_t shard) const;
  // Index of `shard`'s first chunk (its chunks are the next
  // chunks_on_shard(shard) indices); requires shard < shards().
  uint64_t first_chunk(uint32_t shard) const;
  // The bytes [offset, offset + length) of the tensor that `shard` owns.
  uint64_t shard_offset(uint32_t shard) const;
  uint64_t shard_bytes(uint32_t shard) const;

 private:
  uint64_t range_elements(uint32_t shard) const { return base_ + (shard < rem_ ? 1 : 0); }
  uint64_t pieces_of(uint64_t range) const { return range / piece_ + (range % piece_ != 0); }

  uint64_t esize_;
  uint64_t elements_;
  uint32_t shards_;
  uint64_t base_;        // elements of a short range
  uint32_t rem_;         // shards with base_ + 1 elements (the first ones)
  uint64_t piece_;       // elements of a full piece, >= 1
  uint64_t big_pieces_;  // pieces of a range of base_ + 1 elements
  uint64_t small_pieces_;
  uint64_t count_;
};

}  // namespace tally
