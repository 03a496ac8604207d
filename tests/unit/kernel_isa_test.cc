// The element kernels of tally/protocol/kernels.h: the scalar reference
// against known bit patterns (rounding ties, overflow, denormals, NaN,
// infinities), then every ISA level this CPU runs against the scalar
// reference, bit for bit, over lengths around each vector width and over
// every 16-bit pattern, including the in-place layouts the reducer uses.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tally/protocol/kernels.h"

namespace tally {
namespace {

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// ---------------------------------------------------------------------------
// Scalar reference

TEST(KernelReference, HalfRoundTripsEveryNonNanPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(KernelReference, HalfKnownValues) {
  EXPECT_EQ(half_to_float(0x3c00), 1.0f);
  EXPECT_EQ(half_to_float(0xc000), -2.0f);
  EXPECT_EQ(half_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(half_to_float(0x0001), 0x1p-24f);  // smallest denormal
  EXPECT_EQ(half_to_float(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(half_to_float(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits(half_to_float(0x8000)), 0x80000000u);
  // A signalling NaN comes back quiet with its payload and sign.
  EXPECT_EQ(bits(half_to_float(0x7d01)), 0x7fe02000u);
  EXPECT_EQ(bits(half_to_float(0xfe00)), 0xffc00000u);
}

TEST(KernelReference, HalfRoundsToNearestEven) {
  // 1 + 2^-11 lies halfway between 1 and the next half (1 + 2^-10): ties to
  // the even mantissa (1); 1 + 3 * 2^-11 ties up to 1 + 2^-9.
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_half(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);  // above the tie
  // Overflow: 65519.99 rounds to 65504, 65520 (the tie) to infinity.
  EXPECT_EQ(float_to_half(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half(-1e10f), 0xfc00);
  // Denormal results, and their ties: 2^-25 is half the smallest denormal
  // (ties to 0), 3 * 2^-25 ties to 2 * 2^-24.
  EXPECT_EQ(float_to_half(0x1p-25f), 0x0000);
  EXPECT_EQ(float_to_half(0x1p-25f + 0x1p-40f), 0x0001);
  EXPECT_EQ(float_to_half(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(float_to_half(-0x1p-24f), 0x8001);
  // The largest denormal rounds up into the smallest normal.
  EXPECT_EQ(float_to_half(0x1p-14f - 0x1p-26f), 0x0400);
  // Float32 denormals are far below half's range.
  EXPECT_EQ(float_to_half(from_bits(0x00000001)), 0x0000);
  EXPECT_EQ(float_to_half(from_bits(0x80400000)), 0x8000);
  // NaN stays NaN (quiet, sign and top payload bits kept); infinities stay.
  EXPECT_EQ(float_to_half(from_bits(0x7f800001)), 0x7e00);
  EXPECT_EQ(float_to_half(from_bits(0xffc02000)), 0xfe01);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
}

TEST(KernelReference, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bfloat16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bfloat16(1.0f + 0x1p-8f), 0x3f80);             // tie to even
  EXPECT_EQ(float_to_bfloat16(1.0f + 3 * 0x1p-8f), 0x3f82);         // tie to even, up
  EXPECT_EQ(float_to_bfloat16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);  // above the tie
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7f7fffff)), 0x7f80);      // rounds to infinity
  EXPECT_EQ(float_to_bfloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  // Denormals are kept (AVX512-BF16's vcvtneps2bf16 would flush them).
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00010000)), 0x0001);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00018000)), 0x0002);  // tie to even
  EXPECT_EQ(float_to_bfloat16(from_bits(0x80008000)), 0x8000);  // tie to even zero
  // NaN: quiet, never rounded into infinity.
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7f800001)), 0x7fc0);
  EXPECT_EQ(float_to_bfloat16(from_bits(0xff80ffff)), 0xffc0);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7fffffff)), 0x7fff);
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = bfloat16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bfloat16(f), b);
  }
}

// ---------------------------------------------------------------------------
// Every available level against the scalar reference

class KernelIsaTest : public ::testing::TestWithParam<KernelIsa> {
 protected:
  const KernelTable& table() const { return kernel_table(GetParam()); }
  const KernelTable& ref() const { return kernel_table(KernelIsa::kScalar); }
};

