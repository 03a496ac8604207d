// Reduction kernels: exact sums with closed-form expected values, odd counts
// and tails around the vector width, integer wrap-around, and averaging.
#include "tally/reducer/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "tally/protocol/chunking.h"
#include "tally/protocol/dtype.h"
#include "tally/protocol/kernels.h"

namespace tally {
namespace {

template <typename T>
std::byte* bytes(std::vector<T>& v) {
  return reinterpret_cast<std::byte*>(v.data());
}
template <typename T>
const std::byte* bytes(const std::vector<T>& v) {
  return reinterpret_cast<const std::byte*>(v.data());
}

// ---------------------------------------------------------------------------
// Sums over W ranks with a closed-form result, for every supported type.
//
// Rank r contributes x_r[i] = r * count + i + 1, so the sum over W ranks is
// W * (i + 1) + count * W * (W - 1) / 2. Values stay below 2^24 for the
// sizes used here, so float32 adds them exactly too.

struct SumCase {
  DType dtype;
  size_t count;
  uint32_t world;
};

std::string sum_name(const ::testing::TestParamInfo<SumCase>& info) {
  return "W" + std::to_string(info.param.world) + "_" + std::to_string(info.param.count) + "_" +
         std::string(dtype_name(info.param.dtype));
}

// The wire dtype of a C++ element type.
template <typename T>
constexpr DType kDTypeOf = std::is_same_v<T, float>     ? DType::kFloat32
                           : std::is_same_v<T, double>  ? DType::kFloat64
                           : std::is_same_v<T, int32_t> ? DType::kInt32
                                                        : DType::kInt64;
static_assert(kDTypeOf<int64_t> == DType::kInt64);

template <typename T>
void run_sum_case(size_t count, uint32_t world) {
  const DType dtype = kDTypeOf<T>;
  std::vector<T> acc(count);
  for (size_t i = 0; i < count; ++i) acc[i] = static_cast<T>(i + 1);  // rank 0
  for (uint32_t r = 1; r < world; ++r) {
    std::vector<T> in(count);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<T>(uint64_t{r} * count + i + 1);
    const std::vector<T> src_before = in;
    reduce_into(dtype, bytes(acc), bytes(in), count * sizeof(T));
    ASSERT_EQ(std::memcmp(in.data(), src_before.data(), count * sizeof(T)), 0)
        << "reduce_into modified its source";
  }
  const uint64_t w = world;
  for (size_t i = 0; i < count; ++i) {
    const uint64_t expected = w * (i + 1) + uint64_t{count} * w * (w - 1) / 2;
    ASSERT_EQ(acc[i], static_cast<T>(expected)) << "element " << i << " of " << count;
  }
}

class ReduceSumTest : public ::testing::TestWithParam<SumCase> {};

TEST_P(ReduceSumTest, SumMatchesClosedForm) {
  const SumCase& c = GetParam();
  switch (c.dtype) {
    case DType::kFloat32:
      return run_sum_case<float>(c.count, c.world);
    case DType::kFloat64:
      return run_sum_case<double>(c.count, c.world);
    case DType::kInt32:
      return run_sum_case<int32_t>(c.count, c.world);
    case DType::kInt64:
      return run_sum_case<int64_t>(c.count, c.world);
    default:
      FAIL() << "no kernel for " << dtype_name(c.dtype);
  }
}

std::vector<SumCase> sum_cases() {
  std::vector<SumCase> out;
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kInt64}) {
    for (size_t count : {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1000003}) {
      for (uint32_t world : {2, 4}) out.push_back({d, count, world});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(SupportedTypes, ReduceSumTest, ::testing::ValuesIn(sum_cases()), sum_name);

// ---------------------------------------------------------------------------
// Sub-ranges: a chunk at an element offset inside a larger buffer, with every
// tail length a vector loop can leave; nothing outside the range changes.

template <typename T>
void check_sub_ranges() {
  const DType dtype = kDTypeOf<T>;
  constexpr size_t kBuf = 80;
  for (size_t start = 0; start < 9; ++start) {
    for (size_t len = 0; len + start <= 70; ++len) {
      std::vector<T> dst(kBuf);
      std::vector<T> src(kBuf);
      for (size_t i = 0; i < kBuf; ++i) {
        dst[i] = static_cast<T>(1000 + i);
        src[i] = static_cast<T>(3 * i + 1);
      }
      reduce_into(dtype, bytes(dst) + start * sizeof(T), bytes(src) + start * sizeof(T),
                  len * sizeof(T));
      for (size_t i = 0; i < kBuf; ++i) {
        const bool inside = i >= start && i < start + len;
        const T expected = static_cast<T>(inside ? 1000 + i + 3 * i + 1 : 1000 + i);
        ASSERT_EQ(dst[i], expected) << "start " << start << " len " << len << " element " << i;
      }
    }
  }
}

TEST(ReduceInto, SubRangesWithEveryTailLengthTouchOnlyTheirElements) {
  check_sub_ranges<float>();
  check_sub_ranges<double>();
  check_sub_ranges<int32_t>();
  check_sub_ranges<int64_t>();
}

template <typename T>
void check_partial_trailing_element_ignored() {
  // nbytes / sizeof(T) whole elements are summed; a partial element at the
  // end is left alone.
  std::vector<T> dst(5, static_cast<T>(10));
  std::vector<T> src(5, static_cast<T>(1));
  const std::vector<T> before = dst;
  reduce_into(kDTypeOf<T>, bytes(dst), bytes(src), 3 * sizeof(T) + sizeof(T) - 1);
  EXPECT_EQ(dst[0], static_cast<T>(11));
  EXPECT_EQ(dst[2], static_cast<T>(11));
  EXPECT_EQ(std::memcmp(&dst[3], &before[3], 2 * sizeof(T)), 0);
}

TEST(ReduceInto, PartialTrailingElementIsNotTouched) {
  check_partial_trailing_element_ignored<float>();
  check_partial_trailing_element_ignored<double>();
  check_partial_trailing_element_ignored<int32_t>();
  check_partial_trailing_element_ignored<int64_t>();
}

TEST(ReduceInto, ZeroBytesIsANoOp) {
  std::vector<float> dst{1.5f};
  std::vector<float> src{2.0f};
  reduce_into(DType::kFloat32, bytes(dst), bytes(src), 0);
  EXPECT_EQ(dst[0], 1.5f);
}

TEST(ReduceInto, FloatsAddNegativesFractionsAndSpecialValues) {
  std::vector<double> dst{0.5, -1.25, 1e300, -0.0, std::numeric_limits<double>::infinity()};
  std::vector<double> src{0.25, 1.25, 1e300, -0.0, 1.0};
  reduce_into(DType::kFloat64, bytes(dst), bytes(src), dst.size() * sizeof(double));
  EXPECT_EQ(dst[0], 0.75);
  EXPECT_EQ(dst[1], 0.0);
  EXPECT_EQ(dst[2], 2e300);
  EXPECT_TRUE(std::signbit(dst[3]));
  EXPECT_EQ(dst[4], std::numeric_limits<double>::infinity());

  std::vector<float> fdst{0.5f, -3.0f, std::numeric_limits<float>::max()};
  std::vector<float> fsrc{0.25f, 1.0f, std::numeric_limits<float>::max()};
  reduce_into(DType::kFloat32, bytes(fdst), bytes(fsrc), fdst.size() * sizeof(float));
  EXPECT_EQ(fdst[0], 0.75f);
  EXPECT_EQ(fdst[1], -2.0f);
  EXPECT_EQ(fdst[2], std::numeric_limits<float>::infinity());
}

// ---------------------------------------------------------------------------
// Integer wrap-around: two's complement, as NCCL does, and no UB (the ASan
// build runs UBSan with -fno-sanitize-recover, so signed overflow would abort).

TEST(ReduceInto, Int32WrapsOnOverflow) {
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  constexpr int32_t kMin = std::numeric_limits<int32_t>::min();
  std::vector<int32_t> dst{kMax, kMin, kMax, kMin, -1, kMax, 0};
  std::vector<int32_t> src{1, -1, kMax, kMin, kMin, 2, -5};
  reduce_into(DType::kInt32, bytes(dst), bytes(src), dst.size() * sizeof(int32_t));
  EXPECT_EQ(dst[0], kMin);      // INT32_MAX + 1
  EXPECT_EQ(dst[1], kMax);      // INT32_MIN - 1
  EXPECT_EQ(dst[2], -2);        // 2 * INT32_MAX
  EXPECT_EQ(dst[3], 0);         // 2 * INT32_MIN
  EXPECT_EQ(dst[4], kMax);      // -1 + INT32_MIN
  EXPECT_EQ(dst[5], kMin + 1);  // INT32_MAX + 2
  EXPECT_EQ(dst[6], -5);
}

TEST(ReduceInto, Int64WrapsOnOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  std::vector<int64_t> dst{kMax, kMin, kMax, kMin, -1, 0};
  std::vector<int64_t> src{1, -1, kMax, kMin, kMin, -5};
  reduce_into(DType::kInt64, bytes(dst), bytes(src), dst.size() * sizeof(int64_t));
  EXPECT_EQ(dst[0], kMin);
  EXPECT_EQ(dst[1], kMax);
  EXPECT_EQ(dst[2], -2);
  EXPECT_EQ(dst[3], 0);
  EXPECT_EQ(dst[4], kMax);
  EXPECT_EQ(dst[5], -5);
}

TEST(ReduceInto, ManyWrappingInt32AddsMatchModularArithmetic) {
  // 17 ranks of values near INT32_MAX: the sum wraps several times; the
  // expected value is the sum mod 2^32 read back as two's complement.
  constexpr size_t kCount = 1001;
  constexpr int kRanks = 17;
  std::vector<int32_t> acc(kCount, 0);
  for (int r = 0; r < kRanks; ++r) {
    std::vector<int32_t> in(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      in[i] = std::numeric_limits<int32_t>::max() - static_cast<int32_t>(i) - r;
    }
    reduce_into(DType::kInt32, bytes(acc), bytes(in), kCount * sizeof(int32_t));
  }
  for (size_t i = 0; i < kCount; ++i) {
    int64_t exact = 0;
    for (int r = 0; r < kRanks; ++r) exact += int64_t{INT32_MAX} - static_cast<int64_t>(i) - r;
    const auto wrapped = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(exact)));
    ASSERT_EQ(acc[i], wrapped) << "element " << i;
  }
}

// ---------------------------------------------------------------------------
// scale_average

TEST(ScaleAverage, FloatsDivideExactly) {
  std::vector<float> f{7.0f, -3.0f, 1.0f, 0.0f};
  scale_average(DType::kFloat32, bytes(f), f.size() * sizeof(float), 2);
  EXPECT_EQ(f[0], 3.5f);
  EXPECT_EQ(f[1], -1.5f);
  EXPECT_EQ(f[2], 0.5f);
  EXPECT_EQ(f[3], 0.0f);

  std::vector<double> d{12.0, -1.0, 3.0};
  scale_average(DType::kFloat64, bytes(d), d.size() * sizeof(double), 4);
  EXPECT_EQ(d[0], 3.0);
  EXPECT_EQ(d[1], -0.25);
  EXPECT_EQ(d[2], 0.75);
}

TEST(ScaleAverage, IntegersDivideTowardZero) {
  std::vector<int32_t> a{7, -7, 6, -1, std::numeric_limits<int32_t>::min(), 1};
  scale_average(DType::kInt32, bytes(a), a.size() * sizeof(int32_t), 2);
  EXPECT_EQ(a[0], 3);
  EXPECT_EQ(a[1], -3);
  EXPECT_EQ(a[2], 3);
  EXPECT_EQ(a[3], 0);
  EXPECT_EQ(a[4], std::numeric_limits<int32_t>::min() / 2);
  EXPECT_EQ(a[5], 0);

  std::vector<int64_t> b{7, -7, std::numeric_limits<int64_t>::max(), 3000000000LL * 5};
  scale_average(DType::kInt64, bytes(b), b.size() * sizeof(int64_t), 5);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[1], -1);
  EXPECT_EQ(b[2], std::numeric_limits<int64_t>::max() / 5);
  EXPECT_EQ(b[3], 3000000000LL);
}

