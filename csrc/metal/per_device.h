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
#include <vector>

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

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_PER_DEVICE_H_
