// The launch plan of the CustomLoss Metal kernels: which kernel, what grid, which buffer at which
// index. Platform-neutral C++17 (no TensorFlow, no Objective-C), so that the macOS encoder
// (csrc/metal/*.mm) and the Linux emulator (tests/msl_host/) run exactly the same plan: what the
// emulator verifies is what the GPU is told to run.
//
// How the encoder uses it (pseudo-code):
//
//   gpu::LaunchDesc desc = ...from the CustomLossProblem...;
//   std::string name = gpu::KernelName(desc);           // also the pipeline-cache key
//   if (desc.num_rows == 0) return;                      // or: plan.dispatch == false
//   id<MTLComputePipelineState> pso = cache.Get(name);   // nil for bf16 before Metal 3.1
//   gpu::LaunchPlan plan = gpu::PlanLaunch(desc, {pso.maxTotalThreadsPerThreadgroup,
//                                                 pso.threadExecutionWidth});
//   if (!plan.ok) -> error (plan.error);  if (!plan.dispatch) -> nothing to encode
//   [enc setComputePipelineState:pso];
//   for (const gpu::BufferBinding& b : plan.bindings)
//     b.role == kParams ? [enc setBytes:&plan.params length:sizeof(plan.params) atIndex:b.index]
//                       : [enc setBuffer:<tensor or error buffer for b.role> offset:0 atIndex:b.index];
//   if (plan.threadgroup_memory_length)
//     [enc setThreadgroupMemoryLength:plan.threadgroup_memory_length
//                             atIndex:TFMO_THREADGROUP_SCRATCH];
//   [enc dispatchThreadgroups:MTLSizeMake(plan.threadgroups_per_grid[0..2])
//       threadsPerThreadgroup:MTLSizeMake(plan.threads_per_threadgroup[0..2])];
//
// The kernel variant depends only on the shape (never on the pipeline limits), so KernelName()
// can be called before the pipeline exists and always equals plan.kernel_name.
#ifndef TF_METAL_OPS_CSRC_METAL_LAUNCH_PLAN_H_
#define TF_METAL_OPS_CSRC_METAL_LAUNCH_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/loss_kinds.h"
#include "kernels/custom_loss_params.h"

namespace tf_metal_ops {
namespace gpu {

// MSL has no double: float64 logits have no Metal kernel.
enum class LogitsDtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
// kAuto picks from the shape; the others force a variant (tests, debugging).
enum class KernelVariant : int32_t {
  kAuto = -1,
  kRowPerThreadgroup = TFMO_VARIANT_ROW_PER_THREADGROUP,
  kRowPerLaneGroup = TFMO_VARIANT_ROW_PER_LANE_GROUP,
};

// What the encoder binds at a buffer index.
enum class BufferRole : int32_t {
  kLogits = 0,       // the logits tensor
  kLabels = 1,       // the labels tensor
  kClassWeights = 2, // the class_weights tensor; when has_class_weights is false the kernel does
                     // not read it: bind the tensor anyway (it may be a nil, 0-byte buffer)
  kParams = 3,       // plan.params, by setBytes (inline_bytes == true)
  kErrorRecord = 4,  // a CustomLossErrorRecord in shared storage, InitCustomLossErrorRecord'ed
  kOutput = 5,       // the output tensor: loss [N] or d logits [N, C]
  kUpstream = 6,     // gradient only: the upstream gradient [N]
  kRowScales = 7,    // forward only: row_scales float [N]; not read when has_row_scales is false
                     // (bind a stand-in then, as for class_weights)
  kRowStats = 8,     // row_stats float [N, 3]: written by the forward, read by the gradient,
                     // when has_row_stats (else not touched: bind a stand-in)
  kScaledGradient = 9,  // forward only: the scaled gradient [N, C]; not written when
                        // has_row_scales is false (bind a stand-in then)
};
inline constexpr int kNumBufferRoles = 10;
const char* BufferRoleName(BufferRole role);

struct BufferBinding {
  uint32_t index;     // [[buffer(index)]]
  BufferRole role;
  bool inline_bytes;  // true: setBytes:length:atIndex: with `length` bytes (plan.params)
  uint32_t length;    // bytes, for inline_bytes
};

struct LaunchDesc {
  int64_t num_rows = 0;     // N, product of the leading dims
  int64_t num_classes = 0;  // C >= 1
  LogitsDtype dtype = LogitsDtype::kFloat32;
  LabelKind label_kind = LabelKind::kSparseInt32;
  Direction direction = Direction::kForward;
  float gamma = 0.0f;
  float label_smoothing = 0.0f;
  bool has_class_weights = false;
  bool has_ignore_class = false;
  int64_t ignore_class = 0;
  KernelVariant variant = KernelVariant::kAuto;
  // Forward: write row_stats. Gradient: read them instead of a log-sum-exp pass.
  bool has_row_stats = false;
  // Forward only: row_scales are given; write the scaled gradient beside the loss.
  bool has_row_scales = false;
};

// From the pipeline state: maxTotalThreadsPerThreadgroup and threadExecutionWidth (the SIMD
// width; 32 on every Apple GPU).
struct PipelineLimits {
  uint32_t max_total_threads_per_threadgroup = 1024;
  uint32_t thread_execution_width = 32;
};

struct LaunchPlan {
  bool ok = false;        // false: `error` says why nothing can be launched (bad desc or limits)
  std::string error;
  bool dispatch = false;  // false (with ok): N == 0, encode nothing at all
  std::string kernel_name;
  KernelVariant variant = KernelVariant::kAuto;  // the variant chosen (never kAuto when ok)
  uint32_t threadgroups_per_grid[3] = {0, 0, 0};   // dispatchThreadgroups:
  uint32_t threads_per_threadgroup[3] = {0, 0, 0}; // threadsPerThreadgroup:
  uint32_t threadgroup_memory_length = 0;  // bytes at [[threadgroup(0)]]; 0: kernel declares none
  std::vector<BufferBinding> bindings;     // sorted by index, contiguous from 0
  CustomLossParams params{};               // the bytes to send at the kParams binding
};

// "tfmo_custom_loss_<forward|gradient>_<rowtg|rowsimd>_<f32|f16|bf16>_<i32|i64|dense>", with
// "_plain" (label_smoothing / C is 0 in float) or "_smoothed" (it is not) appended for sparse
// labels when gamma == 0 and there are no class weights (desc.gamma, desc.label_smoothing,
// desc.has_class_weights): the [[host_name]] in kernels/custom_loss.metal. Empty if the desc is
// invalid.
std::string KernelName(const LaunchDesc& desc);

LaunchPlan PlanLaunch(const LaunchDesc& desc, const PipelineLimits& limits);

}  // namespace gpu
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_LAUNCH_PLAN_H_
