// Per-device caches: the one entry of type `Entry` (a struct with an `id<MTLDevice> device`
// member) for a Metal device, made on first use.
//
// Objective-C++ (include from .mm files only). Entries are never destroyed: kernels may still
// run on TensorFlow's threads while the process exits, and releasing Metal objects from static
// destructors after Metal itself has been torn down is not safe. The caller holds its cache's
// lock around the call and every use of the entry.
#ifndef TF_METAL_OPS_CSRC_METAL_PER_DEVICE_H_
#define TF_METAL_OPS_CSRC_METAL_PER_DEVICE_H_

#import <Metal/Metal.h>

#include <memory>
#include <string>
#include <vector>

#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace metal {

// Apple silicon has one GPU, so a linear search is enough.
template <typename Entry>
Entry& EntryForDevice(id<MTLDevice> device) {
  static auto* entries = new std::vector<std::unique_ptr<Entry>>();
  for (const auto& entry : *entries) {
    if (entry->device == device) return *entry;
  }
  entries->push_back(std::make_unique<Entry>());
  entries->back()->device = device;
  return *entries->back();
}

// The error of a cache lookup given no device (a command buffer without one).
inline Error NoMetalDevice() {
  return Error::Internal("tf_metal_ops: the command buffer has no Metal device");
}

// A device-wide buffer in shared storage (the CPU reads it without a copy) with hazard tracking
// off: launches write only what no other running launch touches, so Metal must not order
// unrelated command buffers by it. nil with `*error` naming `what` when the allocation fails.
inline id<MTLBuffer> NewUntrackedSharedBuffer(id<MTLDevice> device, size_t length,
                                              const std::string& what, Error* error) {
  id<MTLBuffer> buffer = [device newBufferWithLength:length
                                             options:MTLResourceStorageModeShared |
                                                     MTLResourceHazardTrackingModeUntracked];
  if (buffer == nil) {
    *error = Error::Internal("tf_metal_ops: allocating the " + std::to_string(length) +
                             "-byte Metal buffer of " + what + " failed");
  }
  return buffer;
}

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_PER_DEVICE_H_
