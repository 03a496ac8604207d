// Element types and reductions as they appear on the wire (one byte each).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tally {

enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt32 = 5,
  kInt64 = 6,
};

enum class RedOp : uint8_t {
  kSum = 1,
  kAverage = 2,  // sum divided by the job's world size, applied once by the reducer
};

// Size of one element; 0 for a value that is not a known DType.
size_t dtype_size(DType dtype);
// nccl-tests spelling: "float", "double", "half", "bfloat16", "int32", "int64".
std::string_view dtype_name(DType dtype);
std::optional<DType> parse_dtype(std::string_view name);
std::string_view redop_name(RedOp op);  // "sum", "avg"
std::optional<RedOp> parse_redop(std::string_view name);

// The most elements of `dtype` one chunk (piece) may hold on a reducer whose
// chunk buffers are `max_chunk_bytes`: 16-bit types are summed in float32
// accumulators, 4 bytes per element (reducer/kernels.h), so max_chunk_bytes / 4
// for them and max_chunk_bytes / dtype_size otherwise, at least 1; 0 for an
// unknown dtype. The one place that knows how a reducer's slab relates to a
// piece's elements (the chunk plan, the client's and the reducer's checks).
uint64_t max_piece_elements(uint64_t max_chunk_bytes, DType dtype);

bool is_known_dtype(uint8_t raw);
bool is_known_redop(uint8_t raw);

}  // namespace tally