TEST(ScaleAverage, DivisorOneLeavesValuesUnchanged) {
  std::vector<int64_t> v{std::numeric_limits<int64_t>::min(), -1, 0, 42};
  const auto before = v;
  scale_average(DType::kInt64, bytes(v), v.size() * sizeof(int64_t), 1);
  EXPECT_EQ(v, before);
  std::vector<float> f{-2.5f, 1e30f};
  const auto fbefore = f;
  scale_average(DType::kFloat32, bytes(f), f.size() * sizeof(float), 1);
  EXPECT_EQ(f, fbefore);
}

TEST(ScaleAverage, AverageOfClosedFormSumOverOddCount) {
  // Sum of W ranks of x_r[i] = r * count + i + 1 divided by W is
  // i + 1 + count * (W - 1) / 2; count * (W - 1) is even here, so exact.
  constexpr size_t kCount = 1000003;
  constexpr uint32_t kWorld = 3;
  std::vector<float> acc(kCount);
  for (size_t i = 0; i < kCount; ++i) acc[i] = static_cast<float>(i + 1);
  for (uint32_t r = 1; r < kWorld; ++r) {
    std::vector<float> in(kCount);
    for (size_t i = 0; i < kCount; ++i) in[i] = static_cast<float>(r * kCount + i + 1);
    reduce_into(DType::kFloat32, bytes(acc), bytes(in), kCount * sizeof(float));
  }
  scale_average(DType::kFloat32, bytes(acc), kCount * sizeof(float), kWorld);
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(acc[i], static_cast<float>(i + 1 + kCount * (kWorld - 1) / 2)) << "element " << i;
  }
}

