// Splits a loop over rows across the kernels' thread pool (thread_pool.h).
//
// Small problems run inline: waking a worker costs some microseconds, more than a few tens of
// thousands of elements of work.
#ifndef TF_METAL_OPS_CSRC_CPU_PARALLEL_FOR_H_
#define TF_METAL_OPS_CSRC_CPU_PARALLEL_FOR_H_

#include <algorithm>
#include <cstdint>

#include "csrc/cpu/thread_pool.h"

namespace tf_metal_ops {

// The most threads one op execution uses; 0 means the hardware's concurrency. Set from Python
// (tf_metal_ops.set_cpu_threads) so users can match tf.config.threading.
int CpuThreadLimit();
void SetCpuThreadLimit(int threads);

// Calls body(begin, end) over disjoint ranges covering [0, num_rows). `cost_per_row` is in
// elements touched; below 64K elements per thread the work stays on the caller's thread.
// The rows are cut into a few blocks per thread, claimed dynamically, so the threads finish
// together even when the OS runs one of them late.
template <typename Body>
void ParallelFor(int64_t num_rows, int64_t cost_per_row, const Body& body) {
  constexpr int64_t kMinWorkPerThread = 64 * 1024;
  constexpr int64_t kBlocksPerThread = 4;
  if (num_rows <= 0) return;
  const int64_t total = num_rows * std::max<int64_t>(cost_per_row, 1);
  int64_t threads = std::min<int64_t>(CpuThreadLimit(), total / kMinWorkPerThread);
  threads = std::min<int64_t>(threads, num_rows);
  if (threads <= 1) {
    body(int64_t{0}, num_rows);
    return;
  }
  const int64_t blocks = std::min<int64_t>(num_rows, threads * kBlocksPerThread);
  struct Job {
    const Body* body;
    int64_t num_rows;
    int64_t blocks;
  } job{&body, num_rows, blocks};
  RunOnPool(
      static_cast<int>(threads), blocks,
      [](void* context, int64_t block) {
        const Job& j = *static_cast<const Job*>(context);
        const int64_t begin = j.num_rows * block / j.blocks;
        const int64_t end = j.num_rows * (block + 1) / j.blocks;
        (*j.body)(begin, end);
      },
      &job);
}

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_PARALLEL_FOR_H_
