// The scalar reference kernels and the choice of a table (kernels.h).
#include "tally/protocol/kernels.h"

#include <bit>
#include <cstring>

#include "kernels_x86.h"
#include "tally/protocol/status.h"

namespace tally {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) {
    // Infinity, or a NaN made quiet with its payload kept (as vcvtph2ps).
    return std::bit_cast<float>(sign | 0x7f800000u | (mant != 0 ? 0x400000u : 0u) | (mant << 13));
  }
  if (exp == 0) {
    // Zero or a denormal: mant * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mant) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t exp = (x >> 23) & 0xff;
  const uint32_t mant = x & 0x7fffff;
  if (exp == 0xff) {
    if (mant == 0) return sign | 0x7c00;
    return static_cast<uint16_t>(sign | 0x7e00 | (mant >> 13));  // quiet, top payload bits
  }
  if (exp >= 143) return sign | 0x7c00;  // >= 2^16: beyond the largest half even after rounding
  uint32_t h = 0;
  uint32_t rest = 0;
  uint32_t halfway = 0;
  if (exp >= 113) {  // a normal half: keep 10 of 23 mantissa bits
    h = ((exp - 112) << 10) | (mant >> 13);
    rest = mant & 0x1fff;
    halfway = 0x1000;
  } else if (exp >= 102) {  // a denormal half: units of 2^-24
    const uint32_t m = mant | 0x800000;
    const uint32_t shift = 126 - exp;  // 14..24
    h = m >> shift;
    rest = m & ((1u << shift) - 1);
    halfway = 1u << (shift - 1);
  } else {
    return sign;  // below half the smallest denormal: rounds to zero
  }
  // Ties to even; a carry out of the mantissa correctly bumps the exponent
  // (up to infinity, 0x7c00).
  if (rest > halfway || (rest == halfway && (h & 1))) h++;
  return static_cast<uint16_t>(sign | h);
}

float bfloat16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_bfloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

namespace {

void sum_f32_scalar(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}
void accumulate_f16_scalar(float* acc, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += half_to_float(src[i]);
}
void accumulate_bf16_scalar(float* acc, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += bfloat16_to_float(src[i]);
}
// In place (src in dst's upper half) is safe front to back: element i's
// output ends at byte 4i+4, the next unread input starts at 2n+2i+2.
void widen_f16_scalar(float* dst, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float v = half_to_float(src[i]);
    dst[i] = v;
  }
}
void widen_bf16_scalar(float* dst, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float v = bfloat16_to_float(src[i]);
    dst[i] = v;
  }
}
void narrow_f16_scalar(uint16_t* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint16_t v = float_to_half(src[i]);
    dst[i] = v;
  }
}
void narrow_bf16_scalar(uint16_t* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint16_t v = float_to_bfloat16(src[i]);
    dst[i] = v;
  }
}

constexpr KernelTable kScalarTable{KernelIsa::kScalar,     sum_f32_scalar,    accumulate_f16_scalar,
                                   accumulate_bf16_scalar, widen_f16_scalar,  widen_bf16_scalar,
                                   narrow_f16_scalar,      narrow_bf16_scalar};

}  // namespace

namespace kernels_detail {
const KernelTable& scalar_table() { return kScalarTable; }
}  // namespace kernels_detail

std::string_view kernel_isa_name(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kScalar:
      return "scalar";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

std::optional<KernelIsa> parse_kernel_isa(std::string_view name) {
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (kernel_isa_name(isa) == name) return isa;
  }
  return std::nullopt;
}

bool kernel_isa_available(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kScalar:
      return true;
    case KernelIsa::kAvx2:
      return kernels_detail::avx2_table() != nullptr;
    case KernelIsa::kAvx512:
      return kernels_detail::avx512_table() != nullptr;
  }
  return false;
}

std::vector<KernelIsa> available_kernel_isas() {
  std::vector<KernelIsa> out;
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (kernel_isa_available(isa)) out.push_back(isa);
  }
  return out;
}

const KernelTable& kernel_table(KernelIsa isa) {
  const KernelTable* table = nullptr;
  switch (isa) {
    case KernelIsa::kScalar:
      table = &kScalarTable;
      break;
    case KernelIsa::kAvx2:
      table = kernels_detail::avx2_table();
      break;
    case KernelIsa::kAvx512:
      table = kernels_detail::avx512_table();
      break;
  }
  TALLY_CHECK(table != nullptr);
  return *table;
}

const KernelTable& kernels() {
  static const KernelTable& best = kernel_table(available_kernel_isas().back());
  return best;
}

}  // namespace tally
