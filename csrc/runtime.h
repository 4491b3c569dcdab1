// Process-wide settings of the native library, shared by every kernel instance and exposed to
// Python through the pybind11 module (python_module.cc). Read at each op execution, so a
// change takes effect at the next call without retracing any tf.function.
#ifndef TF_METAL_OPS_CSRC_RUNTIME_H_
#define TF_METAL_OPS_CSRC_RUNTIME_H_

#include <cstdint>
#include <string>
#include <vector>

namespace tf_metal_ops {

enum class CommitMode : int { kCommit = 0, kCommitAndWait = 1 };
CommitMode GetCommitMode();
void SetCommitMode(CommitMode mode);

// GPU time of one kernel, recorded in commit-and-wait mode (the only mode in which the command
// buffer is known to have completed when the op returns).
struct KernelTiming {
  std::string op;           // "TfMetalOps>CustomLoss"
  std::string kernel_name;  // the Metal function's host name
  std::string shape;        // logits shape, "[8, 1000]"; a metal_kernel's "grid (4000, 1, 1)"
  double gpu_seconds = 0;   // GPUEndTime - GPUStartTime
};
void RecordKernelTiming(KernelTiming timing);
std::vector<KernelTiming> KernelTimings();
void ClearKernelTimings();

// True when this build has the Metal kernels compiled in (macOS only).
bool MetalCompiledIn();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_RUNTIME_H_
