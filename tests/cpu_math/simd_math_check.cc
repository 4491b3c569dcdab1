// Accuracy of the CPU kernels' vector math (csrc/cpu/simd/simd_vector.h) against the
// double-precision libm, over a sample of every float32 bit pattern: prints one JSON object per
// function with the largest error in float32 ulps and whether every special value came out as
// specified.
//
// Built once per variant by tests/test_simd_math.py, as the kernels are: with -DCHECK_AVX512 (16
// lanes, AVX-512), with -DCHECK_AVX2 (8 lanes, AVX2 + FMA + F16C) and with neither (the 4-lane
// SSE2 / NEON baseline).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "csrc/cpu/float_types.h"

#if defined(CHECK_AVX512)
// The rest of the file, main included, for AVX-512 as rows_avx512.h (it runs only where that is).
#if defined(__clang__)
#pragma clang attribute push(                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))),               \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#define TF_METAL_OPS_SIMD_LANES 16
#define TMO_SIMD_AVX512 1
#elif defined(CHECK_AVX2)
// The rest of the file, main included, for AVX2 + FMA + F16C (it runs only where they are).
// clang ignores `#pragma GCC target`; it takes the attribute form rows_avx2.h uses.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define TF_METAL_OPS_SIMD_LANES 8
#define TMO_SIMD_AVX2 1
#else
#define TF_METAL_OPS_SIMD_LANES 4
#endif

namespace tf_metal_ops {
#include "csrc/cpu/simd/simd_vector.h"
}  // namespace tf_metal_ops

using tf_metal_ops::kLanes;
using tf_metal_ops::VF;

namespace {

float FromBits32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The distance between `want` (exact, in double) and `got`, in units of the float32 ulp at
// `want` (the subnormal ulp below the normal range).
double UlpError(float got, double want) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) == std::isnan(got) ? 0 : 1e9;
  // Past the largest float the correctly rounded result is inf (exp(88.73) overflows).
  const float rounded = static_cast<float>(want);
  if (std::isinf(rounded) || std::isinf(got)) return got == rounded ? 0 : 1e9;
  const double magnitude = std::fabs(want);
  const int exponent = magnitude < 1.1754943508222875e-38 ? -126 : std::ilogb(magnitude);
  const double ulp = std::ldexp(1.0, (exponent < -126 ? -126 : exponent) - 23);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

template <typename VectorFn, typename ExactFn>
void Measure(const char* name, VectorFn vector_fn, ExactFn exact_fn, float lo, float hi,
             uint32_t stride) {
  double worst = 0;
  float worst_x = 0;
  float inputs[kLanes];
  int filled = 0;
  auto flush = [&] {
    VF v{};
    for (int i = 0; i < kLanes; ++i) v[i] = i < filled ? inputs[i] : inputs[0];
    const VF r = vector_fn(v);
    for (int i = 0; i < filled; ++i) {
      const double error = UlpError(r[i], exact_fn(static_cast<double>(inputs[i])));
      if (error > worst) {
        worst = error;
        worst_x = inputs[i];
      }
    }
    filled = 0;
  };
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += stride) {
    const float x = FromBits32(static_cast<uint32_t>(bits));
    if (!(x >= lo && x <= hi)) continue;
    inputs[filled++] = x;
    if (filled == kLanes) flush();
  }
  if (filled > 0) flush();
  std::printf("{\"function\": \"%s\", \"lanes\": %d, \"max_ulp\": %.4f, \"at\": %.9g}\n", name,
              kLanes, worst, worst_x);
}

bool Same(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  return got == want && std::signbit(got) == std::signbit(want);
}

template <typename VectorFn>
void Specials(const char* name, VectorFn vector_fn, const float (*cases)[2], int count) {
  int failures = 0;
  for (int k = 0; k < count; ++k) {
    const float got = vector_fn(tf_metal_ops::Splat(cases[k][0]))[0];
    if (!Same(got, cases[k][1])) {
      std::fprintf(stderr, "%s(%g) = %g, expected %g\n", name, cases[k][0], got, cases[k][1]);
      ++failures;
    }
  }
  std::printf("{\"function\": \"%s\", \"lanes\": %d, \"special_failures\": %d}\n", name, kLanes,
              failures);
}

