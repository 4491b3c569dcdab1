// The scalar math of CustomLoss: one class's loss and gradient terms and one row's log-softmax,
// written once for every backend. Included by the Metal kernels (custom_loss.h, compiled as MSL,
// by the Linux emulator's C++ stand-in and by the CUDA stand-in of tests/msl_cuda) and by the
// CPU's scalar paths (the float64 kernel in csrc/cpu/custom_loss_cpu.cc, the single-element
// fix-ups of the vectorized rows in csrc/cpu/simd/simd_rows.h and simd_row_groups.h). The CPU's
// vector formulas are separate, and tests/cpu_math/shared_math_check.cc holds them against these.
// The NumPy reference (tf_metal_ops/reference.py) is written independently: it is the oracle.
//
// Plain templates over the accumulator type Acc (float on Metal, which has no double; float or
// double on the CPU) and a small shim, kernels::math, that maps exp / log / pow / expm1 / log1p to
// each backend's functions. The switch is `__METAL__`, as in custom_loss_params.h: the Metal
// compiler defines it, and so do the emulator and the CUDA builds, which then take their
// <metal_stdlib> stand-in (so nothing of the C++ standard library is used in that branch).
//
// ---------------------------------------------------------------------------------------------
// The loss, for one row (example) with logits z_1..z_C:
//   q_c  = (1 - eps) t_c + eps / C              t = one_hot(y) (sparse) or the dense target row
//   w_c  = a_c q_c                              a = class weights (all 1 by default)
//   lp_c = log p_c = z_c - log sum_k exp(z_k)   (log-softmax)
//   r_c  = 1 - p_c
//   loss = - sum_c w_c r_c^gamma lp_c           0^0 = 1; a term with w_c == 0 is 0
//   rows whose sparse label == ignore_class: loss 0, gradient 0.
//
// The gradient. Let f_c(p) = -w_c (1 - p)^gamma log p, so loss = sum_c f_c(p_c). Then
//   f_c'(p_c)  = w_c [ gamma r_c^(gamma-1) lp_c - r_c^gamma / p_c ]
//   dp_c/dz_j  = p_c (delta_cj - p_j)                                  (softmax Jacobian)
//   dloss/dz_j = sum_c f_c'(p_c) p_c (delta_cj - p_j)
//              = -sum_c g_c (delta_cj - p_j) = p_j G - g_j
// with
//   g_c = w_c [ r_c^gamma - gamma p_c r_c^(gamma-1) lp_c ] = w_c r_c^gamma (1 - gamma p_c lp_c / r_c)
//   G   = sum_c g_c.
// (gamma = 0: g_c = w_c and dloss/dz_j = p_j sum_c w_c - w_j, softmax minus target.)
// With one weighted class y (sparse labels, no smoothing) G = g_y, so dloss/dz_j = p_j g_y for
// j != y and (p_y - 1) g_y = -r_y g_y at y.
//
// Numerics, term by term:
// - log-sum-exp keeps (max m, ties k, others s): k = number of logits equal to m, each
//   contributing exactly 1, and s = sum of exp(z - m) over the rest. Then
//   log sum exp(z - m) = log1p(s + (k - 1)), so for a confident row (s < 1e-7 in float) the
//   target's lp = -log1p(s) keeps its digits instead of rounding to 0 (as 1 + s would).
// - m starts at the lowest finite value, not -inf: a row that begins with -inf logits (masked
//   classes) never forms -inf - (-inf). A row of only -inf logits has k = 0, s = 0, so
//   log-sum = log(0) = -inf and every lp = -inf + inf = NaN: the softmax is undefined.
// - A NaN logit is neither > m nor == m, so it lands in s and makes the row NaN (that row only).
//   A +inf logit makes the softmax undefined too (inf - inf); the row is NaN, like the reference.
// - lp_c is kept as (z_c - m) - log_sum, never z_c - (m + log_sum): adding a small log_sum to a
//   large m would round it away (30 + 1e-9 == 30 in float).
// - r_c = -expm1(lp_c), not 1 - exp(lp_c), so r keeps its digits when p is near 1.
// - lp / r -> -1 as r -> 0 (log(1 - r) = -r + O(r^2)): p lp / r is taken as -p when r == 0, so
//   for gamma < 1 the factor gamma p r^(gamma-1) lp = gamma r^gamma (p lp / r) has its finite
//   limit (0 at p = 1) and is never inf * 0.
// - p_c == 0 (a -inf logit, or exp underflow): p lp / r is taken as its limit 0, not 0 * -inf.
// - A term with w_c == 0 is 0, so a masked class (lp = -inf) that carries no target weight
//   contributes 0 instead of 0 * -inf. (With label smoothing every class carries weight, and the
//   true loss of a row that masks a class is +inf, which is what comes out.)
// - gamma == 0 skips r altogether: r^0 = 1, the loss term is w lp and g_c = w_c exactly.
// - MSL has no expm1 / log1p: on Metal they are expm1_nonpositive and log1p_nonnegative below,
//   Kahan's correction with precise exp/log, accurate to a few ulps; the CPU takes libm's.
//   Every call here stays in their domain: lp <= 0, and log1p's argument s + (k - 1) >= 0.
// - On Metal every exp/log/pow is metal::precise::, and the library must still be compiled with
//   fast math off (MTLMathModeSafe / fastMathEnabled = NO / -fno-fast-math): fast math lets the
//   compiler assume no NaN or inf, which would break the NaN and -inf rules above.
// ---------------------------------------------------------------------------------------------
#ifndef TF_METAL_OPS_KERNELS_CUSTOM_LOSS_MATH_H_
#define TF_METAL_OPS_KERNELS_CUSTOM_LOSS_MATH_H_

