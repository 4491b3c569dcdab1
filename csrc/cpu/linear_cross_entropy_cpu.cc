// CPU kernels of LinearCrossEntropy and LinearCrossEntropyGrad: the loss of
// CustomLoss(labels, hidden @ kernel + bias) made `chunk` rows of logits at a time, on the
// platform's BLAS (gemm.h) and CustomLoss's vectorized rows (simd/rows_dispatch.h).
//
// One buffer of chunk x V float32 logits is allocated per execution and reused by every chunk:
//
//   z = h_c W + b                     (sgemm onto rows set to b, beta 1; see below)
//   rows: loss, row statistics and, for a reduced loss, g = s_i d loss_i / d z_i written over z
//   dh_c = g W^T                      into rows of the [N, d] output
//   dW  (+)= h_c^T g                  beta 0 on the first chunk, 1 after: in place, no d x V
//                                     temporary
//   db  (+)= 1^T g                    the same, as a 1 x V product
//
// The bias goes in first: each row of z is set to b and the product added to it (beta 1), which
// costs one write of the chunk where a separate pass would cost a read and a write.
//
// Every product is cut along the vocabulary into the BLAS's column blocks (GemmColumnBlocks in
// gemm.h: on Linux each block one single-threaded OpenBLAS call, the blocks claimed by our pool's
// threads; on macOS one block, Accelerate's whole product). z, dW and db split into blocks of
// columns with nothing shared. dh_c sums over the vocabulary: the blocks are gathered into
// groups, each group one task that sums its blocks' terms into a partial of its own (chunk x
// d) and makes their columns of dW and db while each block of g is in the cache; the partials
// are added in a fixed order, so the result does not depend on which thread ran which group.
// Each element of W and g is packed by the BLAS once per product, as in one whole call.
//
// The forward given row scales (a reduced loss, Liger-Kernel's rule; problem.h) computes the
// three gradients while each chunk's softmax is at hand; the backward then only scales them by
// the upstream scalar (tf_metal_ops/linear_cross_entropy.py). Without row scales (per-row
// losses) it writes the loss and row statistics only, and the gradient op makes each chunk's
// logits again and runs the gradient rows with the forward's statistics and per-row upstream
// gradients.
//
// Float16 and bfloat16 hidden states (mixed precision) are converted to float32 a chunk at a
// time: every product is float32, dW and db accumulate in float32, and d hidden is rounded to
// the hidden states' dtype once, per chunk. The kernel and bias arrive as float32 (the Python
// wrapper casts them; a mixed-precision model keeps them in float32 anyway).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/gemm.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "csrc/cpu/thread_pool.h"
#include "csrc/linear_cross_entropy.h"
#include "csrc/pending_errors.h"
#include "csrc/problem.h"

