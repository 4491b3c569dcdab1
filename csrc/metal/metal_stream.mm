// See metal_stream.h.
#import "csrc/metal/metal_stream.h"

#include <mutex>
#include <vector>

#include "csrc/metal/custom_loss_metal.h"
#include "csrc/metal/metal_messages.h"
#include "csrc/pending_errors.h"

namespace tf_metal_ops {
namespace metal {
namespace {

// The streams commit-mode launches were encoded on (RememberStream). tensorflow-metal has one
// stream per device, so this holds one entry per GPU; the references keep the streams alive for
// the process, as the plugin's devices are anyway. Never destroyed: handlers and check_errors()
// may run during exit.
std::mutex& StreamsMutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
std::vector<id<TF_MetalStream>>& Streams() {
  static auto* streams = new std::vector<id<TF_MetalStream>>();
  return *streams;
}

// check_errors()'s flush (pending_errors.h): on each remembered stream's queue, commits the
// current command buffer and waits for it ([stream commitAndWait], the protocol's only way to
// commit a buffer the plugin owns), so every launch encoded before is committed, and the last of
// them completed. Command buffers the plugin committed earlier complete on their own; the wait
// for their handlers is pending_errors.cc's. Called from Python's thread, never from the queue:
// the dispatch_sync cannot nest.
Error FlushStreams() {
  std::vector<id<TF_MetalStream>> streams;
  {
    std::lock_guard<std::mutex> lock(StreamsMutex());
    streams = Streams();
  }
  for (id<TF_MetalStream> stream : streams) {
    dispatch_queue_t queue = [stream queue];
    if (queue == nil) {
      return Error::Internal(
          "tf_metal_ops.debug.check_errors: a GPU stream has no dispatch queue, so its command "
          "buffer cannot be committed");
    }
    dispatch_sync(queue, ^{
      @autoreleasepool {
        if ([stream currentCommandBuffer] != nil) [stream commitAndWait];
      }
    });
  }
  return Error::Ok();
}

[[maybe_unused]] const bool streams_flush_registered =
    (SetCommandBufferFlush(&FlushStreams), true);

}  // namespace

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

// Takes no queue, only the mutex.
void RememberStream(id<TF_MetalStream> stream) {
  std::lock_guard<std::mutex> lock(StreamsMutex());
  for (id<TF_MetalStream> known : Streams()) {
    if (known == stream) return;
  }
  Streams().push_back(stream);
}

void ReportFailureLater(id<TF_MetalStream> stream, id<MTLCommandBuffer> command_buffer,
                        const std::string& context) {
  RememberStream(stream);
  const uint64_t ticket = BeginOutstandingLaunch();
  const std::string report_for = context;  // the block keeps its own copy
  [command_buffer addCompletedHandler:^(id<MTLCommandBuffer> done) {
    RecordDeferredGpuError(KernelFailure(done, report_for));
    FinishOutstandingLaunch(ticket);
  }];
}

Error KernelFailure(id<MTLCommandBuffer> command_buffer, const std::string& context) {
  const MTLCommandBufferStatus status = [command_buffer status];
  if (status == MTLCommandBufferStatusCompleted) return Error::Ok();
  return Error::InvalidArgument(context + ": the kernel failed on the GPU (command buffer " +
                                StatusName(status) + "): " + Describe([command_buffer error]));
}

}  // namespace metal
}  // namespace tf_metal_ops
