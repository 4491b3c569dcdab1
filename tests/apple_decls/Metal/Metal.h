// Declarations of the Metal APIs used by csrc/metal/*.mm, for the Linux syntax check only (see
// ../README.md). Not Apple's header: written from Apple's documentation; each group cites its
// page and the Objective-C selector from the page's `preciseIdentifier`. Return types of the
// `new...` methods are +1 references (ARC's "new" method family), as in Apple's SDK.
#ifndef TF_METAL_OPS_APPLE_DECLS_METAL_H_
#define TF_METAL_OPS_APPLE_DECLS_METAL_H_

#import <Foundation/Foundation.h>

NS_ASSUME_NONNULL_BEGIN

// CFTimeInterval: Core Foundation's time interval in seconds, a double; the type of
// MTLCommandBuffer's GPUStartTime / GPUEndTime ("var gpuStartTime: CFTimeInterval").
typedef double CFTimeInterval;

// https://developer.apple.com/documentation/metal/mtlsize  (c:@SA@MTLSize; width, height, depth)
// https://developer.apple.com/documentation/metal/mtlsizemake(_:_:_:)  (c:@F@MTLSizeMake)
typedef struct {
  NSUInteger width;
  NSUInteger height;
  NSUInteger depth;
} MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

// https://developer.apple.com/documentation/metal/mtlmathmode  (safe, relaxed, fast)
// Values 0, 1, 2 as listed for the enum's native binding (learn.microsoft.com Metal.MTLMathMode).
typedef NS_ENUM(NSInteger, MTLMathMode){
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
};

// https://developer.apple.com/documentation/metal/mtlcommandbufferstatus
// (notEnqueued, enqueued, committed, scheduled, completed, error = 0..5)
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus){
    MTLCommandBufferStatusNotEnqueued = 0,
    MTLCommandBufferStatusEnqueued = 1,
    MTLCommandBufferStatusCommitted = 2,
    MTLCommandBufferStatusScheduled = 3,
    MTLCommandBufferStatusCompleted = 4,
    MTLCommandBufferStatusError = 5,
};

// https://developer.apple.com/documentation/metal/mtlresourceoptions  (storageModeShared)
// https://developer.apple.com/documentation/metal/mtlresourceoptions/hazardtrackingmodeuntracked
//   (c:@E@MTLResourceOptions@MTLResourceHazardTrackingModeUntracked; hazard-tracking shift 8)
// A storage mode (MTLStorageModeShared = 0) shifted by 4, a hazard-tracking mode
// (MTLHazardTrackingModeUntracked = 1) shifted by 8.
typedef NS_OPTIONS(NSUInteger, MTLResourceOptions){
    MTLResourceStorageModeShared = 0UL << 4,
    MTLResourceHazardTrackingModeUntracked = 1UL << 8,
};

@protocol MTLDevice;

// https://developer.apple.com/documentation/metal/mtlfunction
@protocol MTLFunction <NSObject>
@end

// https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:)
//   c:objc(pl)MTLLibrary(im)newFunctionWithName:  (nil if the library has no such function)
@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString *)functionName;
@end

// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/maxtotalthreadsperthreadgroup
//   c:objc(pl)MTLComputePipelineState(py)maxTotalThreadsPerThreadgroup
// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/threadexecutionwidth
//   c:objc(pl)MTLComputePipelineState(py)threadExecutionWidth
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@end

// https://developer.apple.com/documentation/metal/mtlresource
@protocol MTLResource <NSObject>
@end

// https://developer.apple.com/documentation/metal/mtlbuffer/contents()
//   c:objc(pl)MTLBuffer(im)contents  (NULL for private storage)
@protocol MTLBuffer <MTLResource>
- (void *)contents __attribute__((objc_returns_inner_pointer));
@end

// https://developer.apple.com/documentation/metal/mtlcommandencoder/endencoding()
//   c:objc(pl)MTLCommandEncoder(im)endEncoding
@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder
//   setComputePipelineState(_:)        c:objc(pl)MTLComputeCommandEncoder(im)setComputePipelineState:
//   setBytes(_:length:index:)          c:objc(pl)MTLComputeCommandEncoder(im)setBytes:length:atIndex:
//   setBuffer(_:offset:index:)         c:objc(pl)MTLComputeCommandEncoder(im)setBuffer:offset:atIndex:
//   setThreadgroupMemoryLength(_:index:)
//                      c:objc(pl)MTLComputeCommandEncoder(im)setThreadgroupMemoryLength:atIndex:
//   dispatchThreadgroups(_:threadsPerThreadgroup:)
//                 c:objc(pl)MTLComputeCommandEncoder(im)dispatchThreadgroups:threadsPerThreadgroup:
//   dispatchThreads(_:threadsPerThreadgroup:)  (macOS 10.13 and later; "an arbitrarily sized
//                 grid", on GPUs with nonuniform threadgroup sizes)
//                 c:objc(pl)MTLComputeCommandEncoder(im)dispatchThreads:threadsPerThreadgroup:
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer
           offset:(NSUInteger)offset
          atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid
       threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreads:(MTLSize)threadsPerGrid
    threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup TFMO_API_AVAILABLE_MACOS(10.13);
