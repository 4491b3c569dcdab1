// What the Metal kernels of CustomLoss / CustomLossGrad report about themselves to the rest of the
// native library. Plain C++ so that runtime code (and the pybind11 module) can include it; the
// definitions are in custom_loss_metal.mm, which is compiled on macOS arm64 only, so call these
// only where MetalCompiledIn() is true.
#ifndef TF_METAL_OPS_CSRC_METAL_CUSTOM_LOSS_METAL_H_
#define TF_METAL_OPS_CSRC_METAL_CUSTOM_LOSS_METAL_H_

#include <string>
#include <vector>

namespace tf_metal_ops {
namespace metal {

// Registering a GPU kernel happens in a static initializer, where there is nobody to raise an
// error to: failures are kept here ("TfMetalOps>CustomLoss for bfloat16: <TensorFlow's
// message>"), and `python -m tf_metal_ops info` shows them (build_info's
// gpu_kernel_registration_errors). Empty when every registration succeeded.
std::vector<std::string> KernelRegistrationErrors();

// The logits dtypes the GPU kernels were registered for on this system ("float", "half", and
// "bfloat16" on macOS 14 or later): the others run on the CPU.
std::vector<std::string> RegisteredGpuDtypes();

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_CUSTOM_LOSS_METAL_H_
