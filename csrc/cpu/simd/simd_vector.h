// Portable float vectors and the elementwise math the row kernels need: Exp and Log.
//
// DELIBERATELY NO INCLUDE GUARD. This file is compiled once per instruction set: a
// rows_<isa>.cc file defines TF_METAL_OPS_SIMD_LANES, opens its own namespace (and, for AVX2
// and AVX-512, a target region) and includes it. Every name here therefore exists once per ISA
// and never collides. The includes it needs (<cstdint>, <cstring>, <limits>, the intrinsics headers) are
// made by the including file *before* any target region, so no standard-library inline
// function is ever compiled for a wider ISA than the baseline (it would be merged with the
// baseline copy at link time and could run on a CPU without that ISA).
//
// The vectors are GCC/clang vector extensions (`vector_size`), which both compilers lower to
// SSE2/AVX2/AVX-512 on x86-64 and to NEON on arm64, with IEEE semantics intact (no
// fast-math): NaN compares false, 0 * inf is NaN. Only a few operations use intrinsics (fused multiply-add,
// half conversions, the lane mask test) because the extensions have no spelling for them.
//
// Exp and Log: range reduction plus a polynomial, derived below; exp is within 0.99 ulp and log
// within 1.89 ulp of the exact value in float32 over their whole range (against the
// double-precision libm over every 16th float32 bit pattern, both lane widths;
// tests/test_simd_math.py checks every 256th in every run), and
// exact in the special cases: NaN -> NaN, exp(-inf) = 0, exp(x > 88.72) = inf, exp underflows
// through the subnormals to +0; log(0) = -inf, log(x < 0) = NaN, log(inf) = inf.

#ifndef TF_METAL_OPS_SIMD_LANES
#error "define TF_METAL_OPS_SIMD_LANES before including simd_vector.h"
#endif

#define TMO_SIMD_INLINE inline __attribute__((always_inline))

constexpr int kLanes = TF_METAL_OPS_SIMD_LANES;
typedef float VF __attribute__((vector_size(kLanes * 4)));      // the arithmetic type
typedef int32_t VI __attribute__((vector_size(kLanes * 4)));    // comparison masks, exponents
typedef uint32_t VU __attribute__((vector_size(kLanes * 4)));   // bit patterns
typedef uint16_t VH __attribute__((vector_size(kLanes * 2)));   // 16-bit storage (half, bf16)

TMO_SIMD_INLINE VF Splat(float x) { return VF{} + x; }
TMO_SIMD_INLINE VI SplatI(int32_t x) { return VI{} + x; }
TMO_SIMD_INLINE VU SplatU(uint32_t x) { return VU{} + x; }
TMO_SIMD_INLINE VI Iota() {
  VI v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// Same-size vector casts reinterpret the bits.
TMO_SIMD_INLINE VU Bits(VF x) { return (VU)x; }
TMO_SIMD_INLINE VF FromBits(VU x) { return (VF)x; }

// mask ? a : b, lane by lane (mask lanes are all ones or all zeros, as comparisons give).
TMO_SIMD_INLINE VF Select(VI mask, VF a, VF b) {
#if defined(TMO_SIMD_AVX2)
  return (VF)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)mask);
#elif defined(__aarch64__)
  return (VF)vbslq_f32((uint32x4_t)mask, (float32x4_t)a, (float32x4_t)b);
#else
  const VU m = (VU)mask;
  return FromBits((Bits(a) & m) | (Bits(b) & ~m));
#endif
}
// mask ? a : 0, and mask ? 0 : a.
TMO_SIMD_INLINE VF KeepIf(VI mask, VF a) { return FromBits(Bits(a) & (VU)mask); }
TMO_SIMD_INLINE VF DropIf(VI mask, VF a) {
#if defined(TMO_SIMD_AVX2)
  return (VF)_mm256_andnot_ps((__m256)mask, (__m256)a);
#else
  return FromBits(Bits(a) & ~(VU)mask);
#endif
}

