// CPU kernels of CustomLoss and CustomLossGrad: checks, output allocation, and the choice of
// row kernel.
//
// Float, half and bfloat16 logits run the vectorized rows of simd/rows_dispatch.h (the variant for
// this CPU's instruction set), spread over the thread pool by ParallelFor; rows of very many
// classes are cut into blocks of classes first (simd/simd_split_rows.h), so that a batch of few
// rows still fills the threads. Float64 logits run
// the scalar rows below, built on kernels/custom_loss_math.h (the scalar math shared with the
// Metal kernels, which derives the formulas and their limits, and which the vectorized rows also
// fall back on for single elements). A row is read from memory once per pass and stays in the
// cache between passes.
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <memory>
#include <vector>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "csrc/problem.h"
#include "csrc/runtime.h"
#include "kernels/custom_loss_math.h"

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

// The row's log-softmax (custom_loss_math.h's state), in two passes that both vectorize: the
// maximum, then the sum split into the ties (exactly 1 each) and the others.
template <typename T, typename Acc = typename Accumulator<T>::type>
kernels::RowLogSoftmax<Acc> LogSoftmaxOfRow(const T* z, int64_t num_classes) {
  kernels::LogSumExp<Acc> state = kernels::lse_empty<Acc>();
  for (int64_t c = 0; c < num_classes; ++c) {
    const Acc value = Load(z[c]);
    state.max = value > state.max ? value : state.max;
  }
  for (int64_t c = 0; c < num_classes; ++c) {
    const Acc value = Load(z[c]);
    const bool tie = value == state.max;
    state.others += tie ? Acc(0) : kernels::math::exp(value - state.max);
    state.ties += tie ? Acc(1) : Acc(0);
  }
  return kernels::lse_finish(state);
}

template <typename T, typename Targets>
typename Accumulator<T>::type RowLoss(const RowSetup<T>& setup, const T* z, const Targets& targets) {
  using Acc = typename Accumulator<T>::type;
  const kernels::RowLogSoftmax<Acc> ls = LogSoftmaxOfRow(z, setup.num_classes);
  if (targets.OnlyLabelled()) {
    const Acc lp = kernels::log_prob(ls, Acc(Load(z[targets.label])));
    // 0 - x rather than -x: a zero loss is +0, not -0.
    return Acc(0) - kernels::loss_term(lp, targets.Weight(targets.label), setup.gamma);
  }
  Acc loss = 0;
  for (int64_t c = 0; c < setup.num_classes; ++c) {
    const Acc w = targets.Weight(c);
    if (w != 0) loss -= kernels::loss_term(kernels::log_prob(ls, Acc(Load(z[c]))), w, setup.gamma);
  }
  return loss;
}

// Writes upstream * d loss / d z for one row, as gradient_value's p_j (G - g_j) - g_j r_j.
// `scratch` holds C accumulators for g_c when the focal factor makes g_c too costly to compute
// twice. Correct in place (grad == z): each z_j is read before grad_j is written.
template <typename T, typename Targets>
void RowGradient(const RowSetup<T>& setup, const T* z, const Targets& targets,
                 typename Accumulator<T>::type upstream, T* grad,
                 std::vector<typename Accumulator<T>::type>* scratch) {
  using Acc = typename Accumulator<T>::type;
  const int64_t num_classes = setup.num_classes;
  const kernels::RowLogSoftmax<Acc> ls = LogSoftmaxOfRow(z, num_classes);
  if (targets.OnlyLabelled()) {
    // G = g_y, and g_j = 0 for j != y: d/dz_j = p_j g_y there, and -r_y g_y at y.
    const int64_t y = targets.label;
    // Read before grad (which may be z) is written.
    const Acc lp_y = kernels::log_prob(ls, Acc(Load(z[y])));
    const Acc g = kernels::gradient_term(lp_y, targets.Weight(y), setup.gamma);
    for (int64_t j = 0; j < num_classes; ++j) {
      const Acc p_j = kernels::math::exp(kernels::log_prob(ls, Acc(Load(z[j]))));
      Store(upstream * (p_j * g), &grad[j]);
    }
    Store(upstream * kernels::only_class_gradient(lp_y, g), &grad[y]);
    return;
  }
  // G, and g_c where it is not simply w_c (gamma > 0).
  const bool focal = setup.gamma != 0;
  Acc total = 0;
  if (focal) {
    scratch->resize(static_cast<size_t>(num_classes));
    for (int64_t c = 0; c < num_classes; ++c) {
      const Acc lp = kernels::log_prob(ls, Acc(Load(z[c])));
      (*scratch)[c] = kernels::gradient_term(lp, targets.Weight(c), setup.gamma);
      total += (*scratch)[c];
    }
  } else {
    total = targets.WeightSum();
  }
  for (int64_t j = 0; j < num_classes; ++j) {
    const Acc lp = kernels::log_prob(ls, Acc(Load(z[j])));
    if (!focal) {
      const Acc p_j = kernels::math::exp(lp);
      Store(upstream * kernels::cross_entropy_gradient(p_j, total, targets.Weight(j)), &grad[j]);
      continue;
    }
    const auto parts = kernels::gradient_parts_given(lp, (*scratch)[j]);
    Store(upstream * kernels::gradient_value(parts, total), &grad[j]);
  }
}

