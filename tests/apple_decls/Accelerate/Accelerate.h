// Declarations of the Accelerate (vecLib CBLAS) API csrc/cpu/gemm.cc uses, for the macOS
// cross-build (tests/cross/macos_arm64_build.sh) only. Not Apple's header: written from Apple's
// documentation of its current BLAS interface.
//   https://developer.apple.com/documentation/accelerate/blas
//   https://developer.apple.com/documentation/accelerate/1513264-cblas_sgemm
// With ACCELERATE_NEW_LAPACK defined (setup.py does) the SDK declares the current interface,
// available from macOS 13.3, whose LP64 entry points are exported under the `$NEWLAPACK` suffix
// (the SDK's __LAPACK_ALIAS attaches it as an asm label); the unsuffixed cblas_sgemm is the
// legacy, deprecated one. The dimensions are __LAPACK_int, a 32-bit int unless
// ACCELERATE_LAPACK_ILP64 is also defined (we do not).
#ifndef TF_METAL_OPS_APPLE_DECLS_ACCELERATE_H_
#define TF_METAL_OPS_APPLE_DECLS_ACCELERATE_H_

#ifndef ACCELERATE_NEW_LAPACK
#error "csrc/cpu/gemm.cc is built with ACCELERATE_NEW_LAPACK (setup.py)"
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef int __LAPACK_int;

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 };

void cblas_sgemm(const enum CBLAS_ORDER ORDER, const enum CBLAS_TRANSPOSE TRANSA,
                 const enum CBLAS_TRANSPOSE TRANSB, const __LAPACK_int M, const __LAPACK_int N,
                 const __LAPACK_int K, const float ALPHA, const float* A, const __LAPACK_int LDA,
                 const float* B, const __LAPACK_int LDB, const float BETA, float* C,
                 const __LAPACK_int LDC)
    __attribute__((availability(macos, introduced = 13.3))) __asm("_cblas_sgemm$NEWLAPACK");

#ifdef __cplusplus
}
#endif

#endif  // TF_METAL_OPS_APPLE_DECLS_ACCELERATE_H_
