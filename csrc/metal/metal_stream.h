// The stream object tensorflow-metal hands to custom kernels, and how we obtain it.
//
// Objective-C++ (include from .mm files only). tensorflow-metal ships no header for its stream:
// TF_GetStream returns an Objective-C object that answers the four messages below (Apple's WWDC22
// session 10063, "Accelerate machine learning with Metal", and its sample "Customizing a
// TensorFlow operation" declare the same protocol). The contract, as those sources describe it
// and as the tensorflow-metal 1.1 and 1.2 wheels behave, is what the encoder in
// custom_loss_metal.mm relies on:
//   - encode only inside dispatch_sync([stream queue], ...): the queue is serial and owns the
//     command buffer; a nested dispatch_sync onto it deadlocks;
//   - [stream currentCommandBuffer] is created lazily and replaced after a real commit: use it
//     inside the block only, never keep it, never commit or wait on it directly;
//   - [stream commit] may only batch (the plugin commits every Nth call); [stream commitAndWait]
//     always commits and waits, so the command buffer's status and error are final afterwards.
#ifndef TF_METAL_OPS_CSRC_METAL_METAL_STREAM_H_
#define TF_METAL_OPS_CSRC_METAL_METAL_STREAM_H_

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <dispatch/dispatch.h>

#include <string>

#include "csrc/tf_c.h"

@protocol TF_MetalStream
- (dispatch_queue_t)queue;
- (id<MTLCommandBuffer>)currentCommandBuffer;
- (void)commit;
- (void)commitAndWait;
@end

namespace tf_metal_ops {
namespace metal {

// The kernel's stream as a TF_MetalStream, or nil with `*error` set. Refuses every stream unless
// the Python gate accepted Apple's plugin (metal::GpuKernelsRegistered, which reads no memory of
// the handle); then checks that the object answers the protocol's messages, so a tensorflow-metal
// release with another stream type fails with a TensorFlow error naming the op instead of an
// "unrecognized selector" crash.
id<TF_MetalStream> GetMetalStream(TF_OpKernelContext* ctx, const std::string& op_description,
                                  Error* error);

// The command buffer to encode into, on the stream's queue (inside the dispatch_sync block). With
// `wait` (commit-and-wait mode) it first commits, and waits for, whatever earlier ops batched into
// the current command buffer, so the one returned holds this op's work alone: its status, error
// and GPU time are then this op's. Debug mode only; it costs one extra synchronization per op.
// nil with `*error` set (naming `context`) when the stream has none.
id<MTLCommandBuffer> CommandBufferForEncoding(id<TF_MetalStream> stream, bool wait,
                                              const std::string& context, Error* error);

// Remembers a stream that a commit-mode launch was encoded on, for check_errors()'s flush: the
// plugin hands its stream out only inside an op (TF_GetStream), and the command buffer a launch
// sits in may not be committed until the plugin's next batch. Call on the stream's queue.
void RememberStream(id<TF_MetalStream> stream);

// Commit mode: has `command_buffer` (the stream's current one, before [stream commit]) report
// its failure, if it fails, as a pending error (csrc/pending_errors.h) naming `context`: a kernel
// that faulted or ran past the GPU's time limit then fails the next op of ours or check_errors(),
// which waits for this handler. Call on the stream's queue, before the commit.
void ReportFailureLater(id<TF_MetalStream> stream, id<MTLCommandBuffer> command_buffer,
                        const std::string& context);

// OK when `command_buffer` (committed, and completed or failed) completed; else an error naming
// `context`, the buffer's status and Metal's description of what failed.
Error KernelFailure(id<MTLCommandBuffer> command_buffer, const std::string& context);

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_METAL_STREAM_H_
