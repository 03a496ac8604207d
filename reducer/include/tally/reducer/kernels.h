// Reduction kernels: dst += src over raw chunk bytes, and the final scaling
// for averages. Float32 and float64 loops are written so GCC vectorises them
// (machine-perf.md: explicit AVX-512 gains 0-15% over that); 16-bit types
// need conversion kernels and are refused until they exist.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tally/protocol/dtype.h"

namespace tally {

// Whether reduce_into/scale_average handle `dtype`.
bool kernel_supports(DType dtype);
// dst[i] += src[i] for nbytes / dtype_size(dtype) elements. Requires support.
void reduce_into(DType dtype, std::byte* dst, const std::byte* src, size_t nbytes);
// data[i] /= divisor (integer division for integer types).
void scale_average(DType dtype, std::byte* data, size_t nbytes, uint32_t divisor);

}  // namespace tally