namespace tf_metal_ops {
namespace {

struct LinearKernel {
  CustomLossAttrs attrs;
  int64_t chunk_rows = 0;  // 0: DefaultLinearChunkRows
};

void* CreateKernel(TF_OpKernelConstruction* ctx, Direction direction, const char* op_name) {
  auto kernel = std::make_unique<LinearKernel>();
  if (Error e = ReadLossAttrs(ctx, direction, op_name, TF_FLOAT, &kernel->attrs); !e.ok()) {
    FailConstruction(ctx, e);
    return nullptr;
  }
  StatusPtr status = NewStatus();
  TF_OpKernelConstruction_GetAttrInt64(ctx, "chunk_rows", &kernel->chunk_rows, status.get());
  if (Error e = FromStatus(status.get(), "reading attr chunk_rows"); !e.ok()) {
    FailConstruction(ctx, e);
    return nullptr;
  }
  if (kernel->chunk_rows < 0) {
    FailConstruction(ctx, Error::InvalidArgument(
                              OpDescription(kernel->attrs) + ": chunk_rows must be >= 0 (0: "
                              "the default), got " + std::to_string(kernel->chunk_rows)));
    return nullptr;
  }
  return kernel.release();
}
void* CreateForward(TF_OpKernelConstruction* ctx) {
  return CreateKernel(ctx, Direction::kForward, kLinearForwardOpName);
}
void* CreateGradient(TF_OpKernelConstruction* ctx) {
  return CreateKernel(ctx, Direction::kGradient, kLinearGradientOpName);
}
void Delete(void* kernel) { delete static_cast<LinearKernel*>(kernel); }

struct Inputs {
  TensorPtr hidden, kernel, bias, labels, class_weights;
  TensorPtr row_scales;         // forward
  TensorPtr upstream, row_stats;  // gradient
};

struct Shapes {
  int64_t rows = 0, width = 0, classes = 0;
  bool reduced = false;  // forward: row scales given (problem.h)
  CustomLossProblem problem;  // for the label and class-weight messages and checks
};

Error ShapeError(const CustomLossAttrs& attrs, const std::string& message) {
  return Error::InvalidArgument(OpDescription(attrs) + ": " + message);
}

Error Describe(TF_OpKernelContext* ctx, const CustomLossAttrs& attrs, Inputs* in, Shapes* s) {
  if (Error e = TakePendingError(); !e.ok()) return e;
  const bool forward = attrs.direction == Direction::kForward;
  std::pair<int, TensorPtr*> wanted[] = {
      {kLinearHidden, &in->hidden}, {kLinearKernel, &in->kernel},
      {kLinearBias, &in->bias}, {kLinearLabels, &in->labels},
      {kLinearClassWeights, &in->class_weights},
      {kLinearRowScales, forward ? &in->row_scales : &in->upstream},
      {kLinearRowStats, forward ? nullptr : &in->row_stats}};
  for (auto& [index, tensor] : wanted) {
    if (tensor == nullptr) continue;
    if (Error e = GetInput(ctx, index, tensor); !e.ok()) return e;
  }
  const std::vector<int64_t> h = Dims(in->hidden.get());
  const std::vector<int64_t> w = Dims(in->kernel.get());
  if (h.size() != 2) {
    return ShapeError(attrs, "hidden must have shape [rows, d], got " + ShapeString(h));
  }
  if (w.size() != 2 || w[0] != h[1] || w[1] < 1) {
    return ShapeError(attrs, "kernel must have shape [d, num_classes] with d = hidden's last "
                             "dimension and num_classes >= 1; got kernel shape " +
                                 ShapeString(w) + " and hidden shape " + ShapeString(h));
  }
  s->rows = h[0];
  s->width = h[1];
  s->classes = w[1];
  if (Dims(in->bias.get()) != std::vector<int64_t>{s->classes}) {
    return ShapeError(attrs, "bias must have shape [" + std::to_string(s->classes) +
                                 "]; got " + ShapeString(Dims(in->bias.get())));
  }
  // The BLAS takes 32-bit dimensions and strides.
  if (!GemmFits(s->rows, s->classes, s->width)) {
    return ShapeError(attrs, "hidden " + ShapeString(h) + " and kernel " + ShapeString(w) +
                                 " exceed the BLAS's 32-bit dimensions");
  }
  const std::vector<int64_t> y = Dims(in->labels.get());
  const bool dense = attrs.label_kind == LabelKind::kDense;
  const bool labels_fit =
      dense ? y == std::vector<int64_t>{s->rows, s->classes}
            : (y == std::vector<int64_t>{s->rows} || y == std::vector<int64_t>{s->rows, 1});
  if (!labels_fit) {
    return ShapeError(attrs, std::string(dense ? "dense labels must have shape [rows, "
                                                 "num_classes]"
                                               : "sparse labels must have shape [rows] (or "
                                                 "[rows, 1])") +
                                 "; got labels shape " + ShapeString(y) + " with hidden shape " +
                                 ShapeString(h) + " and kernel shape " + ShapeString(w));
  }
  const std::vector<int64_t> cw = Dims(in->class_weights.get());
  if (cw.size() != 1 || (cw[0] != 0 && cw[0] != s->classes)) {
    return ShapeError(attrs, "class_weights must have shape [" + std::to_string(s->classes) +
                                 "] (or [0] for all ones); got " + ShapeString(cw));
  }
  if (forward) {
    const std::vector<int64_t> scales = Dims(in->row_scales.get());
    s->reduced = scales == std::vector<int64_t>{s->rows};
    if (!s->reduced && scales != std::vector<int64_t>{0}) {
      return ShapeError(attrs, "row_scales must have shape [" + std::to_string(s->rows) +
                                   "] (one per row) or [0] (none); got " +
                                   ShapeString(scales));
    }
  } else {
    if (Dims(in->upstream.get()) != std::vector<int64_t>{s->rows}) {
      return ShapeError(attrs, "the upstream gradient must have shape [" +
                                   std::to_string(s->rows) + "]; got " +
                                   ShapeString(Dims(in->upstream.get())));
    }
    if (Dims(in->row_stats.get()) != std::vector<int64_t>{s->rows, kRowStatsWidth}) {
      return ShapeError(attrs, "row_stats must have shape [" + std::to_string(s->rows) + ", " +
                                   std::to_string(kRowStatsWidth) +
                                   "] (the forward op's second output); got " +
                                   ShapeString(Dims(in->row_stats.get())));
    }
  }
  CustomLossProblem& p = s->problem;
  p.attrs = attrs;
  p.num_rows = s->rows;
  p.num_classes = s->classes;
  p.row_dims = {s->rows};
  p.logits_dims = {s->rows, s->classes};
  p.has_class_weights = cw[0] != 0;
  return Error::Ok();
}

Error Allocate(TF_OpKernelContext* ctx, const CustomLossAttrs& attrs, int index,
               TF_DataType type, std::vector<int64_t> dims, TensorPtr* out) {
  int64_t elements = 1;
  for (int64_t d : dims) elements *= d;
  StatusPtr status = NewStatus();
  out->reset(TF_AllocateOutput(ctx, index, type, dims.data(), static_cast<int>(dims.size()),
                               static_cast<size_t>(elements) * TF_DataTypeSize(type),
                               status.get()));
  return FromStatus(status.get(), OpDescription(attrs) + ": allocating output " +
                                      std::to_string(index));
}

Error AllocateTemp(TF_OpKernelContext* ctx, const CustomLossAttrs& attrs,
                   std::vector<int64_t> dims, TensorPtr* out) {
  StatusPtr status = NewStatus();
  TF_AllocatorAttributes host{TF_ALLOCATOR_ATTRIBUTES_STRUCT_SIZE, /*on_host=*/1};
  out->reset(TF_AllocateTemp(ctx, TF_FLOAT, dims.data(), static_cast<int>(dims.size()), &host,
                             status.get()));
  return FromStatus(status.get(), OpDescription(attrs) + ": allocating the chunk's buffers");
}

float* FloatData(const TensorPtr& t) { return static_cast<float*>(TF_TensorData(t.get())); }

// How many groups of column blocks a chunk's gradient products run as, each group one task with
// its own partial sum of dh_c (see the file's comment): one per block while the partials (chunk
// x d each) stay within half the chunk's logits (chunk x V), and at least two, so that two
// threads share the work.
int64_t DHiddenGroups(const GemmColumnBlocks& blocks, int64_t width, int64_t classes) {
  if (blocks.count <= 1) return 1;
  const int64_t affordable = classes / (2 * std::max<int64_t>(width, 1));
  return std::min(blocks.count, std::max<int64_t>(2, affordable));
}

// Calls body(block) for every column block, on our pool's threads.
template <typename Body>
void ForEachBlock(int64_t count, const Body& body) {
  RunOnPool(
      CpuThreadLimit(), count,
      [](void* context, int64_t block) { (*static_cast<const Body*>(context))(block); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

// The state of one execution's chunk loop.
struct Loop {
  const CustomLossAttrs* attrs;
  const Shapes* s;
  const Inputs* in;
  TF_DataType hidden_type;
  int64_t chunk;
  float* z;           // chunk x V logits, then their gradient
  float* h_float;     // chunk x d: the chunk's hidden states in float32 (16-bit hidden only)
  float* dh_float;    // chunk x d: its d hidden before rounding (16-bit hidden only)
  float* dh_partials; // dh_groups x chunk x d (dh_groups > 1 only)
  GemmColumnBlocks blocks;
  int64_t dh_groups;
  std::vector<float> ones;  // chunk ones, for db = 1^T g
  RowsKernel rows_kernel;

  // The chunk's hidden states as float32 rows of stride d.
  const float* Hidden(int64_t begin, int64_t m) const {
    const int64_t d = s->width;
    const void* h = TF_TensorData(in->hidden.get());
    if (hidden_type == TF_FLOAT) return static_cast<const float*>(h) + begin * d;
    ParallelFor(m, d, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* out = h_float + r * d;
        if (hidden_type == TF_HALF) {
          const Half* row = static_cast<const Half*>(h) + (begin + r) * d;
          for (int64_t j = 0; j < d; ++j) out[j] = Load(row[j]);
        } else {
          const BFloat16* row = static_cast<const BFloat16*>(h) + (begin + r) * d;
          for (int64_t j = 0; j < d; ++j) out[j] = Load(row[j]);
        }
      }
    });
    return h_float;
  }

  // z = h_c W + b for m rows.
  void Logits(const float* hc, int64_t m) const {
    const int64_t v = s->classes;
    const float* bias = FloatData(in->bias);
    const float* w = FloatData(in->kernel);
    ForEachBlock(blocks.count, [&](int64_t block) {
      const int64_t c0 = blocks.Begin(block), c1 = blocks.End(block, v);
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(z + r * v + c0, bias + c0, sizeof(float) * (c1 - c0));
      }
      Sgemm(Transpose::kNo, Transpose::kNo, m, c1 - c0, s->width, 1.0f, hc, s->width, w + c0,
            v, 1.0f, z + c0, v);
    });
  }

  RowsArgs Rows(int64_t begin) const {
    const CustomLossProblem& p = s->problem;
    RowsArgs args;
    args.type = StorageType::kFloat;
    args.label_kind = attrs->label_kind;
    args.num_classes = s->classes;
    args.gamma = attrs->gamma;
    args.smoothing_share = attrs->label_smoothing / static_cast<float>(s->classes);
    args.target_share = 1.0f - attrs->label_smoothing;
    args.class_weights = p.has_class_weights ? FloatData(in->class_weights) : nullptr;
    double sum = static_cast<double>(s->classes);
    if (args.class_weights != nullptr) {
      sum = 0;
      for (int64_t c = 0; c < s->classes; ++c) sum += args.class_weights[c];
    }
    args.sum_class_weights = static_cast<float>(sum);
    args.has_ignore_class = attrs->has_ignore_class;
    args.ignore_class = attrs->ignore_class;
    args.logits = z;
    const char* labels = static_cast<const char*>(TF_TensorData(in->labels.get()));
    switch (attrs->label_kind) {
      case LabelKind::kSparseInt32: args.labels = labels + begin * 4; break;
      case LabelKind::kSparseInt64: args.labels = labels + begin * 8; break;
      case LabelKind::kDense: args.labels = labels + begin * s->classes * 4; break;
    }
    return args;
  }

  void RunRows(const RowsArgs& args, int64_t m) const {
    ParallelFor(m, s->classes, [&](int64_t r0, int64_t r1) { rows_kernel(args, r0, r1); });
  }

  // From the chunk's gradient g (in z): its rows of d hidden, and its share of dW and db.
  void Products(const float* hc, int64_t begin, int64_t m, bool first, TF_Tensor* dh,
                float* dw, float* db) const {
    const int64_t d = s->width, v = s->classes;
    const float* w = FloatData(in->kernel);
    float* dh_rows = hidden_type == TF_FLOAT
                         ? static_cast<float*>(TF_TensorData(dh)) + begin * d
                         : dh_float;
    // Group k takes the blocks [k count / groups, (k + 1) count / groups): for each, its term
    // of dh_c = g W^T (summed into the group's partial), and its columns of dW and db, while
    // the block of g is in the cache.
    const float beta = first ? 0.0f : 1.0f;
    ForEachBlock(dh_groups, [&](int64_t group) {
      float* dh_out = dh_groups == 1 ? dh_rows : dh_partials + group * m * d;
      const int64_t first_block = blocks.count * group / dh_groups;
      for (int64_t block = first_block; block < blocks.count * (group + 1) / dh_groups;
           ++block) {
        const int64_t c0 = blocks.Begin(block), c1 = blocks.End(block, v);
        Sgemm(Transpose::kNo, Transpose::kYes, m, d, c1 - c0, 1.0f, z + c0, v, w + c0, v,
              block == first_block ? 0.0f : 1.0f, dh_out, d);
        Sgemm(Transpose::kYes, Transpose::kNo, d, c1 - c0, m, 1.0f, hc, d, z + c0, v, beta,
              dw + c0, v);
        Sgemm(Transpose::kNo, Transpose::kNo, 1, c1 - c0, m, 1.0f, ones.data(), m, z + c0, v,
              beta, db + c0, v);
      }
    });
    if (dh_groups > 1) {
      ParallelFor(m, d * dh_groups, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* out = dh_rows + r * d;
          std::memcpy(out, dh_partials + r * d, sizeof(float) * d);
          for (int64_t k = 1; k < dh_groups; ++k) {
            const float* part = dh_partials + (k * m + r) * d;
            for (int64_t j = 0; j < d; ++j) out[j] += part[j];
          }
        }
      });
    }
    if (hidden_type != TF_FLOAT) {
      ParallelFor(m, d, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* row = dh_float + r * d;
          if (hidden_type == TF_HALF) {
            Half* out = static_cast<Half*>(TF_TensorData(dh)) + (begin + r) * d;
            for (int64_t j = 0; j < d; ++j) Store(row[j], &out[j]);
          } else {
            BFloat16* out = static_cast<BFloat16*>(TF_TensorData(dh)) + (begin + r) * d;
            for (int64_t j = 0; j < d; ++j) Store(row[j], &out[j]);
          }
        }
      });
    }
  }
};

