// A small cache of large gradient buffers, kept from one training step to the next (CPU).
//
// TensorFlow's default CPU allocator takes a 262 MB gradient (65536 x 1000 floats) from malloc,
// which maps it fresh from the kernel and unmaps it when the tensor dies; the next step's
// gradient is fresh memory again, which the kernel must fault in and zero before our kernel
// writes a single value (perf: clear_page alone was 24% of a forward + backward step at that
// size, with huge pages). Keras's fit() with metrics pays this on every step: it still reads the
// logits (y_pred, for the metrics) after the gradient, so the gradient cannot take over their
// buffer.
//
// So a gradient op that could not take over the logits' buffer, and whose output is large
// (kGradientCacheMinBytes, where malloc maps fresh memory), sets aside one buffer of that size
// for the next step; the next step writes into it (TF_NewTensor with our own deallocator, then
// TF_SetOutput) and, when TensorFlow drops the tensor, the buffer comes back here instead of to
// the kernel. Steady state: the same resident pages every step, no faults, nothing zeroed.
// This is what TensorFlow's caching allocator (TF_CPU_ALLOCATOR_USE_BFC=true) does for every
// tensor; here only for our gradients.
//
// The price is memory held between steps: at most kMaxIdleBuffers idle buffers (the oldest is
// freed first), each within 2x of the size it serves. release_cpu_gradient_cache() in Python
// frees them; TF_METAL_OPS_CPU_GRADIENT_CACHE=0 in the environment (read once) turns the cache
// off. A buffer is only handed out again after TensorFlow's last reference to it is gone, so
// two live tensors never share memory.
#ifndef TF_METAL_OPS_CSRC_CPU_GRADIENT_CACHE_H_
#define TF_METAL_OPS_CSRC_CPU_GRADIENT_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "csrc/tf_c.h"

namespace tf_metal_ops {

// Gradients from this size on: glibc's largest mmap threshold, as for the huge-page advice
// (huge_pages.h). Smaller blocks come from malloc's heap, which keeps them resident anyway.
constexpr size_t kGradientCacheMinBytes = size_t{32} << 20;
constexpr size_t kMaxIdleBuffers = 2;

// False when TF_METAL_OPS_CPU_GRADIENT_CACHE=0.
bool GradientCacheEnabled();

// True when a gradient of `bytes` goes through the cache (enabled, and large enough).
bool UsesGradientCache(size_t bytes);

// A tensor of `dtype` and `dims` (`bytes` long) over an idle cached buffer, or null when none
// fits: the buffer then belongs to the tensor until TensorFlow's last reference to it is gone.
TensorPtr TakeCachedGradient(TF_DataType dtype, const std::vector<int64_t>& dims, size_t bytes);

// Sets aside an idle buffer of at least `bytes` for the next gradient of that size, unless one
// is idle already. Allocation failure is not an error: the next step allocates as before.
void ReserveCachedGradient(size_t bytes);

struct GradientCacheStats {
  int64_t idle_buffers = 0;
  size_t idle_bytes = 0;
  int64_t reuses = 0;        // gradients written into a cached buffer
  int64_t reservations = 0;  // buffers set aside after a fresh gradient
};
GradientCacheStats GetGradientCacheStats();

// Frees the idle buffers (those in use come back, and stay, until the next release); returns
// the bytes freed.
size_t ReleaseGradientCache();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_GRADIENT_CACHE_H_
