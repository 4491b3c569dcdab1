// The compute pipelines of users' kernels (tf_metal_ops.metal_kernel) and of the fill kernels
// that write their init_value, per Metal device.
//
// Objective-C++ (include from .mm files only). A user's generated source is compiled with
// newLibraryWithSource: once per (device, source text, kernel name) and its pipeline kept for the
// life of the process, as our own library's are (kernel_library.h); a source that does not compile
// keeps its error, so a second call fails at once with the same message. One lock guards the
// cache; it is taken inside the stream's queue block and never held while waiting for a queue.
#ifndef TF_METAL_OPS_CSRC_METAL_USER_KERNEL_LIBRARY_H_
#define TF_METAL_OPS_CSRC_METAL_USER_KERNEL_LIBRARY_H_

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <cstddef>
#include <string>

#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace metal {

// The pipeline of `kernel_name` in `source`, compiled with safe math (kernel_library.h's
// CompileWithSafeMath), as MLX compiles its users' kernels. nil with `*error` set:
// InvalidArgument with the Metal compiler's message when the source does not compile (the
// generated source's #line markers make it name `source:LINE` / `header:LINE`, the user's own
// lines), or when it has no such kernel or no pipeline can be built for it.
id<MTLComputePipelineState> GetUserKernelPipeline(id<MTLDevice> device, const std::string& source,
                                                  const std::string& kernel_name, Error* error);

// The pipeline of the fill kernel for elements of `element_size` bytes (1, 2, 4 or 8;
// fill_kernel_source.h), its library compiled on first use.
id<MTLComputePipelineState> GetFillPipeline(id<MTLDevice> device, size_t element_size,
                                            Error* error);

// A small buffer bound where a tensor is empty (an empty GPU tensor may have no buffer,
// and Metal's validation refuses an unbound argument). Never read or written: the kernel has no
// element there to touch.
id<MTLBuffer> GetPlaceholderBuffer(id<MTLDevice> device, Error* error);

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_USER_KERNEL_LIBRARY_H_
