// The CPU kernels' 16-bit loads and stores (csrc/cpu/simd/simd_vector.h: LoadFull, LoadN,
// StoreFull, StoreN for half and bfloat16), for tests/test_simd_conversions.py to compare with
// NumPy's float16 and ml_dtypes' bfloat16.
//
//   conversion_check [flush] < floats > out
// reads float32 bit patterns (uint32, native order) from stdin and writes, as uint16: the
// bfloat16 stores of them, then the half stores of them; then, as uint32, the float32 loads of
// every bfloat16 bit pattern (0 ... 65535), then of every half bit pattern. Elements go through
// the vector functions in chunks of 1, 2, ..., kLanes elements in turn, so the tail functions
// (LoadN, StoreN) see every count and the full ones (LoadFull, StoreFull) run too. A tail load's
// lanes past its count must hold the fill value, and a tail store must not write past its
// count: both are checked here, the number of violations printed on stderr (exit status 1).
//
// Built once per instruction set by the test, as the kernels are: with -DCHECK_AVX512 (16
// lanes), -DCHECK_AVX2 (8 lanes), or neither (the 4-lane SSE2 / NEON baseline).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "csrc/cpu/float_types.h"

#if defined(CHECK_AVX512)
#if defined(__clang__)
#pragma clang attribute push(                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))),               \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#define TF_METAL_OPS_SIMD_LANES 16
#define TMO_SIMD_AVX512 1
#elif defined(CHECK_AVX2)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define TF_METAL_OPS_SIMD_LANES 8
#define TMO_SIMD_AVX2 1
#else
#define TF_METAL_OPS_SIMD_LANES 4
#endif

namespace tf_metal_ops {
#include "csrc/cpu/simd/simd_vector.h"
}  // namespace tf_metal_ops

namespace {

using tf_metal_ops::BFloat16;
using tf_metal_ops::Half;
using tf_metal_ops::kLanes;
using tf_metal_ops::VF;

constexpr uint16_t kGuard = 0xa5a5;  // written past each tail store's count; must survive
constexpr float kFill = -3.25f;      // a tail load's lanes past its count

long violations = 0;

// Chunks of 1, 2, ..., kLanes, 1, 2, ... over [0, n).
template <typename Fn>
void ForEachChunk(size_t n, Fn fn) {
  int64_t size = 1;
  for (size_t begin = 0; begin < n; begin += static_cast<size_t>(size), size = size % kLanes + 1) {
    fn(begin, static_cast<int64_t>(std::min<size_t>(static_cast<size_t>(size), n - begin)));
  }
}

template <typename T>
std::vector<uint16_t> Stores(const std::vector<float>& in) {
  std::vector<uint16_t> out(in.size());
  ForEachChunk(in.size(), [&](size_t begin, int64_t count) {
    VF v = tf_metal_ops::Splat(0.0f);
    for (int64_t i = 0; i < count; ++i) v[i] = in[begin + i];
    T stored[tf_metal_ops::kLanes];
    for (int i = 0; i < kLanes; ++i) std::memcpy(&stored[i], &kGuard, 2);
    if (count == kLanes) {
      tf_metal_ops::StoreFull(stored, v);
    } else {
      tf_metal_ops::StoreN(stored, v, count);
    }
    for (int i = 0; i < kLanes; ++i) {
      uint16_t bits;
      std::memcpy(&bits, &stored[i], 2);
      if (i < count) {
        out[begin + i] = bits;
      } else if (bits != kGuard) {
        ++violations;
      }
    }
  });
  return out;
}

template <typename T>
std::vector<uint32_t> Loads() {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<uint32_t> out(all.size());
  ForEachChunk(all.size(), [&](size_t begin, int64_t count) {
    T source[tf_metal_ops::kLanes];
    std::memcpy(source, &all[begin], 2 * static_cast<size_t>(count));
    const VF v = tf_metal_ops::LoadN(source, count, kFill);
    for (int i = 0; i < kLanes; ++i) {
      const float lane = v[i];
      if (i < count) {
        std::memcpy(&out[begin + i], &lane, 4);
      } else if (std::memcmp(&lane, &kFill, 4) != 0) {
        ++violations;
      }
    }
  });
  return out;
}

}  // namespace

// Denormal inputs and results of float arithmetic read and written as zero, as on TensorFlow's
// threads (its kernels run with flush-to-zero and denormals-are-zero set), where the kernels'
// loads run.
void FlushDenormals() {
#if defined(__x86_64__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
#elif defined(__aarch64__)
  uint64_t fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  fpcr |= uint64_t{1} << 24;  // FZ
  __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "flush") == 0) FlushDenormals();
  std::vector<float> in;
  uint32_t buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 4, 4096, stdin)) > 0) {
    const size_t old = in.size();
    in.resize(old + got);
    std::memcpy(&in[old], buffer, 4 * got);
  }
  const std::vector<uint16_t> bf16 = Stores<BFloat16>(in);
  const std::vector<uint16_t> half = Stores<Half>(in);
  const std::vector<uint32_t> from_bf16 = Loads<BFloat16>();
  const std::vector<uint32_t> from_half = Loads<Half>();
  std::fwrite(bf16.data(), 2, bf16.size(), stdout);
  std::fwrite(half.data(), 2, half.size(), stdout);
  std::fwrite(from_bf16.data(), 4, from_bf16.size(), stdout);
  std::fwrite(from_half.data(), 4, from_half.size(), stdout);
  std::fprintf(stderr, "lanes %d, tail violations %ld\n", kLanes, violations);
  return violations == 0 ? 0 : 1;
}

#if (defined(CHECK_AVX2) || defined(CHECK_AVX512)) && defined(__clang__)
#pragma clang attribute pop
#endif
