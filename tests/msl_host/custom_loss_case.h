// What the emulator's driver and the CUDA driver (tests/msl_cuda/) both make of one case: the
// case directory's case.txt (`key value` lines, written by msl_build.write_case_dir) as a
// TfmoEmuCase, and a TfmoEmuCase as the gpu::LaunchDesc the macOS encoder would plan.
#ifndef TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_CASE_H_
#define TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_CASE_H_

#include <cstring>
#include <fstream>
#include <map>
#include <string>

#include "csrc/launch_plan.h"
#include "tests/msl_host/custom_loss_driver.h"

namespace msl_host {

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
  return c;
}

inline tf_metal_ops::gpu::LaunchDesc LaunchDescOf(const TfmoEmuCase& c) {
  namespace gpu = tf_metal_ops::gpu;
  gpu::LaunchDesc desc;
  desc.num_rows = c.num_rows;
  desc.num_classes = c.num_classes;
  desc.dtype = static_cast<gpu::LogitsDtype>(c.dtype);
  desc.label_kind = static_cast<gpu::LabelKind>(c.label_kind);
  desc.direction = static_cast<gpu::Direction>(c.direction);
  desc.variant = static_cast<gpu::KernelVariant>(c.variant);
  desc.gamma = c.gamma;
  desc.label_smoothing = c.label_smoothing;
  desc.has_class_weights = c.has_class_weights != 0;
  desc.has_ignore_class = c.has_ignore_class != 0;
  desc.ignore_class = c.ignore_class;
  return desc;
}

}  // namespace msl_host

#endif  // TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_CASE_H_
