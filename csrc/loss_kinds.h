// The kinds of CustomLoss execution that every side names: the op's validation (problem.h), the
// CPU rows, and the Metal launch plan (metal/launch_plan.h), which the Linux emulator and the
// CUDA stand-in also compile. Plain C++17 with no TensorFlow, so the launch plan stays free of it.
#ifndef TF_METAL_OPS_CSRC_LOSS_KINDS_H_
#define TF_METAL_OPS_CSRC_LOSS_KINDS_H_

#include <cstdint>

namespace tf_metal_ops {

// The labels input: sparse class ids (int32 or int64, one per row) or a dense target row of the
// logits' dtype.
enum class LabelKind : int32_t { kSparseInt32 = 0, kSparseInt64 = 1, kDense = 2 };
// CustomLoss (the loss) or CustomLossGrad (the gradient with respect to the logits).
enum class Direction : int32_t { kForward = 0, kGradient = 1 };

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_LOSS_KINDS_H_
