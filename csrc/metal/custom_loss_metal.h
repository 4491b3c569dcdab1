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

// Registers the GPU kernels of CustomLoss, CustomLossGrad and MetalKernel (metal_kernel_metal.h)
// for the "GPU" device type. Called from Python (the runtime module's register_metal_kernels)
// only after tf_metal_ops/gpu_plugin.py found that Apple's tensorflow-metal, and no other
// plugin, provides the GPU: another Metal PluggableDevice's stream is not an Objective-C object,
// and the kernels' first act on a stream is an Objective-C message. Idempotent and thread-safe.
// The library's static initializers register no GPU kernel.
void RegisterGpuKernelsForAppleStream();

// Whether RegisterGpuKernelsForAppleStream ran: the gate accepted the GPU's plugin.
bool GpuKernelsRegistered();

// Failures of the registrations are kept here ("TfMetalOps>CustomLoss for bfloat16: <TensorFlow's
// message>"), and `python -m tf_metal_ops info` shows them (build_info's
// gpu_kernel_registration_errors). Empty when every registration succeeded.
std::vector<std::string> KernelRegistrationErrors();

// The logits dtypes the GPU kernels were registered for on this system ("float", "half", and
// "bfloat16" on macOS 14 or later): the others run on the CPU.
std::vector<std::string> RegisteredGpuDtypes();

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_CUSTOM_LOSS_METAL_H_
