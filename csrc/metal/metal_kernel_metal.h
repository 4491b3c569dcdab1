// The GPU kernel of TfMetalOps>MetalKernel (a user's tf_metal_ops.metal_kernel) on the stream of
// Apple's tensorflow-metal. Plain C++ so that custom_loss_metal.mm's gated registration can call
// it; defined in metal_kernel_metal.mm, compiled on macOS arm64 only.
#ifndef TF_METAL_OPS_CSRC_METAL_METAL_KERNEL_METAL_H_
#define TF_METAL_OPS_CSRC_METAL_METAL_KERNEL_METAL_H_

#include <string>

namespace tf_metal_ops {
namespace metal {

// Registers the kernel for the "GPU" device type, its `output_shapes` and `grid` inputs in host
// memory. Called only from RegisterGpuKernelsForAppleStream (custom_loss_metal.h), after the
// Python gate accepted Apple's plugin: on any other GPU, TensorFlow keeps placing the op on the
// CPU kernel. Empty on success, else TensorFlow's message.
std::string RegisterMetalKernelForAppleStream();

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_METAL_KERNEL_METAL_H_
