#include "tally/protocol/chunking.h"

#include <algorithm>

#include "tally/protocol/status.h"

namespace tally {

ChunkPlan::ChunkPlan(uint64_t nbytes, size_t element_bytes, size_t chunk_bytes, uint32_t shards)
    : nbytes_(nbytes), shards_(shards) {
  TALLY_CHECK(element_bytes > 0 && chunk_bytes > 0 && shards > 0);
  chunk_bytes_ = std::max<uint64_t>(element_bytes, chunk_bytes / element_bytes * element_bytes);
  count_ = nbytes_ / chunk_bytes_ + (nbytes_ % chunk_bytes_ != 0);  // no wrap near 2^64
}

ChunkExtent ChunkPlan::chunk(uint64_t index) const {
  TALLY_CHECK(index < count_);
  ChunkExtent e;
  e.index = static_cast<uint32_t>(index);
  e.shard = static_cast<uint32_t>(index % shards_);
  e.offset = index * chunk_bytes_;
  e.length = std::min<uint64_t>(chunk_bytes_, nbytes_ - e.offset);
  return e;
}

uint64_t ChunkPlan::chunks_on_shard(uint32_t shard) const {
  TALLY_CHECK(shard < shards_);
  return count_ > shard ? (count_ - 1 - shard) / shards_ + 1 : 0;
}

}  // namespace tally
