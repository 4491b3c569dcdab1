// Small kernels that break (or keep) Metal's synchronization rules on purpose, compiled only by
// the Linux shim (TFMO_INSTANTIATE_KERNEL registers plain functions there; Metal would need
// templates). They prove that the checks can fail:
// - racy_threadgroup_sum: every thread does `acc[0] += 1` on threadgroup memory with no atomic,
//   the unsynchronized += of Apple's sample. ThreadSanitizer must report it.
// - reduced_threadgroup_sum: the same sum done right (own slot, barrier, one reader): clean.
// - early_return_before_barrier: thread 0 returns, the others wait at a barrier (undefined in
//   Metal): the emulator must refuse it.
// - divergent_simd_sum: half of a SIMD-group calls simd_sum inside a branch: refused too.
#include "kernels/custom_loss.h"

namespace tf_metal_ops {
namespace sync_examples {

using namespace ::metal;

[[kernel]] void racy_threadgroup_sum(device float* out [[buffer(0)]],
                                     threadgroup float* acc TFMO_THREADGROUP_ARG(0),
                                     TFMO_KERNEL_THREAD_ARGS) {
  if (tid == 0u) acc[0] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  acc[0] += 1.0f;  // the data race
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0u) out[tg_pos.x] = acc[0];
}

[[kernel]] void reduced_threadgroup_sum(device float* out [[buffer(0)]],
                                        threadgroup float* acc TFMO_THREADGROUP_ARG(0),
                                        TFMO_KERNEL_THREAD_ARGS) {
  acc[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0u) {
    float sum = 0.0f;
    for (uint i = 0; i < tg_size.x; ++i) sum += acc[i];
    out[tg_pos.x] = sum;
  }
}

[[kernel]] void early_return_before_barrier(device float* out [[buffer(0)]],
                                            threadgroup float* acc TFMO_THREADGROUP_ARG(0),
                                            TFMO_KERNEL_THREAD_ARGS) {
  if (tid == 0u) return;
  acc[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tg_pos.x] = acc[1];
}

[[kernel]] void divergent_simd_sum(device float* out [[buffer(0)]],
                                   threadgroup float* acc TFMO_THREADGROUP_ARG(0),
                                   TFMO_KERNEL_THREAD_ARGS) {
  float x = 1.0f;
  if (lane < simd_width / 2u) x = simd_sum(x);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0u) out[tg_pos.x] = x;
}

}  // namespace sync_examples
}  // namespace tf_metal_ops

TFMO_INSTANTIATE_KERNEL("example_racy_threadgroup_sum",
                        tf_metal_ops::sync_examples::racy_threadgroup_sum)
TFMO_INSTANTIATE_KERNEL("example_reduced_threadgroup_sum",
                        tf_metal_ops::sync_examples::reduced_threadgroup_sum)
TFMO_INSTANTIATE_KERNEL("example_early_return_before_barrier",
                        tf_metal_ops::sync_examples::early_return_before_barrier)
TFMO_INSTANTIATE_KERNEL("example_divergent_simd_sum",
                        tf_metal_ops::sync_examples::divergent_simd_sum)
