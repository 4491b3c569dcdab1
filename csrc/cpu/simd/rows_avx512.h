// The row kernels for x86-64 CPUs with AVX-512 F, BW, VL and DQ besides AVX2, FMA and F16C
// (16 float lanes, mask registers, masked loads and stores of 16-bit tails), chosen at run time
// by rows_dispatch.cc only where the CPU reports them and the OS saves the ZMM and mask
// registers. Empty on other architectures. Compiled once per storage type, as rows_portable.h is,
// by rows_avx512_<dtype>.cc.
//
// The instruction set is enabled by a target region around this file's own code, as in
// rows_avx2.h (see there why not by a compiler flag).
#if defined(__x86_64__)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// GCC 12's AVX-512 intrinsics initialize their undefined operands from themselves (`__Y = __Y`),
// which -Wmaybe-uninitialized reports at every use (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "kernels/custom_loss_math.h"

#if defined(__clang__)
#pragma clang attribute push(                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))),               \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace tf_metal_ops {
namespace avx512 {

#define TF_METAL_OPS_SIMD_LANES 16
#define TMO_SIMD_AVX512 1  // AVX-512 F/BW/VL/DQ, FMA and F16C intrinsics may be used
#include "csrc/cpu/simd/simd_kernels.h"

}  // namespace avx512
}  // namespace tf_metal_ops

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // defined(__x86_64__)
