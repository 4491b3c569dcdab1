// Compiles the generated source of a tf_metal_ops.metal_kernel for the CPU: the source as C++
// against the emulator's stand-in <metal_stdlib> (csrc/emulator/), linked with the emulator into
// a shared object that is cached on disk and loaded with dlopen, once per source per process.
//
// The host compiler is chosen in Python (tf_metal_ops/_toolchain.py knows the ziglang wheel)
// and handed over with SetKernelToolchain before any kernel runs.
#ifndef TF_METAL_OPS_CSRC_KERNEL_COMPILER_H_
#define TF_METAL_OPS_CSRC_KERNEL_COMPILER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tf_metal_ops {

struct KernelToolchain {
  std::vector<std::string> compiler;  // argv prefix, e.g. {"clang++"}; empty: none was found
  std::string missing_reason;         // what to install, when `compiler` is empty
  std::string emulator_dir;           // holds emulator.cc, kernel_entry.cc, include/metal_stdlib
  std::string cache_dir;              // where compiled kernels are kept across processes
};
void SetKernelToolchain(KernelToolchain toolchain);

// tfmo_kernel_run in csrc/emulator/kernel_entry.cc.
using KernelRunFunction = int (*)(const char* name, const uint32_t* threads_per_grid,
                                  const uint32_t* threads_per_threadgroup, uint32_t simd_width,
                                  int lockstep, uint64_t first_group, uint64_t end_group,
                                  void* const* buffers, size_t num_buffers, char* error,
                                  size_t error_size);

// The loaded kernel of `source` (compiled, or found on disk, on first use). Empty on success,
// else why not: no compiler, or the compiler's own message.
std::string LoadKernel(const std::string& source, KernelRunFunction* run);

// How each LoadKernel call was served, for the tests and `tf_metal_ops.kernel_cache_info()`.
struct KernelCacheStats {
  int64_t compiled = 0;     // built by the host compiler
  int64_t from_disk = 0;    // a shared object another process (or an earlier one) built
  int64_t in_memory = 0;    // already loaded in this process
  std::string compiler;     // the compiler's first line of --version, once known
};
KernelCacheStats GetKernelCacheStats();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_KERNEL_COMPILER_H_
