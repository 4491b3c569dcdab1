// Op definitions for CustomLoss and its gradient, with shape inference, for LinearCrossEntropy
// and its gradient (csrc/linear_cross_entropy.h), for AddInto (csrc/add_into.h), the
// in-place sum of the composed chunked loss's kernel gradient, and for MetalKernel
// (csrc/metal_kernel.h), a user's own kernel.
//
// Registered from a static initializer: tf.load_op_library dlopens the library and collects the
// ops registered while it loads (it does not call TF_InitKernel).
#include <cstdio>

#include "csrc/add_into.h"
#include "csrc/linear_cross_entropy.h"
#include "csrc/metal_kernel.h"
#include "csrc/problem.h"
#include "tensorflow/c/ops.h"

namespace tf_metal_ops {
namespace {

struct ShapeHandleDeleter {
  void operator()(TF_ShapeHandle* handle) const { TF_DeleteShapeHandle(handle); }
};
using ShapeHandlePtr = std::unique_ptr<TF_ShapeHandle, ShapeHandleDeleter>;
ShapeHandlePtr NewShape() { return ShapeHandlePtr(TF_NewShapeHandle()); }

// Both ops' outputs are a prefix of, or all of, the logits' shape: [..., C] -> [...] for the
// loss, [..., C] for the gradient. Mismatches between the inputs are reported by the kernels
// (and, with static shapes, by the Python wrapper with both shapes named), so the shape
// function only insists on what every caller needs: logits of rank >= 1.
void InferShape(TF_ShapeInferenceContext* ctx, TF_Status* status, bool keep_class_axis) {
  ShapeHandlePtr logits = NewShape();
  TF_ShapeInferenceContextGetInput(ctx, kLogits, logits.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  ShapeHandlePtr checked = NewShape();
  TF_ShapeInferenceContextWithRankAtLeast(ctx, logits.get(), 1, checked.get(), status);
  if (TF_GetCode(status) != TF_OK) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "TfMetalOps>CustomLoss: logits must have rank >= 1 ([..., num_classes])");
    return;
  }
  if (keep_class_axis || !TF_ShapeInferenceContextRankKnown(ctx, checked.get())) {
    if (!keep_class_axis) {
      TF_ShapeInferenceContextSetUnknownShape(ctx, status);
      return;
    }
    TF_ShapeInferenceContextSetOutput(ctx, kOutput, checked.get(), status);
    return;
  }
  ShapeHandlePtr rows = NewShape();
  TF_ShapeInferenceContextSubshape(ctx, checked.get(), 0, -1, rows.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  TF_ShapeInferenceContextSetOutput(ctx, kOutput, rows.get(), status);
}

void InferLossShape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  // Every output unknown first: the scaled gradient (problem.h) is the logits' shape or [0],
  // which is decided at run time, so it stays unknown.
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
  if (TF_GetCode(status) != TF_OK) return;
  InferShape(ctx, status, /*keep_class_axis=*/false);
  if (TF_GetCode(status) != TF_OK) return;
  // row_stats: [num_rows or 0, kRowStatsWidth] (problem.h); the row count is left unknown
  // (-1, TensorFlow's unknown dimension).
  ShapeHandlePtr rows(TF_ShapeInferenceContextVectorFromSize(ctx, static_cast<size_t>(-1)));
  ShapeHandlePtr width(TF_ShapeInferenceContextVectorFromSize(ctx, kRowStatsWidth));
  ShapeHandlePtr stats = NewShape();
  TF_ShapeInferenceContextConcatenateShapes(ctx, rows.get(), width.get(), stats.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  TF_ShapeInferenceContextSetOutput(ctx, kRowStatsOutput, stats.get(), status);
}
void InferGradientShape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  InferShape(ctx, status, /*keep_class_axis=*/true);
}

// The sum's shape is the `shape` input's value, known only at run time; the Python caller sets
// it (tf.ensure_shape).
void InferAddIntoShape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

// The linear ops' shapes depend on whether row scales were given ([0] or not): only the
// forward's loss ([N], from hidden [N, d]) and row statistics ([N, 3]) are inferred; the
// Python wrapper sets the gradients' shapes.
void InferLinearShape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
  if (TF_GetCode(status) != TF_OK) return;
  ShapeHandlePtr hidden = NewShape();
  TF_ShapeInferenceContextGetInput(ctx, kLinearHidden, hidden.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  ShapeHandlePtr checked = NewShape();
  TF_ShapeInferenceContextWithRank(ctx, hidden.get(), 2, checked.get(), status);
  if (TF_GetCode(status) != TF_OK) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "TfMetalOps>LinearCrossEntropy: hidden must have rank 2 ([rows, d])");
    return;
  }
  ShapeHandlePtr rows = NewShape();
  TF_ShapeInferenceContextSubshape(ctx, checked.get(), 0, 1, rows.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  TF_ShapeInferenceContextSetOutput(ctx, kLinearLossOutput, rows.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  ShapeHandlePtr width(TF_ShapeInferenceContextVectorFromSize(ctx, kRowStatsWidth));
  ShapeHandlePtr stats = NewShape();
  TF_ShapeInferenceContextConcatenateShapes(ctx, rows.get(), width.get(), stats.get(), status);
  if (TF_GetCode(status) != TF_OK) return;
  TF_ShapeInferenceContextSetOutput(ctx, kLinearRowStatsOutput, stats.get(), status);
}
void InferLinearGradientShape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

void AddLinearSignature(TF_OpDefinitionBuilder* builder) {
  TF_OpDefinitionBuilderAddAttr(builder, "T: {half, bfloat16, float}");
  TF_OpDefinitionBuilderAddAttr(builder, "Tlabels: {int32, int64, float}");
  TF_OpDefinitionBuilderAddAttr(builder, "gamma: float = 0.0");
  TF_OpDefinitionBuilderAddAttr(builder, "label_smoothing: float = 0.0");
  TF_OpDefinitionBuilderAddAttr(builder, "has_ignore_class: bool = false");
  TF_OpDefinitionBuilderAddAttr(builder, "ignore_class: int = 0");
  TF_OpDefinitionBuilderAddAttr(builder, "chunk_rows: int = 0");
  TF_OpDefinitionBuilderAddInput(builder, "hidden: T");
  TF_OpDefinitionBuilderAddInput(builder, "kernel: float");
  TF_OpDefinitionBuilderAddInput(builder, "bias: float");
  TF_OpDefinitionBuilderAddInput(builder, "labels: Tlabels");
  TF_OpDefinitionBuilderAddInput(builder, "class_weights: float");
}

void AddCommonSignature(TF_OpDefinitionBuilder* builder) {
  TF_OpDefinitionBuilderAddAttr(builder, "T: {half, bfloat16, float, double}");
  TF_OpDefinitionBuilderAddAttr(builder,
                                "Tlabels: {int32, int64, half, bfloat16, float, double}");
  TF_OpDefinitionBuilderAddAttr(builder, "gamma: float = 0.0");
  TF_OpDefinitionBuilderAddAttr(builder, "label_smoothing: float = 0.0");
  TF_OpDefinitionBuilderAddAttr(builder, "has_ignore_class: bool = false");
  TF_OpDefinitionBuilderAddAttr(builder, "ignore_class: int = 0");
  TF_OpDefinitionBuilderAddInput(builder, "logits: T");
  TF_OpDefinitionBuilderAddInput(builder, "labels: Tlabels");
  TF_OpDefinitionBuilderAddInput(builder, "class_weights: float");
}

void Register(TF_OpDefinitionBuilder* builder, const char* name) {
  StatusPtr status = NewStatus();
  TF_RegisterOpDefinition(builder, status.get());  // takes ownership of the builder
  if (TF_GetCode(status.get()) != TF_OK) {
    // A static initializer has nobody to return an error to; TensorFlow then reports the op as
    // unknown when it is used, and this line says why.
    std::fprintf(stderr, "tf_metal_ops: registering op %s failed: %s\n", name,
                 TF_Message(status.get()));
  }
}

void RegisterOps() {
  TF_OpDefinitionBuilder* forward = TF_NewOpDefinitionBuilder(kForwardOpName);
  AddCommonSignature(forward);
  TF_OpDefinitionBuilderAddInput(forward, "row_scales: float");
  TF_OpDefinitionBuilderAddOutput(forward, "loss: T");
  TF_OpDefinitionBuilderAddOutput(forward, "row_stats: float");
  TF_OpDefinitionBuilderAddOutput(forward, "scaled_gradient: T");
  TF_OpDefinitionBuilderSetShapeInferenceFunction(forward, &InferLossShape);
  Register(forward, kForwardOpName);

  TF_OpDefinitionBuilder* gradient = TF_NewOpDefinitionBuilder(kGradientOpName);
  AddCommonSignature(gradient);
  TF_OpDefinitionBuilderAddInput(gradient, "upstream: T");
  TF_OpDefinitionBuilderAddInput(gradient, "row_stats: float");
  TF_OpDefinitionBuilderAddOutput(gradient, "grad_logits: T");
  TF_OpDefinitionBuilderSetShapeInferenceFunction(gradient, &InferGradientShape);
  Register(gradient, kGradientOpName);

  TF_OpDefinitionBuilder* linear = TF_NewOpDefinitionBuilder(kLinearForwardOpName);
  AddLinearSignature(linear);
  TF_OpDefinitionBuilderAddInput(linear, "row_scales: float");
  TF_OpDefinitionBuilderAddOutput(linear, "loss: float");
  TF_OpDefinitionBuilderAddOutput(linear, "row_stats: float");
  TF_OpDefinitionBuilderAddOutput(linear, "d_hidden: T");
  TF_OpDefinitionBuilderAddOutput(linear, "d_kernel: float");
  TF_OpDefinitionBuilderAddOutput(linear, "d_bias: float");
  TF_OpDefinitionBuilderSetShapeInferenceFunction(linear, &InferLinearShape);
  Register(linear, kLinearForwardOpName);

  TF_OpDefinitionBuilder* linear_gradient = TF_NewOpDefinitionBuilder(kLinearGradientOpName);
  AddLinearSignature(linear_gradient);
  TF_OpDefinitionBuilderAddInput(linear_gradient, "upstream: float");
  TF_OpDefinitionBuilderAddInput(linear_gradient, "row_stats: float");
  TF_OpDefinitionBuilderAddOutput(linear_gradient, "d_hidden: T");
  TF_OpDefinitionBuilderAddOutput(linear_gradient, "d_kernel: float");
  TF_OpDefinitionBuilderAddOutput(linear_gradient, "d_bias: float");
  TF_OpDefinitionBuilderSetShapeInferenceFunction(linear_gradient, &InferLinearGradientShape);
  Register(linear_gradient, kLinearGradientOpName);

  TF_OpDefinitionBuilder* add_into = TF_NewOpDefinitionBuilder(kAddIntoOpName);
  TF_OpDefinitionBuilderAddAttr(add_into, "T: {float, double}");
  TF_OpDefinitionBuilderAddInput(add_into, "accumulator: T");
  TF_OpDefinitionBuilderAddInput(add_into, "addend: T");
  TF_OpDefinitionBuilderAddInput(add_into, "first: bool");
  TF_OpDefinitionBuilderAddInput(add_into, "row_offset: int64");
  TF_OpDefinitionBuilderAddInput(add_into, "shape: int64");
  TF_OpDefinitionBuilderAddOutput(add_into, "sum: T");
  // Stateful: it writes into its input, so it must never be folded, merged or reordered.
  TF_OpDefinitionBuilderSetIsStateful(add_into, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(add_into, &InferAddIntoShape);
  Register(add_into, kAddIntoOpName);
}

// The outputs' shapes are the `output_shapes` input's values, known at run time; the Python
// wrapper sets what it knows statically.
void InferMetalKernelShape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

void RegisterMetalKernelOp() {
  constexpr const char* kTypes = "{float, half, bfloat16, int32, int64, uint32, uint8, bool}";
  TF_OpDefinitionBuilder* op = TF_NewOpDefinitionBuilder(kMetalKernelOpName);
  TF_OpDefinitionBuilderAddAttr(op, (std::string("Tin: list(") + kTypes + ") >= 0").c_str());
  TF_OpDefinitionBuilderAddAttr(op, (std::string("Tout: list(") + kTypes + ") >= 1").c_str());
  TF_OpDefinitionBuilderAddAttr(op, "source: string");
  TF_OpDefinitionBuilderAddAttr(op, "kernel_name: string");
  TF_OpDefinitionBuilderAddAttr(op, "threadgroup: list(int)");
  TF_OpDefinitionBuilderAddAttr(op, "output_ranks: list(int)");
  TF_OpDefinitionBuilderAddAttr(op, "shape_params: list(int)");
  TF_OpDefinitionBuilderAddAttr(op, "init_value: float = 0.0");
  TF_OpDefinitionBuilderAddAttr(op, "has_init_value: bool = false");
  TF_OpDefinitionBuilderAddAttr(op, "lockstep: bool = true");
  TF_OpDefinitionBuilderAddInput(op, "inputs: Tin");
  TF_OpDefinitionBuilderAddInput(op, "output_shapes: int64");
  TF_OpDefinitionBuilderAddInput(op, "grid: int64");
  TF_OpDefinitionBuilderAddOutput(op, "outputs: Tout");
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, &InferMetalKernelShape);
  Register(op, kMetalKernelOpName);
}

const bool ops_registered = (RegisterOps(), RegisterMetalKernelOp(), true);

}  // namespace
}  // namespace tf_metal_ops
