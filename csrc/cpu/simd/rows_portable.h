// The row kernels for the baseline every CPU of the architecture has: SSE2 on x86-64, NEON on
// arm64 (4 float lanes). Always built; rows_avx2.h adds a wider variant for x86-64.
//
// Compiled once per storage type: rows_portable_<dtype>.cc defines TF_METAL_OPS_ROWS_STORAGE
// and includes this (rows_dispatch.h says why a file each).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "kernels/custom_loss_math.h"

namespace tf_metal_ops {
namespace portable {

#define TF_METAL_OPS_SIMD_LANES 4
#include "csrc/cpu/simd/simd_kernels.h"

}  // namespace portable
}  // namespace tf_metal_ops
