// Declarations of the libdispatch APIs used by csrc/metal/*.mm, for the Linux syntax check only
// (see ../README.md). Not Apple's header: written from Apple's documentation.
#ifndef TF_METAL_OPS_APPLE_DECLS_DISPATCH_H_
#define TF_METAL_OPS_APPLE_DECLS_DISPATCH_H_

#import <Foundation/Foundation.h>

NS_ASSUME_NONNULL_BEGIN

// In Objective-C code compiled with ARC on Apple platforms (OS_OBJECT_USE_OBJC), dispatch objects
// are Objective-C objects: dispatch_queue_t is `NSObject<OS_dispatch_queue> *`, retained and
// released by ARC like any other object. Declaring it the same way here makes the check apply
// ARC's rules to it (a property or variable of this type is a strong reference).
// https://developer.apple.com/documentation/dispatch/dispatch_queue_t
@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
typedef NSObject<OS_dispatch_queue> *dispatch_queue_t;

// https://developer.apple.com/documentation/dispatch/dispatch_block_t
typedef void (^dispatch_block_t)(void);

// https://developer.apple.com/documentation/dispatch/dispatchqueue/sync(execute:)-3segw
//   preciseIdentifier c:@F@dispatch_sync. "Submits a block object for execution and returns after
//   that block finishes executing ... Calling this function and targeting the current queue
//   results in deadlock ... no Block_copy is performed on the block ... executes blocks on the
//   current thread whenever possible".
#ifdef __cplusplus
extern "C" {
#endif
void dispatch_sync(dispatch_queue_t queue, __attribute__((noescape)) dispatch_block_t block);
#ifdef __cplusplus
}
#endif

NS_ASSUME_NONNULL_END

#endif  // TF_METAL_OPS_APPLE_DECLS_DISPATCH_H_
