// GPU kernels of CustomLoss and CustomLossGrad for the GPU of Apple's tensorflow-metal (its
// TF_MetalStream), registered only when tf_metal_ops/gpu_plugin.py finds that plugin.
//
// The same structure as the CPU kernels (csrc/cpu/custom_loss_cpu.cc): attributes read once in
// create, inputs validated and the output allocated by the shared code in csrc/problem.cc, then
// the backend-specific part, which here encodes one compute dispatch on the plugin's command
// buffer. What is dispatched (kernel name, grid, threadgroup size and memory, which buffer at which
// index, the parameter bytes) comes entirely from gpu::PlanLaunch (csrc/metal/launch_plan.h), the
// same function the Linux emulator runs, so this file decides nothing about the geometry.
//
// Compiled with ARC: Objective-C objects are released by the compiler on every path, TensorFlow
// objects by the RAII owners of csrc/tf_c.h, so no early return leaks. Errors become TensorFlow
// errors naming the op; nothing here prints or aborts.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <dispatch/dispatch.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/metal/custom_loss_metal.h"
#include "csrc/metal/error_record_slots.h"
#include "csrc/metal/kernel_library.h"
#include "csrc/metal/launch_plan.h"
#include "csrc/metal/metal_kernel_metal.h"
#include "csrc/metal/metal_messages.h"
#include "csrc/metal/metal_stream.h"
#include "csrc/metal_kernel.h"
#include "csrc/pending_errors.h"
#include "csrc/problem.h"
#include "csrc/runtime.h"
#include "csrc/tf_c.h"
#include "kernels/custom_loss_params.h"