TEST(ScaleAverage, OnlyTheGivenBytesAreScaled) {
  std::vector<int32_t> v{10, 20, 30, 40};
  scale_average(DType::kInt32, bytes(v) + sizeof(int32_t), 2 * sizeof(int32_t), 10);
  EXPECT_EQ(v, (std::vector<int32_t>{10, 2, 3, 40}));
}

TEST(ScaleAverage, Int32DivisorAboveInt32MaxStillDividesAsUnsignedMagnitude) {
  // The divisor is a uint32_t world size; scale_average promises integer
  // division by it. |x| < 2^31 <= divisor, so every int32 quotient is 0.
  const uint32_t divisor = 3000000000u;
  std::vector<int32_t> v{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
                         -7, 7};
  scale_average(DType::kInt32, bytes(v), v.size() * sizeof(int32_t), divisor);
  EXPECT_EQ(v, (std::vector<int32_t>{0, 0, 0, 0}));
}

// ---------------------------------------------------------------------------
// Supported types

TEST(KernelSupports, FullWidthTypesAreSupported) {
  EXPECT_TRUE(kernel_supports(DType::kFloat32));
  EXPECT_TRUE(kernel_supports(DType::kFloat64));
  EXPECT_TRUE(kernel_supports(DType::kInt32));
  EXPECT_TRUE(kernel_supports(DType::kInt64));
}

