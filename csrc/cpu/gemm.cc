#include "csrc/cpu/gemm.h"

#include <algorithm>
#include <atomic>
#include <limits>

#if defined(__APPLE__)
// Accelerate's CBLAS, with the prototypes of its current interface: setup.py defines
// ACCELERATE_NEW_LAPACK (32-bit __LAPACK_int dimensions unless ILP64 is asked for).
#include <Accelerate/Accelerate.h>
#define TMO_SGEMM cblas_sgemm
#else
#include "cblas.h"  // scipy-openblas32's: every symbol prefixed with scipy_
#define TMO_SGEMM scipy_cblas_sgemm
#endif

namespace tf_metal_ops {
namespace {

std::atomic<int> gemm_threads{0};

}  // namespace

bool GemmAvailable() {
#if defined(__APPLE__)
  // The current interface's entry points are weak imports when the deployment target is older
  // than macOS 13.3.
  if (__builtin_available(macOS 13.3, *)) return true;
  return false;
#else
  return true;
#endif
}

bool GemmFits(int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  return m >= 0 && n >= 0 && k >= 0 && m <= kMax && n <= kMax && k <= kMax;
}

void Sgemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc) {
  if (m == 0 || n == 0) return;
#if defined(__APPLE__)
  if (__builtin_available(macOS 13.3, *)) {
#endif
  TMO_SGEMM(CblasRowMajor, trans_a == Transpose::kYes ? CblasTrans : CblasNoTrans,
            trans_b == Transpose::kYes ? CblasTrans : CblasNoTrans, static_cast<int>(m),
            static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
            static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#if defined(__APPLE__)
  }
#endif
}

void SetGemmThreads(int threads) {
  if (threads < 1) threads = 1;
  if (gemm_threads.exchange(threads, std::memory_order_relaxed) == threads) return;
#if !defined(__APPLE__)
  scipy_openblas_set_num_threads(threads);
#endif
}

GemmColumnBlocks GemmColumnBlocks::For(int64_t columns) {
  GemmColumnBlocks blocks;
#if defined(__APPLE__)
  blocks.width = columns;
  blocks.count = columns > 0 ? 1 : 0;
#else
  const int64_t wanted = std::clamp<int64_t>(columns / kMinGemmColumnBlock, 1,
                                             kMaxGemmColumnBlocks);
  blocks.width = ((columns + wanted - 1) / wanted + 15) / 16 * 16;
  blocks.count = blocks.width > 0 ? (columns + blocks.width - 1) / blocks.width : 0;
#endif
  return blocks;
}

const char* GemmLibrary() {
#if defined(__APPLE__)
  return "Accelerate (cblas_sgemm)";
#else
  return "OpenBLAS (scipy-openblas32, scipy_cblas_sgemm)";
#endif
}

const char* GemmConfig() {
#if defined(__APPLE__)
  return "";
#else
  return scipy_openblas_get_config();
#endif
}

}  // namespace tf_metal_ops
