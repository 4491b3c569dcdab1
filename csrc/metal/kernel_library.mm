// See kernel_library.h. Compiled with ARC (-fobjc-arc): every Objective-C object below, including
// those held in C++ containers, is released by the compiler, so no error path can leak one.
#import "csrc/metal/kernel_library.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "csrc/metal/kernel_source.h"
#include "csrc/metal/metal_messages.h"
#include "csrc/metal/per_device.h"
#include "kernels/custom_loss_params.h"

// Which form of the kernel library setup.py installed: "precompiled" (a .metallib) or "source".
// Only quoted in messages: the loader tries the .metallib first and the source second either way.
#ifndef TF_METAL_OPS_KERNEL_LIBRARY
#define TF_METAL_OPS_KERNEL_LIBRARY "source"
#endif

namespace tf_metal_ops {
namespace metal {
namespace {

struct DeviceKernels {
  id<MTLDevice> device;
  bool library_attempted = false;
  Error library_error;  // why `library` is nil, once attempted
  id<MTLLibrary> library;
  std::string library_origin = "not loaded";
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;
  id<MTLBuffer> discarded_error_record;
  id<MTLBuffer> error_record_slab;
  std::unique_ptr<ErrorRecordSlots> error_record_slots;  // never destroyed, like the entry
};

// The cache and its lock are created once and never destroyed: kernels may still run on
// TensorFlow's threads while the process exits, and releasing Metal objects from static
// destructors after Metal itself has been torn down is not safe.
std::mutex& CacheMutex() {
  static std::mutex* mutex = new std::mutex();
  return *mutex;
}

NSString* ToNSString(const std::string& text) {
  // nil for text that is not UTF-8; callers check.
  return [NSString stringWithUTF8String:text.c_str()];
}

// The directory holding this native library (_tf_metal_ops.*.so). dladdr maps the address of any
// function to the image that contains it; its dli_fname is the path the image was loaded from.
bool NativeLibraryDirectory(std::string* directory, Error* error) {
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&NativeLibraryDirectory), &info) == 0 ||
      info.dli_fname == nullptr) {
    *error = Error::Internal(
        "tf_metal_ops: dladdr cannot find the path of the native library, so the Metal kernel "
        "library next to it cannot be located");
    return false;
  }
  *directory = DirectoryOf(info.dli_fname);
  return true;
}

id<MTLLibrary> LoadPrecompiled(id<MTLDevice> device, const std::string& path, std::string* why) {
  NSString* ns_path = ToNSString(path);
  if (ns_path == nil) {
    *why = "the path " + path + " is not UTF-8";
    return nil;
  }
  // fileURLWithPath: (not URLWithString:) so that spaces, '#' or '%' in the path are taken
  // literally instead of being parsed as URL syntax.
  NSURL* url = [NSURL fileURLWithPath:ns_path];
  NSError* ns_error = nil;
  id<MTLLibrary> library = [device newLibraryWithURL:url error:&ns_error];
  if (library == nil) *why = "loading " + path + " failed: " + Describe(ns_error);
  return library;
}

id<MTLLibrary> CompileSource(id<MTLDevice> device, const std::string& path, std::string* why) {
  std::string source;
  std::string read_error;
  if (!AssembleKernelSource(path, &source, &read_error)) {
    *why = "reading the kernel source failed: " + read_error;
    return nil;
  }
  std::string compile_error;
  id<MTLLibrary> library = CompileWithSafeMath(device, source, &compile_error);
  if (library == nil) *why = "compiling " + path + " failed: " + compile_error;
  return library;
}

void LoadLibrary(DeviceKernels* entry) {
  entry->library_attempted = true;
  std::string directory;
  if (!NativeLibraryDirectory(&directory, &entry->library_error)) return;
  const KernelFiles files = FindKernelFiles(directory);

  std::string failures;
  if (!files.metallib.empty()) {
    std::string why;
    entry->library = LoadPrecompiled(entry->device, files.metallib, &why);
    if (entry->library != nil) {
      entry->library_origin = "precompiled " + files.metallib;
      return;
    }
    failures += why + "; ";
  }
  if (!files.source.empty()) {
    std::string why;
    entry->library = CompileSource(entry->device, files.source, &why);
    if (entry->library != nil) {
      entry->library_origin = "compiled from " + files.source;
      return;
    }
    failures += why + "; ";
  }
  std::string searched;
  for (const std::string& path : files.searched) searched += (searched.empty() ? "" : ", ") + path;
  entry->library_error = Error::Internal(
      "tf_metal_ops: cannot load the Metal kernel library (this build installed the " +
      std::string(TF_METAL_OPS_KERNEL_LIBRARY) + " form). " + failures + "looked for: " + searched +
      ". Reinstall tf_metal_ops, or run the op on the CPU with tf.device('/CPU:0').");
}

}  // namespace

