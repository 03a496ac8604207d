// AVX2+F16C and AVX-512 kernels, compiled with per-function target
// attributes so the rest of the build stays baseline x86-64; chosen at run
// time by __builtin_cpu_supports. Each loop converts whole vectors and
// leaves the tail (< one vector) to the scalar reference, which computes the
// same bits. Widen and narrow load a vector before storing it, which is what
// makes the in-place layouts of kernels.h safe.
#include "kernels_x86.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace tally::kernels_detail {

#if defined(__x86_64__)
namespace {

#define TALLY_AVX2 __attribute__((target("avx2,f16c,fma")))
#define TALLY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,fma")))

// ---- AVX2 + F16C ----

TALLY_AVX2 void sum_f32_avx2(float* __restrict dst, const float* __restrict src, size_t n) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 a0 = _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i));
    __m256 a1 = _mm256_add_ps(_mm256_loadu_ps(dst + i + 8), _mm256_loadu_ps(src + i + 8));
    __m256 a2 = _mm256_add_ps(_mm256_loadu_ps(dst + i + 16), _mm256_loadu_ps(src + i + 16));
    __m256 a3 = _mm256_add_ps(_mm256_loadu_ps(dst + i + 24), _mm256_loadu_ps(src + i + 24));
    _mm256_storeu_ps(dst + i, a0);
    _mm256_storeu_ps(dst + i + 8, a1);
    _mm256_storeu_ps(dst + i + 16, a2);
    _mm256_storeu_ps(dst + i + 24, a3);
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i)));
  }
  scalar_table().sum_f32(dst + i, src + i, n - i);
}

TALLY_AVX2 inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TALLY_AVX2 inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// Eight floats to bfloat16 bits in the low 16 bits of each 32-bit lane.
TALLY_AVX2 inline __m256i round_bf16x8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

TALLY_AVX2 void accumulate_f16_avx2(float* __restrict acc, const uint16_t* __restrict src,
                                    size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a0 = _mm256_add_ps(_mm256_loadu_ps(acc + i), load_f16x8(src + i));
    __m256 a1 = _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), load_f16x8(src + i + 8));
    _mm256_storeu_ps(acc + i, a0);
    _mm256_storeu_ps(acc + i + 8, a1);
  }
  scalar_table().accumulate_f16(acc + i, src + i, n - i);
}

TALLY_AVX2 void accumulate_bf16_avx2(float* __restrict acc, const uint16_t* __restrict src,
                                     size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a0 = _mm256_add_ps(_mm256_loadu_ps(acc + i), load_bf16x8(src + i));
    __m256 a1 = _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), load_bf16x8(src + i + 8));
    _mm256_storeu_ps(acc + i, a0);
    _mm256_storeu_ps(acc + i + 8, a1);
  }
  scalar_table().accumulate_bf16(acc + i, src + i, n - i);
}

TALLY_AVX2 void widen_f16_avx2(float* dst, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load_f16x8(src + i);
    _mm256_storeu_ps(dst + i, v);
  }
  scalar_table().widen_f16(dst + i, src + i, n - i);
}

TALLY_AVX2 void widen_bf16_avx2(float* dst, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load_bf16x8(src + i);
    _mm256_storeu_ps(dst + i, v);
  }
  scalar_table().widen_bf16(dst + i, src + i, n - i);
}

TALLY_AVX2 void narrow_f16_avx2(uint16_t* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  scalar_table().narrow_f16(dst + i, src + i, n - i);
}

TALLY_AVX2 void narrow_bf16_avx2(uint16_t* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = round_bf16x8(_mm256_loadu_ps(src + i));
    const __m256i b = round_bf16x8(_mm256_loadu_ps(src + i + 8));
    // packus works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7], then put the
    // 64-bit quarters back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  scalar_table().narrow_bf16(dst + i, src + i, n - i);
}

const KernelTable kAvx2Table{KernelIsa::kAvx2,     sum_f32_avx2,    accumulate_f16_avx2,
                             accumulate_bf16_avx2, widen_f16_avx2,  widen_bf16_avx2,
                             narrow_f16_avx2,      narrow_bf16_avx2};

// ---- AVX-512 ----

