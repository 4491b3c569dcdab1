// The interface between the C++ stand-in for <metal_stdlib> (include/metal_stdlib), which the
// kernels see, and the emulator that runs them (emulator.cc). Plain C++17: no Metal spellings
// here, because the shim defines `device`, `constant`, `threadgroup` and `thread` as macros
// right after including this header.
#ifndef TF_METAL_OPS_CSRC_EMULATOR_MSL_HOST_RUNTIME_H_
#define TF_METAL_OPS_CSRC_EMULATOR_MSL_HOST_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace msl_host {

// The values of a kernel's thread-position attributes, in the order of TFMO_KERNEL_THREAD_ARGS
// (kernels/custom_loss.h).
struct ThreadIds {
  uint32_t tg_pos[2];    // [[threadgroup_position_in_grid]]
  uint32_t tg_count[2];  // [[threadgroups_per_grid]]
  uint32_t tg_size[2];   // [[threads_per_threadgroup]]
  uint32_t tid;          // [[thread_index_in_threadgroup]]
  uint32_t lane;         // [[thread_index_in_simdgroup]]
  uint32_t simd_width;   // [[threads_per_simdgroup]]
  uint32_t sg_index;     // [[simdgroup_index_in_threadgroup]]
  uint32_t sg_count;     // [[simdgroups_per_threadgroup]]
  // The 3-D positions a generated kernel (tf_metal_ops.metal_kernel) asks for by attribute name:
  // thread_position_in_grid, threads_per_grid, threadgroup_position_in_grid,
  // threadgroups_per_grid, threads_per_threadgroup (this threadgroup's own size, smaller at the
  // far edge of a grid that the threadgroup size does not divide, as with dispatchThreads) and
  // thread_position_in_threadgroup, in that order.
  uint32_t grid_position[3];
  uint32_t grid_threads[3];
  uint32_t group_position[3];
  uint32_t group_count[3];
  uint32_t group_threads[3];
  uint32_t thread_position[3];
};

// Calls one kernel for one GPU thread. `buffers[i]` is what the host bound at [[buffer(i)]];
// `threadgroup_memory` the threadgroup's [[threadgroup(0)]] block (shared by its threads).
using KernelInvoker = void (*)(void* const* buffers, size_t num_buffers, void* threadgroup_memory,
                               const ThreadIds& ids);

// Runs every thread of one threadgroup as a loop in the kernel's own object, for kernels that
// never wait for each other. `first` is the ids of the threadgroup's thread 0. No threadgroup
// argument: a generated kernel declares its threadgroup arrays in its body.
using GroupRunner = void (*)(void* const* buffers, const ThreadIds& first);

struct KernelEntry {
  std::string name;               // the [[host_name]]
  KernelInvoker invoke;
  size_t num_pointer_params;      // buffers + threadgroup arguments, leading the signature
  GroupRunner run_group;          // generated kernels (tf_metal_ops.metal_kernel); else null
};

// Called from static initializers of the kernel translation unit (TFMO_INSTANTIATE_KERNEL, and a
// generated kernel's host block, which also passes its GroupRunner).
bool register_kernel(const char* name, KernelInvoker invoke, size_t num_pointer_params,
                     GroupRunner run_group = nullptr);
const KernelEntry* find_kernel(const std::string& name);

// The synchronization and SIMD-group primitives, implemented by the executor running the
// calling GPU thread (fibers or OS threads, see emulator.cc).
void threadgroup_barrier();

// The one SIMD-group primitive: an all-gather over the SIMD-group's active lanes, in lockstep.
// Every SIMD-group and quad-group function of the stand-in <metal_stdlib> is built on it: each
// lane deposits `size` bytes (at most kMaxSimdValueBytes) at `value`; once every active lane has
// reached the same function (same `op`, same `uniform` argument, same count of earlier calls),
// each lane receives every active lane's bytes in `lanes` (lane j's at j * size; inactive
// lanes' bytes untouched) and the active lanes as a bit mask (bit j: lane j). `read_lane`, when
// not kNoLane, is the lane whose value this lane will use: the call fails the dispatch if that
// lane is outside the SIMD-group or inactive (what Metal leaves undefined). `op` names the
// function in messages and must outlive the call (a string literal).
constexpr size_t kMaxSimdValueBytes = 64;
constexpr uint32_t kMaxSimdWidth = 64;
constexpr uint32_t kNoLane = 0xFFFFFFFFu;
uint64_t simd_gather(const char* op, uint32_t uniform, uint32_t read_lane, const void* value,
                     size_t size, void* lanes);
// The calling thread's lane in its SIMD-group, and the SIMD-group width of the dispatch.
uint32_t simd_lane();
uint32_t simd_width();

// Which threadgroup of the dispatch the calling GPU thread belongs to (linear index), for the
// traffic counter (memory_traffic.h).
uint64_t current_threadgroup();

}  // namespace msl_host

#endif  // TF_METAL_OPS_CSRC_EMULATOR_MSL_HOST_RUNTIME_H_
