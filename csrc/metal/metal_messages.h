// Metal's outcomes as text for our error messages: an NSError's description and a command
// buffer's status. Objective-C++ (include from .mm files only).
#ifndef TF_METAL_OPS_CSRC_METAL_METAL_MESSAGES_H_
#define TF_METAL_OPS_CSRC_METAL_METAL_MESSAGES_H_

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <string>

namespace tf_metal_ops {
namespace metal {

inline std::string Describe(NSError* error) {
  if (error == nil) return "no error description";
  const char* text = [[error localizedDescription] UTF8String];
  return text != nullptr ? text : "an error without a description";
}

inline const char* StatusName(MTLCommandBufferStatus status) {
  switch (status) {
    case MTLCommandBufferStatusNotEnqueued: return "not enqueued";
    case MTLCommandBufferStatusEnqueued: return "enqueued";
    case MTLCommandBufferStatusCommitted: return "committed";
    case MTLCommandBufferStatusScheduled: return "scheduled";
    case MTLCommandBufferStatusCompleted: return "completed";
    case MTLCommandBufferStatusError: return "error";
  }
  return "unknown";
}

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_METAL_MESSAGES_H_
