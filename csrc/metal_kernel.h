// TfMetalOps>MetalKernel: a user's kernel (tf_metal_ops.metal_kernel) as one generic op. Its
// attributes carry the whole generated MSL source, so a graph or SavedModel holding the op runs
// wherever the package is installed. CPU kernel: csrc/cpu/metal_kernel_cpu.cc.
#ifndef TF_METAL_OPS_CSRC_METAL_KERNEL_H_
#define TF_METAL_OPS_CSRC_METAL_KERNEL_H_

namespace tf_metal_ops {

inline constexpr const char* kMetalKernelOpName = "TfMetalOps>MetalKernel";

// Attributes (tf_metal_ops/kernels.py writes them):
//   Tin, Tout        the inputs' and outputs' dtypes
//   source           the generated MSL source, host block included
//   kernel_name      the [[host_name]] the source registers
//   threadgroup      threads per threadgroup (x, y, z)
//   output_ranks     rank of each output; `output_shapes` holds their dims, concatenated
//   shape_params     per input: which of its shape (1), strides (2), ndim (4) the kernel takes
//   init_value, has_init_value   what the outputs hold before the kernel runs (else undefined)
//   lockstep         false when the source names no barrier or SIMD-group function: the CPU
//                    then runs each threadgroup as a loop over its threads instead of fibers
// Inputs: `inputs` (Tin), `output_shapes` (int64, sum(output_ranks) values), then `grid`
// (int64 [3]: threads per grid, as dispatchThreads counts them; an input, not an attribute, so
// that it can follow a batch size known only at run time).
inline constexpr int kShapeParamShape = 1;
inline constexpr int kShapeParamStrides = 2;
inline constexpr int kShapeParamNdim = 4;

// The SIMD-group width the emulator runs generated kernels with: Apple GPUs' 32.
inline constexpr unsigned kEmulatedSimdWidth = 32;

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_KERNEL_H_
