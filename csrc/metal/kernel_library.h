// The process-wide cache of our Metal kernel library and compute pipelines.
//
// Objective-C++ (include from .mm files only). Building a pipeline state compiles GPU code and
// takes milliseconds (compiling the library from source takes longer), so each is built once per
// device and kernel name and then shared by every kernel instance and thread: TensorFlow may call
// Compute from several threads at once, so every entry point takes the cache's lock.
#ifndef TF_METAL_OPS_CSRC_METAL_KERNEL_LIBRARY_H_
#define TF_METAL_OPS_CSRC_METAL_KERNEL_LIBRARY_H_

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <string>

#include "csrc/metal/error_record_slots.h"
#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace metal {

// Compiles MSL `source` with newLibraryWithSource: and fast math off. Metal compiles with fast
// math by default: it may reorder and contract floating-point operations and use approximate
// exp/log, which a loss cannot afford (log-sum-exp cancellation, -inf logits, the (1 - p)^gamma
// limits). Safe math keeps IEEE semantics. Our loss library and users' metal_kernel sources (as
// MLX compiles its own) are compiled so. nil with `*why` set: the source is not UTF-8, or the
// compiler's message.
id<MTLLibrary> CompileWithSafeMath(id<MTLDevice> device, const std::string& source,
                                   std::string* why);

// The compute pipeline of the function `kernel_name` in `library`; nil with `*why` set otherwise:
// "no kernel named '...'" (and `*missing` true), or Metal's reason for failing to build it.
id<MTLComputePipelineState> NewComputePipeline(id<MTLDevice> device, id<MTLLibrary> library,
                                               const std::string& kernel_name, bool* missing,
                                               std::string* why);

// The pipeline of the kernel whose [[host_name]] is `kernel_name` on `device`, built on first use;
// nil with `*error` set when the library cannot be loaded or has no such kernel. A failure to load
// the library is remembered (the files will not appear while the process runs), so later calls
// fail fast with the same message.
id<MTLComputePipelineState> GetComputePipeline(id<MTLDevice> device, const std::string& kernel_name,
                                               Error* error);

// A CustomLossErrorRecord-sized buffer in shared storage for launches whose error record nobody
// reads (dense labels, which cannot be out of range): the kernels must be given somewhere to
// write. One per device, shared by all
// launches: hazard tracking is off for it, so it adds no dependency between unrelated command
// buffers, and its contents are never looked at.
id<MTLBuffer> GetDiscardedErrorRecord(id<MTLDevice> device, Error* error);

// The slab of error records that commit-mode launches on `device` write to, and the bookkeeping
// of its slots (csrc/metal/error_record_slots.h says who takes and frees them, and when): a
// shared-storage buffer of ErrorRecordSlots::kCapacity records with hazard tracking off, made on
// first use and kept, like the pipelines, for the life of the process. nil with `*error` set
// when the allocation fails.
id<MTLBuffer> GetErrorRecordSlab(id<MTLDevice> device, ErrorRecordSlots** slots, Error* error);

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_KERNEL_LIBRARY_H_