template <typename Label>
int64_t ReadLabel(const void* labels, int64_t row) {
  return static_cast<int64_t>(static_cast<const Label*>(labels)[row]);
}

// sum_c a_c. Without class weights it is C, not a loop over C: C is not bounded by any
// allocation then (an empty batch may declare 2^62 classes).
double SumClassWeights(const CustomLossProblem& problem, const float* class_weights) {
  if (class_weights == nullptr) return static_cast<double>(problem.num_classes);
  double sum = 0;
  for (int64_t c = 0; c < problem.num_classes; ++c) sum += class_weights[c];
  return sum;
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
  setup.sum_class_weights = SumClassWeights(problem, setup.class_weights);
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

RowsArgs MakeRowsArgs(const CustomLossProblem& problem, const CustomLossInputs& inputs,
                      StorageType type, TF_Tensor* out) {
  RowsArgs args;
  args.type = type;
  args.label_kind = problem.attrs.label_kind;
  args.forward = problem.attrs.direction == Direction::kForward;
  args.num_classes = problem.num_classes;
  args.gamma = problem.attrs.gamma;
  const float eps = problem.attrs.label_smoothing;
  args.smoothing_share = eps / static_cast<float>(problem.num_classes);
  args.target_share = 1.0f - eps;
  args.class_weights =
      problem.has_class_weights
          ? static_cast<const float*>(TF_TensorData(inputs.class_weights.get()))
          : nullptr;
  args.sum_class_weights = static_cast<float>(SumClassWeights(problem, args.class_weights));
  args.has_ignore_class = problem.attrs.has_ignore_class;
  args.ignore_class = problem.attrs.ignore_class;
  args.logits = TF_TensorData(inputs.logits.get());
  args.labels = TF_TensorData(inputs.labels.get());
  args.upstream = args.forward ? nullptr : TF_TensorData(inputs.upstream.get());
  args.out = TF_TensorData(out);
  if (problem.has_row_stats) {
    args.stats_in = static_cast<const float*>(TF_TensorData(inputs.row_stats.get()));
  }
  return args;
}

// ParallelTasks (rows_dispatch.h) on ParallelFor.
void RunTasksInParallel(int64_t count, int64_t cost_per_task, void (*task)(void*, int64_t),
                        void* context) {
  ParallelFor(count, cost_per_task, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) task(context, i);
  });
}

