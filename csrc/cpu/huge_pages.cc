#include "csrc/cpu/huge_pages.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tf_metal_ops {
namespace {

bool ReadEnabled() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const char* setting = std::getenv("TF_METAL_OPS_CPU_HUGE_PAGES");
  return setting == nullptr || std::strcmp(setting, "0") != 0;
#else
  return false;
#endif
}

}  // namespace

bool HugePageAdviceEnabled() {
  static const bool enabled = ReadEnabled();
  return enabled;
}

void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePageAdviceMinBytes || !HugePageAdviceEnabled()) return;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end <= begin) return;
  // Memory that is already resident was handed on by a caching allocator (TensorFlow's BFC
  // allocator with TF_CPU_ALLOCATOR_USE_BFC=true, a caching malloc): it faults no more, and
  // advising it would only split its mapping. One page tells: a fresh mapping has none.
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(begin), 4096, &resident) == 0 && (resident & 1) != 0) {
    return;
  }
  // Advice only: a failure (EINVAL without THP support) leaves ordinary pages, which is fine.
  (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace tf_metal_ops