id<MTLLibrary> CompileWithSafeMath(id<MTLDevice> device, const std::string& source,
                                   std::string* why) {
  NSString* text = ToNSString(source);
  if (text == nil) {
    *why = "the source is not UTF-8";
    return nil;
  }
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  // `mathMode` replaces `fastMathEnabled` from macOS 15 on; older systems only know the latter.
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
  } else {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
    options.fastMathEnabled = NO;
#pragma clang diagnostic pop
  }
  NSError* ns_error = nil;
  // A library can come back together with an NSError that only carries warnings: nil is the
  // failure signal, not the error.
  id<MTLLibrary> library = [device newLibraryWithSource:text options:options error:&ns_error];
  if (library == nil) *why = Describe(ns_error);
  return library;
}

id<MTLComputePipelineState> NewComputePipeline(id<MTLDevice> device, id<MTLLibrary> library,
                                               const std::string& kernel_name, bool* missing,
                                               std::string* why) {
  NSString* name = ToNSString(kernel_name);
  id<MTLFunction> function = name != nil ? [library newFunctionWithName:name] : nil;
  *missing = function == nil;
  if (function == nil) {
    *why = "no kernel named '" + kernel_name + "'";
    return nil;
  }
  NSError* ns_error = nil;
  id<MTLComputePipelineState> pipeline =
      [device newComputePipelineStateWithFunction:function error:&ns_error];
  if (pipeline == nil) {
    *why = "building the compute pipeline of '" + kernel_name + "' failed: " + Describe(ns_error);
  }
  return pipeline;
}

id<MTLComputePipelineState> GetComputePipeline(id<MTLDevice> device, const std::string& kernel_name,
                                               Error* error) {
  if (device == nil) {
    *error = NoMetalDevice();
    return nil;
  }
  // Held while the library compiles or a pipeline is built: other threads would only build the
  // same objects again. This lock is never held while waiting for a stream's queue, so it cannot
  // take part in a deadlock with it.
  std::lock_guard<std::mutex> lock(CacheMutex());
  DeviceKernels& entry = EntryForDevice<DeviceKernels>(device);
  if (!entry.library_attempted) LoadLibrary(&entry);
  if (entry.library == nil) {
    *error = entry.library_error;
    return nil;
  }
  const auto found = entry.pipelines.find(kernel_name);
  if (found != entry.pipelines.end()) return found->second;

  bool missing = false;
  std::string why;
  id<MTLComputePipelineState> pipeline =
      NewComputePipeline(device, entry.library, kernel_name, &missing, &why);
  if (pipeline == nil && missing) {
    std::string hint;
    if (kernel_name.find("_bf16_") != std::string::npos) {
      hint = " (bfloat16 kernels need Metal Shading Language 3.1, macOS 14 or later; cast the "
             "logits to float32 or float16)";
    }
    *error = Error::Internal("tf_metal_ops: the Metal kernel library (" + entry.library_origin +
                             ") has " + why + hint);
    return nil;
  }
  if (pipeline == nil) {
    *error = Error::Internal("tf_metal_ops: " + why);
    return nil;
  }
  entry.pipelines.emplace(kernel_name, pipeline);
  return pipeline;
}

id<MTLBuffer> GetDiscardedErrorRecord(id<MTLDevice> device, Error* error) {
  if (device == nil) {
    *error = NoMetalDevice();
    return nil;
  }
  std::lock_guard<std::mutex> lock(CacheMutex());
  DeviceKernels& entry = EntryForDevice<DeviceKernels>(device);
  if (entry.discarded_error_record == nil) {
    id<MTLBuffer> buffer = NewUntrackedSharedBuffer(device, sizeof(CustomLossErrorRecord),
                                                    "a discarded error record", error);
    if (buffer == nil) return nil;
    InitCustomLossErrorRecord(static_cast<CustomLossErrorRecord*>([buffer contents]));
    entry.discarded_error_record = buffer;
  }
  return entry.discarded_error_record;
}

id<MTLBuffer> GetErrorRecordSlab(id<MTLDevice> device, ErrorRecordSlots** slots, Error* error) {
  if (device == nil) {
    *error = NoMetalDevice();
    return nil;
  }
  std::lock_guard<std::mutex> lock(CacheMutex());
  DeviceKernels& entry = EntryForDevice<DeviceKernels>(device);
  if (entry.error_record_slab == nil) {
    const size_t length = sizeof(CustomLossErrorRecord) * ErrorRecordSlots::kCapacity;
    // Untracked: each launch writes only the slot it was given, which no other launch touches
    // until the completion handler has freed it.
    id<MTLBuffer> buffer = NewUntrackedSharedBuffer(device, length, "error records", error);
    if (buffer == nil) return nil;
    entry.error_record_slab = buffer;
    entry.error_record_slots = std::make_unique<ErrorRecordSlots>(ErrorRecordSlots::kCapacity);
  }
  *slots = entry.error_record_slots.get();
  return entry.error_record_slab;
}

}  // namespace metal
}  // namespace tf_metal_ops
