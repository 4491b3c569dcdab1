// The one matrix product the CPU kernels call: row-major single-precision GEMM on the
// platform's BLAS, chosen when the library is built (gemm.cc):
//   - macOS: Accelerate's cblas_sgemm (the system's own, tuned for Apple's cores and AMX);
//   - Linux (x86-64, aarch64): OpenBLAS from the scipy-openblas32 wheel, whose symbols carry a
//     `scipy_` prefix, so it never binds to (or is bound by) NumPy's or TensorFlow's copies of
//     BLAS in the same process.
#ifndef TF_METAL_OPS_CSRC_CPU_GEMM_H_
#define TF_METAL_OPS_CSRC_CPU_GEMM_H_

#include <cstdint>

namespace tf_metal_ops {

enum class Transpose : int { kNo = 0, kYes = 1 };

// C = alpha * op(A) op(B) + beta * C, every matrix row-major: op(A) is m x k, op(B) k x n, C
// m x n; lda, ldb, ldc are the row strides of A, B and C as stored. beta == 0 never reads C (it
// may hold anything, NaN included). Dimensions and strides must fit in 32 bits (the BLAS's
// integer); callers check that first (GemmFits).
void Sgemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc);

// Whether this process has the BLAS: always on Linux (the library links it); on macOS whether
// Accelerate's current interface (macOS 13.3 and later) is there. Sgemm must not be called
// where it is false.
bool GemmAvailable();

// Whether a product with these dimensions and strides can be handed to the BLAS.
bool GemmFits(int64_t m, int64_t n, int64_t k);

// Caps the BLAS's own threads at `threads` (>= 1), so that a kernel's products and its row
// passes on our pool (thread_pool.h), which run one after the other, use the same cores and never
// two pools at once. Cheap when the cap is unchanged. Accelerate manages its threads itself: a
// no-op there.
void SetGemmThreads(int threads);

// A wide product's columns cut into blocks, each block one BLAS call on one thread, the blocks
// claimed by our pool's threads as they come free (thread_pool.h). OpenBLAS's own threads split
// a product evenly up front and wait for each other at every packed panel, so a core that the
// OS gives to another process for a while stalls both (docs/performance.md: under load a step
// of the linear op took up to 5x its time where the composition of TensorFlow ops took 2x);
// whole blocks claimed dynamically move to the free core instead. OpenBLAS: blocks of at least kMinGemmColumnBlock
// columns, at most kMaxGemmColumnBlocks of them, widths a multiple of 16 (64-byte rows). Accelerate
// keeps one block: the whole product on its own threads and the AMX units, which our threads
// would only contend for.
struct GemmColumnBlocks {
  int64_t width = 0;  // columns per block (the last may have fewer)
  int64_t count = 0;  // blocks; 1 means one whole product on the BLAS's own threads
  static GemmColumnBlocks For(int64_t columns);
  int64_t Begin(int64_t block) const { return block * width; }
  int64_t End(int64_t block, int64_t columns) const {
    return block + 1 == count ? columns : (block + 1) * width;
  }
};
inline constexpr int64_t kMinGemmColumnBlock = 512;
inline constexpr int64_t kMaxGemmColumnBlocks = 16;

// "OpenBLAS 0.3.x (scipy-openblas32) ..." or "Accelerate": for build information and benches.
const char* GemmLibrary();
// The BLAS's own configuration string (OpenBLAS: version, core, thread model), or "".
const char* GemmConfig();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_GEMM_H_
