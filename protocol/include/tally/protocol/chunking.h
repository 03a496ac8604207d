// How an op's tensor is cut into chunks and spread over shards.
//
// The plan is a pure function of (nbytes, dtype, S, PlanSettings, op), so
// every rank computes the same one (docs/architecture.md, "The chunk plan"):
//
// 1. An op spreads over n = min(S, ceil(nbytes / min_shard_bytes)) shards
//    (all S with `chunk_bytes` set or min_shard_bytes 0): a small op goes to
//    fewer reducers, as each one it reaches costs every rank a frame and a
//    wake-up. Its E elements are split into n contiguous ranges of E / n
//    elements, the first E % n ranges taking one more. Range j goes to shard
//    (first + j) % S, first = op % S when n < S (so small ops take turns
//    over the shards) and 0 when n = S. A shard gets nothing when it has no
//    range or when E < n.
// 2. Each shard's range is cut into chunks of P elements (the last chunk of a
//    range may be shorter). Automatic: P = clamp(ceil(R / target_chunks),
//    chunk floor, chunk ceiling), R the largest range, so a shard's pipeline has
//    about `target_chunks` chunks (fill and drain are a small part of the op)
//    but no chunk is so small that per-frame cost dominates. With
//    `chunk_bytes` set (TALLY_CHUNK_BYTES) P is exactly that many bytes,
//    rounded down to whole elements (at least one).
// 3. Chunks are numbered range after range: range 0's chunks first, in
//    offset order, then range 1's; so chunk k+1 starts where chunk k ends,
//    and the chunks tile the tensor in index order.
//
// A tensor of 0 bytes has no chunks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tally/protocol/dtype.h"

namespace tally {

// Defaults of the automatic plan; the reasons (measurements) are in
// docs/architecture.md, "The chunk plan".
inline constexpr uint32_t kPlanTargetChunks = 16;               // per shard
inline constexpr uint64_t kPlanChunkFloorBytes = 32u << 10;     // per-frame cost floor
inline constexpr uint64_t kPlanChunkCeilingBytes = 256u << 10;  // fill and drain on paced links
inline constexpr uint64_t kPlanPacedChunkCeilingMs =
    3;  // ceiling on slow paced links, ms of a stream
inline constexpr uint64_t kPlanMinShardBytes = 16u << 10;    // per reducer an op reaches
inline constexpr uint64_t kDefaultMaxChunkBytes = 4u << 20;  // the reducer's --max-chunk-bytes
// The largest --max-chunk-bytes a reducer may have (so the largest data frame
// a worker may be sent, known before the Welcome says the actual limit).
inline constexpr uint64_t kMaxChunkBytesLimit = 1u << 30;

// The most elements of `dtype` one chunk may hold at a reducer whose
// Welcome says `max_chunk_bytes` (its slab size): 16-bit types are summed in
// float32 accumulators (4 bytes each), others in their own size. At least 1.
// The one place that knows how a reducer's slab relates to a chunk.
uint64_t max_chunk_elements(uint64_t max_chunk_bytes, DType dtype);

// The automatic plan's chunk ceiling for a pool whose reducers' links run at
// `link_rate_bits` (the slowest of their Welcomes' link_rate_bits; 0 where
// any reducer has none): about
// kPlanPacedChunkCeilingMs of wire time at the paced share of a stream when
// `streams` share one link (max(S, W): a worker's S streams leave its link,
// and a reducer paces its W streams of results to their share of its own),
// rounded down to 4 KiB, between kPlanChunkFloorBytes and
// kPlanChunkCeilingBytes; kPlanChunkCeilingBytes without a rate. A reducer returns
// a chunk only once every rank's copy is in, so each op spends about a
// chunk's wire time filling and one draining a shard's pipeline, and on a
// slow link at W = 8 that was a third of a 16 MiB op with 128 KiB chunks.
uint64_t chunk_ceiling_for_link(uint64_t link_rate_bits, uint32_t streams);

struct PlanSettings {
  // The smallest max_chunk_bytes among the reducers the worker talks to.
  uint64_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // 0: automatic; else the override's chunk size in bytes (TALLY_CHUNK_BYTES).
  uint64_t chunk_bytes = 0;
  uint32_t target_chunks = kPlanTargetChunks;
  // Automatic plans only; a client sets chunk_ceiling_for_link of its pool.
  uint64_t chunk_floor_bytes = kPlanChunkFloorBytes;
  uint64_t chunk_ceiling_bytes = kPlanChunkCeilingBytes;
  // Automatic plans only: an op reaches one shard per this many bytes (at
  // least one, at most S); 0: every op reaches all S.
  uint64_t min_shard_bytes = kPlanMinShardBytes;
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
  // whole elements. `op`: the op's number, which picks the first shard of an
  // op that reaches fewer than S.
  ChunkPlan(uint64_t nbytes, DType dtype, uint32_t shards, const PlanSettings& settings = {},
            uint64_t op = 0);

  uint64_t nbytes() const { return elements_ * esize_; }
  uint32_t shards() const { return shards_; }
  // How many shards the op reaches (its ranges), 1..shards().
  uint32_t spread() const { return spread_; }
  // Bytes of a full chunk (every chunk but a range's last is full).
  uint64_t full_chunk_bytes() const { return chunk_ * esize_; }
  uint64_t chunk_count() const { return count_; }
  // Requires index < chunk_count().
  ChunkExtent chunk(uint64_t index) const;
  // How many chunks go to `shard` (requires shard < shards()).
  uint64_t chunks_on_shard(uint32_t shard) const;
  // Index of `shard`'s first chunk (its chunks are the next
  // chunks_on_shard(shard) indices); requires shard < shards().
  uint64_t first_chunk(uint32_t shard) const;
  // The bytes [offset, offset + length) of the tensor that `shard` owns
  // (0 bytes, at offset 0, for a shard the op does not reach).
  uint64_t shard_offset(uint32_t shard) const;
  uint64_t shard_bytes(uint32_t shard) const;

 private:
  // The range `shard` holds, or spread_ when it holds none.
  uint32_t range_of(uint32_t shard) const;
  uint64_t range_elements(uint32_t range) const { return base_ + (range < rem_ ? 1 : 0); }
  uint64_t chunks_of(uint64_t range) const { return range / chunk_ + (range % chunk_ != 0); }

  uint64_t esize_;
  uint64_t elements_;
  uint32_t shards_;
  uint32_t spread_;      // ranges, 1..shards_
  uint32_t first_;       // the shard of range 0
  uint64_t base_;        // elements of a short range
  uint32_t rem_;         // ranges with base_ + 1 elements (the first ones)
  uint64_t chunk_;       // elements of a full chunk, >= 1
  uint64_t big_chunks_;  // chunks of a range of base_ + 1 elements
  uint64_t small_chunks_;
  uint64_t count_;
};

}  // namespace tally
