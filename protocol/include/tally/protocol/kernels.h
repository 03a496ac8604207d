// Element kernels shared by the reducer and the client: float32 sums and the
// conversions between float32 and the 16-bit types (float16, bfloat16).
//
// Every kernel exists at several instruction-set levels (KernelIsa); one
// table per level, and `kernels()` is the best level this CPU runs, chosen
// once. Every level gives bit-identical results to kScalar, the portable
// reference: sums are element-wise IEEE adds (no reassociation, no FMA),
// the same bits except which input's payload a NaN + NaN carries (x86 takes
// the first operand's, and compilers may swap the operands of an add);
// narrowing rounds to nearest, ties to even, keeps infinities, turns a NaN
// into the quiet NaN with the sign and the top payload bits of the input
// (as F16C's vcvtps2ph does), and keeps denormals (bfloat16 narrowing uses
// integer rounding rather than AVX512-BF16's vcvtneps2bf16, which flushes
// denormal inputs to zero); widening is exact, a signalling NaN comes back
// quiet.
//
// Aliasing: sum_f32 and accumulate_* need disjoint buffers. widen_* may run
// in place with the 16-bit input in the upper half of the float32 output
// (src == reinterpret_cast<uint16_t*>(dst) + n); narrow_* may run in place
// with dst == reinterpret_cast<uint16_t*>(src). That is how the reducer
// turns a received 16-bit chunk into float32 accumulators and back without a
// second buffer (docs/architecture.md, "16-bit types").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace tally {

enum class KernelIsa : uint8_t {
  kScalar = 0,  // portable C++
  kAvx2 = 1,    // AVX2 + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL (float16 through its vcvtph2ps/vcvtps2ph)
};

struct KernelTable {
  KernelIsa isa = KernelIsa::kScalar;
  // dst[i] += src[i]
  void (*sum_f32)(float* dst, const float* src, size_t n) = nullptr;
  // acc[i] += widen(src[i])
  void (*accumulate_f16)(float* acc, const uint16_t* src, size_t n) = nullptr;
  void (*accumulate_bf16)(float* acc, const uint16_t* src, size_t n) = nullptr;
  // dst[i] = widen(src[i])
  void (*widen_f16)(float* dst, const uint16_t* src, size_t n) = nullptr;
  void (*widen_bf16)(float* dst, const uint16_t* src, size_t n) = nullptr;
  // dst[i] = round_to_nearest_even(src[i])
  void (*narrow_f16)(uint16_t* dst, const float* src, size_t n) = nullptr;
  void (*narrow_bf16)(uint16_t* dst, const float* src, size_t n) = nullptr;
};

// "scalar", "avx2", "avx512".
std::string_view kernel_isa_name(KernelIsa isa);
std::optional<KernelIsa> parse_kernel_isa(std::string_view name);
// Whether this build and this CPU run `isa`.
bool kernel_isa_available(KernelIsa isa);
// Every level this CPU runs, kScalar first.
std::vector<KernelIsa> available_kernel_isas();
// The table of `isa`; requires kernel_isa_available(isa).
const KernelTable& kernel_table(KernelIsa isa);
// The table of the best available level, chosen on first use.
const KernelTable& kernels();

// One element, the scalar reference (what the tables compute).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace tally
