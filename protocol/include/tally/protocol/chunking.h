// How a tensor is cut into chunks and striped over shards.
//
// Terms: the tensor has `nbytes` bytes of elements of `element_bytes` each.
// The chunk size is `chunk_bytes` rounded down to a whole number of elements
// (at least one element). Chunk k covers bytes [k * chunk, min(nbytes,
// (k + 1) * chunk)) and goes to shard k mod S, so consecutive chunks land on
// different reducers and all shards work at once. A tensor of 0 bytes has no
// chunks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tally {

struct ChunkExtent {
  uint32_t index = 0;
  uint32_t shard = 0;
  uint64_t offset = 0;  // bytes
  uint64_t length = 0;  // bytes, > 0
};

class ChunkPlan {
 public:
  // Requires element_bytes > 0, chunk_bytes > 0, shards > 0.
  ChunkPlan(uint64_t nbytes, size_t element_bytes, size_t chunk_bytes, uint32_t shards);

  uint64_t nbytes() const { return nbytes_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t shards() const { return shards_; }
  uint64_t chunk_count() const { return count_; }
  // Requires index < chunk_count().
  ChunkExtent chunk(uint64_t index) const;
  // How many chunks go to `shard` (requires shard < shards()).
  uint64_t chunks_on_shard(uint32_t shard) const;

 private:
  uint64_t nbytes_;
  uint64_t chunk_bytes_;
  uint32_t shards_;
  uint64_t count_;
};

}  // namespace tally
