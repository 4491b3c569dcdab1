#include "csrc/problem.h"

#include <cmath>
#include <memory>
#include <sstream>

#include "csrc/pending_errors.h"

namespace tf_metal_ops {
namespace {

bool IsFloatType(TF_DataType dtype) {
  return dtype == TF_HALF || dtype == TF_BFLOAT16 || dtype == TF_FLOAT || dtype == TF_DOUBLE;
}

Error AttrError(const CustomLossAttrs& attrs, const std::string& message) {
  return Error::InvalidArgument(OpDescription(attrs) + ": " + message);
}

}  // namespace

std::string ShapeString(const std::vector<int64_t>& dims) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << ']';
  return out.str();
}

std::string RowIndexString(const std::vector<int64_t>& dims, int64_t row) {
  if (dims.empty()) return "labels[()]";
  std::vector<int64_t> index(dims.size());
  for (size_t i = dims.size(); i-- > 0;) {
    index[i] = dims[i] > 0 ? row % dims[i] : 0;
    row = dims[i] > 0 ? row / dims[i] : 0;
  }
  std::string text = ShapeString(index);
  return "labels" + text;
}

std::string OpDescription(const CustomLossAttrs& attrs) {
  const char* op = attrs.op_name != nullptr ? attrs.op_name
                   : attrs.direction == Direction::kForward ? kForwardOpName
                                                             : kGradientOpName;
  return std::string(op) + " (node '" + attrs.node_name + "')";
}

// Reads and checks the attributes (gamma >= 0 and finite, 0 <= label_smoothing <= 1, the label
// dtype matches the logits dtype when labels are dense): every backend's create calls it
// through CreateKernel below.
Error ReadLossAttrs(TF_OpKernelConstruction* ctx, Direction direction, const char* op_name,
                    TF_DataType dense_labels_dtype, CustomLossAttrs* attrs) {
  StatusPtr status = NewStatus();
  attrs->direction = direction;
  attrs->op_name = op_name;
  TF_StringView name = TF_OpKernelConstruction_GetName(ctx);
  attrs->node_name.assign(name.data, name.len);

  TF_OpKernelConstruction_GetAttrType(ctx, "T", &attrs->logits_dtype, status.get());
  if (Error e = FromStatus(status.get(), "reading attr T"); !e.ok()) return e;
  TF_OpKernelConstruction_GetAttrType(ctx, "Tlabels", &attrs->labels_dtype, status.get());
  if (Error e = FromStatus(status.get(), "reading attr Tlabels"); !e.ok()) return e;
  TF_OpKernelConstruction_GetAttrFloat(ctx, "gamma", &attrs->gamma, status.get());
  if (Error e = FromStatus(status.get(), "reading attr gamma"); !e.ok()) return e;
  TF_OpKernelConstruction_GetAttrFloat(ctx, "label_smoothing", &attrs->label_smoothing,
                                       status.get());
  if (Error e = FromStatus(status.get(), "reading attr label_smoothing"); !e.ok()) return e;
  TF_Bool has_ignore = 0;
  TF_OpKernelConstruction_GetAttrBool(ctx, "has_ignore_class", &has_ignore, status.get());
  if (Error e = FromStatus(status.get(), "reading attr has_ignore_class"); !e.ok()) return e;
  attrs->has_ignore_class = has_ignore != 0;
  TF_OpKernelConstruction_GetAttrInt64(ctx, "ignore_class", &attrs->ignore_class, status.get());
  if (Error e = FromStatus(status.get(), "reading attr ignore_class"); !e.ok()) return e;

  // The same rules the Python wrapper applies where the values enter; repeated here because the
  // raw op can be called directly.
  if (!(attrs->gamma >= 0.0f) || std::isinf(attrs->gamma)) {
    return AttrError(*attrs, "gamma must be a finite number >= 0, got " +
                                 std::to_string(attrs->gamma));
  }
  if (!(attrs->label_smoothing >= 0.0f && attrs->label_smoothing <= 1.0f)) {
    return AttrError(*attrs, "label_smoothing must be in [0, 1], got " +
                                 std::to_string(attrs->label_smoothing));
  }
  if (attrs->labels_dtype == TF_INT32) {
    attrs->label_kind = LabelKind::kSparseInt32;
  } else if (attrs->labels_dtype == TF_INT64) {
    attrs->label_kind = LabelKind::kSparseInt64;
  } else if (IsFloatType(attrs->labels_dtype) &&
             attrs->labels_dtype == (dense_labels_dtype == static_cast<TF_DataType>(0)
                                         ? attrs->logits_dtype
                                         : dense_labels_dtype)) {
    attrs->label_kind = LabelKind::kDense;
    if (attrs->has_ignore_class) {
      return AttrError(*attrs, "ignore_class applies to sparse (integer) labels only");
    }
  } else {
    return AttrError(*attrs,
                     "labels must be int32/int64 class ids, or dense targets with the logits' "
                     "dtype; got labels dtype " +
                         std::to_string(attrs->labels_dtype) + " with logits dtype " +
                         std::to_string(attrs->logits_dtype));
  }
  return Error::Ok();
}

