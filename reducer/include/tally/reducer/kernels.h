// Reduction kernels over raw chunk bytes: adds into a chunk's accumulator
// and the final scaling for averages. Float32 adds go through the
// run-time-dispatched kernels of tally/protocol/kernels.h; float64 and the
// integers are loops GCC vectorises.
//
// 16-bit types (float16, bfloat16) accumulate in float32: a chunk's
// accumulator holds 4 bytes per element, the first payload is received into
// the accumulator slab's upper half and widened in place, every further
// payload is widened and added in one pass, and the result is narrowed in
// place (round to nearest even) before it is sent. So a 16-bit chunk of n
// elements needs 4n bytes of slab (max_chunk_elements in chunking.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tally/protocol/dtype.h"

namespace tally {

// Whether the functions below handle `dtype`.
bool kernel_supports(DType dtype);
// The element type of a chunk's accumulator: float32 for 16-bit types,
// `dtype` itself otherwise.
DType accumulator_dtype(DType dtype);
// Where in the accumulator slab the first payload of `payload_bytes` is
// received: payload_bytes for 16-bit types (the upper half of the 4n bytes),
// 0 otherwise.
size_t payload_offset(DType dtype, size_t payload_bytes);
// Turns the payload received at `acc + payload_offset` into accumulators at
// `acc` (16-bit types: widens in place; others: nothing to do).
void load_payload(DType dtype, std::byte* acc, size_t payload_bytes);
// acc[i] += payload[i] for payload_bytes / dtype_size(dtype) elements; acc
// holds accumulator_dtype(dtype) elements.
void reduce_into(DType dtype, std::byte* acc, const std::byte* payload, size_t payload_bytes);
// data[i] /= divisor over accumulators of accumulator_dtype(dtype) (integer
// division for integer types); `nbytes` counts accumulator bytes.
void scale_average(DType dtype, std::byte* data, size_t nbytes, uint32_t divisor);
// Turns `count` accumulators at `data` into the op's elements in place
// (16-bit types: narrows; others: nothing to do).
void store_result(DType dtype, std::byte* data, size_t count);

}  // namespace tally
