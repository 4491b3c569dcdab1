#include "csrc/cpu/memory_floor.h"

#include <atomic>
#include <vector>

#include "csrc/cpu/parallel_for.h"

namespace tf_metal_ops {
namespace {

// Four independent 4-float accumulators: the loop is limited by the loads, not by the adds
// (a plain float sum would not vectorize without reassociation, which we do not allow).
typedef float Float4 __attribute__((vector_size(16)));

float SumRange(const float* p, int64_t n) {
  Float4 acc[4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 4; ++k) {
      Float4 v;
      __builtin_memcpy(&v, p + i + 4 * k, sizeof(v));
      acc[k] += v;
    }
  }
  float sum = 0;
  for (; i < n; ++i) sum += p[i];
  const Float4 total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  return sum + total[0] + total[1] + total[2] + total[3];
}

// Local pointers and explicit vectors: the loop must not reload anything per element.
void HalveRange(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Float4 a, b;
    __builtin_memcpy(&a, src + i, sizeof(a));
    __builtin_memcpy(&b, src + i + 4, sizeof(b));
    a *= 0.5f;
    b *= 0.5f;
    __builtin_memcpy(dst + i, &a, sizeof(a));
    __builtin_memcpy(dst + i + 4, &b, sizeof(b));
  }
  for (; i < n; ++i) dst[i] = 0.5f * src[i];
}

}  // namespace

double StreamReadPass(const float* src, int64_t rows, int64_t cols) {
  std::atomic<double> total{0.0};
  ParallelFor(rows, cols, [src, cols, &total](int64_t begin, int64_t end) {
    const double part = SumRange(src + begin * cols, (end - begin) * cols);
    double seen = total.load();
    while (!total.compare_exchange_weak(seen, seen + part)) {
    }
  });
  return total.load();
}

void StreamCopyPass(const float* src, float* dst, int64_t rows, int64_t cols) {
  ParallelFor(rows, cols, [src, dst, cols](int64_t begin, int64_t end) {
    HalveRange(src + begin * cols, dst + begin * cols, (end - begin) * cols);
  });
}

}  // namespace tf_metal_ops
