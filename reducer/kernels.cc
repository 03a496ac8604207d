#include "tally/reducer/kernels.h"

#include <cstring>
#include <type_traits>

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

template <typename T>
void add_loop(std::byte* dst, const std::byte* src, size_t nbytes) {
  const size_t n = nbytes / sizeof(T);
  // Chunk buffers are page aligned and offsets are element multiples, but
  // memcpy-free typed access needs alignment: check it rather than assume.
  TALLY_CHECK(reinterpret_cast<uintptr_t>(dst) % alignof(T) == 0);
  TALLY_CHECK(reinterpret_cast<uintptr_t>(src) % alignof(T) == 0);
  using A = AddType<T>;
  A* __restrict d = reinterpret_cast<A*>(dst);
  const A* __restrict s = reinterpret_cast<const A*>(src);
  for (size_t i = 0; i < n; ++i) d[i] += s[i];
}

template <typename T>
void div_loop(std::byte* data, size_t nbytes, uint32_t divisor) {
  const size_t n = nbytes / sizeof(T);
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

}  // namespace

bool kernel_supports(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kInt32:
    case DType::kInt64:
      return true;
    case DType::kFloat16:
    case DType::kBFloat16:
      return false;
  }
  return false;
}

void reduce_into(DType dtype, std::byte* dst, const std::byte* src, size_t nbytes) {
  switch (dtype) {
    case DType::kFloat32:
      return add_loop<float>(dst, src, nbytes);
    case DType::kFloat64:
      return add_loop<double>(dst, src, nbytes);
    case DType::kInt32:
      return add_loop<int32_t>(dst, src, nbytes);
    case DType::kInt64:
      return add_loop<int64_t>(dst, src, nbytes);
    default:
      TALLY_CHECK(kernel_supports(dtype));
  }
}

void scale_average(DType dtype, std::byte* data, size_t nbytes, uint32_t divisor) {
  TALLY_CHECK(divisor > 0);
  switch (dtype) {
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

}  // namespace tally
