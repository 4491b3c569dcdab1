// The row kernels for x86-64 CPUs with AVX2, FMA and F16C (8 float lanes, fused multiply-add,
// hardware half conversions), chosen at run time by rows_dispatch.cc on CPUs that report all three
// but not AVX-512 (rows_avx512.h). Empty on other architectures. Compiled once per storage type,
// as rows_portable.h is, by rows_avx2_<dtype>.cc.
//
// The instruction set is enabled by a target region around this file's own code, not by a
// compiler flag: every standard header is included before the region, so its inline functions
// are compiled for the baseline and a baseline CPU can never reach an AVX2 copy of them.
#if defined(__x86_64__)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "kernels/custom_loss_math.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace tf_metal_ops {
namespace avx2 {

#define TF_METAL_OPS_SIMD_LANES 8
#define TMO_SIMD_AVX2 1  // AVX2, FMA and F16C intrinsics may be used
#include "csrc/cpu/simd/simd_kernels.h"

}  // namespace avx2
}  // namespace tf_metal_ops

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // defined(__x86_64__)