TEST(KernelSupports, SixteenBitFloatsAccumulateInFloat32) {
  EXPECT_TRUE(kernel_supports(DType::kFloat16));
  EXPECT_TRUE(kernel_supports(DType::kBFloat16));
  EXPECT_EQ(accumulator_dtype(DType::kFloat16), DType::kFloat32);
  EXPECT_EQ(accumulator_dtype(DType::kBFloat16), DType::kFloat32);
  EXPECT_EQ(accumulator_dtype(DType::kInt64), DType::kInt64);
  EXPECT_EQ(payload_offset(DType::kFloat16, 200), 200u);
  EXPECT_EQ(payload_offset(DType::kFloat32, 200), 0u);
}

// A 16-bit chunk's life on a reducer: the first payload lands in the upper
// half of the accumulator slab and is widened in place, the others are added
// in float32, the average divides in float32, and the result is narrowed in
// place. Expected: the same steps on the scalar reference, element by element.
TEST(SixteenBitChunk, AccumulatesInFloat32AndNarrowsOnce) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (RedOp redop : {RedOp::kSum, RedOp::kAverage}) {
      const bool bf16 = dtype == DType::kBFloat16;
      auto narrow = [&](float f) { return bf16 ? float_to_bfloat16(f) : float_to_half(f); };
      auto widen = [&](uint16_t h) { return bf16 ? bfloat16_to_float(h) : half_to_float(h); };
      const size_t n = 1037;  // not a multiple of any vector width
      const uint32_t world = 3;
      std::vector<std::vector<uint16_t>> inputs(world, std::vector<uint16_t>(n));
      for (uint32_t r = 0; r < world; ++r) {
        for (size_t i = 0; i < n; ++i) {
          inputs[r][i] = narrow(0.37f * static_cast<float>(i) - 11.0f * static_cast<float>(r) +
                                0.001f * static_cast<float>(i % 7));
        }
      }
      std::vector<float> slab(n);  // 4n bytes, as a reducer slab holds
      auto* base = reinterpret_cast<std::byte*>(slab.data());
      std::memcpy(base + payload_offset(dtype, 2 * n), inputs[0].data(), 2 * n);
      load_payload(dtype, base, 2 * n);
      for (uint32_t r = 1; r < world; ++r) {
        reduce_into(dtype, base, reinterpret_cast<const std::byte*>(inputs[r].data()), 2 * n);
      }
      if (redop == RedOp::kAverage) scale_average(dtype, base, 4 * n, world);
      store_result(dtype, base, n);
      const auto* out = reinterpret_cast<const uint16_t*>(base);
      for (size_t i = 0; i < n; ++i) {
        float acc = widen(inputs[0][i]);
        for (uint32_t r = 1; r < world; ++r) acc += widen(inputs[r][i]);
        if (redop == RedOp::kAverage) acc /= static_cast<float>(world);
        ASSERT_EQ(out[i], narrow(acc))
            << dtype_name(dtype) << " " << redop_name(redop) << " element " << i;
      }
    }
  }
}

