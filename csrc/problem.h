// The platform-neutral description of one CustomLoss / CustomLossGrad execution.
//
// Every backend (the CPU loop, the Metal encoder) starts from the same CustomLossProblem, built
// and validated here once: attributes are read and checked when the kernel is constructed,
// input shapes when it runs. Label *values* are checked by the backends themselves, because on
// the GPU they are not readable by the host (see csrc/metal/ and kernels/custom_loss.h).
#ifndef TF_METAL_OPS_CSRC_PROBLEM_H_
#define TF_METAL_OPS_CSRC_PROBLEM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/loss_kinds.h"
#include "csrc/tf_c.h"

namespace tf_metal_ops {

inline constexpr const char kForwardOpName[] = "TfMetalOps>CustomLoss";
inline constexpr const char kGradientOpName[] = "TfMetalOps>CustomLossGrad";
// The fused linear head's loss and its gradient (csrc/cpu/linear_cross_entropy_cpu.cc).
inline constexpr const char kLinearForwardOpName[] = "TfMetalOps>LinearCrossEntropy";
inline constexpr const char kLinearGradientOpName[] = "TfMetalOps>LinearCrossEntropyGrad";

// Input and output positions, shared by the op definitions and every kernel.
enum InputIndex : int {
  kLogits = 0,
  kLabels = 1,
  kClassWeights = 2,
  kRowScales = 3,  // forward op: the per-row scales of a reduced loss's gradient
  kUpstream = 3,   // gradient op
  kRowStats = 4,   // gradient op
};
enum OutputIndex : int {
  kOutput = 0,
  kRowStatsOutput = 1,        // forward op only
  kScaledGradientOutput = 2,  // forward op only
};

// Row statistics: the forward op's second output and the gradient op's last input, float32
// [num_rows, kRowStatsWidth] holding, per flattened row, the softmax pieces the loss was computed
// from: max_c z_c, log_sum = log sum_c exp(z_c - max) (summed so a confident row keeps its
// digits, see kernels/custom_loss_math.h) and 1 / sum_c exp(z_c - max). They depend on the logits
// alone. A gradient given them skips the passes that find them again, and (CPU) computes a
// plain or smoothed cross-entropy gradient in one pass over the row. The gradient is the same
// bit for bit as without them, except where the CPU forward computed rows in groups
// (cpu/simd/simd_row_groups.h: its vector log1p may end log_sum an ulp or two away) and the
// gradient did not, between the two kernels' class limits. The Metal kernels write and read
// the same three numbers (kernels/custom_loss.h: a Metal gradient takes max and log_sum from
// them and skips its log-sum-exp pass), so either backend's gradient can take the other's. A
// backend that does not produce them returns [0, kRowStatsWidth] (the CPU's float64 kernel),
// and the gradient then computes them itself.
inline constexpr int64_t kRowStatsWidth = 3;

// The scaled gradient of a reduced loss (Liger-Kernel's rule): a loss reduced to
// sum_i s_i loss_i (Keras's mean is s_i = 1 / N; sample weights, masks and replicas only change
// the s_i) has the gradient U * s_i * d loss_i / d z_i, U being the scalar upstream of the
// reduced loss. Given `row_scales` s (float32, the loss's shape), the forward op writes
// s_i * d loss_i / d z_i as its third output (the logits' shape and dtype) while each row's
// softmax is at hand, so a training step computes exp(z - max) once per element; the backward
// only multiplies it by U (tf_metal_ops/ops.py). Given row_scales of shape [0] (per-example
// losses), or where a backend does not make it (the float64 CPU kernel), that output is [0]
// and the gradient op computes the gradient as usual. The Metal forward writes it in the pass
// that would be the gradient kernel's last (kernels/custom_loss.h).

// The op's attributes, read once per kernel instance.
struct CustomLossAttrs {
  std::string node_name;  // for error messages: which op in the user's graph failed
  // The op's registered name, for messages; null: CustomLoss or CustomLossGrad by `direction`.
  const char* op_name = nullptr;
  Direction direction = Direction::kForward;
  TF_DataType logits_dtype = TF_FLOAT;
  TF_DataType labels_dtype = TF_INT32;
  LabelKind label_kind = LabelKind::kSparseInt32;
  float gamma = 0.0f;
  float label_smoothing = 0.0f;
  bool has_ignore_class = false;
  int64_t ignore_class = 0;
};

struct CustomLossProblem {
  CustomLossAttrs attrs;
  int64_t num_rows = 0;     // product of logits.shape[:-1]
  int64_t num_classes = 0;  // logits.shape[-1]
  bool has_class_weights = false;  // false: class_weights is empty and every a_c is 1
  std::vector<int64_t> logits_dims;
  std::vector<int64_t> row_dims;  // logits_dims without the class axis: the loss's shape
  bool has_row_stats = false;   // gradient op: row_stats were given (not [0, 3])
  bool has_row_scales = false;  // forward op: row_scales were given (not [0])
};

// The inputs of one execution, owned for the duration of Compute.
struct CustomLossInputs {
  TensorPtr logits;
  TensorPtr labels;
  TensorPtr class_weights;
  TensorPtr upstream;   // gradient op only
  TensorPtr row_stats;   // gradient op only: [num_rows, kRowStatsWidth], or [0, kRowStatsWidth]
  TensorPtr row_scales;  // forward op only: logits.shape[:-1], or [0]
};

// The state every backend's kernel keeps between calls is its attributes, read once when
// TensorFlow constructs the kernel. These are the create and delete functions of
// TF_NewKernelBuilder for every backend; Compute receives a CustomLossAttrs*. On bad attributes
// create reports the failure and returns null (TensorFlow then never calls Compute).
void* CreateForwardKernel(TF_OpKernelConstruction* ctx);
void* CreateGradientKernel(TF_OpKernelConstruction* ctx);
void DeleteKernel(void* kernel);

// Reads and checks the loss attributes every op of ours shares (T, Tlabels, gamma,
// label_smoothing, has_ignore_class, ignore_class). `op_name` names the op in messages (null:
// CustomLoss / CustomLossGrad); dense labels must have dtype `dense_labels_dtype` (TF_DATA_TYPE
// 0: the logits' dtype, T).
Error ReadLossAttrs(TF_OpKernelConstruction* ctx, Direction direction, const char* op_name,
                    TF_DataType dense_labels_dtype, CustomLossAttrs* attrs);

// Fetches the inputs and checks their shapes against each other and their dtypes against the
// attributes; fills `problem`. Does not read tensor values, so it works on GPU tensors too.
// Fails first with the pending GPU error, if any (pending_errors.h), which it clears.
Error DescribeProblem(TF_OpKernelContext* ctx, const CustomLossAttrs& attrs,
                      CustomLossInputs* inputs, CustomLossProblem* problem);

// "[2, 3, 10]": for messages.
std::string ShapeString(const std::vector<int64_t>& dims);
// "labels[1, 2]": the multi-index of flat row `row` of a tensor whose leading dims are `dims`.
std::string RowIndexString(const std::vector<int64_t>& dims, int64_t row);
// "TfMetalOps>CustomLoss (node 'name')": the prefix of every error message.
std::string OpDescription(const CustomLossAttrs& attrs);

// The message for a sparse label outside [0, C) that is not ignore_class; shared by the CPU
// kernel (raised at once) and the GPU error buffer (raised after commitAndWait).
Error BadLabelError(const CustomLossProblem& problem, int64_t row, int64_t label);
// Same for a negative or NaN class weight found at run time.
Error BadClassWeightError(const CustomLossProblem& problem, int64_t index, double value);

// Checks every label and class weight a CPU kernel can see, before any arithmetic: a bad one is
// an error for the whole batch, and the first (lowest index) is reported. `class_weights` is
// read only when the problem has them.
Error CheckLabelsAndClassWeights(const CustomLossProblem& problem, const TF_Tensor* labels,
                                 const TF_Tensor* class_weights);

// Allocates output 0 with the op's output shape (per-row loss, or d logits).
Error AllocateOutput(TF_OpKernelContext* ctx, const CustomLossProblem& problem, TensorPtr* out);

// Allocates the forward op's row statistics: [num_rows, kRowStatsWidth] when the backend fills
// them (`filled`), else [0, kRowStatsWidth].
Error AllocateRowStats(TF_OpKernelContext* ctx, const CustomLossProblem& problem, bool filled,
                       TensorPtr* out);

// The gradient (the logits' shape and dtype) as output `index`, over the logits' own buffer
// when TensorFlow allows it: when nothing but this op still holds them (a model's last layer in
// training, whose logits only the loss reads), the step allocates nothing of size N x C. Every
// backend's kernels are correct in place (the CPU rows read z_c before they write grad_c; the
// Metal kernels read a row's logits before its gradient is written over them:
// kernels/custom_loss.h). Otherwise TensorFlow allocates a buffer of its own. `inputs->logits`
// is taken again afterwards (the same buffer when it was forwarded); `in_place`, when given,
// says which happened.
Error ForwardLogitsOrAllocate(TF_OpKernelContext* ctx, const CustomLossProblem& problem,
                              int index, CustomLossInputs* inputs, TensorPtr* out,
                              bool* in_place = nullptr);

// Allocates the forward op's scaled gradient with shape [0]: without row_scales, and for
// backends and dtypes that do not make one.
Error AllocateNoScaledGradient(TF_OpKernelContext* ctx, const CustomLossProblem& problem);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_PROBLEM_H_
