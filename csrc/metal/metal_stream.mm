// See metal_stream.h.
#import "csrc/metal/metal_stream.h"

#include "csrc/metal/custom_loss_metal.h"

namespace tf_metal_ops {
namespace metal {

id<TF_MetalStream> GetMetalStream(TF_OpKernelContext* ctx, const std::string& op_description,
                                  Error* error) {
  StatusPtr status = NewStatus();
  SP_Stream raw_stream = TF_GetStream(ctx, status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    *error = FromStatus(status.get(), op_description + ": getting the GPU stream");
    return nil;
  }
  if (raw_stream == nullptr) {
    *error = Error::Internal(op_description + ": TF_GetStream returned no stream");
    return nil;
  }
  // First guard, and the one that matters: the GPU kernels exist only after the Python gate
  // (tf_metal_ops/gpu_plugin.py) found Apple's tensorflow-metal to be the GPU's only plugin. No
  // cheap, safe test tells an Objective-C object from another plugin's C++ stream struct:
  // object_getClass and respondsToSelector: both read the handle's first word as a class pointer,
  // which on a C++ struct is undefined behaviour (a crash in practice). This check reads no memory.
  if (!GpuKernelsRegistered()) {
    *error = Error::Internal(op_description +
                             ": our Metal kernels run only on Apple's tensorflow-metal stream, and "
                             "tf_metal_ops's import did not find that plugin");
    return nil;
  }
  // The SP_Stream handle of a tensorflow-metal device is the plugin's Objective-C stream object
  // itself. __bridge: we borrow it for this Compute call and take no ownership (ARC neither
  // retains nor releases across the cast; the local strong reference below keeps it alive).
  id stream = (__bridge id)raw_stream;
  // Second guard, valid only because the handle is known to come from Apple's plugin: a
  // tensorflow-metal release whose stream no longer answers the protocol fails with a TensorFlow
  // error naming the op instead of an "unrecognized selector" crash.
  if (![stream respondsToSelector:@selector(queue)] ||
      ![stream respondsToSelector:@selector(currentCommandBuffer)] ||
      ![stream respondsToSelector:@selector(commit)] ||
      ![stream respondsToSelector:@selector(commitAndWait)]) {
    *error = Error::Internal(op_description +
                             ": the GPU stream is not a tensorflow-metal stream (expected "
                             "tensorflow-metal 1.2.0); run the op on the CPU instead");
    return nil;
  }
  return stream;
}

id<MTLCommandBuffer> CommandBufferForEncoding(id<TF_MetalStream> stream, bool wait,
                                              const std::string& context, Error* error) {
  if (wait) [stream commitAndWait];
  id<MTLCommandBuffer> command_buffer = [stream currentCommandBuffer];
  if (command_buffer == nil) {
    *error = Error::Internal(context + ": the GPU stream has no command buffer");
  }
  return command_buffer;
}

}  // namespace metal
}  // namespace tf_metal_ops