void Compute(void* raw, TF_OpKernelContext* ctx) {
  const LinearKernel& kernel = *static_cast<const LinearKernel*>(raw);
  const CustomLossAttrs& attrs = kernel.attrs;
  const bool forward = attrs.direction == Direction::kForward;
  Inputs in;
  Shapes s;
  if (!GemmAvailable()) {
    return FailKernel(ctx, Error::Internal(OpDescription(attrs) + ": this macOS lacks "
                                           "Accelerate's current BLAS interface (macOS 13.3 or "
                                           "later); linear_cross_entropy runs its chunk loop of "
                                           "TensorFlow ops there"));
  }
  if (Error e = Describe(ctx, attrs, &in, &s); !e.ok()) return FailKernel(ctx, e);
  if (Error e = CheckLabelsAndClassWeights(s.problem, in.labels.get(), in.class_weights.get());
      !e.ok()) {
    return FailKernel(ctx, e);
  }
  const int64_t n = s.rows, d = s.width, v = s.classes;
  const bool gradients = !forward || s.reduced;
  const TF_DataType hidden_type = attrs.logits_dtype;

  TensorPtr loss, stats, dh, dw, db;
  if (forward) {
    if (Error e = Allocate(ctx, attrs, kLinearLossOutput, TF_FLOAT, {n}, &loss); !e.ok()) {
      return FailKernel(ctx, e);
    }
    if (Error e = Allocate(ctx, attrs, kLinearRowStatsOutput, TF_FLOAT, {n, kRowStatsWidth},
                           &stats);
        !e.ok()) {
      return FailKernel(ctx, e);
    }
  }
  // The gradients' outputs: the forward's follow its loss and statistics.
  const int first_gradient = forward ? kLinearDHiddenOutput : 0;
  {
    const std::vector<int64_t> none = {0};
    Error e = Allocate(ctx, attrs, first_gradient, hidden_type,
                       gradients ? std::vector<int64_t>{n, d} : none, &dh);
    if (e.ok()) {
      e = Allocate(ctx, attrs, first_gradient + 1, TF_FLOAT,
                   gradients ? std::vector<int64_t>{d, v} : none, &dw);
    }
    if (e.ok()) {
      e = Allocate(ctx, attrs, first_gradient + 2, TF_FLOAT,
                   gradients ? std::vector<int64_t>{v} : none, &db);
    }
    if (!e.ok()) return FailKernel(ctx, e);
  }
  if (n == 0) {  // no rows: zero kernel and bias gradients
    if (gradients) {
      std::memset(TF_TensorData(dw.get()), 0, TF_TensorByteSize(dw.get()));
      std::memset(TF_TensorData(db.get()), 0, TF_TensorByteSize(db.get()));
    }
    return;
  }

  const int64_t chunk = LinearChunkRows(kernel.chunk_rows, n, d, v);
  const GemmColumnBlocks blocks = GemmColumnBlocks::For(v);
  const int64_t dh_groups = gradients ? DHiddenGroups(blocks, d, v) : 1;
  TensorPtr z, h_float, dh_float, dh_partials;
  if (Error e = AllocateTemp(ctx, attrs, {chunk, v}, &z); !e.ok()) return FailKernel(ctx, e);
  if (dh_groups > 1) {
    if (Error e = AllocateTemp(ctx, attrs, {dh_groups, chunk, d}, &dh_partials); !e.ok()) {
      return FailKernel(ctx, e);
    }
  }
  if (hidden_type != TF_FLOAT) {
    if (Error e = AllocateTemp(ctx, attrs, {chunk, d}, &h_float); !e.ok()) {
      return FailKernel(ctx, e);
    }
    if (gradients) {
      if (Error e = AllocateTemp(ctx, attrs, {chunk, d}, &dh_float); !e.ok()) {
        return FailKernel(ctx, e);
      }
    }
  }
  // Blocks run a single-threaded BLAS each on our pool; one whole block, the BLAS's own threads.
  SetGemmThreads(blocks.count > 1 ? 1 : CpuThreadLimit());
  Loop loop{&attrs, &s, &in, hidden_type, chunk, FloatData(z),
            h_float ? FloatData(h_float) : nullptr, dh_float ? FloatData(dh_float) : nullptr,
            dh_partials ? FloatData(dh_partials) : nullptr, blocks, dh_groups,
            std::vector<float>(static_cast<size_t>(chunk), 1.0f), SelectRowsKernel()};
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t m = std::min(chunk, n - begin);
    const float* hc = loop.Hidden(begin, m);
    loop.Logits(hc, m);
    RowsArgs args = loop.Rows(begin);
    if (forward) {
      args.forward = true;
      args.out = FloatData(loss) + begin;
      args.stats_out = FloatData(stats) + begin * kRowStatsWidth;
      if (s.reduced) {  // g = s_i d loss_i / d z_i, over the logits
        args.scaled_gradient = loop.z;
        args.row_scales = FloatData(in.row_scales) + begin;
        args.in_place = true;
      }
    } else {
      args.forward = false;
      args.upstream = FloatData(in.upstream) + begin;
      args.stats_in = FloatData(in.row_stats) + begin * kRowStatsWidth;
      args.out = loop.z;
      args.in_place = true;
    }
    loop.RunRows(args, m);
    if (gradients) {
      loop.Products(hc, begin, m, begin == 0, dh.get(), FloatData(dw), FloatData(db));
    }
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

const bool linear_kernels_registered =
    (RegisterKernel(kLinearForwardOpName, &CreateForward),
     RegisterKernel(kLinearGradientOpName, &CreateGradient), true);

}  // namespace

int64_t LinearChunkRows(int64_t requested, int64_t rows, int64_t width, int64_t classes) {
  int64_t chunk = requested;
  if (chunk <= 0) {
    // About rows x d logits per chunk (Liger-Kernel's size): the chunk's logits then weigh what
    // the hidden states do. At least kMinLinearChunkRows rows, so that each product's inner or
    // outer dimension keeps the BLAS efficient (docs/performance.md).
    const double budget = static_cast<double>(rows) * static_cast<double>(width);
    chunk = static_cast<int64_t>(std::ceil(budget / static_cast<double>(std::max<int64_t>(
                                                        classes, 1))));
    chunk = std::max(chunk, kMinLinearChunkRows);
  }
  return std::max<int64_t>(1, std::min(chunk, rows));
}

}  // namespace tf_metal_ops
