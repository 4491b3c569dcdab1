// The Metal kernels that fill a metal_kernel's outputs with init_value before the user's kernel
// runs (csrc/metal/metal_kernel_metal.mm), one per element width. A GPU tensor is private
// storage, so the CPU cannot write it, and a blit's fillBuffer repeats a single byte, which
// init_value's element (1.0f is 0x3f800000) rarely is: a compute kernel writes any pattern.
//
// Platform-neutral (a string and a constant): tests/test_metal_kernel_gpu_parts.py compiles the
// source under the address-space check, as it does the users' generated sources.
#ifndef TF_METAL_OPS_CSRC_METAL_FILL_KERNEL_SOURCE_H_
#define TF_METAL_OPS_CSRC_METAL_FILL_KERNEL_SOURCE_H_

namespace tf_metal_ops {
namespace metal {

// Kernel names: "tfmo_fill_" followed by the element width in bits (8, 16, 32, 64).
inline constexpr const char kFillKernelPrefix[] = "tfmo_fill_";

// buffer(0): the output; buffer(1): one element of init_value; buffer(2): the element count.
// The grid is 2-D (metal_kernel_args.h's FillGrid): thread (x, y) writes element
// y * threads_per_grid.x + x, if there is one.
inline constexpr const char kFillKernelSource[] = R"msl(#include <metal_stdlib>
using namespace metal;

#define TFMO_FILL_KERNEL(NAME, T)                                                   \
  [[kernel]] void NAME(device T* out [[buffer(0)]], constant T& value [[buffer(1)]], \
                       constant ulong& count [[buffer(2)]],                         \
                       uint2 position [[thread_position_in_grid]],                  \
                       uint2 grid [[threads_per_grid]]) {                           \
    const ulong i = ulong(position.y) * ulong(grid.x) + ulong(position.x);          \
    if (i < count) out[i] = value;                                                  \
  }

TFMO_FILL_KERNEL(tfmo_fill_8, uchar)
TFMO_FILL_KERNEL(tfmo_fill_16, ushort)
TFMO_FILL_KERNEL(tfmo_fill_32, uint)
TFMO_FILL_KERNEL(tfmo_fill_64, ulong)
)msl";

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_FILL_KERNEL_SOURCE_H_
