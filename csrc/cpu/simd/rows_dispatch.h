// The vectorized row kernels (float, half and bfloat16 logits) and the choice between their
// instruction-set variants.
//
// The kernels are written once (simd_kernels.h) and compiled per instruction set:
// rows_portable.h for the baseline every CPU of the architecture has (SSE2 on x86-64, NEON on
// arm64; 4 lanes), rows_avx2.h for x86-64 CPUs with AVX2, FMA and F16C (8 lanes), and
// rows_avx512.h for those that also have AVX-512 F, BW, VL and DQ with the OS saving its
// registers (16 lanes). Which one runs is decided once per process from the CPU's feature bits
// (rows_dispatch.cc), so a wheel built on any machine runs on every x86-64 and arm64 machine; no
// -march flag is used.
//
// Each variant is compiled once per storage type, in a file of its own (rows_<isa>_<dtype>.cc):
// the row kernels' instances are most of a build's compile time (a variant whole is about a
// minute and a half at -O3), and an arm64 build, a Mac's included, has one variant, which as one
// file was one compiler job however many cores the machine has.
//
// Each variant gives the same bits for any thread count and batch split. The variants differ
// from one another in the last bits: a row's sums are taken lane by lane (4, 8 or 16 lanes) and
// added across lanes at the end, so a different width adds in a different order. Each is within
// the same tolerances of the float64 reference (tests/test_cpu_kernels.py runs every variant the
// CPU has), and the vector math of each is checked alone (tests/cpu_math/simd_math_check.cc).
// Float64 logits take csrc/cpu/custom_loss_cpu.cc's scalar kernel (kernels/custom_loss_math.h).
#ifndef TF_METAL_OPS_CSRC_CPU_SIMD_ROWS_DISPATCH_H_
#define TF_METAL_OPS_CSRC_CPU_SIMD_ROWS_DISPATCH_H_

#include <cstdint>

#include "csrc/problem.h"

namespace tf_metal_ops {

enum class StorageType : int32_t { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

// Everything one op execution's rows need, fixed for the whole batch.
struct RowsArgs {
  StorageType type = StorageType::kFloat;
  LabelKind label_kind = LabelKind::kSparseInt32;
  bool forward = true;
  int64_t num_classes = 0;
  float gamma = 0;
  float smoothing_share = 0;  // eps / C: every class's share of the smoothed target
  float target_share = 1;     // 1 - eps: what the labelled class (or t_c) keeps
  const float* class_weights = nullptr;  // null: all ones
  float sum_class_weights = 0;           // sum_c a_c
  bool has_ignore_class = false;
  int64_t ignore_class = 0;
  const void* logits = nullptr;    // [N, C] of `type`
  const void* labels = nullptr;    // [N] int32/int64, or [N, C] of `type`
  const void* upstream = nullptr;  // [N] of `type`, gradient only; null: `row_scales`
  void* out = nullptr;             // [N] loss, or [N, C] gradient, of `type`
  bool in_place = false;  // the gradient (out, or scaled_gradient) is written over the logits
  // Row statistics (problem.h): the forward writes them to `stats_out`; a gradient reads them
  // from `stats_in` when the forward's were given (null: it finds them itself).
  float* stats_out = nullptr;
  const float* stats_in = nullptr;
  // A reduced loss's scaled gradient (problem.h): when set, the forward also writes
  // row_scales[i] * d loss_i / d z_i here ([N, C] of `type`).
  void* scaled_gradient = nullptr;
  const float* row_scales = nullptr;  // [N]
};

// Computes rows [begin, end) of the output. Thread-safe: different ranges may run at once.
using RowsKernel = void (*)(const RowsArgs& args, int64_t begin, int64_t end);

// Calls task(context, i) for every i in [0, count), on the kernels' threads, and returns when
// all have returned; `cost_per_task` (elements) decides how many threads are worth waking.
using ParallelTasks = void (*)(int64_t count, int64_t cost_per_task,
                               void (*task)(void* context, int64_t index), void* context);
// Computes the whole batch of `num_rows` rows with each row split into blocks of classes spread
// over `parallel`, which uses up to `threads` threads (simd_split_rows.h; the results do not
// depend on it), and returns true; or returns false, having done nothing, for batches whose
// rows are not split (a RowsKernel computes those).
using SplitRowsKernel = bool (*)(const RowsArgs& args, int64_t num_rows, int threads,
                                 ParallelTasks parallel);

// Each variant's entry points, one instance per storage type (simd_entry_points.h).
namespace portable {
template <StorageType kType>
void ComputeRows(const RowsArgs& args, int64_t begin, int64_t end);
template <StorageType kType>
bool ComputeSplitRows(const RowsArgs& args, int64_t num_rows, int threads,
                      ParallelTasks parallel);
}  // namespace portable
#if defined(__x86_64__)
namespace avx2 {
template <StorageType kType>
void ComputeRows(const RowsArgs& args, int64_t begin, int64_t end);
template <StorageType kType>
bool ComputeSplitRows(const RowsArgs& args, int64_t num_rows, int threads,
                      ParallelTasks parallel);
}  // namespace avx2
namespace avx512 {
template <StorageType kType>
void ComputeRows(const RowsArgs& args, int64_t begin, int64_t end);
template <StorageType kType>
bool ComputeSplitRows(const RowsArgs& args, int64_t num_rows, int threads,
                      ParallelTasks parallel);
}  // namespace avx512
#endif

// The variant for this CPU. TF_METAL_OPS_CPU_ISA=portable or =avx2 in the environment (read
// once) caps the choice at that variant, so a narrower variant's numerics can be tested on a
// wider machine too; =avx512 is the default (the widest the CPU has).
RowsKernel SelectRowsKernel();
// The split-row kernel of the same variant.
SplitRowsKernel SelectSplitRowsKernel();
// "avx512", "avx2" or "portable" (what SelectRowsKernel() picked), for build information and benchmarks.
const char* SelectedRowsIsa();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_SIMD_ROWS_DISPATCH_H_