std::string isa_name(const ::testing::TestParamInfo<KernelIsa>& info) {
  return std::string(kernel_isa_name(info.param));
}

// Lengths around every vector width and unroll factor, plus a long one.
const std::vector<size_t> kLengths = {0,  1,  7,  8,  9,  15, 16,   17,
                                      31, 32, 33, 63, 64, 65, 1000, 4099};

// Floats that exercise every rounding case: random bit patterns (NaNs,
// infinities, denormals included), ties, and values near the half range.
std::vector<float> interesting_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f + 0x1p-8f,
                            1.0f + 0x1p-11f,
                            1.0f + 3 * 0x1p-11f,
                            65520.0f,
                            65504.0f,
                            0x1p-25f,
                            3 * 0x1p-25f,
                            from_bits(0x00018000),
                            from_bits(0x00000001),
                            from_bits(0x7f800001),
                            from_bits(0xffc00000),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            from_bits(0x7f7fffff)};
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t r = rng();
    switch (r % 4) {
      case 0:
        out[i] = from_bits(rng());  // any pattern
        break;
      case 1:
        out[i] = specials[rng() % std::size(specials)];
        break;
      case 2:  // a half tie or near one: low 13 mantissa bits 0x1000 +- 1
        out[i] = from_bits((rng() & 0xc7ffe000u) | (0x1000u + (rng() % 3) - 1));
        break;
      default:  // a bfloat16 tie or near one
        out[i] = from_bits((rng() & 0xffff0000u) | (0x8000u + (rng() % 3) - 1));
        break;
    }
  }
  return out;
}

std::vector<uint16_t> every_pattern_and_random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(i < 65536 ? i : rng());
  return out;
}

// Bitwise equality, so NaN payloads and signed zeros count.
template <typename T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  if (got.empty()) return;  // memcmp's pointers must not be null, even for 0 bytes
  ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)), 0) << [&] {
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        uint32_t g = 0, w = 0;
        std::memcpy(&g, &got[i], sizeof(T));
        std::memcpy(&w, &want[i], sizeof(T));
        return std::string(what) + ": element " + std::to_string(i) + " of " +
               std::to_string(got.size()) + " has bits " + std::to_string(g) + ", the reference " +
               std::to_string(w);
      }
    }
    return std::string();
  }();
}

// Sums: the same bits, except that where the reference has a NaN only NaN
// is required (the sum of two NaNs may carry either payload: kernels.h).
void expect_same_sums(const std::vector<float>& got, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << what << ": element " << i << " is " << got[i];
    } else {
      ASSERT_EQ(bits(got[i]), bits(want[i]))
          << what << ": element " << i << " is " << got[i] << ", the reference " << want[i];
    }
  }
}

TEST_P(KernelIsaTest, SumF32MatchesReference) {
  for (size_t n : kLengths) {
    const auto a = interesting_floats(n, 1), b = interesting_floats(n, 2);
    auto got = a, want = a;
    table().sum_f32(got.data(), b.data(), n);
    ref().sum_f32(want.data(), b.data(), n);
    expect_same_sums(got, want, "sum_f32");
    for (size_t i = 0; i < n; ++i) {
      if (!std::isnan(want[i])) {
        ASSERT_EQ(want[i], a[i] + b[i]);
      }
    }
  }
}

TEST_P(KernelIsaTest, NarrowMatchesReference) {
  for (size_t n : kLengths) {
    const auto src = interesting_floats(n, 3);
    std::vector<uint16_t> got(n), want(n);
    table().narrow_f16(got.data(), src.data(), n);
    for (size_t i = 0; i < n; ++i) want[i] = float_to_half(src[i]);
    expect_same_bits(got, want, "narrow_f16");
    table().narrow_bf16(got.data(), src.data(), n);
    for (size_t i = 0; i < n; ++i) want[i] = float_to_bfloat16(src[i]);
    expect_same_bits(got, want, "narrow_bf16");
  }
}