namespace tf_metal_ops {
namespace {

// The Metal buffers behind the op's tensors. On a tensorflow-metal device TF_TensorData is an
// id<MTLBuffer> handle (private storage, the tensor starting at offset 0), not a host pointer.
// __bridge: borrowed for this Compute call; the TensorPtr owners in CustomLossInputs keep the
// tensors alive until it returns, and the command buffer retains what it was given after that.
struct TensorBuffers {
  id<MTLBuffer> logits;
  id<MTLBuffer> labels;
  id<MTLBuffer> class_weights;  // nil when class_weights is empty ([0]: all ones)
  id<MTLBuffer> output;
  id<MTLBuffer> upstream;       // gradient op only
  id<MTLBuffer> row_stats;      // forward: written; gradient: read (nil when given none)
  id<MTLBuffer> row_scales;     // forward only; nil without them
  id<MTLBuffer> scaled_gradient;  // forward only; nil without row_scales
};

id<MTLBuffer> BufferOf(TF_Tensor* tensor) {
  if (tensor == nullptr || TF_TensorByteSize(tensor) == 0) return nil;
  return (__bridge id<MTLBuffer>)TF_TensorData(tensor);
}

// Everything the encoding block hands back, as values that outlive the block. Never the command
// buffer: it belongs to the stream and is replaced after a commit.
struct EncodeOutcome {
  Error error;
  id<MTLBuffer> error_record;  // the buffer the kernel wrote its CustomLossErrorRecord to
  NSUInteger record_offset = 0;  // where in it (a slot of the slab, commit mode)
  ErrorRecordSlots* slots = nullptr;  // the slab's slots, when the record is one of them
  int slot = -1;
  bool record_is_ours = false;  // true: a record for this call alone, read after the wait (or by
                                // the completion handler in commit mode)
  double gpu_seconds = -1.0;    // GPUEndTime - GPUStartTime, commit-and-wait mode only
};

Error MakeLaunchDesc(const CustomLossProblem& problem, gpu::LaunchDesc* desc) {
  switch (problem.attrs.logits_dtype) {
    case TF_FLOAT:
      desc->dtype = gpu::LogitsDtype::kFloat32;
      break;
    case TF_HALF:
      desc->dtype = gpu::LogitsDtype::kFloat16;
      break;
    case TF_BFLOAT16:
      desc->dtype = gpu::LogitsDtype::kBFloat16;
      break;
    default:
      // Not registered for other dtypes (MSL has no double), so TensorFlow never gets here.
      return Error::Internal(OpDescription(problem.attrs) + ": no Metal kernel for logits dtype " +
                             std::to_string(problem.attrs.logits_dtype));
  }
  desc->num_rows = problem.num_rows;
  desc->num_classes = problem.num_classes;
  desc->label_kind = problem.attrs.label_kind;
  desc->direction = problem.attrs.direction;
  desc->gamma = problem.attrs.gamma;
  desc->label_smoothing = problem.attrs.label_smoothing;
  desc->has_class_weights = problem.has_class_weights;
  desc->has_ignore_class = problem.attrs.has_ignore_class;
  desc->ignore_class = problem.attrs.ignore_class;
  desc->variant = gpu::KernelVariant::kAuto;
  // The forward always writes row_stats (12 bytes a row); the gradient reads them when given.
  const bool forward = problem.attrs.direction == Direction::kForward;
  desc->has_row_stats = forward || problem.has_row_stats;
  desc->has_row_scales = forward && problem.has_row_scales;
  return Error::Ok();
}

// The buffer to bind for `role`. An empty class_weights tensor may have no Metal buffer at all,
// and Metal's validation layer rejects a kernel argument left unbound, so the logits buffer
// stands in: the kernel never reads index TFMO_BUFFER_CLASS_WEIGHTS when has_class_weights == 0,
// and both bindings only read, so the alias creates no hazard. The same for row_scales and a
// gradient's row_stats when there are none (the params say so; never read), and the output
// stands in for a scaled gradient that is not made (never written). A scaled gradient TensorFlow
// forwarded from the logits is the logits' buffer itself (ForwardLogitsOrAllocate), which
// the kernels write in place.
id<MTLBuffer> BufferForRole(gpu::BufferRole role, const TensorBuffers& tensors,
                            id<MTLBuffer> error_record) {
  switch (role) {
    case gpu::BufferRole::kLogits: return tensors.logits;
    case gpu::BufferRole::kLabels: return tensors.labels;
    case gpu::BufferRole::kClassWeights:
      return tensors.class_weights != nil ? tensors.class_weights : tensors.logits;
    case gpu::BufferRole::kErrorRecord: return error_record;
    case gpu::BufferRole::kOutput: return tensors.output;
    case gpu::BufferRole::kUpstream: return tensors.upstream;
    case gpu::BufferRole::kRowScales:
      return tensors.row_scales != nil ? tensors.row_scales : tensors.logits;
    case gpu::BufferRole::kRowStats:
      return tensors.row_stats != nil ? tensors.row_stats : tensors.logits;
    case gpu::BufferRole::kScaledGradient:
      return tensors.scaled_gradient != nil ? tensors.scaled_gradient : tensors.output;
    case gpu::BufferRole::kParams: return nil;  // bytes, not a buffer
  }
  return nil;
}


// Runs on the stream's serial queue (inside dispatch_sync): must not dispatch_sync onto it again.
// Every step that can fail comes before the compute encoder is created, so no failure leaves an
// encoder open on the plugin's command buffer: Metal refuses to commit a command buffer whose
// encoder was never ended, which would break the plugin's next commit, not just this op.
void EncodeOnQueue(id<TF_MetalStream> stream, const CustomLossProblem& problem,
                   const gpu::LaunchDesc& desc, const TensorBuffers& tensors, bool wait,
                   const std::string& context, EncodeOutcome* outcome) {
  Error error;
  id<MTLCommandBuffer> command_buffer =
      metal::CommandBufferForEncoding(stream, wait, context, &error);
  if (command_buffer == nil) {
    outcome->error = error;
    return;
  }
  id<MTLDevice> device = [command_buffer device];

  const std::string kernel_name = gpu::KernelName(desc);
  // Built (or the library compiled) on first use, here on the queue: the device is known only
  // from the command buffer, and a pipeline must come from the device that runs it.
  id<MTLComputePipelineState> pipeline = metal::GetComputePipeline(device, kernel_name, &error);
  if (pipeline == nil) {
    outcome->error = Error{error.code, context + ": " + error.message};
    return;
  }
  gpu::PipelineLimits limits;
  limits.max_total_threads_per_threadgroup =
      static_cast<uint32_t>([pipeline maxTotalThreadsPerThreadgroup]);
  limits.thread_execution_width = static_cast<uint32_t>([pipeline threadExecutionWidth]);
  const gpu::LaunchPlan plan = gpu::PlanLaunch(desc, limits);
  if (!plan.ok) {
    outcome->error = Error::Internal(context + ": no launch plan for " + kernel_name + ": " +
                                     plan.error);
    return;
  }
  if (!plan.dispatch) return;  // nothing to run (N == 0 is handled before; kept for safety)

  // Only sparse labels can be out of range: dense ones have no record to read.
  if (desc.label_kind != LabelKind::kDense) {
    // A record for this call alone, read after the wait (commit-and-wait) or by the completion
    // handler below (commit), so it must not be shared with launches still running. Shared
    // storage: the CPU reads what the GPU wrote without a copy. Commit mode takes a slot of the
    // device's slab (error_record_slots.h: no allocation per op); commit-and-wait mode, and
    // commit mode when every slot is in use, a fresh 32-byte buffer (newBufferWithLength:
    // zero-fills; Init sets the "no row" sentinel).
    if (!wait) {
      ErrorRecordSlots* slots = nullptr;
      id<MTLBuffer> slab = metal::GetErrorRecordSlab(device, &slots, &error);
      if (slab == nil) {
        outcome->error = Error{error.code, context + ": " + error.message};
        return;
      }
      const int slot = slots->Acquire(static_cast<CustomLossErrorRecord*>([slab contents]));
      if (slot >= 0) {
        outcome->error_record = slab;
        outcome->record_offset = static_cast<NSUInteger>(slot) * sizeof(CustomLossErrorRecord);
        outcome->slots = slots;
        outcome->slot = slot;
      }
    }
    if (outcome->error_record == nil) {
      outcome->error_record = [device newBufferWithLength:sizeof(CustomLossErrorRecord)
                                                  options:MTLResourceStorageModeShared];
      if (outcome->error_record == nil) {
        outcome->error = Error::Internal(context + ": allocating the error-record buffer failed");
        return;
      }
      InitCustomLossErrorRecord(
          static_cast<CustomLossErrorRecord*>([outcome->error_record contents]));
    }
    outcome->record_is_ours = true;
  } else {
    // Dense labels: nobody reads this record, so the kernels write into a shared sink instead of
    // a per-call allocation.
    outcome->error_record = metal::GetDiscardedErrorRecord(device, &error);
    if (outcome->error_record == nil) {
      outcome->error = Error{error.code, context + ": " + error.message};
      return;
    }
  }
  // A slot taken above goes back at once when nothing is encoded after all (no handler will).
  auto release_unused_slot = [outcome] {
    if (outcome->slots == nullptr) return;
    outcome->slots->Release(
        static_cast<const CustomLossErrorRecord*>([outcome->error_record contents]), outcome->slot);
    outcome->slots = nullptr;
  };
  for (const gpu::BufferBinding& binding : plan.bindings) {
    if (binding.inline_bytes) continue;
    if (BufferForRole(binding.role, tensors, outcome->error_record) == nil) {
      release_unused_slot();
      outcome->error = Error::Internal(context + ": no Metal buffer for " +
                                       gpu::BufferRoleName(binding.role) + " (buffer " +
                                       std::to_string(binding.index) + ")");
      return;
    }
  }

  id<MTLComputeCommandEncoder> encoder = [command_buffer computeCommandEncoder];
  if (encoder == nil) {
    release_unused_slot();
    outcome->error = Error::Internal(context + ": the command buffer gave no compute encoder");
    return;
  }
  [encoder setComputePipelineState:pipeline];
  for (const gpu::BufferBinding& binding : plan.bindings) {
    if (binding.inline_bytes) {
      // The parameter struct is 56 bytes: setBytes copies it into the command buffer (fine below
      // 4 KB), so `plan` need not outlive the encoding.
      [encoder setBytes:&plan.params length:binding.length atIndex:binding.index];
    } else {
      const bool record = binding.role == gpu::BufferRole::kErrorRecord;
      [encoder setBuffer:BufferForRole(binding.role, tensors, outcome->error_record)
                  offset:record ? outcome->record_offset : 0
                 atIndex:binding.index];
    }
  }
  if (plan.threadgroup_memory_length > 0) {
    [encoder setThreadgroupMemoryLength:plan.threadgroup_memory_length
                                atIndex:TFMO_THREADGROUP_SCRATCH];
  }
  [encoder dispatchThreadgroups:MTLSizeMake(plan.threadgroups_per_grid[0],
                                            plan.threadgroups_per_grid[1],
                                            plan.threadgroups_per_grid[2])
          threadsPerThreadgroup:MTLSizeMake(plan.threads_per_threadgroup[0],
                                            plan.threads_per_threadgroup[1],
                                            plan.threads_per_threadgroup[2])];
  [encoder endEncoding];

  if (!wait) {
    const std::string failed_launch = context + " (the Metal kernel " + kernel_name + ")";
    if (outcome->record_is_ours) {
      // Reads the record once the GPU is done with it, frees its slot, and leaves any error for
      // the next op or check_errors() (csrc/pending_errors.h). Added before [stream commit],
      // which may commit this very command buffer; Metal allows handlers only until then. The
      // block keeps the record's buffer and a copy of the problem (for the message) alive until
      // Metal releases it after running it. A command buffer that failed (a fault, a GPU
      // timeout) is reported as that failure, as a user kernel's is; its record may be
      // incomplete, so the record is not read, but its slot is freed.
      // The launch is outstanding (pending_errors.h) until the handler has run: check_errors()
      // commits this stream's command buffer (metal_stream.h) and waits for that.
      id<MTLBuffer> buffer = outcome->error_record;
      ErrorRecordSlots* slots = outcome->slots;  // the device's, never destroyed
      const int slot = outcome->slot;
      const CustomLossProblem report_for = problem;  // the block keeps its own copy
      metal::RememberStream(stream);
      const uint64_t ticket = BeginOutstandingLaunch();
      [command_buffer addCompletedHandler:^(id<MTLCommandBuffer> done) {
        const auto* records = static_cast<const CustomLossErrorRecord*>([buffer contents]);
        const CustomLossErrorRecord record =
            slots != nullptr ? slots->Release(records, slot) : records[0];
        if ([done status] == MTLCommandBufferStatusCompleted) {
          ReportCompletedErrorRecord(report_for, &record, sizeof(record));
        } else {
          RecordDeferredGpuError(metal::KernelFailure(done, failed_launch));
        }
        FinishOutstandingLaunch(ticket);
      }];
    } else {
      // Dense labels have no record to read; a failed command buffer is still reported.
      metal::ReportFailureLater(stream, command_buffer, failed_launch);
    }
    [stream commit];
    return;
  }
  [stream commitAndWait];
  // After commitAndWait the buffer we encoded into has completed or failed; read its outcome here,
  // while we may still touch it.
  const MTLCommandBufferStatus status = [command_buffer status];
  if (status != MTLCommandBufferStatusCompleted) {
    outcome->error = Error::Internal(context + ": the Metal kernel " + kernel_name +
                                     " failed on the GPU (command buffer " +
                                     metal::StatusName(status) +
                                     "): " + metal::Describe([command_buffer error]));
    return;
  }
  outcome->gpu_seconds = [command_buffer GPUEndTime] - [command_buffer GPUStartTime];
}

// Copies the label of `row` out of the (GPU-private) labels buffer. Used only to report a bad
// label exactly as the CPU does, in commit-and-wait mode, on the error path. Runs its own
// dispatch_sync after the encoding one has returned (sequential, never nested).
bool ReadLabelOnStream(id<TF_MetalStream> stream, id<MTLBuffer> labels, int64_t row,
                       size_t label_size, int64_t* label) {
  __block bool ok = false;
  __block int64_t value = 0;
  // The blit offset must be a multiple of 4 on macOS: rows of 4- or 8-byte labels are.
  const NSUInteger offset = static_cast<NSUInteger>(row) * label_size;
  dispatch_sync([stream queue], ^{
    @autoreleasepool {
      id<MTLCommandBuffer> command_buffer = [stream currentCommandBuffer];
      if (command_buffer == nil) return;
      id<MTLBuffer> readback = [[command_buffer device] newBufferWithLength:sizeof(int64_t)
                                                                    options:MTLResourceStorageModeShared];
      if (readback == nil) return;
      id<MTLBlitCommandEncoder> blit = [command_buffer blitCommandEncoder];
      if (blit == nil) return;
      [blit copyFromBuffer:labels
              sourceOffset:offset
                  toBuffer:readback
         destinationOffset:0
                      size:label_size];
      [blit endEncoding];
      [stream commitAndWait];
      if ([command_buffer status] != MTLCommandBufferStatusCompleted) return;
      if (label_size == sizeof(int32_t)) {
        int32_t narrow = 0;
        std::memcpy(&narrow, [readback contents], sizeof(narrow));
        value = narrow;
      } else {
        std::memcpy(&value, [readback contents], sizeof(value));
      }
      ok = true;
    }
  });
  if (ok) *label = value;
  return ok;
}

// The error the CPU kernel raises for the same input, from the record the GPU kernel wrote. The
// CPU names the lowest bad row; the record always has that row (min_bad_row, an atomic minimum),
// but its label only when that row also won the detail slot; otherwise one more round trip reads
// it. If even that fails, the claimed (row, label) pair is still a true bad label to report.
Error BadLabelFromRecord(const CustomLossProblem& problem, const CustomLossErrorRecord& record,
                         id<TF_MetalStream> stream, id<MTLBuffer> labels) {
  if (!CustomLossErrorRecordHasError(record)) return Error::Ok();
  const uint32_t lowest = record.words[TFMO_ERROR_MIN_BAD_ROW];
  const int64_t claimed_row = record.words[TFMO_ERROR_DETAIL_ROW];
  const int64_t claimed_label = CustomLossErrorRecordLabel(record);
  if (lowest == TFMO_ERROR_NO_ROW || lowest == claimed_row) {
    return BadLabelError(problem, claimed_row, claimed_label);
  }
  const size_t label_size =
      problem.attrs.label_kind == LabelKind::kSparseInt64 ? sizeof(int64_t) : sizeof(int32_t);
  int64_t label = 0;
  if (ReadLabelOnStream(stream, labels, lowest, label_size, &label)) {
    return BadLabelError(problem, lowest, label);
  }
  return BadLabelError(problem, claimed_row, claimed_label);
}

void ComputeOnGpu(const CustomLossAttrs& attrs, TF_OpKernelContext* ctx) {
  CustomLossInputs inputs;
  CustomLossProblem problem;
  if (Error e = DescribeProblem(ctx, attrs, &inputs, &problem); !e.ok()) {
    return FailKernel(ctx, e);
  }
  TensorPtr out;
  if (Error e = AllocateOutput(ctx, problem, &out); !e.ok()) return FailKernel(ctx, e);
  // The forward writes row statistics (problem.h) for the gradient, and given row_scales the
  // scaled gradient of a reduced loss, so that its backward needs no gradient op.
  TensorPtr stats;
  TensorPtr scaled_gradient;
  if (problem.attrs.direction == Direction::kForward) {
    if (Error e = AllocateRowStats(ctx, problem, /*filled=*/true, &stats); !e.ok()) {
      return FailKernel(ctx, e);
    }
    Error e = problem.has_row_scales
                  ? ForwardLogitsOrAllocate(ctx, problem, kScaledGradientOutput, &inputs,
                                            &scaled_gradient)
                  : AllocateNoScaledGradient(ctx, problem);
    if (!e.ok()) return FailKernel(ctx, e);
  }
  // No rows: the (empty) output is complete and nothing is encoded, not even an empty dispatch.
  if (problem.num_rows == 0) return;

  gpu::LaunchDesc desc;
  if (Error e = MakeLaunchDesc(problem, &desc); !e.ok()) return FailKernel(ctx, e);
  const std::string op = OpDescription(problem.attrs);
  const std::string context = op + " with logits shape " + ShapeString(problem.logits_dims);

  Error error;
  id<TF_MetalStream> stream = metal::GetMetalStream(ctx, op, &error);
  if (stream == nil) return FailKernel(ctx, error);
  dispatch_queue_t queue = [stream queue];
  if (queue == nil) {
    return FailKernel(ctx, Error::Internal(op + ": the GPU stream has no dispatch queue"));
  }

  TensorBuffers tensors;
  tensors.logits = BufferOf(inputs.logits.get());
  tensors.labels = BufferOf(inputs.labels.get());
  tensors.class_weights = problem.has_class_weights ? BufferOf(inputs.class_weights.get()) : nil;
  tensors.output = BufferOf(out.get());
  tensors.upstream = inputs.upstream ? BufferOf(inputs.upstream.get()) : nil;
  if (problem.attrs.direction == Direction::kForward) {
    tensors.row_stats = BufferOf(stats.get());
    tensors.row_scales = problem.has_row_scales ? BufferOf(inputs.row_scales.get()) : nil;
    tensors.scaled_gradient = problem.has_row_scales ? BufferOf(scaled_gradient.get()) : nil;
  } else {
    tensors.row_stats = problem.has_row_stats ? BufferOf(inputs.row_stats.get()) : nil;
  }

  // Read once: a switch from Python takes effect at the next op, never halfway through this one.
  const bool wait = GetCommitMode() == CommitMode::kCommitAndWait;
  EncodeOutcome outcome;
  // The block captures pointers to these locals: dispatch_sync returns only after the block ran,
  // so they outlive it, and nothing is copied.
  const CustomLossProblem* problem_ptr = &problem;
  const gpu::LaunchDesc* desc_ptr = &desc;
  const TensorBuffers* tensors_ptr = &tensors;
  const std::string* context_ptr = &context;
  EncodeOutcome* outcome_ptr = &outcome;
  dispatch_sync(queue, ^{
    // dispatch_sync usually runs the block on the calling TensorFlow thread, which has no
    // autorelease pool of its own: drain what the Metal calls autorelease right here.
    @autoreleasepool {
      EncodeOnQueue(stream, *problem_ptr, *desc_ptr, *tensors_ptr, wait, *context_ptr,
                    outcome_ptr);
    }
  });
  if (!outcome.error.ok()) return FailKernel(ctx, outcome.error);
  if (!wait) return;

  if (outcome.gpu_seconds >= 0) {
    RecordKernelTiming({problem.attrs.direction == Direction::kForward ? kForwardOpName
                                                                       : kGradientOpName,
                        gpu::KernelName(desc), ShapeString(problem.logits_dims),
                        outcome.gpu_seconds});
  }
  if (outcome.record_is_ours) {
    // Shared storage and the kernel has completed (commitAndWait): the CPU sees its writes.
    CustomLossErrorRecord record;
    std::memcpy(&record, [outcome.error_record contents], sizeof(record));
    if (Error e = BadLabelFromRecord(problem, record, stream, tensors.labels); !e.ok()) {
      return FailKernel(ctx, e);
    }
  }
}

void Compute(void* kernel, TF_OpKernelContext* ctx) {
  @autoreleasepool {
    ComputeOnGpu(*static_cast<const CustomLossAttrs*>(kernel), ctx);
  }
}

// Registration runs once the Python gate asks for it (RegisterGpuKernelsForAppleStream); its
// outcome is kept for KernelRegistrationErrors().
std::mutex& RegistrationMutex() {
  static std::mutex* mutex = new std::mutex();
  return *mutex;
}
std::vector<std::string>& RegistrationErrors() {
  static auto* errors = new std::vector<std::string>();
  return *errors;
}
std::vector<std::string>& RegisteredDtypes() {
  static auto* dtypes = new std::vector<std::string>();
  return *dtypes;
}

struct GpuDtype {
  TF_DataType dtype;
  const char* name;
};

void RegisterGpuKernel(const char* op_name, void* (*create)(TF_OpKernelConstruction*),
                       const GpuDtype& type) {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder = TF_NewKernelBuilder(op_name, "GPU", create, &Compute, &DeleteKernel);
  // One registration per logits dtype: TensorFlow then places other dtypes (float64) on the CPU.
  // Tlabels is left free: int32, int64 and dense labels all have kernels.
  TF_KernelBuilder_TypeConstraint(builder, "T", type.dtype, status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    const std::string message = TF_Message(status.get());
    TF_DeleteKernelBuilder(builder);  // not registered, so still ours to delete
    std::lock_guard<std::mutex> lock(RegistrationMutex());
    RegistrationErrors().push_back(std::string(op_name) + " for " + type.name + ": " + message);
    return;
  }
  const std::string kernel_name = std::string(op_name) + "_GPU_" + type.name;
  TF_RegisterKernelBuilder(kernel_name.c_str(), builder, status.get());  // takes the builder
  std::lock_guard<std::mutex> lock(RegistrationMutex());
  if (TF_GetCode(status.get()) != TF_OK) {
    RegistrationErrors().push_back(std::string(op_name) + " for " + type.name + ": " +
                                   TF_Message(status.get()));
  }
}

// Set once the gate (tf_metal_ops/gpu_plugin.py) accepted Apple's plugin and the kernels were
// registered; GetMetalStream refuses any stream while it is false.
std::atomic<bool>& AppleStreamAccepted() {
  static auto* accepted = new std::atomic<bool>(false);
  return *accepted;
}

void RegisterGpuKernels() {
  std::vector<GpuDtype> dtypes = {{TF_FLOAT, "float"}, {TF_HALF, "half"}};
  // MSL's bfloat arrived with Metal 3.1 (macOS 14): on older systems the library has no bf16
  // kernels, and registering none lets TensorFlow run bfloat16 logits on the CPU instead of
  // failing on the GPU.
  if (@available(macOS 14.0, *)) dtypes.push_back({TF_BFLOAT16, "bfloat16"});
  for (const GpuDtype& type : dtypes) {
    RegisterGpuKernel(kForwardOpName, &CreateForwardKernel, type);
    RegisterGpuKernel(kGradientOpName, &CreateGradientKernel, type);
    std::lock_guard<std::mutex> lock(RegistrationMutex());
    RegisteredDtypes().push_back(type.name);
  }
  // Users' kernels (tf_metal_ops.metal_kernel): behind the same gate, for the same reason.
  if (std::string e = metal::RegisterMetalKernelForAppleStream(); !e.empty()) {
    std::lock_guard<std::mutex> lock(RegistrationMutex());
    RegistrationErrors().push_back(std::string(kMetalKernelOpName) + ": " + e);
  }
}

}  // namespace

namespace metal {

void RegisterGpuKernelsForAppleStream() {
  // A function-local static: registered once, however often and from however many threads
  // Python asks.
  [[maybe_unused]] static const bool registered = (RegisterGpuKernels(), true);
  AppleStreamAccepted().store(true);
}

bool GpuKernelsRegistered() { return AppleStreamAccepted().load(); }

std::vector<std::string> KernelRegistrationErrors() {
  std::lock_guard<std::mutex> lock(RegistrationMutex());
  return RegistrationErrors();
}

std::vector<std::string> RegisteredGpuDtypes() {
  std::lock_guard<std::mutex> lock(RegistrationMutex());
  return RegisteredDtypes();
}

}  // namespace metal
}  // namespace tf_metal_ops
