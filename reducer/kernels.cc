#include "tally/reducer/kernels.h"

#include <cstring>
#include <type_traits>

#include "tally/protocol/kernels.h"
#include "tally/protocol/status.h"

namespace tally {
namespace {

// Integers wrap on overflow (two's complement, as in NCCL): they are added as
// their unsigned counterparts, where wrapping is defined.
template <typename T>
struct AddTypeOf {
  using type = T;
};
template <>
struct AddTypeOf<int32_t> {
  using type = uint32_t;
};
template <>
struct AddTypeOf<int64_t> {
  using type = uint64_t;
};
template <typename T>
using AddType = typename AddTypeOf<T>::type;

// Chunk buffers are page aligned and offsets are element multiples, but
// typed access needs alignment: check it rather than assume.
template <typename T>
void check_aligned(const std::byte* p) {
  TALLY_CHECK(reinterpret_cast<uintptr_t>(p) % alignof(T) == 0);
}

template <typename T>
void add_loop(std::byte* dst, const std::byte* src, size_t nbytes) {
  const size_t n = nbytes / sizeof(T);
  check_aligned<T>(dst);
  check_aligned<T>(src);
  using A = AddType<T>;
  A* __restrict d = reinterpret_cast<A*>(dst);
  const A* __restrict s = reinterpret_cast<const A*>(src);
  for (size_t i = 0; i < n; ++i) d[i] += s[i];
}

template <typename T>
void div_loop(std::byte* data, size_t nbytes, uint32_t divisor) {
  const size_t n = nbytes / sizeof(T);
  check_aligned<T>(data);
  T* d = reinterpret_cast<T*>(data);
  if constexpr (std::is_integral_v<T>) {
    // In int64 so that any uint32 divisor keeps its value (an int32 cast of
    // one above INT32_MAX would turn negative).
    const int64_t div = divisor;
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<int64_t>(d[i]) / div);
  } else {
    const T div = static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) d[i] /= div;
  }
}

float* as_f32(std::byte* p) {
  check_aligned<float>(p);
  return reinterpret_cast<float*>(p);
}
const uint16_t* as_u16(const std::byte* p) {
  check_aligned<uint16_t>(p);
  return reinterpret_cast<const uint16_t*>(p);
}

}  // namespace

bool kernel_supports(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt32:
    case DType::kInt64:
      return true;
  }
  return false;
}

DType accumulator_dtype(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 ? DType::kFloat32 : dtype;
}

size_t payload_offset(DType dtype, size_t payload_bytes) {
  return accumulator_dtype(dtype) != dtype ? payload_bytes : 0;
}

void load_payload(DType dtype, std::byte* acc, size_t payload_bytes) {
  const size_t n = payload_bytes / 2;
  switch (dtype) {
    case DType::kFloat16:
      return kernels().widen_f16(as_f32(acc), as_u16(acc + payload_bytes), n);
    case DType::kBFloat16:
      return kernels().widen_bf16(as_f32(acc), as_u16(acc + payload_bytes), n);
    default:
      TALLY_CHECK(kernel_supports(dtype));
  }
}

void reduce_into(DType dtype, std::byte* acc, const std::byte* payload, size_t payload_bytes) {
  switch (dtype) {
    case DType::kFloat32:
      check_aligned<float>(payload);
      return kernels().sum_f32(as_f32(acc), reinterpret_cast<const float*>(payload),
                               payload_bytes / sizeof(float));
    case DType::kFloat64:
      return add_loop<double>(acc, payload, payload_bytes);
    case DType::kInt32:
      return add_loop<int32_t>(acc, payload, payload_bytes);
    case DType::kInt64:
      return add_loop<int64_t>(acc, payload, payload_bytes);
    case DType::kFloat16:
      return kernels().accumulate_f16(as_f32(acc), as_u16(payload), payload_bytes / 2);
    case DType::kBFloat16:
      return kernels().accumulate_bf16(as_f32(acc), as_u16(payload), payload_bytes / 2);
  }
  TALLY_CHECK(kernel_supports(dtype));
}

void scale_average(DType dtype, std::byte* data, size_t nbytes, uint32_t divisor) {
  TALLY_CHECK(divisor > 0);
  switch (accumulator_dtype(dtype)) {
    case DType::kFloat32:
      return div_loop<float>(data, nbytes, divisor);
    case DType::kFloat64:
      return div_loop<double>(data, nbytes, divisor);
    case DType::kInt32:
      return div_loop<int32_t>(data, nbytes, divisor);
    case DType::kInt64:
      return div_loop<int64_t>(data, nbytes, divisor);
    default:
      TALLY_CHECK(kernel_supports(dtype));
  }
}

void store_result(DType dtype, std::byte* data, size_t count) {
  switch (dtype) {
    case DType::kFloat16:
      return kernels().narrow_f16(reinterpret_cast<uint16_t*>(data), as_f32(data), count);
    case DType::kBFloat16:
      return kernels().narrow_bf16(reinterpret_cast<uint16_t*>(data), as_f32(data), count);
    default:
      TALLY_CHECK(kernel_supports(dtype));
  }
}

}  // namespace tally