TEST_P(KernelIsaTest, WidenAndAccumulateMatchReferenceOnEveryPattern) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{33}, size_t{65536 + 77}}) {
    const auto src = every_pattern_and_random(n, 4);
    std::vector<float> got(n), want(n);
    table().widen_f16(got.data(), src.data(), n);
    for (size_t i = 0; i < n; ++i) want[i] = half_to_float(src[i]);
    expect_same_bits(got, want, "widen_f16");
    table().widen_bf16(got.data(), src.data(), n);
    for (size_t i = 0; i < n; ++i) want[i] = bfloat16_to_float(src[i]);
    expect_same_bits(got, want, "widen_bf16");

    const auto acc = interesting_floats(n, 5);
    got = acc;
    want = acc;
    table().accumulate_f16(got.data(), src.data(), n);
    for (size_t i = 0; i < n; ++i) want[i] += half_to_float(src[i]);
    expect_same_sums(got, want, "accumulate_f16");
    got = acc;
    want = acc;
    table().accumulate_bf16(got.data(), src.data(), n);
    for (size_t i = 0; i < n; ++i) want[i] += bfloat16_to_float(src[i]);
    expect_same_sums(got, want, "accumulate_bf16");
  }
}

// The reducer's layouts: a 16-bit payload in the upper half of a float32
// buffer widened in place, and float32 narrowed in place to its front.
TEST_P(KernelIsaTest, InPlaceLayoutsMatchOutOfPlace) {
  for (size_t n : kLengths) {
    const auto src16 = every_pattern_and_random(n, 6);
    for (bool bf16 : {false, true}) {
      auto widen = bf16 ? table().widen_bf16 : table().widen_f16;
      std::vector<float> out(n), buf(n);
      widen(out.data(), src16.data(), n);
      // n = 0: empty vectors may hold null, which memcpy must not get (UBSan).
      if (n > 0) std::memcpy(reinterpret_cast<uint16_t*>(buf.data()) + n, src16.data(), n * 2);
      widen(buf.data(), reinterpret_cast<uint16_t*>(buf.data()) + n, n);
      expect_same_bits(buf, out, bf16 ? "widen_bf16 in place" : "widen_f16 in place");

      auto narrow = bf16 ? table().narrow_bf16 : table().narrow_f16;
      const auto src32 = interesting_floats(n, 7);
      std::vector<uint16_t> want(n);
      narrow(want.data(), src32.data(), n);
      std::vector<float> inplace = src32;
      auto* front = reinterpret_cast<uint16_t*>(inplace.data());
      narrow(front, inplace.data(), n);
      const std::vector<uint16_t> got(front, front + n);
      expect_same_bits(got, want, bf16 ? "narrow_bf16 in place" : "narrow_f16 in place");
    }
  }
}

TEST_P(KernelIsaTest, UnalignedBuffersWork) {
  // Every kernel takes loads and stores at any element offset.
  const size_t n = 100;
  const auto a = interesting_floats(n + 1, 8), b = interesting_floats(n + 1, 9);
  auto got = a, want = a;
  table().sum_f32(got.data() + 1, b.data() + 1, n);
  ref().sum_f32(want.data() + 1, b.data() + 1, n);
  expect_same_sums(got, want, "sum_f32 at +4 bytes");
}

INSTANTIATE_TEST_SUITE_P(Levels, KernelIsaTest, ::testing::ValuesIn(available_kernel_isas()),
                         isa_name);

TEST(KernelIsa, NamesParseBack) {
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    EXPECT_EQ(parse_kernel_isa(kernel_isa_name(isa)), isa);
  }
  EXPECT_FALSE(parse_kernel_isa("sse9").has_value());
}

TEST(KernelIsa, BestLevelIsTheLastAvailable) {
  const auto levels = available_kernel_isas();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), KernelIsa::kScalar);
  EXPECT_EQ(kernels().isa, levels.back());
#if defined(__x86_64__)
  // The build machines have AVX2+F16C (docs/benchmarking.md); a level that
  // silently vanished would leave only the scalar loops.
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    EXPECT_TRUE(kernel_isa_available(KernelIsa::kAvx2));
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    EXPECT_TRUE(kernel_isa_available(KernelIsa::kAvx512));
  }
#endif
}

}  // namespace
}  // namespace tally
