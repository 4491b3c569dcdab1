// Where the Metal kernel library of tf_metal_ops lives on disk, and how the shipped `.metal`
// source becomes the single string that -[MTLDevice newLibraryWithSource:options:error:] compiles.
//
// Platform-neutral C++17 (no Objective-C, no TensorFlow), so the Linux tests can run it on the
// real kernels/ directory; csrc/metal/kernel_library.mm uses it on macOS.
//
// Layout, relative to the directory D that holds the native library (_tf_metal_ops.*.so):
//   D/custom_loss.metallib          precompiled by setup.py when the Metal toolchain exists
//   D/kernels/custom_loss.metal     the source, shipped as package data (plus its headers)
//   D/../kernels/custom_loss.metal  the source tree itself, for `setup.py build_ext --inplace`
// The precompiled library is tried first; the source is the fallback (no Metal toolchain at build
// time, or a .metallib built for a newer macOS than the one running it).
#ifndef TF_METAL_OPS_CSRC_METAL_KERNEL_SOURCE_H_
#define TF_METAL_OPS_CSRC_METAL_KERNEL_SOURCE_H_

#include <string>
#include <vector>

namespace tf_metal_ops {
namespace metal {

inline constexpr const char kPrecompiledLibraryName[] = "custom_loss.metallib";
inline constexpr const char kKernelSourceName[] = "custom_loss.metal";
inline constexpr const char kKernelSourceDirName[] = "kernels";

struct KernelFiles {
  std::string metallib;               // empty: no precompiled library found
  std::string source;                 // empty: no kernel source found
  std::vector<std::string> searched;  // every candidate path, in order, for error messages
};

// Looks for the precompiled library and the source next to `native_library_dir` (layout above).
KernelFiles FindKernelFiles(const std::string& native_library_dir);

// Reads the `.metal` file at `path` and replaces each `#include "name"` line with the contents of
// `name`, looked up next to the file that includes it, recursively. A string compiled by
// newLibraryWithSource: has no location and no include path, so quoted includes would not resolve;
// angle-bracket includes (<metal_stdlib>) are the compiler's own and stay as they are.
//   - Each file is inlined once: our headers have include guards, so a second inclusion would be
//     empty anyway, and cycles cannot recurse forever.
//   - `#line` markers keep the Metal compiler's messages pointing at the original file and line.
//   - A quoted include that names no existing file is left in place: it may sit in a branch the
//     Metal compiler never takes (#ifndef __METAL__), and if it does not, the compiler's own error
//     names it.
// Returns false with `*error` set when `path` (or an included file that exists) cannot be read.
bool AssembleKernelSource(const std::string& path, std::string* source, std::string* error);

// "a/b/c.so" -> "a/b"; "c.so" -> "."; "/c.so" -> "/".
std::string DirectoryOf(const std::string& path);

}  // namespace metal
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_KERNEL_SOURCE_H_
