// See user_kernel_library.h. Compiled with ARC: the Metal objects in the cache below are
// released by the compiler (never, in practice: the cache lives as long as the process).
#import "csrc/metal/user_kernel_library.h"

#include <mutex>
#include <unordered_map>
#include <utility>

#include "csrc/metal/fill_kernel_source.h"
#include "csrc/metal/kernel_library.h"
#include "csrc/metal/metal_messages.h"
#include "csrc/metal/per_device.h"

namespace tf_metal_ops {
namespace metal {
namespace {

// One compile of one source: its pipeline, or why there is none.
struct CompiledKernel {
  id<MTLComputePipelineState> pipeline;
  Error error;
};

struct DeviceUserKernels {
  id<MTLDevice> device;
  // Keyed by the full source text and the kernel name: equal keys are the same program, so a
  // hash collision cannot hand one user's kernel to another.
  std::unordered_map<std::string, CompiledKernel> kernels;
  bool fill_attempted = false;
  Error fill_error;
  id<MTLComputePipelineState> fill[4];  // 8, 16, 32, 64-bit elements
  id<MTLBuffer> placeholder;
};

// Never destroyed, like the entries (per_device.h says why).
std::mutex& CacheMutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

// Compiles `source` with safe math; nil with `*error` set to the compiler's message.
id<MTLLibrary> CompileLibrary(id<MTLDevice> device, const std::string& source, Error* error) {
  std::string why;
  id<MTLLibrary> library = CompileWithSafeMath(device, source, &why);
  if (library == nil) {
    *error = Error::InvalidArgument("the Metal compiler rejected the source:\n" + why);
  }
  return library;
}

id<MTLComputePipelineState> BuildPipeline(id<MTLDevice> device, id<MTLLibrary> library,
                                          const std::string& kernel_name, Error* error) {
  bool missing = false;
  std::string why;
  id<MTLComputePipelineState> pipeline =
      NewComputePipeline(device, library, kernel_name, &missing, &why);
  if (pipeline == nil) {
    *error = Error::InvalidArgument(missing ? "the compiled source has " + why : why);
  }
  return pipeline;
}

}  // namespace

id<MTLComputePipelineState> GetUserKernelPipeline(id<MTLDevice> device, const std::string& source,
                                                  const std::string& kernel_name, Error* error) {
  if (device == nil) {
    *error = NoMetalDevice();
    return nil;
  }
  // Held while compiling: another thread asking for the same source waits for this compile
  // instead of starting its own.
  std::lock_guard<std::mutex> lock(CacheMutex());
  DeviceUserKernels& entry = EntryForDevice<DeviceUserKernels>(device);
  std::string key = kernel_name;
  key.push_back('\0');  // no kernel name holds a NUL, so (name, source) pairs map one-to-one
  key += source;
  auto found = entry.kernels.find(key);
  if (found == entry.kernels.end()) {
    CompiledKernel compiled;
    id<MTLLibrary> library = CompileLibrary(device, source, &compiled.error);
    if (library != nil) {
      compiled.pipeline = BuildPipeline(device, library, kernel_name, &compiled.error);
    }
    found = entry.kernels.emplace(std::move(key), std::move(compiled)).first;
  }
  if (found->second.pipeline == nil) *error = found->second.error;
  return found->second.pipeline;
}

id<MTLComputePipelineState> GetFillPipeline(id<MTLDevice> device, size_t element_size,
                                            Error* error) {
  if (device == nil) {
    *error = NoMetalDevice();
    return nil;
  }
  int slot = -1;
  switch (element_size) {
    case 1: slot = 0; break;
    case 2: slot = 1; break;
    case 4: slot = 2; break;
    case 8: slot = 3; break;
    default:
      *error = Error::Internal("tf_metal_ops: no fill kernel for " +
                               std::to_string(element_size) + "-byte elements");
      return nil;
  }
  std::lock_guard<std::mutex> lock(CacheMutex());
  DeviceUserKernels& entry = EntryForDevice<DeviceUserKernels>(device);
  if (!entry.fill_attempted) {
    entry.fill_attempted = true;
    id<MTLLibrary> library = CompileLibrary(device, kFillKernelSource, &entry.fill_error);
    for (int i = 0; i < 4 && library != nil && entry.fill_error.ok(); ++i) {
      const std::string name = std::string(kFillKernelPrefix) + std::to_string(8 << i);
      entry.fill[i] = BuildPipeline(device, library, name, &entry.fill_error);
    }
    if (!entry.fill_error.ok()) {
      // Ours, not the user's: an internal error, whatever the compiler said.
      entry.fill_error = Error::Internal("tf_metal_ops: the init_value fill kernels: " +
                                         entry.fill_error.message);
    }
  }
  if (entry.fill[slot] == nil) *error = entry.fill_error;
  return entry.fill[slot];
}

id<MTLBuffer> GetPlaceholderBuffer(id<MTLDevice> device, Error* error) {
  if (device == nil) {
    *error = NoMetalDevice();
    return nil;
  }
  std::lock_guard<std::mutex> lock(CacheMutex());
  DeviceUserKernels& entry = EntryForDevice<DeviceUserKernels>(device);
  if (entry.placeholder == nil) {
    // Nothing reads or writes it: a valid buffer to bind for an empty tensor.
    entry.placeholder = NewUntrackedSharedBuffer(device, 16, "an empty tensor's placeholder",
                                                 error);
  }
  return entry.placeholder;
}

}  // namespace metal
}  // namespace tf_metal_ops
