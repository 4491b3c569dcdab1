// Declarations of the Foundation / Objective-C runtime APIs used by csrc/metal/*.mm, for the Linux
// syntax check only (see ../README.md). Not Apple's header: written from Apple's documentation,
// one cited page per group. Declares nothing the code does not use.
#ifndef TF_METAL_OPS_APPLE_DECLS_FOUNDATION_H_
#define TF_METAL_OPS_APPLE_DECLS_FOUNDATION_H_

#include <stddef.h>
#include <stdint.h>

// Apple's availability annotations, reduced to clang's attribute. They are inert on the Linux
// target of the check, but keep the declarations faithful to the pages cited below.
#define TFMO_API_AVAILABLE_MACOS(v) __attribute__((availability(macos, introduced = v)))
#define TFMO_API_DEPRECATED_MACOS(from, to, msg) \
  __attribute__((availability(macos, introduced = from, deprecated = to, message = msg)))

// NSInteger / NSUInteger are `long` / `unsigned long` on 64-bit Apple platforms.
// https://developer.apple.com/documentation/objectivec/nsuinteger  ("typedef unsigned long
//   NSUInteger; ... A 64-bit application treats NSUInteger as a 64-bit unsigned integer")
typedef long NSInteger;
typedef unsigned long NSUInteger;

// BOOL is `bool` on arm64 (Apple silicon).
// https://developer.apple.com/documentation/objectivec/bool  ("typedef bool BOOL;")
typedef bool BOOL;
#define YES true
#define NO false

// The null object pointer. Apple's <objc/objc.h> defines it as `nullptr` when compiling C++11 or
// later (no documentation page spells this out; it is the only definition that type-checks as
// both an `id` and a C++ pointer, which is how the code uses it).
#define nil nullptr

// Apple's headers assume non-null pointers unless marked nullable; so do these.
#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")

#define NS_ENUM(type, name) enum name : type name; enum name : type
#define NS_OPTIONS(type, name) type name; enum : type

NS_ASSUME_NONNULL_BEGIN

// -respondsToSelector: belongs to the NSObject protocol.
// https://developer.apple.com/documentation/objectivec/nsobjectprotocol/responds(to:)
//   preciseIdentifier c:objc(pl)NSObject(im)respondsToSelector:
@protocol NSObject
- (BOOL)respondsToSelector:(SEL)aSelector;
@end

// The root class; +alloc and -init are how MTLCompileOptions is created.
// https://developer.apple.com/documentation/objectivec/nsobject-swift.class
__attribute__((objc_root_class))
@interface NSObject <NSObject> {
  Class isa;
}
+ (instancetype)alloc;
- (instancetype)init;
@end

// https://developer.apple.com/documentation/foundation/nsstring/init(utf8string:)-321f6
//   preciseIdentifier c:objc(cs)NSString(cm)stringWithUTF8String:  (returns nil for invalid UTF-8)
// https://developer.apple.com/documentation/foundation/nsstring/utf8string
//   preciseIdentifier c:objc(cs)NSString(py)UTF8String
@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char *)nullTerminatedCString;
@property(nullable, readonly) const char *UTF8String __attribute__((objc_returns_inner_pointer));
@end

// https://developer.apple.com/documentation/foundation/nserror/localizeddescription
//   preciseIdentifier c:objc(cs)NSError(py)localizedDescription
@interface NSError : NSObject
@property(readonly, copy) NSString *localizedDescription;
@end

// https://developer.apple.com/documentation/foundation/nsurl/fileurl(withpath:)
//   preciseIdentifier c:objc(cs)NSURL(cm)fileURLWithPath:
@interface NSURL : NSObject
+ (NSURL *)fileURLWithPath:(NSString *)path;
@end

NS_ASSUME_NONNULL_END

#endif  // TF_METAL_OPS_APPLE_DECLS_FOUNDATION_H_
