// The GPU kernel of TfMetalOps>MetalKernel (csrc/metal_kernel.h) on tensorflow-metal's stream.
//
// The same structure as the CPU kernel (csrc/cpu/metal_kernel_cpu.cc): attributes read once in
// create and the call's inputs checked and outputs allocated by csrc/metal_kernel_args.h, whose
// bindings decide which tensor goes to which [[buffer(i)]]; then the Metal part: the generated
// source compiled once per device (user_kernel_library.h), the outputs filled with init_value when
// it is given, and one dispatchThreads encoded on the plugin's command buffer inside dispatch_sync
// on its queue, as custom_loss_metal.mm encodes the loss (metal_stream.h has the contract).
//
// Compiled with ARC; TensorFlow objects are held by csrc/tf_c.h's owners. Every step that can
// fail comes before the compute encoder is created, so no failure leaves an encoder open on the
// plugin's command buffer.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <dispatch/dispatch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "csrc/metal/metal_kernel_metal.h"
#include "csrc/metal/metal_stream.h"
#include "csrc/metal/user_kernel_library.h"
#include "csrc/metal_kernel.h"
#include "csrc/metal_kernel_args.h"
#include "csrc/problem.h"
#include "csrc/runtime.h"
#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace {

// One init_value fill, resolved before encoding.
struct FillStep {
  id<MTLComputePipelineState> pipeline;
  id<MTLBuffer> output;
  std::vector<uint8_t> element;
  uint64_t count = 0;
  uint32_t grid[2] = {1, 1};
};

// What the encoding block hands back, as values that outlive it (never the command buffer: it
// belongs to the stream and is replaced after a commit).
struct EncodeOutcome {
  Error error;
  double gpu_seconds = -1.0;  // commit-and-wait mode only
};

// On a tensorflow-metal device TF_TensorData is the tensor's id<MTLBuffer> (offset 0), borrowed
// for this call: the launch's TensorPtr owners keep the tensors alive until Compute returns, and
// the command buffer retains what it was given after that. An empty tensor may have no buffer:
// the placeholder stands in (the kernel has no element of it to touch).
id<MTLBuffer> BufferOf(TF_Tensor* tensor, id<MTLBuffer> placeholder) {
  if (TF_TensorByteSize(tensor) == 0 || TF_TensorData(tensor) == nullptr) return placeholder;
  return (__bridge id<MTLBuffer>)TF_TensorData(tensor);
}

std::string SizeString(const uint32_t size[3]) {
  return "(" + std::to_string(size[0]) + ", " + std::to_string(size[1]) + ", " +
         std::to_string(size[2]) + ")";
}

