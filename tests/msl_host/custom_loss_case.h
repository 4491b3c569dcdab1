// What the emulator's driver and the CUDA driver (tests/msl_cuda/) both make of one case: the
// case directory's files (case.txt's `key value` lines and the raw .bin arrays, written by
// msl_build.write_case_dir), a TfmoEmuCase as the gpu::LaunchDesc the macOS encoder would plan,
// and the plan as the TfmoEmuResult reports it.
#ifndef TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_CASE_H_
#define TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_CASE_H_

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "csrc/metal/launch_plan.h"
#include "tests/msl_host/custom_loss_driver.h"

namespace msl_host {

inline std::vector<char> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline bool WriteFileBytes(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  return static_cast<bool>(out);
}

// Bytes per element of a case's logits dtype (gpu::LogitsDtype: 0 float32, else 16 bits).
inline size_t DtypeBytes(int32_t dtype) { return dtype == 0 ? 4 : 2; }

// Absent keys take the defaults below (those of a forward float32 case on a 32-wide GPU).
inline TfmoEmuCase ReadCaseFile(const std::string& dir) {
  std::map<std::string, std::string> kv;
  {
    std::ifstream in(dir + "/case.txt");
    std::string key, value;
    while (in >> key >> value) kv[key] = value;
  }
  auto get = [&kv](const char* key, const char* fallback) {
    auto it = kv.find(key);
    return it == kv.end() ? std::string(fallback) : it->second;
  };
  TfmoEmuCase c;
  std::memset(&c, 0, sizeof(c));
  c.num_rows = std::stoll(get("num_rows", "0"));
  c.num_classes = std::stoll(get("num_classes", "1"));
  c.dtype = std::stoi(get("dtype", "0"));
  c.label_kind = std::stoi(get("label_kind", "0"));
  c.direction = std::stoi(get("direction", "0"));
  c.variant = std::stoi(get("variant", "-1"));
  c.gamma = std::stof(get("gamma", "0"));
  c.label_smoothing = std::stof(get("label_smoothing", "0"));
  c.has_class_weights = std::stoi(get("has_class_weights", "0"));
  c.has_ignore_class = std::stoi(get("has_ignore_class", "0"));
  c.ignore_class = std::stoll(get("ignore_class", "0"));
  c.max_total_threads_per_threadgroup = std::stoul(get("max_threads", "1024"));
  c.thread_execution_width = std::stoul(get("simd_width", "32"));
  c.executor = std::stoi(get("executor", "1"));
  c.max_concurrent_threadgroups = std::stoul(get("max_concurrent_threadgroups", "4"));
  c.has_row_stats = std::stoi(get("has_row_stats", "0"));
  c.has_row_scales = std::stoi(get("has_row_scales", "0"));
  c.alias_gradient = std::stoul(get("alias_gradient", "0"));
  return c;
}

inline tf_metal_ops::gpu::LaunchDesc LaunchDescOf(const TfmoEmuCase& c) {
  namespace gpu = tf_metal_ops::gpu;
  gpu::LaunchDesc desc;
  desc.num_rows = c.num_rows;
  desc.num_classes = c.num_classes;
  desc.dtype = static_cast<gpu::LogitsDtype>(c.dtype);
  desc.label_kind = static_cast<tf_metal_ops::LabelKind>(c.label_kind);
  desc.direction = static_cast<tf_metal_ops::Direction>(c.direction);
  desc.variant = static_cast<gpu::KernelVariant>(c.variant);
  desc.gamma = c.gamma;
  desc.label_smoothing = c.label_smoothing;
  desc.has_class_weights = c.has_class_weights != 0;
  desc.has_ignore_class = c.has_ignore_class != 0;
  desc.ignore_class = c.ignore_class;
  desc.has_row_stats = c.has_row_stats != 0;
  desc.has_row_scales = c.has_row_scales != 0;
  return desc;
}

// The case's memory for a buffer role the plan binds (not kParams: those are bytes, which each
// driver sends its own way). Inputs a case does not use are null: a kernel that read one anyway
// would fault (crash the emulator; compute-sanitizer's memcheck names it on a GPU).
inline void* CaseBuffer(const TfmoEmuCase& c, tf_metal_ops::gpu::BufferRole role) {
  using tf_metal_ops::gpu::BufferRole;
  const bool gradient = c.direction == 1;
  if (c.alias_gradient != 0 && ((gradient && role == BufferRole::kOutput) ||
                                (!gradient && role == BufferRole::kScaledGradient &&
                                 c.has_row_scales))) {
    return const_cast<void*>(c.logits);
  }
  switch (role) {
    case BufferRole::kLogits: return const_cast<void*>(c.logits);
    case BufferRole::kLabels: return const_cast<void*>(c.labels);
    case BufferRole::kClassWeights:
      return c.has_class_weights ? const_cast<float*>(c.class_weights) : nullptr;
    case BufferRole::kParams: return nullptr;
    case BufferRole::kErrorRecord: return c.error_record;
    case BufferRole::kOutput: return c.output;
    case BufferRole::kUpstream: return const_cast<void*>(c.upstream);
    case BufferRole::kRowScales:
      return c.has_row_scales ? const_cast<float*>(c.row_scales) : nullptr;
    case BufferRole::kRowStats: return c.has_row_stats ? c.row_stats : nullptr;
    case BufferRole::kScaledGradient: return c.has_row_scales ? c.scaled_gradient : nullptr;
  }
  return nullptr;
}

// The plan's kernel, geometry and binding count, as the result reports them.
inline void ReportPlan(const tf_metal_ops::gpu::LaunchPlan& plan, TfmoEmuResult* result) {
  std::snprintf(result->kernel_name, sizeof(result->kernel_name), "%s", plan.kernel_name.c_str());
  result->variant = static_cast<int32_t>(plan.variant);
  for (int i = 0; i < 3; ++i) {
    result->threadgroups_per_grid[i] = plan.threadgroups_per_grid[i];
    result->threads_per_threadgroup[i] = plan.threads_per_threadgroup[i];
  }
  result->threadgroup_memory_length = plan.threadgroup_memory_length;
  result->threads_per_row = plan.params.threads_per_row;
  result->rows_per_threadgroup = plan.params.rows_per_threadgroup;
  result->num_bindings = static_cast<uint32_t>(plan.bindings.size());
}

}  // namespace msl_host

#endif  // TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_CASE_H_
