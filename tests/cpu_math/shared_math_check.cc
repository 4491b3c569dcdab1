// The CPU's vector loss and gradient terms (csrc/cpu/simd/simd_rows.h) against the scalar math they
// share with the Metal kernels (kernels/custom_loss_math.h), on a grid of lp = log p, gamma and
// w that includes the limits (p = 1, p = 0, lp = -inf, NaN, p on both sides of the vector
// kernels' 1/2 switch to the scalar code). Also the scalar math itself: the float and double
// instantiations against each other, and the Metal branch's expm1 / log1p (Kahan's correction)
// against the double-precision libm.
//
// Prints one JSON object per check: how many points, how many broke the rule, the largest
// relative difference seen where values are compared with a tolerance. Each broken point is
// described on stderr. Built once per variant by tests/test_shared_math.py, as the kernels are:
// with -DCHECK_AVX512 (16 lanes), -DCHECK_AVX2 (8 lanes) or neither (the 4-lane baseline).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "kernels/custom_loss_math.h"

#if defined(CHECK_AVX512)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define TF_METAL_OPS_SIMD_LANES 16
#define TMO_SIMD_AVX512 1
#elif defined(CHECK_AVX2)
#pragma GCC target("avx2,fma,f16c")
#define TF_METAL_OPS_SIMD_LANES 8
#define TMO_SIMD_AVX2 1
#else
#define TF_METAL_OPS_SIMD_LANES 4
#endif

// The kernels without their entry points (simd_entry_points.h), which would compile every
// instance of the row kernels where this check needs a few of their terms.
namespace tf_metal_ops {
#include "csrc/cpu/simd/simd_vector.h"
#include "csrc/cpu/simd/simd_rows.h"
}  // namespace tf_metal_ops

namespace {

namespace kernels = tf_metal_ops::kernels;
using tf_metal_ops::LoadBlock;
using tf_metal_ops::Splat;
using tf_metal_ops::VF;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The class weights of the vector ops, one per element; the padding lanes of a block get 0.
struct GridWeights {
  const float* w;
  bool NeverZero() const { return false; }  // the grid has w = 0 points
  template <bool kFull>
  VF Get(int64_t c, int64_t n) const {
    return LoadBlock<kFull>(w + c, n, 0.0f);
  }
};

struct Check {
  const char* name;
  int64_t points = 0;
  int64_t failures = 0;
  double max_rel = 0;

  // `got` must be `want` exactly (any NaN matches any NaN; +0 matches -0, since a vector op's
  // lanes are summed from +0).
  void Exact(float got, float want, const char* what, float lp, float gamma, float w) {
    ++points;
    if ((std::isnan(got) && std::isnan(want)) || got == want) return;
    Fail(got, want, what, lp, gamma, w);
  }

  // Equal to `rel_tol` relative; infinities, NaN and zeros must match exactly.
  void Close(double got, double want, double rel_tol, const char* what, float lp, float gamma,
             float w) {
    ++points;
    if (std::isnan(got) || std::isnan(want) || std::isinf(got) || std::isinf(want) ||
        want == 0) {
      if ((std::isnan(got) && std::isnan(want)) || got == want) return;
      Fail(got, want, what, lp, gamma, w);
      return;
    }
    const double rel = std::fabs(got - want) / std::fabs(want);
    max_rel = std::max(max_rel, rel);
    if (rel > rel_tol) Fail(got, want, what, lp, gamma, w);
  }

  void Fail(double got, double want, const char* what, float lp, float gamma, float w) {
    ++failures;
    if (failures <= 20) {
      std::fprintf(stderr, "%s: %s at lp=%.9g gamma=%g w=%g: got %.9g, want %.9g\n", name, what,
                   lp, gamma, w, got, want);
    }
  }