// `x > m ? x : m`: the kernels' max, which never picks a NaN x. x86's maxps(x, m) is exactly
// this; elsewhere it is spelled out.
TMO_SIMD_INLINE VF MaxKeep(VF m, VF x) {
#if defined(TMO_SIMD_AVX512)
  return (VF)_mm512_max_ps((__m512)x, (__m512)m);
#elif defined(TMO_SIMD_AVX2)
  return (VF)_mm256_max_ps((__m256)x, (__m256)m);
#elif defined(__x86_64__)
  return (VF)_mm_max_ps((__m128)x, (__m128)m);
#else
  return Select(x > m, x, m);
#endif
}
// `x < m ? x : m`, the mirror image (minps(x, m)).
TMO_SIMD_INLINE VF MinKeep(VF m, VF x) {
#if defined(TMO_SIMD_AVX512)
  return (VF)_mm512_min_ps((__m512)x, (__m512)m);
#elif defined(TMO_SIMD_AVX2)
  return (VF)_mm256_min_ps((__m256)x, (__m256)m);
#elif defined(__x86_64__)
  return (VF)_mm_min_ps((__m128)x, (__m128)m);
#else
  return Select(x < m, x, m);
#endif
}

TMO_SIMD_INLINE VF Fma(VF a, VF b, VF c) {
#if defined(TMO_SIMD_AVX512)
  return (VF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(TMO_SIMD_AVX2)
  return (VF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  return (VF)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  return a * b + c;
#endif
}

// (1 + q) * scale for a power of two `scale` whose product is a normal float. A fused
// multiply-add rounds scale * (1 + q) once, which scaling by a power of two makes the same as
// rounding 1 + q and scaling it: the same bits, one instruction fewer. Without a fused
// multiply-add (Fma's last form) q * scale alone may round, so the sum is taken first.
TMO_SIMD_INLINE VF OnePlusTimes(VF q, VF scale) {
#if defined(TMO_SIMD_AVX512) || defined(TMO_SIMD_AVX2) || defined(__aarch64__)
  return Fma(q, scale, scale);
#else
  return (Splat(1.0f) + q) * scale;
#endif
}

// True when any lane of a comparison mask is set.
TMO_SIMD_INLINE bool Any(VI mask) {
#if defined(TMO_SIMD_AVX512)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(TMO_SIMD_AVX2)
  return _mm256_movemask_ps((__m256)mask) != 0;
#elif defined(__x86_64__) && TF_METAL_OPS_SIMD_LANES == 4
  return _mm_movemask_ps((__m128)mask) != 0;
#elif defined(__aarch64__)
  return vmaxvq_u32((uint32x4_t)mask) != 0;
#else
  int32_t any = 0;
  for (int i = 0; i < kLanes; ++i) any |= mask[i];
  return any != 0;
#endif
}

// v[i][j] <-> v[j][i]: kLanes vectors as the rows of a square block, transposed in registers.
// It only moves bits, so any spelling gives the same result; the shuffles of AVX2 and SSE do
// it in a few instructions per vector where a lane-by-lane copy takes two per element.
TMO_SIMD_INLINE void Transpose(VF* v) {
#if defined(TMO_SIMD_AVX512)
  // 16 x 16 in four rounds of 16 shuffles: pairs of rows interleaved (2 x 2 blocks of
  // elements), pairs of those (4 x 4), then 128-bit quarters moved twice (8 x 8, 16 x 16).
  __m512 a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_ps((__m512)v[i], (__m512)v[i + 1]);
    a[i + 1] = _mm512_unpackhi_ps((__m512)v[i], (__m512)v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_shuffle_ps(a[i], a[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    b[i + 1] = _mm512_shuffle_ps(a[i], a[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    b[i + 2] = _mm512_shuffle_ps(a[i + 1], a[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    b[i + 3] = _mm512_shuffle_ps(a[i + 1], a[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // b[4q + j] holds column j (of each 128-bit quarter) for rows 4q..4q+3, quarter by quarter.
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(2, 0, 2, 0));
    a[i + 4] = _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(3, 1, 3, 1));
    a[i + 8] = _mm512_shuffle_f32x4(b[i + 8], b[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
    a[i + 12] = _mm512_shuffle_f32x4(b[i + 8], b[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = (VF)_mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(2, 0, 2, 0));
    v[i + 8] = (VF)_mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(3, 1, 3, 1));
    v[i + 4] = (VF)_mm512_shuffle_f32x4(a[i + 4], a[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
    v[i + 12] = (VF)_mm512_shuffle_f32x4(a[i + 4], a[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
#elif defined(TMO_SIMD_AVX2)
  const __m256 t0 = _mm256_unpacklo_ps((__m256)v[0], (__m256)v[1]);
  const __m256 t1 = _mm256_unpackhi_ps((__m256)v[0], (__m256)v[1]);
  const __m256 t2 = _mm256_unpacklo_ps((__m256)v[2], (__m256)v[3]);
  const __m256 t3 = _mm256_unpackhi_ps((__m256)v[2], (__m256)v[3]);
  const __m256 t4 = _mm256_unpacklo_ps((__m256)v[4], (__m256)v[5]);
  const __m256 t5 = _mm256_unpackhi_ps((__m256)v[4], (__m256)v[5]);
  const __m256 t6 = _mm256_unpacklo_ps((__m256)v[6], (__m256)v[7]);
  const __m256 t7 = _mm256_unpackhi_ps((__m256)v[6], (__m256)v[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  v[0] = (VF)_mm256_permute2f128_ps(s0, s4, 0x20);
  v[1] = (VF)_mm256_permute2f128_ps(s1, s5, 0x20);
  v[2] = (VF)_mm256_permute2f128_ps(s2, s6, 0x20);
  v[3] = (VF)_mm256_permute2f128_ps(s3, s7, 0x20);
  v[4] = (VF)_mm256_permute2f128_ps(s0, s4, 0x31);
  v[5] = (VF)_mm256_permute2f128_ps(s1, s5, 0x31);
  v[6] = (VF)_mm256_permute2f128_ps(s2, s6, 0x31);
  v[7] = (VF)_mm256_permute2f128_ps(s3, s7, 0x31);
#elif defined(__x86_64__) && TF_METAL_OPS_SIMD_LANES == 4
  __m128 r0 = (__m128)v[0], r1 = (__m128)v[1], r2 = (__m128)v[2], r3 = (__m128)v[3];
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  v[0] = (VF)r0;
  v[1] = (VF)r1;
  v[2] = (VF)r2;
  v[3] = (VF)r3;
#else
  for (int i = 0; i < kLanes; ++i) {
    for (int j = i + 1; j < kLanes; ++j) {
      const float a = v[i][j];
      v[i][j] = v[j][i];
      v[j][i] = a;
    }
  }
#endif
}

TMO_SIMD_INLINE float ReduceAdd(VF v) {
  // Pairwise halving: the same tree on every ISA width, and fewer roundings than a chain.
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}
TMO_SIMD_INLINE float ReduceMaxKeep(VF v, float m) {
  for (int i = 0; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// ---- exp ------------------------------------------------------------------------------------
// exp(x) = 2^k * exp(f), k = round(x / ln 2), f = x - k ln 2 in [-ln2/2, ln2/2].
// - k ln 2 is subtracted in two parts (Cody and Waite): kLn2Hi has its low 12 bits zero, so
//   k * kLn2Hi is exact for |k| < 2^12 and x - k * kLn2Hi is exact (the operands are within
//   a factor of two); kLn2Lo = ln 2 - kLn2Hi carries the rest.
// - exp(f) = 1 + f + f^2 P(f) with P of degree 4: the coefficients minimize the largest
//   relative error of exp over [-ln2/2, ln2/2] (fitted for this file by iteratively reweighted
//   least squares; they stay within 1e-4 of the Taylor coefficients 1/2, 1/6, 1/24, 1/120,
//   1/720). The fit's error is 3.1e-9, far under float32's 6e-8 half-ulp, so what remains is
//   the rounding of the Horner steps, about 1 ulp. The leading 1 is added last.
// - 2^k is built in the exponent bits. Usually k is in [-126, 126] and one normal 2^k does.
//   Otherwise (|x| beyond 87) 2^k is applied as 2^k1 * 2^k2 with k1 = k / 2: the first product
//   is exact (normal), the second rounds once, which gives correctly rounded subnormals and a
//   clean overflow to inf.
// - Inputs are clamped to [-104, 89] first (below exp(-104) < 2^-150 everything rounds to 0;
//   above 88.73 everything overflows), which keeps k in range for -inf and +inf. The clamp
//   lets a NaN through, and every later step keeps it NaN.
TMO_SIMD_INLINE VF ClampKeepingNaN(VF x, float lo, float hi) {
#if defined(TMO_SIMD_AVX512)
  return (VF)_mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), (__m512)x));
#elif defined(TMO_SIMD_AVX2)
  // maxps/minps return their second operand when either is NaN.
  return (VF)_mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), (__m256)x));
#elif defined(__x86_64__)
  return (VF)_mm_min_ps(_mm_set1_ps(hi), _mm_max_ps(_mm_set1_ps(lo), (__m128)x));
#elif defined(__aarch64__)
  return (VF)vminq_f32(vdupq_n_f32(hi), vmaxq_f32(vdupq_n_f32(lo), (float32x4_t)x));  // NaN wins
#else
  return Select(x < Splat(lo), Splat(lo), Select(x > Splat(hi), Splat(hi), x));
#endif
}

// The largest |x| whose exp needs no care for the range of 2^k (below). A caller that knows
// every lane is within it (a softmax row whose logits span at most this much below the
// maximum) calls Exp<false>, which skips the clamp and the test: on such lanes the clamp is the
// identity and the test fails, so the result is the same bit for bit, for 6 fewer instructions
// per vector of the row's most frequent operation.
constexpr float kExpPlainRange = 87.3f;

constexpr float kLn2Hi = 0.693145751953125f;          // 0x3f317200
constexpr float kLn2Lo = 1.428606820309417232e-06f;   // ln 2 - kLn2Hi

// exp(f) - 1 = f + f^2 P(f) for f in [-ln2/2, ln2/2] (P above).
TMO_SIMD_INLINE VF Expm1Reduced(VF f) {
  VF poly = Splat(1.381461276e-03f);
  poly = Fma(poly, f, Splat(8.368710056e-03f));
  poly = Fma(poly, f, Splat(4.166838899e-02f));
  poly = Fma(poly, f, Splat(1.666652113e-01f));
  poly = Fma(poly, f, Splat(4.999999404e-01f));
  return Fma(poly, f * f, f);
}

template <bool kAnyRange = true>
TMO_SIMD_INLINE VF Exp(VF x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundMagic = 12582912.0f;            // 1.5 * 2^23: adding it rounds to an integer
  const VF xc = kAnyRange ? ClampKeepingNaN(x, -104.0f, 89.0f) : x;
  // k + 1.5 * 2^23 holds the integer k in its low mantissa bits.
  const VF k_magic = Fma(xc, Splat(kLog2e), Splat(kRoundMagic));
  const VF kf = k_magic - Splat(kRoundMagic);
  VF f = Fma(kf, Splat(-kLn2Hi), xc);
  f = Fma(kf, Splat(-kLn2Lo), f);
  const VF expm1f = Expm1Reduced(f);  // exp(f) - 1
  // |x| <= 87.3 gives k in [-126, 126]. (A NaN lane passes the test with a meaningless k; its
  // result is NaN, from expm1f.)
  if (!kAnyRange || !Any(FromBits(Bits(xc) & SplatU(0x7fffffffu)) > Splat(kExpPlainRange))) {
    // 2^k = (k + 127) << 23, shifted straight out of k_magic's bits: the magic's own bits
    // below bit 9 are 0, so they leave k << 23, modulo 2^32 for a negative k. No conversion
    // to integers.
    const VF scale = FromBits((Bits(k_magic) << 23) + SplatU(127u << 23));
    return OnePlusTimes(expm1f, scale);
  }
  const VI k = __builtin_convertvector(kf, VI);
  const VF expf = Splat(1.0f) + expm1f;
  const VI k1 = k >> 1;  // arithmetic shift: floor(k / 2)
  const VI k2 = k - k1;
  const VF scale1 = FromBits((VU)(k1 + 127) << 23);
  const VF scale2 = FromBits((VU)(k2 + 127) << 23);
  return (expf * scale1) * scale2;
}

// ---- log ------------------------------------------------------------------------------------
// log(x) = e ln 2 + log(m) with x = m 2^e and m in [sqrt(1/2), sqrt(2)).
// - log(m) = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (m - 1) / (m + 1), |s| <= 0.1716:
//   m - 1 is exact (Sterbenz), and stopping after s^9/9 leaves s^11/11 < 2e-9 relative.
// - e ln 2 again in two parts, the large one added last so no digit of log(m) is lost.
// - Subnormal inputs are scaled by 2^23 first; 0, negatives, inf and NaN are set at the end.
TMO_SIMD_INLINE VF Log(VF x) {
  constexpr float kMinNormal = 1.17549435e-38f;  // 2^-126
  const VI subnormal = x < Splat(kMinNormal);
  const VF xs = Select(subnormal, x * Splat(8388608.0f), x);  // * 2^23
  const VU bits = Bits(xs);
  VI e = (VI)(bits >> 23) - SplatI(127) - (subnormal & SplatI(23));
  VF m = FromBits((bits & SplatU(0x007fffffu)) | SplatU(0x3f800000u));  // in [1, 2)
  const VI big = m > Splat(1.41421356f);
  m = Select(big, m * Splat(0.5f), m);
  e = e - big;  // big lanes are -1: e + 1
  const VF s = (m - Splat(1.0f)) / (m + Splat(1.0f));
  const VF z = s * s;
  VF poly = Splat(1.0f / 9.0f);
  poly = Fma(poly, z, Splat(1.0f / 7.0f));
  poly = Fma(poly, z, Splat(1.0f / 5.0f));
  poly = Fma(poly, z, Splat(1.0f / 3.0f));
  const VF two_s = s + s;
  const VF log_m = Fma(two_s * z, poly, two_s);
  const VF ef = __builtin_convertvector(e, VF);
  VF result = Fma(ef, Splat(kLn2Hi), Fma(ef, Splat(kLn2Lo), log_m));
  result = Select(x == Splat(0.0f), Splat(-std::numeric_limits<float>::infinity()), result);
  result = Select(x < Splat(0.0f), Splat(std::numeric_limits<float>::quiet_NaN()), result);
  result = Select(x == Splat(std::numeric_limits<float>::infinity()), x, result);
  return Select(x != x, x + x, result);
}

// ---- log1p and expm1 -------------------------------------------------------------------------
// For the per-row quantities of small-class rows, which are computed kLanes rows at a time
// (simd_row_groups.h); a row of many classes computes them once in scalar (<cmath>).
// - log1p(x) = log(u) * x / (u - 1) with u = 1 + x rounded (Goldberg): u - 1 is exact, and the
//   ratio x / (u - 1) corrects log(u) for the rounding of u to first order, so the result keeps
//   Log's accuracy plus a few ulp even where x is far below 1 (where log(1 + x) alone would
//   lose every digit: u == 1 exactly, and then log1p(x) = x to float precision).
// - expm1(x) = (u - 1) * x / log(u) with u = exp(x) rounded (Kahan), by the same argument;
//   u == 1 gives x, u - 1 == -1 (x below about -17) gives -1, u == inf gives inf.
// Over every 64th float32 bit pattern against the double-precision libm (both lane widths;
// tests/test_simd_math.py checks every 256th in every run): log1p within 3.7 ulp, expm1 within
// 3.9 ulp.
// Special values: log1p(-1) = -inf, log1p(x < -1) = NaN, log1p(inf) = inf, expm1(-inf) = -1;
// NaN stays NaN.
TMO_SIMD_INLINE VF Log1p(VF x) {
  const VF u = Splat(1.0f) + x;
  const VF um1 = u - Splat(1.0f);
  const VF log_u = Log(u);
  VF result = log_u * (x / um1);
  result = Select(um1 == Splat(0.0f), x, result);
  return Select(u == Splat(std::numeric_limits<float>::infinity()), u, result);
}
TMO_SIMD_INLINE VF Expm1(VF x) {
  const VF u = Exp(x);
  const VF um1 = u - Splat(1.0f);
  VF result = um1 * (x / Log(u));
  result = Select(um1 == Splat(0.0f), x, result);
  result = Select(um1 == Splat(-1.0f), um1, result);
  return Select(u == Splat(std::numeric_limits<float>::infinity()), u, result);
}

// 1 - exp(x) = -expm1(x) for x in [-ln 2 - 1/16, 0]: a softmax's r = 1 - p from lp = log p
// where p > 1/2, which 1 - p would round away. Exp's reduction with k = 0 or -1 only, so no
// Log and no division (Expm1 above): where x < -ln2/2, f = x + ln 2 (x + kLn2Hi is exact, the
// operands being within a factor of two) and 1 - exp(x) = 1/2 - (exp(f) - 1) / 2; elsewhere
// f = x and 1 - exp(x) = -(exp(f) - 1). Within 0.94 ulp over every 16th float32 of that
// domain against the double-precision libm (tests/test_simd_math.py checks every 256th against
// 1 ulp); x = +-0 gives +0, NaN stays NaN.
TMO_SIMD_INLINE VF OneMinusExpNearZero(VF x) {
  const VI reduced = x < Splat(-0.3465735903f);  // -ln2/2
  const VF f = Select(reduced, (x + Splat(kLn2Hi)) + Splat(kLn2Lo), x);
  const VF q = Expm1Reduced(f);
  return Select(reduced, Splat(0.5f) - Splat(0.5f) * q, Splat(0.0f) - q);
}

// ---- loads and stores of every storage type, widened to / narrowed from float -----------------
TMO_SIMD_INLINE VF LoadFull(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
TMO_SIMD_INLINE VF LoadFull(const BFloat16* p) {
#if defined(TMO_SIMD_AVX512)
  return (VF)_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(TMO_SIMD_AVX2)
  // vpmovzxwd from memory and one shift: the generic widening below compiles to a 128-bit load,
  // two half-width widenings and an insert.
  return (VF)_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  VH h;
  std::memcpy(&h, p, sizeof(h));
  return FromBits(__builtin_convertvector(h, VU) << 16);  // bfloat16 is a float's top half
#endif
}
TMO_SIMD_INLINE VF LoadFull(const Half* p) {
#if defined(TMO_SIMD_AVX512)
  return (VF)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(TMO_SIMD_AVX2)
  return (VF)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__aarch64__)
  return (VF)vcvt_f32_f16(vld1_f16(reinterpret_cast<const __fp16*>(p)));
#else
  // IEEE half -> float by bits: exponent and mantissa moved up 13 places, the exponent rebiased
  // by adding 127 - 15 to it. A subnormal half (exponent 0) is its mantissa times 2^-24, made
  // from the integer: a float32 subnormal at any step would read as zero on a thread that
  // flushes denormals, as TensorFlow's do. Inf and NaN (exponent all ones) get a float exponent
  // of all ones instead, keeping the NaN payload.
  VH h;
  std::memcpy(&h, p, sizeof(h));
  const VU wide = __builtin_convertvector(h, VU);
  const VU sign = (wide & SplatU(0x8000u)) << 16;
  const VU magnitude = wide & SplatU(0x7fffu);
  const VF normal = FromBits((magnitude << 13) + SplatU((127u - 15u) << 23));
  const VF subnormal =
      __builtin_convertvector((VI)magnitude, VF) * Splat(5.9604644775390625e-08f);  // 2^-24
  const VF inf_nan = FromBits((magnitude << 13) | SplatU(0x7f800000u));
  VF value = Select((VI)(magnitude < SplatU(0x0400u)), subnormal, normal);
  value = Select((VI)(magnitude >= SplatU(0x7c00u)), inf_nan, value);
  return FromBits(Bits(value) | sign);
#endif
}

TMO_SIMD_INLINE void StoreFull(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }
#if defined(TMO_SIMD_AVX512)
// The 16 lanes rounded to 16 bits, packed in one 256-bit register, for full and masked stores.
TMO_SIMD_INLINE __m256i NarrowToHalf(VF v) {
  return _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
TMO_SIMD_INLINE __m256i NarrowToBFloat16(VF v) {
  // The integer rounding of the generic StoreFull below in AVX-512's form: the quiet bit set
  // under the NaN lanes' mask register, and vpmovdw narrowing the shifted lanes. AVX-512 BF16's
  // vcvtneps2bf16 would round in one instruction, but it treats float32 subnormal inputs as zero
  // (measured on AMD Zen 4 over all 2^32 inputs: the subnormals that round to a nonzero bfloat16
  // differ, everything else, NaN included, agrees), small gradients are subnormal, and CPUs
  // without AVX-512 BF16 would need a variant of their own.
  const __m512i bits = (__m512i)v;
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lowest_kept);
  const __mmask16 is_nan = _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, is_nan, bits, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif
TMO_SIMD_INLINE void StoreFull(BFloat16* p, VF v) {
  // Round to nearest even as float_types.h's Store does; NaN stays a quiet NaN.
#if defined(TMO_SIMD_AVX512)
  // The integer rounding below in AVX-512's form: the quiet bit set under the NaN lanes' mask
  // register, and vpmovdw narrowing (truncating) the shifted lanes on their way to memory.
  // AVX-512 BF16's vcvtneps2bf16 would round in one instruction, but it treats float32
  // subnormal inputs as zero (measured on AMD Zen 4 over all 2^32 inputs: the subnormals that
  // round to a nonzero bfloat16 differ, everything else, NaN included, agrees), and small
  // gradients are subnormal; CPUs without it would also need a variant of their own.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), NarrowToBFloat16(v));
#elif defined(TMO_SIMD_AVX2)
  // The same bits in fewer instructions: the NaN lanes from one unordered compare, their quiet
  // bit set before the shift, and the halves packed by packusdw (each is at most 0xffff, so
  // nothing saturates) where the generic narrowing below takes a long shuffle sequence.
  const __m256i bits = (__m256i)v;
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lowest_kept);
  const __m256i quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256 is_nan = _mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q);
  const __m256i out = _mm256_srli_epi32(
      (__m256i)_mm256_blendv_ps((__m256)rounded, (__m256)quiet_nan, is_nan), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(out),
                                    _mm256_extracti128_si256(out, 1)));
#else
  const VU bits = Bits(v);
  const VU rounded = (bits + SplatU(0x7fffu) + ((bits >> 16) & SplatU(1u))) >> 16;
  const VU quiet_nan = (bits >> 16) | SplatU(0x40u);
  const VI is_nan = (VI)((bits & SplatU(0x7fffffffu)) > SplatU(0x7f800000u));
  const VU out = (quiet_nan & (VU)is_nan) | (rounded & ~(VU)is_nan);
  const VH h = __builtin_convertvector(out, VH);
  std::memcpy(p, &h, sizeof(h));
#endif
}
TMO_SIMD_INLINE void StoreFull(Half* p, VF v) {
#if defined(TMO_SIMD_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), NarrowToHalf(v));
#elif defined(TMO_SIMD_AVX2)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__aarch64__)
  vst1_f16(reinterpret_cast<__fp16*>(p), vcvt_f16_f32((float32x4_t)v));
#else
  for (int i = 0; i < kLanes; ++i) Store(v[i], &p[i]);
#endif
}

// The first n (< kLanes) elements, the other lanes set to `fill`: the tail of a row.
template <typename T>
TMO_SIMD_INLINE VF LoadN(const T* p, int64_t n, float fill) {
  if (n >= kLanes) return LoadFull(p);
  VF v = Splat(fill);
  for (int64_t i = 0; i < n; ++i) v[i] = Load(p[i]);
  return v;
}
template <typename T>
TMO_SIMD_INLINE void StoreN(T* p, VF v, int64_t n) {
  if (n >= kLanes) return StoreFull(p, v);
  for (int64_t i = 0; i < n; ++i) Store(v[i], &p[i]);
}
#if defined(TMO_SIMD_AVX2)
// Float tails with AVX2's masked moves, which never touch the lanes past n (no fault at the end
// of a buffer). For small class counts (C = 10: one vector and a tail of two) the tail is a
// large part of every pass, and the element-by-element loop above dominated it.
TMO_SIMD_INLINE VF LoadN(const float* p, int64_t n, float fill) {
  if (n >= kLanes) return LoadFull(p);
  const VI mask = Iota() < SplatI(static_cast<int32_t>(n));
  return Select(mask, (VF)_mm256_maskload_ps(p, (__m256i)mask), Splat(fill));
}
TMO_SIMD_INLINE void StoreN(float* p, VF v, int64_t n) {
  if (n >= kLanes) return StoreFull(p, v);
  _mm256_maskstore_ps(p, (__m256i)(Iota() < SplatI(static_cast<int32_t>(n))), (__m256)v);
}
#endif
#if defined(TMO_SIMD_AVX512)
// Tails of every storage type with AVX-512's masked moves (no fault past n, as above): at 16
// lanes a tail is up to 15 elements, which the element-by-element loop above takes one at a
// time.
TMO_SIMD_INLINE __mmask16 FirstLanes(int64_t n) {
  return static_cast<__mmask16>((1u << n) - 1u);  // n < 16
}
TMO_SIMD_INLINE VF LoadN(const float* p, int64_t n, float fill) {
  if (n >= kLanes) return LoadFull(p);
  return (VF)_mm512_mask_loadu_ps(_mm512_set1_ps(fill), FirstLanes(n), p);
}
TMO_SIMD_INLINE VF LoadN(const Half* p, int64_t n, float fill) {
  if (n >= kLanes) return LoadFull(p);
  const __mmask16 mask = FirstLanes(n);
  const __m512 wide = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  return (VF)_mm512_mask_blend_ps(mask, _mm512_set1_ps(fill), wide);
}
TMO_SIMD_INLINE VF LoadN(const BFloat16* p, int64_t n, float fill) {
  if (n >= kLanes) return LoadFull(p);
  const __mmask16 mask = FirstLanes(n);
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16);
  return (VF)_mm512_mask_blend_ps(mask, _mm512_set1_ps(fill), (__m512)wide);
}
TMO_SIMD_INLINE void StoreN(float* p, VF v, int64_t n) {
  if (n >= kLanes) return StoreFull(p, v);
  _mm512_mask_storeu_ps(p, FirstLanes(n), (__m512)v);
}
TMO_SIMD_INLINE void StoreN(Half* p, VF v, int64_t n) {
  if (n >= kLanes) return StoreFull(p, v);
  _mm256_mask_storeu_epi16(p, FirstLanes(n), NarrowToHalf(v));
}
TMO_SIMD_INLINE void StoreN(BFloat16* p, VF v, int64_t n) {
  if (n >= kLanes) return StoreFull(p, v);
  _mm256_mask_storeu_epi16(p, FirstLanes(n), NarrowToBFloat16(v));
}
#endif