namespace {
void* CreateKernel(TF_OpKernelConstruction* ctx, Direction direction) {
  auto attrs = std::make_unique<CustomLossAttrs>();
  if (Error e = ReadLossAttrs(ctx, direction, nullptr, static_cast<TF_DataType>(0), attrs.get());
      !e.ok()) {
    FailConstruction(ctx, e);
    return nullptr;
  }
  return attrs.release();
}
}  // namespace

void* CreateForwardKernel(TF_OpKernelConstruction* ctx) {
  return CreateKernel(ctx, Direction::kForward);
}
void* CreateGradientKernel(TF_OpKernelConstruction* ctx) {
  return CreateKernel(ctx, Direction::kGradient);
}
void DeleteKernel(void* kernel) { delete static_cast<CustomLossAttrs*>(kernel); }

Error DescribeProblem(TF_OpKernelContext* ctx, const CustomLossAttrs& attrs,
                      CustomLossInputs* inputs, CustomLossProblem* problem) {
  // A bad label the GPU found after an earlier op had returned (pending_errors.h) fails the next
  // execution of our ops, on any device. One atomic load when there is none.
  if (Error e = TakePendingError(); !e.ok()) return e;
  problem->attrs = attrs;
  if (Error e = GetInput(ctx, kLogits, &inputs->logits); !e.ok()) return e;
  if (Error e = GetInput(ctx, kLabels, &inputs->labels); !e.ok()) return e;
  if (Error e = GetInput(ctx, kClassWeights, &inputs->class_weights); !e.ok()) return e;
  if (attrs.direction == Direction::kGradient) {
    if (Error e = GetInput(ctx, kUpstream, &inputs->upstream); !e.ok()) return e;
    if (Error e = GetInput(ctx, kRowStats, &inputs->row_stats); !e.ok()) return e;
  } else if (Error e = GetInput(ctx, kRowScales, &inputs->row_scales); !e.ok()) {
    return e;
  }

  const std::string op = OpDescription(attrs);
  problem->logits_dims = Dims(inputs->logits.get());
  const std::vector<int64_t>& logits_dims = problem->logits_dims;
  if (logits_dims.empty()) {
    return Error::InvalidArgument(op + ": logits must have rank >= 1 ([..., num_classes]), "
                                       "got a scalar");
  }
  problem->num_classes = logits_dims.back();
  if (problem->num_classes < 1) {
    return Error::InvalidArgument(op + ": logits must have at least one class, got shape " +
                                  ShapeString(logits_dims));
  }
  problem->row_dims.assign(logits_dims.begin(), logits_dims.end() - 1);
  problem->num_rows = 1;
  for (int64_t d : problem->row_dims) problem->num_rows *= d;

  const std::vector<int64_t> label_dims = Dims(inputs->labels.get());
  bool labels_fit;
  if (attrs.label_kind == LabelKind::kDense) {
    labels_fit = label_dims == logits_dims;
  } else {
    std::vector<int64_t> with_trailing_one = problem->row_dims;
    with_trailing_one.push_back(1);
    labels_fit = label_dims == problem->row_dims || label_dims == with_trailing_one;
  }
  if (!labels_fit) {
    const char* expected = attrs.label_kind == LabelKind::kDense
                               ? "dense labels must have the logits' shape"
                               : "sparse labels must have shape logits.shape[:-1] (optionally "
                                 "with a trailing 1)";
    return Error::InvalidArgument(op + ": " + expected + "; got labels shape " +
                                  ShapeString(label_dims) + " and logits shape " +
                                  ShapeString(logits_dims));
  }

  const std::vector<int64_t> weight_dims = Dims(inputs->class_weights.get());
  if (weight_dims.size() != 1 || (weight_dims[0] != 0 && weight_dims[0] != problem->num_classes)) {
    return Error::InvalidArgument(op + ": class_weights must have shape [" +
                                  std::to_string(problem->num_classes) +
                                  "] (or [0] for all ones); got class_weights shape " +
                                  ShapeString(weight_dims) + " and logits shape " +
                                  ShapeString(logits_dims));
  }
  problem->has_class_weights = weight_dims[0] != 0;

  if (attrs.direction == Direction::kForward) {
    // A reduced loss's row scales (problem.h): one per row, or [0] for none.
    const std::vector<int64_t> scale_dims = Dims(inputs->row_scales.get());
    if (scale_dims != problem->row_dims && scale_dims != std::vector<int64_t>{0}) {
      return Error::InvalidArgument(op + ": row_scales must have shape " +
                                    ShapeString(problem->row_dims) + " (logits.shape[:-1]) or "
                                    "[0] (none); got " + ShapeString(scale_dims) +
                                    " with logits shape " + ShapeString(logits_dims));
    }
    problem->has_row_scales = problem->num_rows > 0 && scale_dims == problem->row_dims;
    return Error::Ok();
  }

  // The gradient op's own inputs.
  const std::vector<int64_t> upstream_dims = Dims(inputs->upstream.get());
  if (upstream_dims != problem->row_dims) {
    return Error::InvalidArgument(op + ": the upstream gradient must have shape " +
                                  ShapeString(problem->row_dims) + " (logits.shape[:-1]); got " +
                                  ShapeString(upstream_dims) + " with logits shape " +
                                  ShapeString(logits_dims));
  }
  const std::vector<int64_t> stats_dims = Dims(inputs->row_stats.get());
  const std::vector<int64_t> full = {problem->num_rows, kRowStatsWidth};
  const std::vector<int64_t> none = {0, kRowStatsWidth};
  if (stats_dims != full && stats_dims != none) {
    return Error::InvalidArgument(op + ": row_stats must have shape " + ShapeString(full) +
                                  " (the forward op's second output for these logits) or " +
                                  ShapeString(none) + " (none); got " +
                                  ShapeString(stats_dims) + " with logits shape " +
                                  ShapeString(logits_dims));
  }
  problem->has_row_stats = problem->num_rows > 0 && stats_dims == full;
  return Error::Ok();
}

