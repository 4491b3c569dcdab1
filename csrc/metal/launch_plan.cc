// See launch_plan.h. Every number the GPU is told comes from here; the kernels
// (kernels/custom_loss.h) document what they assume about it.
#include "csrc/metal/launch_plan.h"

#include <cmath>
#include <string>

namespace tf_metal_ops {
namespace gpu {
namespace {

// Metal guarantees large grids, but we fold the threadgroup count into x and y beyond this so the
// plan never depends on a per-device limit (the kernels linearize tg.y * grid.x + tg.x).
constexpr uint32_t kMaxGridDimension = 65535;
// The kernels index rows and classes with 32-bit integers (offsets into the tensors with 64).
constexpr int64_t kMaxIndex = (int64_t{1} << 31) - 1;
// Values per thread the geometry aims for: enough work per thread that a row's reductions
// (shuffles, barriers, the log-sum-exp combines) cost little beside its elements, few enough
// that the parallelism stays.
constexpr int64_t kLaneGroupValuesPerLane = 8;
constexpr int64_t kThreadgroupValuesPerThread = 16;
// Threads per row of the row-per-threadgroup kernels, at most: a row of 512 threads leaves room
// for a second row's threadgroup on a core while the first waits at its barriers. This cap and
// kThreadgroupValuesPerThread come from timing these kernels on a GPU (an NVIDIA H200, through
// tests/msl_cuda): at a thousand classes 64 threads per row (16 values each) beat 256, and at
// tens of thousands of classes 256 to 512 beat 1024. Apple GPUs share the shape they depend on
// (32-wide SIMD-groups, up to 1024 threads per threadgroup); no Apple GPU has timed them.
constexpr uint64_t kMaxThreadsPerRow = 512;
// Threads per threadgroup of the lane-group variant: 8 SIMD-groups, several threadgroups per core.
constexpr uint32_t kLaneGroupThreadgroupSize = 256;
// Floats of threadgroup scratch per SIMD-group in the row-per-threadgroup kernels: the partial
// (max, ties, others) triple of the log-sum-exp and the partial sums of the second reduction
// (two: the loss and G, in a forward that writes the scaled gradient).
constexpr uint32_t kScratchFloatsPerSimdGroup = 5;

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

uint64_t NextPowerOfTwo(uint64_t x) {
  uint64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
uint64_t RoundUp(uint64_t a, uint64_t b) { return CeilDiv(a, b) * b; }

const char* DirectionToken(Direction d) {
  return d == Direction::kForward ? "forward" : "gradient";
}
const char* VariantToken(KernelVariant v) {
  return v == KernelVariant::kRowPerThreadgroup ? "rowtg" : "rowsimd";
}
const char* DtypeToken(LogitsDtype t) {
  switch (t) {
    case LogitsDtype::kFloat32: return "f32";
    case LogitsDtype::kFloat16: return "f16";
    case LogitsDtype::kBFloat16: return "bf16";
  }
  return nullptr;
}
const char* LabelToken(LabelKind k) {
  switch (k) {
    case LabelKind::kSparseInt32: return "i32";
    case LabelKind::kSparseInt64: return "i64";
    case LabelKind::kDense: return "dense";
  }
  return nullptr;
}

// Empty when the desc can be launched; otherwise the reason.
std::string CheckDesc(const LaunchDesc& d) {
  if (DtypeToken(d.dtype) == nullptr) return "unsupported logits dtype (Metal has float, half, bfloat)";
  if (LabelToken(d.label_kind) == nullptr) return "unknown label kind";
  if (d.direction != Direction::kForward && d.direction != Direction::kGradient)
    return "unknown direction";
  if (d.variant != KernelVariant::kAuto && d.variant != KernelVariant::kRowPerThreadgroup &&
      d.variant != KernelVariant::kRowPerLaneGroup)
    return "unknown kernel variant";
  if (d.num_rows < 0 || d.num_rows > kMaxIndex)
    return "num_rows = " + std::to_string(d.num_rows) + " is outside [0, 2^31)";
  if (d.num_classes < 1 || d.num_classes > kMaxIndex)
    return "num_classes = " + std::to_string(d.num_classes) + " is outside [1, 2^31)";
  if (!(d.gamma >= 0.0f) || std::isinf(d.gamma)) return "gamma must be finite and >= 0";
  if (!(d.label_smoothing >= 0.0f && d.label_smoothing <= 1.0f))
    return "label_smoothing must be in [0, 1]";
  if (d.has_row_scales && d.direction != Direction::kForward)
    return "row_scales belong to the forward kernel";
  return "";
}

// Variant selection (shape only). A row fits one SIMD-group when C <= kMaxLaneGroupClasses:
// then rows go to groups of lanes (many rows per threadgroup, register-only shuffles);
// otherwise a whole threadgroup reduces each row through SIMD-group and threadgroup memory.
constexpr int64_t kMaxLaneGroupClasses = 256;

KernelVariant ChooseVariant(const LaunchDesc& desc) {
  if (desc.variant != KernelVariant::kAuto) return desc.variant;
  return desc.num_classes <= kMaxLaneGroupClasses ? KernelVariant::kRowPerLaneGroup
                                                  : KernelVariant::kRowPerThreadgroup;
}

// eps / C as the kernels read it (CustomLossParams::smooth_off), rounded once from double.
float SmoothOff(const LaunchDesc& desc) {
  return static_cast<float>(static_cast<double>(desc.label_smoothing) /
                            static_cast<double>(desc.num_classes));
}

// Cross-entropy on sparse labels (no focal term, no class weights) runs kernels of its own
// (kernels/custom_loss.h, KernelForm): "_plain" without label smoothing, "_smoothed" with it.
// They compile the other options' passes out and so need fewer registers; the geometry is the
// same. The choice depends on the loss options alone, never on the device. Smoothing is judged
// by eps / C as the kernels get it: an eps so small that eps / C rounds to 0 in float smooths
// nothing, and the general kernels then take their one-class path too, which the plain kernels
// reproduce (1 - eps stays in the label's weight).
const char* FormSuffix(const LaunchDesc& desc) {
  if (desc.label_kind == LabelKind::kDense || desc.gamma != 0.0f || desc.has_class_weights) {
    return "";
  }
  return SmoothOff(desc) == 0.0f ? "_plain" : "_smoothed";
}

}  // namespace

const char* BufferRoleName(BufferRole role) {
  switch (role) {
    case BufferRole::kLogits: return "logits";
    case BufferRole::kLabels: return "labels";
    case BufferRole::kClassWeights: return "class_weights";
    case BufferRole::kParams: return "params";
    case BufferRole::kErrorRecord: return "error_record";
    case BufferRole::kOutput: return "output";
    case BufferRole::kUpstream: return "upstream";
    case BufferRole::kRowScales: return "row_scales";
    case BufferRole::kRowStats: return "row_stats";
    case BufferRole::kScaledGradient: return "scaled_gradient";
  }
  return "?";
}

std::string KernelName(const LaunchDesc& desc) {
  if (!CheckDesc(desc).empty()) return "";
  std::string name = "tfmo_custom_loss_";
  name += DirectionToken(desc.direction);
  name += "_";
  name += VariantToken(ChooseVariant(desc));
  name += "_";
  name += DtypeToken(desc.dtype);
  name += "_";
  name += LabelToken(desc.label_kind);
  name += FormSuffix(desc);
  return name;
}

LaunchPlan PlanLaunch(const LaunchDesc& desc, const PipelineLimits& limits) {
  LaunchPlan plan;
  plan.error = CheckDesc(desc);
  if (!plan.error.empty()) return plan;

  const uint32_t width = limits.thread_execution_width;
  // The reductions need whole SIMD-groups of a power-of-two width, and (rowtg) at most `width`
  // SIMD-groups so one SIMD-group can combine their partials.
  if (!IsPowerOfTwo(width) || width < 4 || width > 128) {
    plan.error = "threadExecutionWidth = " + std::to_string(width) +
                 " is not a power of two in [4, 128]";
    return plan;
  }
  uint64_t max_threads = limits.max_total_threads_per_threadgroup;
  if (max_threads > 1024) max_threads = 1024;
  if (max_threads > uint64_t{width} * width) max_threads = uint64_t{width} * width;
  max_threads = max_threads / width * width;  // whole SIMD-groups only
  if (max_threads == 0) {
    plan.error = "maxTotalThreadsPerThreadgroup = " +
                 std::to_string(limits.max_total_threads_per_threadgroup) +
                 " is smaller than one SIMD-group (" + std::to_string(width) + ")";
    return plan;
  }

  const uint64_t n = static_cast<uint64_t>(desc.num_rows);
  const uint64_t c = static_cast<uint64_t>(desc.num_classes);
  const bool sparse = desc.label_kind != LabelKind::kDense;
  plan.variant = ChooseVariant(desc);
  plan.kernel_name = KernelName(desc);

  CustomLossParams& p = plan.params;
  p.num_rows = static_cast<tfmo_u32>(n);
  p.num_classes = static_cast<tfmo_u32>(c);
  p.gamma = desc.gamma;
  p.has_class_weights = desc.has_class_weights ? 1u : 0u;
  p.has_ignore_class = (sparse && desc.has_ignore_class) ? 1u : 0u;
  p.ignore_class = p.has_ignore_class ? desc.ignore_class : 0;
  // q_c = (1 - eps) t_c + eps / C, the two coefficients rounded once from double.
  p.smooth_on = static_cast<float>(1.0 - static_cast<double>(desc.label_smoothing));
  p.smooth_off = SmoothOff(desc);
  p.variant = static_cast<tfmo_u32>(plan.variant);
  p.has_row_stats = desc.has_row_stats ? 1u : 0u;
  p.has_row_scales = desc.has_row_scales ? 1u : 0u;

  uint64_t threads = 0;
  uint64_t groups = 0;  // threadgroups needed (before folding into x, y)
  if (plan.variant == KernelVariant::kRowPerLaneGroup) {
    // A power-of-two group of lanes per row, inside one SIMD-group (shuffles stay in the group).
    uint64_t lanes = NextPowerOfTwo(CeilDiv(c, kLaneGroupValuesPerLane));
    if (lanes > width) lanes = width;
    threads = kLaneGroupThreadgroupSize;
    if (threads > max_threads) threads = max_threads;
    // A few rows need no full threadgroup (still whole SIMD-groups).
    const uint64_t needed = RoundUp(n * lanes, width);
    if (needed > 0 && threads > needed) threads = needed;
    p.threads_per_row = static_cast<tfmo_u32>(lanes);
    p.rows_per_threadgroup = static_cast<tfmo_u32>(threads / lanes);
    groups = CeilDiv(n, threads / lanes);
    plan.threadgroup_memory_length = 0;
  } else {
    threads = RoundUp(CeilDiv(c, kThreadgroupValuesPerThread), width);
    if (threads > kMaxThreadsPerRow) threads = kMaxThreadsPerRow / width * width;
    if (threads > max_threads) threads = max_threads;
    p.threads_per_row = static_cast<tfmo_u32>(threads);
    p.rows_per_threadgroup = 1;
    groups = n;
    const uint64_t simd_groups = threads / width;
    plan.threadgroup_memory_length =
        static_cast<uint32_t>(RoundUp(simd_groups * kScratchFloatsPerSimdGroup * sizeof(float), 16));
  }

  plan.threads_per_threadgroup[0] = static_cast<uint32_t>(threads);
  plan.threads_per_threadgroup[1] = 1;
  plan.threads_per_threadgroup[2] = 1;
  const uint64_t grid_y = groups == 0 ? 0 : CeilDiv(groups, kMaxGridDimension);
  const uint64_t grid_x = groups == 0 ? 0 : CeilDiv(groups, grid_y);
  plan.threadgroups_per_grid[0] = static_cast<uint32_t>(grid_x);
  plan.threadgroups_per_grid[1] = static_cast<uint32_t>(grid_y);
  plan.threadgroups_per_grid[2] = groups == 0 ? 0 : 1;

  auto bind = [&plan](uint32_t index, BufferRole role) {
    plan.bindings.push_back({index, role, false, 0});
  };
  bind(TFMO_BUFFER_LOGITS, BufferRole::kLogits);
  bind(TFMO_BUFFER_LABELS, BufferRole::kLabels);
  bind(TFMO_BUFFER_CLASS_WEIGHTS, BufferRole::kClassWeights);
  plan.bindings.push_back({TFMO_BUFFER_PARAMS, BufferRole::kParams, true,
                           static_cast<uint32_t>(sizeof(CustomLossParams))});
  bind(TFMO_BUFFER_ERROR_RECORD, BufferRole::kErrorRecord);
  bind(TFMO_BUFFER_OUTPUT, BufferRole::kOutput);
  // Every kernel of a direction takes the same buffers, used or not (the params say which).
  if (desc.direction == Direction::kGradient) {
    bind(TFMO_BUFFER_UPSTREAM, BufferRole::kUpstream);
    bind(TFMO_BUFFER_ROW_STATS, BufferRole::kRowStats);
  } else {
    bind(TFMO_BUFFER_ROW_SCALES, BufferRole::kRowScales);
    bind(TFMO_BUFFER_ROW_STATS, BufferRole::kRowStats);
    bind(TFMO_BUFFER_SCALED_GRADIENT, BufferRole::kScaledGradient);
  }

  plan.dispatch = n > 0;
  plan.ok = true;
  return plan;
}

}  // namespace gpu
}  // namespace tf_metal_ops