#if defined(__METAL__)
#include <metal_stdlib>
#else
#include <cmath>
#include <limits>
#endif

namespace tf_metal_ops {
namespace kernels {
namespace math {

// ---- the backend shim -----------------------------------------------------------------------

#if defined(__METAL__)
inline float exp(float x) { return ::metal::precise::exp(x); }
inline float exp2(float x) { return ::metal::precise::exp2(x); }
inline float log(float x) { return ::metal::precise::log(x); }
inline float pow(float x, float y) { return ::metal::precise::pow(x, y); }
template <typename Acc>
inline Acc lowest() { return Acc(-FLT_MAX); }
template <typename Acc>
inline Acc infinity() { return Acc(INFINITY); }
template <typename Acc>
inline Acc quiet_nan() { return Acc(NAN); }
#else
inline float exp(float x) { return std::exp(x); }
inline double exp(double x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline double exp2(double x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline double log(double x) { return std::log(x); }
inline float pow(float x, float y) { return std::pow(x, y); }
inline double pow(double x, double y) { return std::pow(x, y); }
template <typename Acc>
inline Acc lowest() { return std::numeric_limits<Acc>::lowest(); }
template <typename Acc>
inline Acc infinity() { return std::numeric_limits<Acc>::infinity(); }
template <typename Acc>
inline Acc quiet_nan() { return std::numeric_limits<Acc>::quiet_NaN(); }
#endif

// expm1(x) for x <= 0 (or NaN). With u = exp(x) rounded, (u - 1) * x / log(u) cancels the
// rounding error of u (Kahan). u == 1: |x| is below half an ulp of 1, expm1(x) = x.
// u - 1 == -1: exp(x) is negligible next to 1 (x < -17 in float, or x = -inf).
// Defined for every backend (the CPU tests check it against libm); only Metal calls it.
// The same, given u = exp(x) already computed (the gradient has it: p = exp(lp)), bitwise equal.
template <typename Acc>
inline Acc expm1_nonpositive_given_exp(Acc x, Acc u) {
  if (u == Acc(1)) return x;
  const Acc um1 = u - Acc(1);
  if (um1 == Acc(-1)) return Acc(-1);
  return um1 * (x / log(u));
}

template <typename Acc>
inline Acc expm1_nonpositive(Acc x) {
  return expm1_nonpositive_given_exp(x, exp(x));
}

// log1p(x) for finite x >= 0 (or NaN), same correction: u = 1 + x rounded, log(u) * x / (u - 1).
// (x = inf would give inf * NaN; the kernels' argument is at most 2C - 1: ties + others <= C.)
template <typename Acc>
inline Acc log1p_nonnegative(Acc x) {
  const Acc u = Acc(1) + x;
  if (u == Acc(1)) return x;
  return log(u) * (x / (u - Acc(1)));
}

#if defined(__METAL__)
inline float expm1(float x) { return expm1_nonpositive(x); }
inline float log1p(float x) { return log1p_nonnegative(x); }
#else
inline float expm1(float x) { return std::expm1(x); }
inline double expm1(double x) { return std::expm1(x); }
inline float log1p(float x) { return std::log1p(x); }
inline double log1p(double x) { return std::log1p(x); }
#endif

}  // namespace math

// ---- one class's terms ------------------------------------------------------------------------

// r = 1 - p = -expm1(lp), which keeps its digits where p is near 1. A NaN lp passes unchanged:
// negated, its sign bit would flip, and where it met the row's other (positive) NaNs in a
// product, the sign that survives would follow the operand order the compiler picked, which can
// differ between two inlinings of the same formula (the forward's scaled gradient and the
// gradient op disagreed so in their NaN rows under clang, on x86-64 and arm64).
template <typename Acc>
inline Acc one_minus_p(Acc lp) {
  return lp != lp ? lp : -math::expm1(lp);
}

// The same given p = exp(lp): on Metal, whose expm1 starts from exp(lp), that exponential is p
// itself (bitwise the same r, one exp fewer per class); elsewhere libm's expm1.
template <typename Acc>
inline Acc one_minus_p_given_p(Acc lp, Acc p) {
#if defined(__METAL__)
  return lp != lp ? lp : -math::expm1_nonpositive_given_exp(lp, p);
#else
  (void)p;
  return one_minus_p(lp);
#endif
}

// r^gamma with 0^0 = 1 and 0^gamma = 0 (gamma > 0); r is in [0, 1] or NaN.
template <typename Acc>
inline Acc focal_power(Acc r, Acc gamma) {
  if (gamma == Acc(0)) return Acc(1);
  if (r == Acc(0)) return Acc(0);
  return math::pow(r, gamma);
}

// r^gamma lp: one class's term of -loss, before the weight.
template <typename Acc>
inline Acc focal_loss_factor(Acc lp, Acc gamma) {
  if (gamma == Acc(0)) return lp;
  return focal_power(one_minus_p(lp), gamma) * lp;
}

// r^gamma (1 - gamma p lp / r) = g_c / w_c, given p = exp(lp) and r = -expm1(lp), with the
// limits of p lp / r at r == 0 and p == 0 (see the numerics notes above).
template <typename Acc>
inline Acc focal_gradient_factor(Acc lp, Acc p, Acc r, Acc gamma) {
  if (gamma == Acc(0)) return Acc(1);
  Acc p_lp_over_r;
  if (p == Acc(0)) {
    p_lp_over_r = Acc(0);  // lim p lp / r as p -> 0 (lp may be -inf)
  } else if (r == Acc(0)) {
    p_lp_over_r = -p;  // lim lp / r = -1 as r -> 0
  } else {
    p_lp_over_r = p * lp / r;
  }
  return focal_power(r, gamma) * (Acc(1) - gamma * p_lp_over_r);
}

// The same, from lp alone.
template <typename Acc>
inline Acc focal_gradient_factor(Acc lp, Acc gamma) {
  if (gamma == Acc(0)) return Acc(1);
  const Acc p = math::exp(lp);
  return focal_gradient_factor(lp, p, one_minus_p_given_p(lp, p), gamma);
}

// w r^gamma lp: one class's term of -loss. 0 when w == 0, even for lp = -inf.
template <typename Acc>
inline Acc loss_term(Acc lp, Acc w, Acc gamma) {
  if (w == Acc(0)) return Acc(0);
  return w * focal_loss_factor(lp, gamma);
}

// g_c = w r^gamma (1 - gamma p lp / r); 0 when w == 0.
template <typename Acc>
inline Acc gradient_term(Acc lp, Acc w, Acc gamma) {
  if (w == Acc(0)) return Acc(0);
  return w * focal_gradient_factor(lp, gamma);
}

// One class's gradient quantities, computed once per class.
template <typename Acc>
struct GradientParts {
  Acc p;  // p_c
  Acc r;  // r_c = 1 - p_c, from expm1
  Acc g;  // g_c
};

// p_c and r_c of a class whose g_c is already known.
template <typename Acc>
inline GradientParts<Acc> gradient_parts_given(Acc lp, Acc g) {
  GradientParts<Acc> out;
  out.p = math::exp(lp);
  out.r = one_minus_p_given_p(lp, out.p);
  out.g = g;
  return out;
}

// g_c bitwise as gradient_term computes it, with p_c and r_c beside it.
template <typename Acc>
inline GradientParts<Acc> gradient_parts(Acc lp, Acc w, Acc gamma) {
  GradientParts<Acc> out = gradient_parts_given(lp, Acc(0));
  if (w != Acc(0)) out.g = w * focal_gradient_factor(lp, out.p, out.r, gamma);
  return out;
}

// d loss / d z_j = p_j G - g_j, written as p_j (G - g_j) - g_j r_j. The same number, but when
// p_j is close to 1 the direct form subtracts two nearly equal products and keeps only the digits
// of p_j (1e-3 relative error at r_j = 1e-4 in float); here g_j r_j carries r_j's own digits, and
// G - g_j is exactly 0 when g_j is the row's only term (one weighted class: -r_y g_y at y).
template <typename Acc>
inline Acc gradient_value(GradientParts<Acc> t, Acc big_g) {
  return t.p * (big_g - t.g) - t.g * t.r;
}

// The cross-entropy gradient (gamma = 0, g_c = w_c) written directly, p_j W - w_j: for the
// float64 kernel, whose 16 digits leave enough where p_j is near 1, and which would otherwise
// spend a second exponential (expm1 for r_j) on every element.
template <typename Acc>
inline Acc cross_entropy_gradient(Acc p, Acc total_weight, Acc w) {
  return p * total_weight - w;
}

// The same at y for a row whose only weighted class is y (G = g_y, so G - g_y = 0): -r_y g_y,
// without p_y. (g_j = 0 elsewhere, where the gradient is p_j g_y.)
template <typename Acc>
inline Acc only_class_gradient(Acc lp_y, Acc g_y) {
  return math::expm1(lp_y) * g_y;
}

// ---- one row's log-softmax --------------------------------------------------------------------

// The log-sum-exp state of some of a row's logits: sum_c exp(z_c - max) = ties + others.
template <typename Acc>
struct LogSumExp {
  Acc max;     // m: largest logit seen, starts at the lowest finite value
  Acc ties;    // k: how many logits equal m (each contributes exp(0) = 1)
  Acc others;  // s: sum of exp(z - m) over the logits below m (NaN logits land here)
};

template <typename Acc>
inline LogSumExp<Acc> lse_empty() {
  LogSumExp<Acc> s;
  s.max = math::lowest<Acc>();
  s.ties = Acc(0);
  s.others = Acc(0);
  return s;
}

// The state of the union of two sets of logits. Commutative (bitwise: a + b == b + a), which
// the Metal kernels' butterflies rely on.
template <typename Acc>
inline LogSumExp<Acc> lse_combine(LogSumExp<Acc> a, LogSumExp<Acc> b) {
  LogSumExp<Acc> out;
  if (a.max == b.max) {
    out.max = a.max;
    out.ties = a.ties + b.ties;
    out.others = a.others + b.others;
  } else if (a.max > b.max) {
    out.max = a.max;
    out.ties = a.ties;
    out.others = a.others + (b.others + b.ties) * math::exp(b.max - a.max);
  } else {
    out.max = b.max;
    out.ties = b.ties;
    out.others = b.others + (a.others + a.ties) * math::exp(a.max - b.max);
  }
  return out;
}

// lp_c = (z_c - max) - log_sum, kept in two parts (see the numerics notes above).
template <typename Acc>
struct RowLogSoftmax {
  Acc max;
  Acc log_sum;  // log sum_c exp(z_c - max)
};

template <typename Acc>
inline RowLogSoftmax<Acc> lse_finish(LogSumExp<Acc> s) {
  RowLogSoftmax<Acc> out;
  out.max = s.max;
  if (s.max == math::infinity<Acc>()) {
    out.log_sum = math::quiet_nan<Acc>();  // a +inf logit: inf - inf, no softmax
  } else if (s.ties == Acc(0)) {
    out.log_sum = math::log(s.others);  // only -inf (log 0 = -inf, lp = NaN) or NaN logits
  } else {
    out.log_sum = math::log1p(s.others + (s.ties - Acc(1)));
  }
  return out;
}

template <typename Acc>
inline Acc log_prob(RowLogSoftmax<Acc> ls, Acc z) {
  return (z - ls.max) - ls.log_sum;
}

// ---- cross-entropy (gamma = 0) from two sums the log-sum-exp walk carries ------------------
// With gamma = 0 every class's term of -loss is w_c lp_c, and lp_c = (z_c - m) - log_sum, so
//   loss = -sum_c w_c lp_c = W log_sum - S,   W = sum_c w_c,   S = sum_c w_c (z_c - m),
// and the gradient is p_j W - w_j (G = W). Both need W and S beside the row's log-softmax, and
// both sums can be taken in the same walk over the logits as the log-sum-exp: label smoothing,
// class weights and dense targets then read each logit as often as plain cross-entropy does.
// - S is kept relative to the running maximum m: each term is <= 0 (z_c <= m), and when m grows
//   to m', S + W (m - m') is the same sum relative to m' (every term still <= 0). The loss is the
//   non-negative W log_sum minus the non-positive S, a sum of like-signed parts: no cancellation
//   however large |z| is (summing w_c z_c and subtracting W m would lose all digits at z ~ 1e4).
// - A class with w_c == 0 adds nothing to S, also at z_c = -inf (a masked class without
//   weight); with weight, z_c = -inf makes S = -inf and the loss +inf, the true loss.
// - Sparse labels: q_c = (1 - eps) [c == y] + eps / C, so with A = sum_c a_c and
//   S_a = sum_c a_c (z_c - m),  W = (1 - eps) a_y + (eps / C) A  and
//   S = (1 - eps) a_y (z_y - m) + (eps / C) S_a: the walk sums a_c (z_c - m) and a_c alone and
//   never compares a class with the label.

// w (z - m), 0 when w == 0 (even for z = -inf).
template <typename Acc>
inline Acc shifted_term(Acc z, Acc max, Acc w) {
  return w == Acc(0) ? Acc(0) : w * (z - max);
}

// S relative to old_max, given its weight W, as the same sum relative to new_max >= old_max.
template <typename Acc>
inline Acc shifted_sum_rebased(Acc shifted, Acc weight, Acc old_max, Acc new_max) {
  return weight == Acc(0) ? shifted : shifted + weight * (old_max - new_max);
}

// W of a sparse row: (1 - eps) a_y + (eps / C) A; `label_weight` is (1 - eps) a_y.
template <typename Acc>
inline Acc sparse_total_weight(Acc label_weight, Acc smooth_off, Acc weight_sum) {
  return label_weight + smooth_off * weight_sum;
}

// -loss = S - W log_sum (<= 0); 0 when no class carries weight (every term is 0).
template <typename Acc>
inline Acc cross_entropy_neg_loss(RowLogSoftmax<Acc> ls, Acc total_weight, Acc shifted) {
  if (total_weight == Acc(0)) return Acc(0);
  return shifted - total_weight * ls.log_sum;
}

}  // namespace kernels
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_KERNELS_CUSTOM_LOSS_MATH_H_