// Float, half and bfloat16 logits: the vectorized rows of this CPU's instruction set, which
// write the forward's row statistics (`stats`, null for the gradient).
void ComputeVectorized(const CustomLossProblem& problem, const CustomLossInputs& inputs,
                       StorageType type, bool in_place, TF_Tensor* out, TF_Tensor* stats,
                       TF_Tensor* scaled_gradient) {
  RowsArgs args = MakeRowsArgs(problem, inputs, type, out);
  args.in_place = in_place;
  if (stats != nullptr) args.stats_out = static_cast<float*>(TF_TensorData(stats));
  if (scaled_gradient != nullptr) {
    args.scaled_gradient = TF_TensorData(scaled_gradient);
    args.row_scales = static_cast<const float*>(TF_TensorData(inputs.row_scales.get()));
  }
  if (SelectSplitRowsKernel()(args, problem.num_rows, CpuThreadLimit(), &RunTasksInParallel)) {
    return;
  }
  const RowsKernel kernel = SelectRowsKernel();
  ParallelFor(problem.num_rows, problem.num_classes,
              [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
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

void Compute(void* kernel, TF_OpKernelContext* ctx) {
  const CustomLossAttrs& attrs = *static_cast<const CustomLossAttrs*>(kernel);
  CustomLossInputs inputs;
  CustomLossProblem problem;
  if (Error e = DescribeProblem(ctx, attrs, &inputs, &problem); !e.ok()) {
    return FailKernel(ctx, e);
  }
  if (Error e = CheckLabelsAndClassWeights(problem, inputs.labels.get(),
                                            inputs.class_weights.get());
      !e.ok()) {
    return FailKernel(ctx, e);
  }
  const bool forward = problem.attrs.direction == Direction::kForward;
  // The vectorized kernels write the forward's row statistics, and a reduced loss's scaled
  // gradient when given row scales; the float64 one does neither.
  const bool vectorized = problem.attrs.logits_dtype != TF_DOUBLE;
  const bool scaled_gradient = forward && vectorized && problem.has_row_scales;
  TensorPtr stats;
  if (forward) {
    if (Error e = AllocateRowStats(ctx, problem, vectorized, &stats); !e.ok()) {
      return FailKernel(ctx, e);
    }
    if (!scaled_gradient) {
      if (Error e = AllocateNoScaledGradient(ctx, problem); !e.ok()) return FailKernel(ctx, e);
    }
  }
  if (problem.num_rows == 0) {  // an empty batch: an empty output, and no per-class setup
    TensorPtr empty;
    if (Error e = AllocateOutput(ctx, problem, &empty); !e.ok()) return FailKernel(ctx, e);
    return;
  }
  TensorPtr out;
  TensorPtr gradient;  // the forward's scaled gradient
  bool in_place = false;
  if (!forward) {
    if (Error e = ForwardLogitsOrAllocate(ctx, problem, kOutput, &inputs, &out, &in_place);
        !e.ok()) {
      return FailKernel(ctx, e);
    }
  } else {
    if (Error e = AllocateOutput(ctx, problem, &out); !e.ok()) return FailKernel(ctx, e);
    if (scaled_gradient) {
      // The scaled gradient may take over the logits' buffer as the gradient op's output does
      // (each row is read for its loss before its gradient is written over it): a model's last
      // layer, whose logits nothing else reads, then costs one N x C tensor, as with
      // TensorFlow's own fused op, which writes its backprop over the logits too.
      if (Error e = ForwardLogitsOrAllocate(ctx, problem, kScaledGradientOutput, &inputs,
                                            &gradient, &in_place);
          !e.ok()) {
        return FailKernel(ctx, e);
      }
    }
  }
  switch (problem.attrs.logits_dtype) {
    case TF_HALF:
      return ComputeVectorized(problem, inputs, StorageType::kHalf, in_place, out.get(),
                               stats.get(), gradient.get());
    case TF_BFLOAT16:
      return ComputeVectorized(problem, inputs, StorageType::kBFloat16, in_place, out.get(),
                               stats.get(), gradient.get());
    case TF_FLOAT:
      return ComputeVectorized(problem, inputs, StorageType::kFloat, in_place, out.get(),
                               stats.get(), gradient.get());
    case TF_DOUBLE:
      return ComputeTyped<double>(problem, inputs, out.get());
    default:
      return FailKernel(ctx, Error::Internal(OpDescription(problem.attrs) +
                                             ": no CPU kernel for this logits dtype"));
  }
}

void RegisterKernel(const char* op_name, void* (*create)(TF_OpKernelConstruction*)) {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder = TF_NewKernelBuilder(op_name, "CPU", create, &Compute, &DeleteKernel);
  TF_RegisterKernelBuilder((std::string(op_name) + "_CPU").c_str(), builder, status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    std::fprintf(stderr, "tf_metal_ops: registering the CPU kernel of %s failed: %s\n", op_name,
                 TF_Message(status.get()));
  }
}

const bool cpu_kernels_registered = (RegisterKernel(kForwardOpName, &CreateForwardKernel),
                                     RegisterKernel(kGradientOpName, &CreateGradientKernel), true);

}  // namespace
}  // namespace tf_metal_ops
