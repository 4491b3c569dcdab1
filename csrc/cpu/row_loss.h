// The CustomLoss of one row and its gradient, for the CPU kernels.
//
// Definition (one row, C classes; w_c = a_c q_c with q_c = (1 - eps) t_c + eps / C):
//
//   lse   = log sum_k exp(z_k)               lp_c = log p_c = z_c - lse
//   loss  = - sum_c w_c (1 - p_c)^gamma lp_c                       (0^0 = 1)
//
// Gradient. Write r_c = 1 - p_c. With dp_c/dz_j = p_c (delta_cj - p_j) and
//   d/dp [ r^gamma lp ] = r^gamma / p - gamma r^(gamma-1) lp,
// the chain rule gives
//   d loss / dz_j = - sum_c w_c [ r_c^gamma - gamma p_c r_c^(gamma-1) lp_c ] (delta_cj - p_j)
//                 = p_j G - g_j,
//   g_c = w_c r_c^gamma (1 - gamma p_c lp_c / r_c),        G = sum_c g_c.
// With gamma = 0 this is the familiar p_j sum_c w_c - w_j (softmax minus target).
//
// Precision and limits, term by term:
// - r_c = -expm1(lp_c) rather than 1 - exp(lp_c): near p = 1 the subtraction would cancel all
//   digits, while expm1 keeps them.
// - lp_c / r_c -> -1 as p_c -> 1 (log(1 - r) / r), so with gamma < 1 the factor
//   r^(gamma-1) lp = r^gamma (lp / r) stays finite and tends to 0: no inf * 0.
// - p_c = 0 (a masked logit of -inf): p_c lp_c / r_c -> 0; computed literally it is 0 * -inf.
// - Terms with w_c = 0 are skipped, so a masked class that carries no target weight
//   contributes 0 instead of 0 * -inf. (With label smoothing the true loss of a row that masks
//   a class is +inf, and the kernel says so.)
// - The running maximum starts at the lowest finite value, not -inf, so a row that begins with
//   -inf logits never evaluates -inf - (-inf).
// - A NaN logit makes lse NaN, hence the row's loss and gradient NaN, and no other row's; so
//   does a +inf logit (the softmax is inf / inf there).
#ifndef TF_METAL_OPS_CSRC_CPU_ROW_LOSS_H_
#define TF_METAL_OPS_CSRC_CPU_ROW_LOSS_H_

#include <cmath>
#include <cstdint>
#include <limits>

#include "csrc/cpu/float_types.h"

namespace tf_metal_ops {

// log_softmax of one row, kept as lp_c = (z_c - max) - log_sum rather than z_c - lse: adding a
// tiny log_sum to a large max would round it away (30 + 1e-13 == 30 in float32).
template <typename Acc>
struct LogSoftmax {
  Acc max;
  Acc log_sum;  // log sum_c exp(z_c - max)
  Acc operator()(Acc z) const { return (z - max) - log_sum; }
};

// The row's LogSoftmax, in two passes (maximum, then the sum) that both vectorize.
//
// Each logit equal to the maximum m contributes exactly 1 to the sum, so the sum is
// ties + s with s the share of the others, and lse = m + log1p(s + ties - 1). Keeping the 1 out
// of the float sum keeps s's digits: for a confident row (s < 1e-7 in float32) the labelled
// class's lp = -log1p(s) stays accurate instead of rounding to 0, and so does r = 1 - p.
// A NaN logit is never equal to m, so it reaches the sum and makes lse NaN.
template <typename T, typename Acc = typename Accumulator<T>::type>
LogSoftmax<Acc> RowLogSoftmax(const T* z, int64_t num_classes) {
  Acc max_value = std::numeric_limits<Acc>::lowest();
  for (int64_t c = 0; c < num_classes; ++c) {
    Acc value = Load(z[c]);
    max_value = value > max_value ? value : max_value;
  }
  Acc others = 0;
  Acc ties = 0;
  for (int64_t c = 0; c < num_classes; ++c) {
    const Acc value = Load(z[c]);
    const bool tie = value == max_value;
    others += tie ? Acc(0) : std::exp(value - max_value);
    ties += tie ? Acc(1) : Acc(0);
  }
  // No logit reached m: every one is -inf (or NaN). The softmax is undefined; log(0) makes lse
  // -inf and every lp = -inf - (-inf) = NaN, as in the reference.
  // A +inf logit makes the softmax inf / inf: the whole row is NaN, as in the reference.
  if (max_value == std::numeric_limits<Acc>::infinity()) {
    return {max_value, std::numeric_limits<Acc>::quiet_NaN()};
  }
  if (ties == 0) return {max_value, std::log(others)};
  return {max_value, std::log1p(others + (ties - 1))};
}

// The focal factors of one class, given lp = log p.
template <typename Acc>
struct FocalFactors {
  Acc loss;      // r^gamma lp                         (the loss term, before -w)
  Acc gradient;  // r^gamma (1 - gamma p lp / r)       (g_c / w_c)
};

template <typename Acc>
inline FocalFactors<Acc> Focal(Acc lp, Acc gamma) {
  if (gamma == 0) return {lp, Acc(1)};
  const Acc p = std::exp(lp);
  // A NaN lp passes unchanged: negating it would flip its sign bit, and where this NaN meets the
  // row's other (positive) NaNs in a product, which one survives depends on the order the
  // compiler gives the operands, which may differ between two inlinings of the same formula
  // (the early gradient and the gradient op then disagreed in their NaN rows under clang).
  const Acc r = std::isnan(lp) ? lp : -std::expm1(lp);
  const Acc r_pow = std::pow(r, gamma);  // pow(0, gamma > 0) = 0
  Acc p_lp_over_r;
  if (p == 0) {
    p_lp_over_r = 0;  // lim p lp / r as p -> 0 (lp may be -inf)
  } else if (r == 0) {
    p_lp_over_r = -p;  // lim lp / r = -1 as r -> 0
  } else {
    p_lp_over_r = p * lp / r;
  }
  return {r_pow * lp, r_pow * (1 - gamma * p_lp_over_r)};
}

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_ROW_LOSS_H_