@end

// https://developer.apple.com/documentation/metal/mtlblitcommandencoder/copy(from:sourceoffset:to:destinationoffset:size:)
//   c:objc(pl)MTLBlitCommandEncoder(im)copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:
@protocol MTLBlitCommandEncoder <MTLCommandEncoder>
- (void)copyFromBuffer:(id<MTLBuffer>)sourceBuffer
          sourceOffset:(NSUInteger)sourceOffset
              toBuffer:(id<MTLBuffer>)destinationBuffer
     destinationOffset:(NSUInteger)destinationOffset
                  size:(NSUInteger)size;
@end

// https://developer.apple.com/documentation/metal/mtlcommandbufferhandler
//   c:@T@MTLCommandBufferHandler  ("A completion handler signature a GPU device calls when it
//   finishes scheduling a command buffer, or when the GPU finishes running it"; its one
//   parameter is the command buffer that invokes it)
@protocol MTLCommandBuffer;
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer> commandBuffer);

// https://developer.apple.com/documentation/metal/mtlcommandbuffer
//   device                        c:objc(pl)MTLCommandBuffer(py)device
//   status                        c:objc(pl)MTLCommandBuffer(py)status
//   error                         c:objc(pl)MTLCommandBuffer(py)error  (nil unless it failed)
//   gpuStartTime / gpuEndTime     c:objc(pl)MTLCommandBuffer(py)GPUStartTime / (py)GPUEndTime
//                                 (0.0 until the command buffer has completed)
//   makeComputeCommandEncoder()   c:objc(pl)MTLCommandBuffer(im)computeCommandEncoder
//   makeBlitCommandEncoder()      c:objc(pl)MTLCommandBuffer(im)blitCommandEncoder
//   addCompletedHandler(_:)       c:objc(pl)MTLCommandBuffer(im)addCompletedHandler:
//                                 ("You can only call this method before calling the command
//                                 buffer's commit() method"; macOS 10.11 and later)
@protocol MTLCommandBuffer <NSObject>
@property(readonly) id<MTLDevice> device;
@property(readonly) MTLCommandBufferStatus status;
@property(nullable, readonly) NSError *error;
@property(readonly) CFTimeInterval GPUStartTime;
@property(readonly) CFTimeInterval GPUEndTime;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (nullable id<MTLBlitCommandEncoder>)blitCommandEncoder;
- (void)addCompletedHandler:(MTLCommandBufferHandler)block;
@end

// https://developer.apple.com/documentation/metal/mtlcompileoptions
//   mathMode         c:objc(cs)MTLCompileOptions(py)mathMode         (macOS 15.0 and later)
//   fastMathEnabled  c:objc(cs)MTLCompileOptions(py)fastMathEnabled  (macOS 10.11 - 15.0,
//                    deprecated: "Use mathMode instead"; default YES)
@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) MTLMathMode mathMode TFMO_API_AVAILABLE_MACOS(15.0);
@property(readwrite, nonatomic) BOOL fastMathEnabled
    TFMO_API_DEPRECATED_MACOS(10.11, 15.0, "Use mathMode instead");
@end

// https://developer.apple.com/documentation/metal/mtldevice
//   makeLibrary(URL:)                 c:objc(pl)MTLDevice(im)newLibraryWithURL:error:
//   makeLibrary(source:options:)      c:objc(pl)MTLDevice(im)newLibraryWithSource:options:error:
//   makeComputePipelineState(function:)
//                        c:objc(pl)MTLDevice(im)newComputePipelineStateWithFunction:error:
//   makeBuffer(length:options:)       c:objc(pl)MTLDevice(im)newBufferWithLength:options:
//                                     ("creates a buffer the method clears with zero values")
@protocol MTLDevice <NSObject>
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL *)url
                                       error:(NSError *__autoreleasing _Nullable *_Nullable)error
    TFMO_API_AVAILABLE_MACOS(10.13);
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString *)source
                                        options:(nullable MTLCompileOptions *)options
                                          error:(NSError *__autoreleasing _Nullable *_Nullable)error;
- (nullable id<MTLComputePipelineState>)
    newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                  error:(NSError *__autoreleasing _Nullable *_Nullable)error;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
@end

NS_ASSUME_NONNULL_END

#endif  // TF_METAL_OPS_APPLE_DECLS_METAL_H_