Error BadLabelError(const CustomLossProblem& problem, int64_t row, int64_t label) {
  std::string message = OpDescription(problem.attrs) + ": " +
                        RowIndexString(problem.row_dims, row) + " = " + std::to_string(label) +
                        " is not a class id in [0, " + std::to_string(problem.num_classes) + ")";
  if (problem.attrs.has_ignore_class) {
    message += " nor ignore_class (" + std::to_string(problem.attrs.ignore_class) + ")";
  }
  return Error::InvalidArgument(message);
}

Error BadClassWeightError(const CustomLossProblem& problem, int64_t index, double value) {
  std::ostringstream out;
  out << OpDescription(problem.attrs) << ": class_weights[" << index << "] = " << value
      << " must be a finite number >= 0";
  return Error::InvalidArgument(out.str());
}

Error CheckLabelsAndClassWeights(const CustomLossProblem& problem, const TF_Tensor* labels,
                                 const TF_Tensor* class_weights) {
  if (problem.has_class_weights) {
    const float* weights = static_cast<const float*>(TF_TensorData(class_weights));
    for (int64_t c = 0; c < problem.num_classes; ++c) {
      if (!(weights[c] >= 0.0f) || std::isinf(weights[c])) {
        return BadClassWeightError(problem, c, weights[c]);
      }
    }
  }
  if (problem.attrs.label_kind == LabelKind::kDense) return Error::Ok();
  const void* data = TF_TensorData(labels);
  const bool wide = problem.attrs.label_kind == LabelKind::kSparseInt64;
  for (int64_t row = 0; row < problem.num_rows; ++row) {
    const int64_t label = wide ? static_cast<const int64_t*>(data)[row]
                               : static_cast<const int32_t*>(data)[row];
    if (label >= 0 && label < problem.num_classes) continue;
    if (problem.attrs.has_ignore_class && label == problem.attrs.ignore_class) continue;
    return BadLabelError(problem, row, label);
  }
  return Error::Ok();
}

