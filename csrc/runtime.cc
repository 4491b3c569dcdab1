#include "csrc/runtime.h"

#include <atomic>
#include <mutex>
#include <thread>
#include <utility>

#include "csrc/cpu/parallel_for.h"

namespace tf_metal_ops {
namespace {

std::atomic<int> commit_mode{static_cast<int>(CommitMode::kCommit)};
std::atomic<int> cpu_thread_limit{0};

// Timings are appended by kernels on TensorFlow's threads and read from Python; a bounded
// buffer keeps a long debug session from growing without limit.
constexpr size_t kMaxTimings = 10000;
std::mutex timings_mutex;
std::vector<KernelTiming>& Timings() {
  static auto* timings = new std::vector<KernelTiming>();  // never destroyed: used at exit
  return *timings;
}

}  // namespace

CommitMode GetCommitMode() { return static_cast<CommitMode>(commit_mode.load()); }
void SetCommitMode(CommitMode mode) { commit_mode.store(static_cast<int>(mode)); }

int CpuThreadLimit() {
  const int limit = cpu_thread_limit.load(std::memory_order_relaxed);
  if (limit > 0) return limit;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
}
void SetCpuThreadLimit(int threads) { cpu_thread_limit.store(threads > 0 ? threads : 0); }

void RecordKernelTiming(KernelTiming timing) {
  std::lock_guard<std::mutex> lock(timings_mutex);
  std::vector<KernelTiming>& timings = Timings();
  if (timings.size() >= kMaxTimings) timings.erase(timings.begin());
  timings.push_back(std::move(timing));
}

std::vector<KernelTiming> KernelTimings() {
  std::lock_guard<std::mutex> lock(timings_mutex);
  return Timings();
}

void ClearKernelTimings() {
  std::lock_guard<std::mutex> lock(timings_mutex);
  Timings().clear();
}

bool MetalCompiledIn() {
#if defined(TF_METAL_OPS_WITH_METAL)
  return true;
#else
  return false;
#endif
}

}  // namespace tf_metal_ops
