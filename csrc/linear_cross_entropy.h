// LinearCrossEntropy and LinearCrossEntropyGrad: the loss of a linear head, CustomLoss(labels,
// hidden @ kernel + bias), without its logits (csrc/cpu/linear_cross_entropy_cpu.cc has the
// loop; tf_metal_ops/linear_cross_entropy.py the Python side).
//
// Forward inputs:  hidden T [N, d] (half, bfloat16, float), kernel float [d, V], bias float [V],
//                  labels (int32 / int64 [N] or [N, 1], or float32 dense [N, V]),
//                  class_weights float [V] or [0], row_scales float [N] or [0].
// Forward outputs: loss float [N], row_stats float [N, 3] (problem.h), and, given row scales
//                  (a reduced loss), the gradients of sum_i s_i loss_i: d hidden T [N, d],
//                  d kernel float [d, V], d bias float [V]; each [0] without row scales.
// Gradient inputs: hidden, kernel, bias, labels, class_weights as above, upstream float [N],
//                  row_stats float [N, 3] (the forward's).
// Gradient outputs: d hidden T [N, d], d kernel float [d, V], d bias float [V] of
//                  sum_i upstream_i loss_i.
// Attributes: CustomLoss's (T, Tlabels, gamma, label_smoothing, has_ignore_class, ignore_class)
// and chunk_rows (rows of logits made at once; 0: LinearChunkRows's default). The gradient op
// must be given the forward's chunk_rows, so that it makes the same logits the statistics came
// from.
#ifndef TF_METAL_OPS_CSRC_LINEAR_CROSS_ENTROPY_H_
#define TF_METAL_OPS_CSRC_LINEAR_CROSS_ENTROPY_H_

#include <cstdint>

namespace tf_metal_ops {

enum LinearInputIndex : int {
  kLinearHidden = 0,
  kLinearKernel = 1,
  kLinearBias = 2,
  kLinearLabels = 3,
  kLinearClassWeights = 4,
  kLinearRowScales = 5,  // forward
  kLinearUpstream = 5,   // gradient
  kLinearRowStats = 6,   // gradient
};
enum LinearOutputIndex : int {
  kLinearLossOutput = 0,      // forward
  kLinearRowStatsOutput = 1,  // forward
  kLinearDHiddenOutput = 2,   // forward; the gradient op's outputs start at 0
};

// The default chunk's floor: below it the products' shared dimension is too short for the
// BLAS to run at full speed (docs/performance.md).
inline constexpr int64_t kMinLinearChunkRows = 256;

// Rows per chunk: `requested` when > 0, else about rows x width logits (Liger-Kernel's size),
// at least kMinLinearChunkRows; never more than `rows`, never less than 1.
int64_t LinearChunkRows(int64_t requested, int64_t rows, int64_t width, int64_t classes);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_LINEAR_CROSS_ENTROPY_H_