TEST(KernelSupports, UnknownWireValueIsNotSupported) {
  EXPECT_FALSE(kernel_supports(static_cast<DType>(0)));
  EXPECT_FALSE(kernel_supports(static_cast<DType>(7)));
}

TEST(MaxChunkElements, SixteenBitTypesCountFourBytesOfAccumulator) {
  EXPECT_EQ(max_chunk_elements(4096, DType::kFloat16), 1024u);
  EXPECT_EQ(max_chunk_elements(4096, DType::kBFloat16), 1024u);
  EXPECT_EQ(max_chunk_elements(4096, DType::kFloat32), 1024u);
  EXPECT_EQ(max_chunk_elements(4096, DType::kFloat64), 512u);
}

using KernelsDeathTest = ::testing::Test;

TEST_F(KernelsDeathTest, UnsupportedTypeIsABugNotASilentNoOp) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<uint16_t> dst(4, 1);
  std::vector<uint16_t> src(4, 1);
  EXPECT_DEATH(reduce_into(static_cast<DType>(9), bytes(dst), bytes(src), 8), "TALLY_CHECK");
  EXPECT_DEATH(scale_average(static_cast<DType>(9), bytes(dst), 8, 2), "TALLY_CHECK");
}

TEST_F(KernelsDeathTest, ZeroDivisorIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<float> v{1.0f};
  EXPECT_DEATH(scale_average(DType::kFloat32, bytes(v), sizeof(float), 0), "TALLY_CHECK");
}

TEST_F(KernelsDeathTest, MisalignedBuffersAreCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<double> dst(4, 1.0);
  std::vector<double> src(4, 1.0);
  EXPECT_DEATH(reduce_into(DType::kFloat64, bytes(dst) + 4, bytes(src), 8), "TALLY_CHECK");
  EXPECT_DEATH(reduce_into(DType::kFloat64, bytes(dst), bytes(src) + 4, 8), "TALLY_CHECK");
}

}  // namespace
}  // namespace tally
