// Runs a registered kernel (msl_host_runtime.h) over a Metal dispatch: a grid of threadgroups,
// each with its threads, threadgroup memory, threadgroup_barrier and 32-lane (or any
// power-of-two width) SIMD-groups whose collective functions run in lockstep.
//
// Two executors, same semantics:
// - kFibers: the threads of one threadgroup are ucontext fibers on the calling OS thread. A
//   barrier or SIMD-group function parks the fiber; when every fiber is parked the scheduler
//   completes the collective (SIMD-group first, then the barrier) and resumes them. Threadgroups
//   run one after another. Deterministic and fast (no OS threads): the default for the tests.
// - kThreads: one OS thread per GPU thread, several threadgroups at once; barriers and
//   collectives are mutex + condition variable. Slower, but ThreadSanitizer sees every GPU
//   thread as a thread, so a race between GPU threads (in threadgroup or device memory) is
//   reported. Used by the -fsanitize=thread build.
// Both check the rules Metal leaves undefined and a real GPU would silently get wrong:
// a barrier not reached by every thread of the threadgroup (some returned early), live lanes of a
// SIMD-group waiting at different collectives, a shuffle that reads a lane that has returned.
// Such a kernel fails the run with a message instead of producing numbers.
#ifndef TF_METAL_OPS_CSRC_EMULATOR_EMULATOR_H_
#define TF_METAL_OPS_CSRC_EMULATOR_EMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "msl_host_runtime.h"

namespace msl_host {

// kDirect: for kernels that never wait for each other (no barrier, no SIMD-group function:
// tf_metal_ops/kernels.py decides from the source), each threadgroup's threads run one after
// another in a loop compiled into the kernel's own object (KernelEntry::run_group, which only
// generated kernels have). A barrier or SIMD-group call under it fails the dispatch.
enum class ExecutorKind { kFibers = 0, kThreads = 1, kDirect = 2 };

struct Dispatch {
  uint32_t threadgroups_per_grid[3];    // ignored when threads_per_grid is set
  uint32_t threads_per_threadgroup[3];
  // dispatchThreads: the grid counts threads, and the threadgroups at its far edges are cut to
  // what is left. All zero: dispatchThreadgroups (threadgroups_per_grid, every one full).
  uint32_t threads_per_grid[3] = {0, 0, 0};
  uint32_t threadgroup_memory_length;   // bytes; 0: the kernel has no threadgroup argument
  uint32_t simd_width;                  // threadExecutionWidth
  std::vector<void*> buffers;           // [[buffer(i)]] = buffers[i]
  ExecutorKind executor = ExecutorKind::kFibers;
  uint32_t max_concurrent_threadgroups = 4;  // kThreads only
  // The threadgroups to run, by linear index (x fastest): a caller may split a dispatch into
  // ranges and run them on several OS threads at once, as a GPU runs threadgroups concurrently.
  uint64_t first_group = 0;
  uint64_t end_group = UINT64_MAX;
};

// The threadgroups a dispatch runs: threadgroups_per_grid, or what covers threads_per_grid.
void threadgroup_grid(const Dispatch& dispatch, uint32_t groups[3]);

// Empty on success, else what went wrong (unknown kernel, signature / plan mismatch, a
// synchronization rule broken by the kernel).
std::string run_dispatch(const std::string& kernel_name, const Dispatch& dispatch);

}  // namespace msl_host

#endif  // TF_METAL_OPS_CSRC_EMULATOR_EMULATOR_H_
