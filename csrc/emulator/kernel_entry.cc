// The C entry point of a shared object built for tf_metal_ops.metal_kernel: the generated kernel,
// this file and the emulator, loaded with dlopen by the native op (csrc/cpu/metal_kernel_cpu.cc).
// C linkage and plain types only: the op library and the kernel's object may come from different
// compilers and C++ standard libraries (g++'s libstdc++, the ziglang wheel's libc++).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "emulator.h"

extern "C" {

// Bumped when the arguments below change, so that a cached object of another layout is rebuilt.
int tfmo_kernel_entry_version() { return 2; }

// Runs the threadgroups [first_group, end_group) (linear, x fastest) of kernel `name`
// (registered by the generated source's host block) over a dispatchThreads grid; `lockstep` 0
// runs each threadgroup as a loop over its threads in the kernel's own object (no barrier or
// SIMD-group function allowed), else on fibers.
// Returns 0, or 1 with the reason in `error` (NUL-terminated, cut to error_size).
int tfmo_kernel_run(const char* name, const uint32_t* threads_per_grid,
                    const uint32_t* threads_per_threadgroup, uint32_t simd_width, int lockstep,
                    uint64_t first_group, uint64_t end_group, void* const* buffers,
                    size_t num_buffers, char* error, size_t error_size) {
  msl_host::Dispatch dispatch;
  for (int a = 0; a < 3; ++a) {
    dispatch.threadgroups_per_grid[a] = 0;
    dispatch.threads_per_grid[a] = threads_per_grid[a];
    dispatch.threads_per_threadgroup[a] = threads_per_threadgroup[a];
  }
  dispatch.threadgroup_memory_length = 0;  // threadgroup arrays live in the kernel's body
  dispatch.simd_width = simd_width;
  dispatch.buffers.assign(buffers, buffers + num_buffers);
  dispatch.executor = lockstep ? msl_host::ExecutorKind::kFibers : msl_host::ExecutorKind::kDirect;
  dispatch.first_group = first_group;
  dispatch.end_group = end_group;
  const std::string message = msl_host::run_dispatch(name, dispatch);
  if (message.empty()) return 0;
  if (error_size > 0) {
    const size_t n = message.size() < error_size - 1 ? message.size() : error_size - 1;
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return 1;
}

}  // extern "C"