  void Print() const {
    std::printf("{\"check\": \"%s\", \"points\": %lld, \"failures\": %lld, \"max_rel\": %.3e}\n",
                name, static_cast<long long>(points), static_cast<long long>(failures), max_rel);
  }
};

std::vector<float> LogProbGrid() {
  std::vector<float> grid = {0.0f, -0.0f, -1e-30f, -1e-12f, -1e-7f, -6e-8f, -1e-5f, -1e-3f,
                             -0.01f, -0.1f, -0.3f, -0.5f, -0.69f, -0.6931471f, -0.6931472f,
                             -0.7f, -1.0f, -2.0f, -5.0f, -10.0f, -20.0f, -50.0f, -87.0f,
                             -88.0f, -100.0f, -103.0f, -104.0f, -200.0f, -1e30f, -kInf, kNaN};
  // Dense in between, through both sides of p = 1/2.
  for (int i = 1; i <= 200; ++i) grid.push_back(-std::pow(10.0f, -8.0f + 10.0f * i / 200.0f));
  return grid;
}

const float kGammas[] = {0.0f, 0.25f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 5.0f};
const float kWeights[] = {0.0f, 1e-4f, 0.3f, 1.0f, 2.5f};

// The vector terms of one element: lp = z with the row's max = 0 and log_sum = 0, and
// p = e * inv_sum with e = exp(lp) and inv_sum = 1, so both sides see the same p.
struct VectorTerms {
  float loss;  // w r^gamma lp (the loss op's lane)
  float g;     // g_c = w r^gamma (1 - gamma p lp / r) (the focal factor op's lane)
  // The same two from the pass that takes both (gamma > 0; else loss and g).
  float loss_of_both;
  float g_of_both;
};

VectorTerms VectorTermsOf(float lp, float gamma, float w) {
  const float z[1] = {lp};
  const float e[1] = {std::exp(lp)};
  const float weights[1] = {w};
  float g[1] = {0.0f};
  const GridWeights grid{weights};
  tf_metal_ops::SoftmaxLanes sm{Splat(0.0f), Splat(0.0f), Splat(1.0f)};
  VectorTerms out;
  out.loss = tf_metal_ops::LossTerms(z, grid, sm, e, gamma, 1).Total();
  // The kernels use the focal factor op for gamma > 0 only; with gamma = 0, g_c is w_c itself.
  if (gamma != 0.0f) {
    tf_metal_ops::FocalFactorTerms(z, grid, sm, e, g, gamma, 1);
    out.g = g[0];
    // A forward writing the gradient takes both in one pass: the same bits as each alone.
    float g_both[1] = {0.0f};
    const auto both = tf_metal_ops::FocalLossAndFactorTerms(z, grid, sm, e, g_both, gamma, 1);
    out.loss_of_both = both.first.Total();
    out.g_of_both = g_both[0];
  } else {
    out.g = w;
    out.loss_of_both = out.loss;
    out.g_of_both = out.g;
  }
  return out;
}

// Vector against shared scalar: bitwise where the kernel hands the element to the scalar code
// (p > 1/2 with gamma other than 1 and 2), within the vector math's error elsewhere (for gamma
// 1 and 2 the vector takes those lanes' r = -expm1(lp) itself).
void CheckVectorAgainstScalar(Check* loss, Check* gradient, double rel_tol) {
  for (const float lp : LogProbGrid()) {
    for (const float gamma : kGammas) {
      const bool scalar_lane = std::exp(lp) > 0.5f && gamma != 1.0f && gamma != 2.0f;
      for (const float w : kWeights) {
        const VectorTerms vec = VectorTermsOf(lp, gamma, w);
        loss->Exact(vec.loss_of_both, vec.loss, "loss term, one pass with g_c", lp, gamma, w);
        gradient->Exact(vec.g_of_both, vec.g, "g_c, one pass with the loss", lp, gamma, w);
        const float want_loss = kernels::loss_term(lp, w, gamma);
        const float want_g = kernels::gradient_term(lp, w, gamma);
        if (scalar_lane || gamma == 0.0f) {
          // gamma = 0: the vector loss term is w lp, as the scalar one.
          loss->Exact(vec.loss, want_loss, "loss term", lp, gamma, w);
        } else {
          loss->Close(vec.loss, want_loss, rel_tol, "loss term", lp, gamma, w);
        }
        if (scalar_lane || gamma == 0.0f) {
          gradient->Exact(vec.g, want_g, "g_c", lp, gamma, w);
        } else {
          gradient->Close(vec.g, want_g, rel_tol, "g_c", lp, gamma, w);
        }
      }
    }
  }
}

// The limits the kernels rely on, spelled out (the reference has the same ones).
void CheckLimits(Check* check) {
  for (const float gamma : kGammas) {
    for (const float w : kWeights) {
      // p = 1 (lp = 0, r = 0): no loss; g = w (gamma = 0) or 0 (gamma > 0), never NaN.
      check->Exact(kernels::loss_term(0.0f, w, gamma), gamma == 0.0f ? w * 0.0f : 0.0f,
                   "loss at p = 1", 0.0f, gamma, w);
      check->Exact(kernels::gradient_term(0.0f, w, gamma), gamma == 0.0f ? w : 0.0f, "g at p = 1",
                   0.0f, gamma, w);
      // p = 0 (lp = -inf): loss term -inf where weighted, 0 where not; g = w (r = 1, p lp / r = 0).
      check->Exact(kernels::loss_term(-kInf, w, gamma), w == 0.0f ? 0.0f : -kInf, "loss at p = 0",
                   -kInf, gamma, w);
      check->Exact(kernels::gradient_term(-kInf, w, gamma), w, "g at p = 0", -kInf, gamma, w);
      // A NaN lp stays NaN where weighted (the row is NaN), 0 where not.
      check->Exact(kernels::loss_term(kNaN, w, gamma), w == 0.0f ? 0.0f : kNaN, "loss at NaN", kNaN,
                   gamma, w);
      // gradient_parts' g is gradient_term's, bit for bit (a row's G - g_y is then exactly 0).
      for (const float lp : LogProbGrid()) {
        check->Exact(kernels::gradient_parts(lp, w, gamma).g, kernels::gradient_term(lp, w, gamma),
                     "gradient_parts.g", lp, gamma, w);
        const float g = kernels::gradient_term(lp, w, gamma);
        check->Exact(kernels::gradient_value(kernels::gradient_parts(lp, w, gamma), g),
                     lp == lp ? 0.0f - g * -std::expm1(lp) : kNaN, "one weighted class at y",
                     lp, gamma, w);
      }
    }
  }
  // Below one: gamma < 1 has a finite limit at p -> 1 (r^gamma (lp / r) -> 0), not inf * 0.
  for (const float gamma : {0.25f, 0.5f}) {
    const float g = kernels::gradient_term(-1e-30f, 1.0f, gamma);
    check->Exact(std::isfinite(g) ? 0.0f : 1.0f, 0.0f, "finite g as p -> 1", -1e-30f, gamma, 1);
  }
}

// The float instantiation against the double one: the float64 kernel and the float paths run
// the same formulas.
void CheckFloatAgainstDouble(Check* check, double rel_tol) {
  for (const float lp : LogProbGrid()) {
    for (const float gamma : kGammas) {
      for (const float w : kWeights) {
        const double dlp = lp, dgamma = gamma, dw = w;
        // Near p = 1 with gamma > 0 both are r^gamma-small: compare where float has them in its
        // normal range.
        const double ld = kernels::loss_term(dlp, dw, dgamma);
        if (std::fabs(ld) > 1e-30 || ld == 0 || std::isnan(ld)) {
          check->Close(kernels::loss_term(lp, w, gamma), ld, rel_tol, "loss term", lp, gamma, w);
        }
        const double gd = kernels::gradient_term(dlp, dw, dgamma);
        if (std::fabs(gd) > 1e-30 || gd == 0 || std::isnan(gd)) {
          check->Close(kernels::gradient_term(lp, w, gamma), gd, rel_tol, "g_c", lp, gamma, w);
        }
      }
    }
  }
  // The row's log_sum: log(0) for no ties, NaN for a +inf maximum, log1p(s + k - 1) else.
  const float states[][3] = {{0.0f, 1.0f, 0.0f},  {3.0f, 1.0f, 1e-9f}, {3.0f, 2.0f, 0.5f},
                             {-5.0f, 1.0f, 40.0f}, {1.0f, 0.0f, 0.0f},  {kInf, 1.0f, 0.0f},
                             {2.0f, 1.0f, kNaN}};
  for (const auto& st : states) {
    kernels::LogSumExp<float> f{st[0], st[1], st[2]};
    kernels::LogSumExp<double> d{st[0], st[1], st[2]};
    check->Close(kernels::lse_finish(f).log_sum, kernels::lse_finish(d).log_sum, rel_tol, "log_sum",
                 st[2], st[0], st[1]);
  }
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Distance to the exact value in float32 ulps at the exact value.
double UlpError(float got, double want) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) == std::isnan(got) ? 0 : 1e9;
  if (std::isinf(static_cast<float>(want)) || std::isinf(got)) {
    return got == static_cast<float>(want) ? 0 : 1e9;
  }
  const double magnitude = std::fabs(want);
  const int exponent = magnitude < 1.1754943508222875e-38 ? -126 : std::ilogb(magnitude);
  const double ulp = std::ldexp(1.0, (exponent < -126 ? -126 : exponent) - 23);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

// Metal's expm1 (x <= 0) and log1p (x >= 0), with this machine's float exp and log in place of
// metal::precise's: every 64th bit pattern of their domains, plus their ends.
void CheckKahan(Check* expm1_check, Check* log1p_check, double max_ulp) {
  for (uint64_t bits = 0x80000000u; bits <= 0xFF800000u; bits += 64) {
    const float x = FromBits(static_cast<uint32_t>(bits));
    const double err = UlpError(kernels::math::expm1_nonpositive(x), std::expm1(double(x)));
    ++expm1_check->points;
    expm1_check->max_rel = std::max(expm1_check->max_rel, err);
    if (err > max_ulp) expm1_check->Fail(kernels::math::expm1_nonpositive(x), std::expm1(double(x)),
                                         "expm1 ulps", x, 0, 0);
  }
  for (uint64_t bits = 0; bits < 0x7F800000u; bits += 64) {  // finite: see the header
    const float x = FromBits(static_cast<uint32_t>(bits));
    const double err = UlpError(kernels::math::log1p_nonnegative(x), std::log1p(double(x)));
    ++log1p_check->points;
    log1p_check->max_rel = std::max(log1p_check->max_rel, err);
    if (err > max_ulp) log1p_check->Fail(kernels::math::log1p_nonnegative(x), std::log1p(double(x)),
                                         "log1p ulps", x, 0, 0);
  }
  expm1_check->Exact(kernels::math::expm1_nonpositive(-kInf), -1.0f, "expm1(-inf)", -kInf, 0, 0);
  expm1_check->Exact(kernels::math::expm1_nonpositive(-0.0f), -0.0f, "expm1(-0)", -0.0f, 0, 0);
  log1p_check->Exact(kernels::math::log1p_nonnegative(FromBits(0x7F7FFFFFu)), 88.7228394f,
                     "log1p(FLT_MAX)", FromBits(0x7F7FFFFFu), 0, 0);
  log1p_check->Exact(kernels::math::log1p_nonnegative(0.0f), 0.0f, "log1p(0)", 0.0f, 0, 0);
}

}  // namespace

int main(int argc, char** argv) {
  // Tolerances: the vector exp / log / pow are within a few ulps (test_simd_math.py), and
  // r = 1 - p within an ulp for p <= 1/2.
  const double vector_rel = argc > 1 ? std::atof(argv[1]) : 1e-5;
  const double kahan_ulp = argc > 2 ? std::atof(argv[2]) : 4.0;
  Check loss{"vector_loss_term"}, gradient{"vector_gradient_term"}, limits{"scalar_limits"};
  Check precision{"float_vs_double"}, expm1_check{"kahan_expm1"}, log1p_check{"kahan_log1p"};
  CheckVectorAgainstScalar(&loss, &gradient, vector_rel);
  CheckLimits(&limits);
  CheckFloatAgainstDouble(&precision, 1e-5);
  CheckKahan(&expm1_check, &log1p_check, kahan_ulp);
  for (const Check* c : {&loss, &gradient, &limits, &precision, &expm1_check, &log1p_check}) {
    c->Print();
  }
  return 0;
}
