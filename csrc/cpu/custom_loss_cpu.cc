// CPU kernels of CustomLoss and CustomLossGrad.
//
// One thread handles a row at a time; a row is read from memory once per pass and stays in the
// cache between passes (a row of 1000 float logits is 4 KB). The formulas and their limits are
// derived in row_loss.h.
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <memory>
#include <vector>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/cpu/row_loss.h"
#include "csrc/problem.h"

namespace tf_metal_ops {
namespace {

template <typename T>
struct RowSetup {
  using Acc = typename Accumulator<T>::type;
  int64_t num_classes;
  Acc gamma;
  Acc smoothing_share;  // eps / C: every class's share of the smoothed target
  Acc target_share;     // 1 - eps: what the labelled class (or t_c) keeps
  const float* class_weights;  // null: all ones
  Acc sum_class_weights;

  Acc ClassWeight(int64_t c) const { return class_weights ? Acc(class_weights[c]) : Acc(1); }
};

// w_c of a sparse row labelled `label`.
template <typename T>
struct SparseTargets {
  using Acc = typename Accumulator<T>::type;
  const RowSetup<T>& setup;
  int64_t label;
  Acc Weight(int64_t c) const {
    Acc q = setup.smoothing_share + (c == label ? setup.target_share : Acc(0));
    return setup.ClassWeight(c) * q;
  }
  // sum_c w_c, without a loop over the classes.
  Acc WeightSum() const {
    return setup.smoothing_share * setup.sum_class_weights +
           setup.target_share * setup.ClassWeight(label);
  }
  // With no smoothing only the labelled class carries weight.
  bool OnlyLabelled() const { return setup.smoothing_share == 0; }
};

// w_c of a dense row with targets t.
template <typename T>
struct DenseTargets {
  using Acc = typename Accumulator<T>::type;
  const RowSetup<T>& setup;
  const T* targets;
  int64_t label = -1;  // unused: dense rows have no single labelled class
  Acc Weight(int64_t c) const {
    return setup.ClassWeight(c) * (setup.target_share * Load(targets[c]) + setup.smoothing_share);
  }
  Acc WeightSum() const {
    Acc sum = 0;
    for (int64_t c = 0; c < setup.num_classes; ++c) sum += Weight(c);
    return sum;
  }
  bool OnlyLabelled() const { return false; }
};

template <typename T, typename Targets>
typename Accumulator<T>::type RowLoss(const RowSetup<T>& setup, const T* z, const Targets& targets) {
  using Acc = typename Accumulator<T>::type;
  const LogSoftmax<Acc> log_softmax = RowLogSoftmax(z, setup.num_classes);
  if (targets.OnlyLabelled()) {
    const Acc w = targets.Weight(targets.label);
    // 0 - x rather than -x: a zero loss is +0, not -0.
    return w == 0 ? Acc(0) : Acc(0) - w * Focal<Acc>(log_softmax(Load(z[targets.label])), setup.gamma).loss;
  }
  Acc loss = 0;
  for (int64_t c = 0; c < setup.num_classes; ++c) {
    const Acc w = targets.Weight(c);
    if (w != 0) loss -= w * Focal<Acc>(log_softmax(Load(z[c])), setup.gamma).loss;
  }
  return loss;
}

// Writes upstream * d loss / d z for one row. `scratch` holds C accumulators for g_c when the
// focal factor makes g_c too costly to compute twice.
template <typename T, typename Targets>
void RowGradient(const RowSetup<T>& setup, const T* z, const Targets& targets,
                 typename Accumulator<T>::type upstream, T* grad,
                 std::vector<typename Accumulator<T>::type>* scratch) {
  using Acc = typename Accumulator<T>::type;
  const int64_t num_classes = setup.num_classes;
  const LogSoftmax<Acc> log_softmax = RowLogSoftmax(z, num_classes);
  if (targets.OnlyLabelled()) {
    // G = g_y, so d/dz_j = p_j g_y for j != y and (p_y - 1) g_y = -r_y g_y for y: written
    // with r_y = -expm1(lp_y) it keeps its digits when p_y rounds to 1.
    const int64_t y = targets.label;
    const Acc lp_y = log_softmax(Load(z[y]));
    const Acc g = targets.Weight(y) * Focal<Acc>(lp_y, setup.gamma).gradient;
    for (int64_t j = 0; j < num_classes; ++j) {
      Store(upstream * (std::exp(log_softmax(Load(z[j]))) * g), &grad[j]);
    }
    Store(upstream * (std::expm1(lp_y) * g), &grad[y]);
    return;
  }
  if (setup.gamma == 0) {  // g_c = w_c
    const Acc total = targets.WeightSum();
    for (int64_t j = 0; j < num_classes; ++j) {
      const Acc p = std::exp(log_softmax(Load(z[j])));
      Store(upstream * (p * total - targets.Weight(j)), &grad[j]);
    }
    return;
  }
  scratch->resize(static_cast<size_t>(num_classes));
  Acc* g = scratch->data();
  Acc total = 0;
  for (int64_t c = 0; c < num_classes; ++c) {
    const Acc w = targets.Weight(c);
    g[c] = w == 0 ? Acc(0) : w * Focal<Acc>(log_softmax(Load(z[c])), setup.gamma).gradient;
    total += g[c];
  }
  for (int64_t j = 0; j < num_classes; ++j) {
    const Acc p = std::exp(log_softmax(Load(z[j])));
    Store(upstream * (p * total - g[j]), &grad[j]);
  }
}

template <typename Label>
int64_t ReadLabel(const void* labels, int64_t row) {
  return static_cast<int64_t>(static_cast<const Label*>(labels)[row]);
}

struct CpuKernel {
  CustomLossAttrs attrs;
};

// Checks every value the CPU can see before any arithmetic: a bad label or class weight is an
// error for the whole batch, and the first one (lowest index) is reported.
Error CheckValues(const CustomLossProblem& problem, const CustomLossInputs& inputs) {
  if (problem.has_class_weights) {
    const float* weights = static_cast<const float*>(TF_TensorData(inputs.class_weights.get()));
    for (int64_t c = 0; c < problem.num_classes; ++c) {
      if (!(weights[c] >= 0.0f) || std::isinf(weights[c])) {
        return BadClassWeightError(problem, c, weights[c]);
      }
    }
  }
  if (problem.attrs.label_kind == LabelKind::kDense) return Error::Ok();
  const void* labels = TF_TensorData(inputs.labels.get());
  const bool wide = problem.attrs.label_kind == LabelKind::kSparseInt64;
  for (int64_t row = 0; row < problem.num_rows; ++row) {
    const int64_t label = wide ? ReadLabel<int64_t>(labels, row) : ReadLabel<int32_t>(labels, row);
    if (label >= 0 && label < problem.num_classes) continue;
    if (problem.attrs.has_ignore_class && label == problem.attrs.ignore_class) continue;
    return BadLabelError(problem, row, label);
  }
  return Error::Ok();
}

template <typename T>
RowSetup<T> MakeSetup(const CustomLossProblem& problem, const CustomLossInputs& inputs) {
  using Acc = typename Accumulator<T>::type;
  RowSetup<T> setup;
  setup.num_classes = problem.num_classes;
  setup.gamma = problem.attrs.gamma;
  const Acc eps = problem.attrs.label_smoothing;
  setup.smoothing_share = eps / Acc(problem.num_classes);
  setup.target_share = Acc(1) - eps;
  setup.class_weights =
      problem.has_class_weights
          ? static_cast<const float*>(TF_TensorData(inputs.class_weights.get()))
          : nullptr;
  setup.sum_class_weights = 0;
  for (int64_t c = 0; c < problem.num_classes; ++c) setup.sum_class_weights += setup.ClassWeight(c);
  return setup;
}

template <typename T, typename Label>
void ComputeRows(const CustomLossProblem& problem, const CustomLossInputs& inputs, TF_Tensor* out) {
  using Acc = typename Accumulator<T>::type;
  const RowSetup<T> setup = MakeSetup<T>(problem, inputs);
  const int64_t num_classes = problem.num_classes;
  const T* logits = static_cast<const T*>(TF_TensorData(inputs.logits.get()));
  const void* labels = TF_TensorData(inputs.labels.get());
  constexpr bool kDense = !std::is_integral_v<Label>;
  const bool forward = problem.attrs.direction == Direction::kForward;
  const T* upstream =
      forward ? nullptr : static_cast<const T*>(TF_TensorData(inputs.upstream.get()));
  T* output = static_cast<T*>(TF_TensorData(out));
  const CustomLossAttrs& attrs = problem.attrs;

  ParallelFor(problem.num_rows, num_classes, [&](int64_t begin, int64_t end) {
    std::vector<Acc> scratch;
    for (int64_t row = begin; row < end; ++row) {
      const T* z = logits + row * num_classes;
      if constexpr (kDense) {
        DenseTargets<T> targets{setup, static_cast<const T*>(labels) + row * num_classes};
        if (forward) {
          Store(RowLoss(setup, z, targets), &output[row]);
        } else {
          RowGradient(setup, z, targets, Load(upstream[row]), output + row * num_classes,
                      &scratch);
        }
        continue;
      } else {
      const int64_t label = ReadLabel<Label>(labels, row);
      const bool ignored = attrs.has_ignore_class && label == attrs.ignore_class;
      if (ignored) {
        if (forward) {
          Store(Acc(0), &output[row]);
        } else {
          for (int64_t j = 0; j < num_classes; ++j) Store(Acc(0), &output[row * num_classes + j]);
        }
        continue;
      }
      SparseTargets<T> targets{setup, label};
      if (forward) {
        Store(RowLoss(setup, z, targets), &output[row]);
      } else {
        RowGradient(setup, z, targets, Load(upstream[row]), output + row * num_classes, &scratch);
      }
      }
    }
  });
}

template <typename T>
void ComputeTyped(const CustomLossProblem& problem, const CustomLossInputs& inputs, TF_Tensor* out) {
  switch (problem.attrs.label_kind) {
    case LabelKind::kSparseInt32:
      return ComputeRows<T, int32_t>(problem, inputs, out);
    case LabelKind::kSparseInt64:
      return ComputeRows<T, int64_t>(problem, inputs, out);
    case LabelKind::kDense:
      return ComputeRows<T, T>(problem, inputs, out);
  }
}

void* Create(TF_OpKernelConstruction* ctx, Direction direction) {
  auto kernel = std::make_unique<CpuKernel>();
  if (Error e = ReadAttrs(ctx, direction, &kernel->attrs); !e.ok()) {
    FailConstruction(ctx, e);
    return nullptr;
  }
  return kernel.release();
}
void* CreateForward(TF_OpKernelConstruction* ctx) { return Create(ctx, Direction::kForward); }
void* CreateGradient(TF_OpKernelConstruction* ctx) { return Create(ctx, Direction::kGradient); }
void Delete(void* kernel) { delete static_cast<CpuKernel*>(kernel); }

void Compute(void* kernel, TF_OpKernelContext* ctx) {
  const CpuKernel& self = *static_cast<CpuKernel*>(kernel);
  CustomLossInputs inputs;
  CustomLossProblem problem;
  if (Error e = DescribeProblem(ctx, self.attrs, &inputs, &problem); !e.ok()) {
    return FailKernel(ctx, e);
  }
  if (Error e = CheckValues(problem, inputs); !e.ok()) return FailKernel(ctx, e);
  TensorPtr out;
  if (Error e = AllocateOutput(ctx, problem, &out); !e.ok()) return FailKernel(ctx, e);
  switch (problem.attrs.logits_dtype) {
    case TF_HALF:
      return ComputeTyped<Half>(problem, inputs, out.get());
    case TF_BFLOAT16:
      return ComputeTyped<BFloat16>(problem, inputs, out.get());
    case TF_FLOAT:
      return ComputeTyped<float>(problem, inputs, out.get());
    case TF_DOUBLE:
      return ComputeTyped<double>(problem, inputs, out.get());
    default:
      return FailKernel(ctx, Error::Internal(OpDescription(problem.attrs) +
                                             ": no CPU kernel for this logits dtype"));
  }
}

void RegisterKernel(const char* op_name, void* (*create)(TF_OpKernelConstruction*)) {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder = TF_NewKernelBuilder(op_name, "CPU", create, &Compute, &Delete);
  TF_RegisterKernelBuilder((std::string(op_name) + "_CPU").c_str(), builder, status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    std::fprintf(stderr, "tf_metal_ops: registering the CPU kernel of %s failed: %s\n", op_name,
                 TF_Message(status.get()));
  }
}

const bool cpu_kernels_registered = (RegisterKernel(kForwardOpName, &CreateForward),
                                     RegisterKernel(kGradientOpName, &CreateGradient), true);

}  // namespace
}  // namespace tf_metal_ops
