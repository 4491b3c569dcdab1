// Counts the device-memory traffic of an emulated launch, per buffer role, from the kernels' own
// loads and stores. The kernel translation unit is compiled (clang) with
// -fsanitize-coverage=func,trace-loads,trace-stores, which makes every load and store call
// __sanitizer_cov_load<N> / __sanitizer_cov_store<N> with its address (clang's SanitizerCoverage
// documentation, "Tracing data flow"); memory_traffic.cc defines those hooks. Only accesses that
// fall inside a registered buffer count (not the stack, the threadgroup memory or the shim).
//
// What one byte counts: the threads of a threadgroup run on one GPU core, a SIMD-group issues
// each load or store once for all its lanes, and lanes or SIMD-groups of one threadgroup that
// load the same address with the same instruction are served by one access to memory (a row's
// label, read by every thread of the row, moves 4 bytes, not 4 per thread). So an access counts
// once per (threadgroup, instruction, address), the instruction being the call site of the
// hook. A pass that reads the logits again is another instruction and counts again: the
// traffic to memory when nothing stays in a cache from one pass to the next, which is what the
// kernels' pass structure decides (caches can only lower it).
#ifndef TF_METAL_OPS_TESTS_MSL_HOST_MEMORY_TRAFFIC_H_
#define TF_METAL_OPS_TESTS_MSL_HOST_MEMORY_TRAFFIC_H_

#include <cstddef>
#include <cstdint>

namespace msl_host {

inline constexpr int kTrafficRoles = 10;  // gpu::kNumBufferRoles

struct TrafficCounts {
  bool instrumented = false;  // some access hook ran: the kernels were compiled with them
  uint64_t bytes_read[kTrafficRoles] = {};
  uint64_t bytes_written[kTrafficRoles] = {};
};

// Starts counting (all counts 0, no buffers registered).
void traffic_begin();
// Accesses inside [begin, begin + bytes) count for `role` (the first range that holds them).
void traffic_add_buffer(int role, const void* begin, size_t bytes);
// Stops counting and returns what was counted since traffic_begin.
TrafficCounts traffic_end();

}  // namespace msl_host

#endif  // TF_METAL_OPS_TESTS_MSL_HOST_MEMORY_TRAFFIC_H_