// Exp<false> (no range handling) against Exp over every stride-th bit pattern within its plain
// range, and NaN: it must give the same bits, since the kernels pick it only for speed.
void PlainExpMatches(uint32_t stride) {
  int64_t mismatches = 0;
  int64_t checked = 0;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += stride) {
    const float x = FromBits32(static_cast<uint32_t>(bits));
    if (!(std::fabs(x) <= tf_metal_ops::kExpPlainRange) && !std::isnan(x)) continue;
    const VF v = tf_metal_ops::Splat(x);
    const VF plain = tf_metal_ops::Exp<false>(v);
    const VF checked_exp = tf_metal_ops::Exp(v);
    if (std::memcmp(&plain, &checked_exp, sizeof(VF)) != 0) ++mismatches;
    ++checked;
  }
  std::printf("{\"function\": \"exp\", \"plain_checked\": %lld, \"plain_mismatches\": %lld}\n",
              static_cast<long long>(checked), static_cast<long long>(mismatches));
}

}  // namespace

int main(int argc, char** argv) {
  // Every stride-th bit pattern: 32768 samples in every binade at the default stride, the one
  // tests/test_simd_math.py runs.
  const uint32_t stride = argc > 1 ? static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10)) : 256;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  using tf_metal_ops::Exp;
  using tf_metal_ops::Expm1;
  using tf_metal_ops::Log;
  using tf_metal_ops::Log1p;
  using tf_metal_ops::OneMinusExpNearZero;
  Measure("exp", [](VF v) { return Exp(v); }, [](double x) { return std::exp(x); }, -inf, inf,
          stride);
  Measure("log", [](VF v) { return Log(v); }, [](double x) { return std::log(x); }, 0.0f, inf,
          stride);
  Measure("log1p", [](VF v) { return Log1p(v); }, [](double x) { return std::log1p(x); }, -1.0f,
          inf, stride);
  Measure("expm1", [](VF v) { return Expm1(v); }, [](double x) { return std::expm1(x); }, -inf,
          inf, stride);
  // Its domain: lp = log p of the classes the focal passes find with p > 1/2, and a margin.
  Measure("one_minus_exp", [](VF v) { return OneMinusExpNearZero(v); },
          [](double x) { return -std::expm1(x); }, -0.6931472f - 0.0625f, 0.0f, stride);

  const float exp_cases[][2] = {{nan, nan}, {-inf, 0.0f}, {inf, inf}, {100.0f, inf},
                                {-110.0f, 0.0f}, {0.0f, 1.0f}};
  const float log_cases[][2] = {{nan, nan}, {0.0f, -inf}, {-1.0f, nan}, {inf, inf}, {1.0f, 0.0f}};
  const float log1p_cases[][2] = {{nan, nan}, {-1.0f, -inf}, {-2.0f, nan}, {inf, inf},
                                  {0.0f, 0.0f}, {1e-30f, 1e-30f}};
  const float expm1_cases[][2] = {{nan, nan}, {-inf, -1.0f}, {inf, inf}, {0.0f, 0.0f},
                                  {-100.0f, -1.0f}, {1e-30f, 1e-30f}};
  const float one_minus_exp_cases[][2] = {{nan, nan}, {0.0f, 0.0f}, {-0.0f, 0.0f},
                                          {-1e-30f, 1e-30f}, {-0.6931471805599453f, 0.5f}};
  Specials("exp", [](VF v) { return Exp(v); }, exp_cases, 6);
  PlainExpMatches(stride);
  Specials("log", [](VF v) { return Log(v); }, log_cases, 5);
  Specials("log1p", [](VF v) { return Log1p(v); }, log1p_cases, 6);
  Specials("expm1", [](VF v) { return Expm1(v); }, expm1_cases, 6);
  Specials("one_minus_exp", [](VF v) { return OneMinusExpNearZero(v); }, one_minus_exp_cases, 5);
  return 0;
}

#if (defined(CHECK_AVX2) || defined(CHECK_AVX512)) && defined(__clang__)
#pragma clang attribute pop
#endif