// Runs on the stream's serial queue (inside dispatch_sync): must not dispatch_sync onto it again.
void EncodeOnQueue(id<TF_MetalStream> stream, const MetalKernelAttrs& a,
                   const MetalKernelLaunch& launch, bool wait, EncodeOutcome* outcome) {
  const std::string context = MetalKernelContext(a);
  Error error;
  id<MTLCommandBuffer> command_buffer =
      metal::CommandBufferForEncoding(stream, wait, context, &error);
  if (command_buffer == nil) {
    outcome->error = error;
    return;
  }
  id<MTLDevice> device = [command_buffer device];
  // Compiled here, on first use: the device is known only from the command buffer. The source
  // is compiled even when there is nothing to run, so a broken one fails on every device alike.
  id<MTLComputePipelineState> pipeline =
      metal::GetUserKernelPipeline(device, a.source, a.kernel_name, &error);
  if (pipeline == nil) {
    outcome->error = Error{error.code, context + ": " + error.message};
    return;
  }
  if (!launch.has_work) return;  // every output is empty: nothing to dispatch

  // At most 1024 (CheckThreadgroup), so NSUInteger cannot overflow.
  const NSUInteger threads = static_cast<NSUInteger>(launch.threadgroup[0]) *
                             launch.threadgroup[1] * launch.threadgroup[2];
  const NSUInteger most = [pipeline maxTotalThreadsPerThreadgroup];
  if (threads > most) {
    outcome->error = Error::InvalidArgument(
        context + ": threadgroup " + SizeString(launch.threadgroup) + " has " +
        std::to_string(threads) + " threads, more than this kernel's pipeline allows on this GPU "
        "(maxTotalThreadsPerThreadgroup = " + std::to_string(most) +
        "); use a smaller threadgroup");
    return;
  }

  id<MTLBuffer> placeholder = metal::GetPlaceholderBuffer(device, &error);
  if (placeholder == nil) {
    outcome->error = Error{error.code, context + ": " + error.message};
    return;
  }
  std::vector<FillStep> fills;
  if (a.has_init_value) {
    for (size_t o = 0; o < launch.outputs.size(); ++o) {
      if (launch.output_specs[o].elements == 0) continue;
      FillStep fill;
      if (Error e = InitValueBytes(a.output_types[o], a.init_value, &fill.element); !e.ok()) {
        outcome->error = e;
        return;
      }
      fill.pipeline = metal::GetFillPipeline(device, fill.element.size(), &error);
      if (fill.pipeline == nil) {
        outcome->error = Error{error.code, context + ": " + error.message};
        return;
      }
      fill.count = static_cast<uint64_t>(launch.output_specs[o].elements);
      if (!FillGrid(launch.output_specs[o].elements, fill.grid)) {
        outcome->error = Error::InvalidArgument(context + ": output " + std::to_string(o) +
                                                " is too large to fill with init_value");
        return;
      }
      fill.output = BufferOf(launch.outputs[o].get(), placeholder);
      fills.push_back(std::move(fill));
    }
  }
  std::vector<id<MTLBuffer>> buffers(launch.bindings.size());
  for (size_t i = 0; i < launch.bindings.size(); ++i) {
    const Binding& binding = launch.bindings[i];
    if (binding.kind == BindingKind::kInput) {
      buffers[i] = BufferOf(launch.inputs[binding.index].get(), placeholder);
    } else if (binding.kind == BindingKind::kOutput) {
      buffers[i] = BufferOf(launch.outputs[binding.index].get(), placeholder);
    }
  }

  id<MTLComputeCommandEncoder> encoder = [command_buffer computeCommandEncoder];
  if (encoder == nil) {
    outcome->error = Error::Internal(context + ": the command buffer gave no compute encoder");
    return;
  }
  // computeCommandEncoder's dispatches are serial (MTLDispatchTypeSerial): the fills complete,
  // their writes visible, before the user's kernel starts.
  for (const FillStep& fill : fills) {
    [encoder setComputePipelineState:fill.pipeline];
    [encoder setBuffer:fill.output offset:0 atIndex:0];
    [encoder setBytes:fill.element.data() length:fill.element.size() atIndex:1];
    [encoder setBytes:&fill.count length:sizeof(fill.count) atIndex:2];
    const NSUInteger width =
        std::min<NSUInteger>({fill.grid[0], [fill.pipeline maxTotalThreadsPerThreadgroup], 256});
    [encoder dispatchThreads:MTLSizeMake(fill.grid[0], fill.grid[1], 1)
        threadsPerThreadgroup:MTLSizeMake(width, 1, 1)];
  }
  [encoder setComputePipelineState:pipeline];
  for (size_t i = 0; i < launch.bindings.size(); ++i) {
    const InlineBytes bytes = InlineBytesOf(launch.bindings[i], launch.shape_params);
    if (bytes.data != nullptr) {
      // A shape, strides or ndim: a few bytes a dimension, copied into the command buffer
      // (setBytes takes up to 4 KB), so `launch` need not outlive the encoding.
      [encoder setBytes:bytes.data length:bytes.length atIndex:i];
    } else {
      [encoder setBuffer:buffers[i] offset:0 atIndex:i];
    }
  }
  // dispatchThreads, as MLX dispatches users' kernels: `grid` counts threads, and the
  // threadgroups at the far edges are cut to it (every Apple-silicon GPU has non-uniform
  // threadgroups).
  [encoder dispatchThreads:MTLSizeMake(launch.grid[0], launch.grid[1], launch.grid[2])
      threadsPerThreadgroup:MTLSizeMake(launch.threadgroup[0], launch.threadgroup[1],
                                        launch.threadgroup[2])];
  [encoder endEncoding];

  if (!wait) {
    // The kernel runs after the op has returned: a fault or a GPU timeout in it (a user's kernel
    // can loop forever) fails the next op of ours or check_errors(), rather than passing unseen.
    // Added before the commit, which may commit this very command buffer.
    metal::ReportFailureLater(stream, command_buffer, context);
    [stream commit];
    return;
  }
  [stream commitAndWait];
  outcome->error = metal::KernelFailure(command_buffer, context);
  if (!outcome->error.ok()) return;
  outcome->gpu_seconds = [command_buffer GPUEndTime] - [command_buffer GPUStartTime];
}