Error AllocateOutput(TF_OpKernelContext* ctx, const CustomLossProblem& problem, TensorPtr* out) {
  const std::vector<int64_t>& dims =
      problem.attrs.direction == Direction::kForward ? problem.row_dims : problem.logits_dims;
  int64_t elements = 1;
  for (int64_t d : dims) elements *= d;
  StatusPtr status = NewStatus();
  out->reset(TF_AllocateOutput(ctx, kOutput, problem.attrs.logits_dtype, dims.data(),
                               static_cast<int>(dims.size()),
                               static_cast<size_t>(elements) *
                                   TF_DataTypeSize(problem.attrs.logits_dtype),
                               status.get()));
  return FromStatus(status.get(), OpDescription(problem.attrs) + ": allocating the output");
}

Error AllocateRowStats(TF_OpKernelContext* ctx, const CustomLossProblem& problem, bool filled,
                       TensorPtr* out) {
  const int64_t dims[] = {filled ? problem.num_rows : 0, kRowStatsWidth};
  StatusPtr status = NewStatus();
  out->reset(TF_AllocateOutput(ctx, kRowStatsOutput, TF_FLOAT, dims, 2,
                               static_cast<size_t>(dims[0] * dims[1]) * sizeof(float),
                               status.get()));
  return FromStatus(status.get(), OpDescription(problem.attrs) + ": allocating row_stats");
}

Error ForwardLogitsOrAllocate(TF_OpKernelContext* ctx, const CustomLossProblem& problem,
                              int index, CustomLossInputs* inputs, TensorPtr* out,
                              bool* in_place) {
  // Our own handle on the logits counts as a second owner and would forbid the forwarding.
  inputs->logits.reset();
  const int candidates[] = {kLogits};
  int forwarded = -1;
  StatusPtr status = NewStatus();
  out->reset(TF_ForwardInputOrAllocateOutput(
      ctx, candidates, 1, index, problem.logits_dims.data(),
      static_cast<int>(problem.logits_dims.size()), &forwarded, status.get()));
  if (in_place != nullptr) *in_place = forwarded == kLogits;
  if (Error e = FromStatus(status.get(), OpDescription(problem.attrs) +
                                             (index == kScaledGradientOutput
                                                  ? ": allocating scaled_gradient"
                                                  : ": allocating the gradient"));
      !e.ok()) {
    return e;
  }
  return GetInput(ctx, kLogits, &inputs->logits);
}

Error AllocateNoScaledGradient(TF_OpKernelContext* ctx, const CustomLossProblem& problem) {
  const int64_t dims[] = {0};
  StatusPtr status = NewStatus();
  TensorPtr none(TF_AllocateOutput(ctx, kScaledGradientOutput, problem.attrs.logits_dtype, dims,
                                   1, 0, status.get()));
  return FromStatus(status.get(), OpDescription(problem.attrs) + ": allocating scaled_gradient");
}

}  // namespace tf_metal_ops