TALLY_AVX512 void sum_f32_avx512(float* __restrict dst, const float* __restrict src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512 a0 = _mm512_add_ps(_mm512_loadu_ps(dst + i), _mm512_loadu_ps(src + i));
    __m512 a1 = _mm512_add_ps(_mm512_loadu_ps(dst + i + 16), _mm512_loadu_ps(src + i + 16));
    __m512 a2 = _mm512_add_ps(_mm512_loadu_ps(dst + i + 32), _mm512_loadu_ps(src + i + 32));
    __m512 a3 = _mm512_add_ps(_mm512_loadu_ps(dst + i + 48), _mm512_loadu_ps(src + i + 48));
    _mm512_storeu_ps(dst + i, a0);
    _mm512_storeu_ps(dst + i + 16, a1);
    _mm512_storeu_ps(dst + i + 32, a2);
    _mm512_storeu_ps(dst + i + 48, a3);
  }
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), _mm512_loadu_ps(src + i)));
  }
  scalar_table().sum_f32(dst + i, src + i, n - i);
}

TALLY_AVX512 inline __m512 load_f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TALLY_AVX512 inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

TALLY_AVX512 void accumulate_f16_avx512(float* __restrict acc, const uint16_t* __restrict src,
                                        size_t n) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 a0 = _mm512_add_ps(_mm512_loadu_ps(acc + i), load_f16x16(src + i));
    __m512 a1 = _mm512_add_ps(_mm512_loadu_ps(acc + i + 16), load_f16x16(src + i + 16));
    _mm512_storeu_ps(acc + i, a0);
    _mm512_storeu_ps(acc + i + 16, a1);
  }
  scalar_table().accumulate_f16(acc + i, src + i, n - i);
}

TALLY_AVX512 void accumulate_bf16_avx512(float* __restrict acc, const uint16_t* __restrict src,
                                         size_t n) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 a0 = _mm512_add_ps(_mm512_loadu_ps(acc + i), load_bf16x16(src + i));
    __m512 a1 = _mm512_add_ps(_mm512_loadu_ps(acc + i + 16), load_bf16x16(src + i + 16));
    _mm512_storeu_ps(acc + i, a0);
    _mm512_storeu_ps(acc + i + 16, a1);
  }
  scalar_table().accumulate_bf16(acc + i, src + i, n - i);
}

TALLY_AVX512 void widen_f16_avx512(float* dst, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load_f16x16(src + i);
    _mm512_storeu_ps(dst + i, v);
  }
  scalar_table().widen_f16(dst + i, src + i, n - i);
}

TALLY_AVX512 void widen_bf16_avx512(float* dst, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load_bf16x16(src + i);
    _mm512_storeu_ps(dst + i, v);
  }
  scalar_table().widen_bf16(dst + i, src + i, n - i);
}

TALLY_AVX512 void narrow_f16_avx512(uint16_t* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h =
        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  scalar_table().narrow_f16(dst + i, src + i, n - i);
}

TALLY_AVX512 void narrow_bf16_avx512(uint16_t* dst, const float* src, size_t n) {
  size_t i = 0;
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet_bit = _mm512_set1_epi32(0x40);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i x = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(x, 16);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_and_si512(high, one)), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i out = _mm512_mask_or_epi32(rounded, is_nan, high, quiet_bit);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(out));
  }
  scalar_table().narrow_bf16(dst + i, src + i, n - i);
}

const KernelTable kAvx512Table{KernelIsa::kAvx512,     sum_f32_avx512,    accumulate_f16_avx512,
                               accumulate_bf16_avx512, widen_f16_avx512,  widen_bf16_avx512,
                               narrow_f16_avx512,      narrow_bf16_avx512};

// F16C from CPUID leaf 1 (ECX bit 29): clang before 16 does not know
// __builtin_cpu_supports("f16c"), and the fuzz build uses Debian's clang 14.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

}  // namespace

const KernelTable* avx2_table() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && cpu_has_f16c() && __builtin_cpu_supports("fma");
  return ok ? &kAvx2Table : nullptr;
}

const KernelTable* avx512_table() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
                         cpu_has_f16c();
  return ok ? &kAvx512Table : nullptr;
}

#else  // not x86-64: the scalar table only

const KernelTable* avx2_table() { return nullptr; }
const KernelTable* avx512_table() { return nullptr; }

#endif

}  // namespace tally::kernels_detail