void ComputeOnGpu(const MetalKernelAttrs& attrs, TF_OpKernelContext* ctx) {
  MetalKernelLaunch launch;
  if (Error e = PrepareMetalKernelLaunch(attrs, ctx, &launch); !e.ok()) return FailKernel(ctx, e);
  const std::string context = MetalKernelContext(attrs);
  Error error;
  id<TF_MetalStream> stream = metal::GetMetalStream(ctx, context, &error);
  if (stream == nil) return FailKernel(ctx, error);
  dispatch_queue_t queue = [stream queue];
  if (queue == nil) {
    return FailKernel(ctx, Error::Internal(context + ": the GPU stream has no dispatch queue"));
  }
  // Read once: a switch from Python takes effect at the next op, never halfway through this one.
  const bool wait = GetCommitMode() == CommitMode::kCommitAndWait;
  EncodeOutcome outcome;
  // The block captures pointers to these locals: dispatch_sync returns only after it ran.
  const MetalKernelAttrs* attrs_ptr = &attrs;
  const MetalKernelLaunch* launch_ptr = &launch;
  EncodeOutcome* outcome_ptr = &outcome;
  dispatch_sync(queue, ^{
    // The calling TensorFlow thread has no autorelease pool of its own.
    @autoreleasepool {
      EncodeOnQueue(stream, *attrs_ptr, *launch_ptr, wait, outcome_ptr);
    }
  });
  if (!outcome.error.ok()) return FailKernel(ctx, outcome.error);
  if (outcome.gpu_seconds >= 0) {
    RecordKernelTiming({kMetalKernelOpName, attrs.kernel_name,
                        "grid " + SizeString(launch.grid), outcome.gpu_seconds});
  }
}

void Compute(void* kernel, TF_OpKernelContext* ctx) {
  @autoreleasepool {
    ComputeOnGpu(*static_cast<const MetalKernelAttrs*>(kernel), ctx);
  }
}

}  // namespace

namespace metal {

std::string RegisterMetalKernelForAppleStream() {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder =
      TF_NewKernelBuilder(kMetalKernelOpName, "GPU", &CreateMetalKernel, &Compute,
                          &DeleteMetalKernel);
  // Read on the host by metal_kernel_args.cc (the grid and the output shapes decide the
  // dispatch and the allocations before anything is encoded).
  TF_KernelBuilder_HostMemory(builder, "output_shapes");
  TF_KernelBuilder_HostMemory(builder, "grid");
  TF_RegisterKernelBuilder((std::string(kMetalKernelOpName) + "_GPU").c_str(), builder,
                           status.get());  // takes the builder
  return TF_GetCode(status.get()) == TF_OK ? "" : TF_Message(status.get());
}

}  // namespace metal
}  // namespace tf_metal_ops
