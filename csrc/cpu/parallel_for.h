// Splits a loop over rows across a few threads.
//
// The C API gives a kernel no access to TensorFlow's intra-op thread pool, so large problems
// are split over threads of our own. Small ones run inline: starting a thread costs tens of
// microseconds, more than a few thousand elements of work.
#ifndef TF_METAL_OPS_CSRC_CPU_PARALLEL_FOR_H_
#define TF_METAL_OPS_CSRC_CPU_PARALLEL_FOR_H_

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace tf_metal_ops {

// The most threads one op execution uses; 0 means the hardware's concurrency. Set from Python
// (tf_metal_ops.set_cpu_threads) so users can match tf.config.threading.
int CpuThreadLimit();
void SetCpuThreadLimit(int threads);

// Calls body(begin, end) over disjoint ranges covering [0, num_rows). `cost_per_row` is in
// elements touched; below about 64K elements per thread the work stays on the caller's thread.
template <typename Body>
void ParallelFor(int64_t num_rows, int64_t cost_per_row, const Body& body) {
  constexpr int64_t kMinWorkPerThread = 64 * 1024;
  const int64_t total = num_rows * std::max<int64_t>(cost_per_row, 1);
  int64_t threads = std::min<int64_t>(CpuThreadLimit(), total / kMinWorkPerThread);
  threads = std::min<int64_t>(threads, num_rows);
  if (threads <= 1) {
    if (num_rows > 0) body(int64_t{0}, num_rows);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  const int64_t chunk = (num_rows + threads - 1) / threads;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = t * chunk;
    const int64_t end = std::min(num_rows, begin + chunk);
    if (begin >= end) break;
    workers.emplace_back([&body, begin, end] { body(begin, end); });
  }
  body(int64_t{0}, std::min(num_rows, chunk));
  for (std::thread& worker : workers) worker.join();
}

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_PARALLEL_FOR_H_
