// Storage types of the logits and how they widen to the accumulator.
//
// Half and bfloat16 are stored as 16 bits and computed in float: every kernel reads through
// Load() and writes through Store(), so the arithmetic never happens in 16 bits.
#ifndef TF_METAL_OPS_CSRC_CPU_FLOAT_TYPES_H_
#define TF_METAL_OPS_CSRC_CPU_FLOAT_TYPES_H_

#include <cstdint>
#include <cstring>

namespace tf_metal_ops {

// The type only stores the 16 bits; Load and Store convert. On arm64, __fp16 is the ACLE's
// IEEE half storage type, which gcc and clang both accept in C++ and convert with the hardware's
// fcvt (gcc 12 defines __FLT16_MAX__ there but accepts _Float16 in C only). On x86-64, _Float16
// (gcc >= 12, clang >= 15), converted by F16C or by the compiler's runtime library.
#if defined(__aarch64__)
using Half = __fp16;
#elif defined(__FLT16_MAX__)
using Half = _Float16;
#else
#error "tf_metal_ops needs a compiler with _Float16 on x86-64 (gcc >= 12, clang >= 15)"
#endif
static_assert(sizeof(Half) == 2, "Half must be the 16-bit IEEE storage type");

// bfloat16 is the top half of an IEEE float, so widening is a shift.
struct BFloat16 {
  uint16_t bits;
};

template <typename T>
struct Accumulator {
  using type = float;  // half, bfloat16 and float accumulate in float
};
template <>
struct Accumulator<double> {
  using type = double;
};

inline float Load(Half value) { return static_cast<float>(value); }
inline float Load(float value) { return value; }
inline double Load(double value) { return value; }
inline float Load(BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.bits) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void Store(float value, Half* out) { *out = static_cast<Half>(value); }
inline void Store(float value, float* out) { *out = value; }
inline void Store(double value, double* out) { *out = value; }
inline void Store(float value, BFloat16* out) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    out->bits = static_cast<uint16_t>((bits >> 16) | 0x40u);  // keep NaN a (quiet) NaN
    return;
  }
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
  bits += 0x7fffu + ((bits >> 16) & 1u);
  out->bits = static_cast<uint16_t>(bits >> 16);
}

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_FLOAT_TYPES_H_
