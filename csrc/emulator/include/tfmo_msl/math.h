// MSL's math, common, geometric, relational and integer functions for the stand-in
// <metal_stdlib> (run mode). float uses the C++ library's functions (its own overloads, not
// wrappers: libc++ also declares them in the global namespace, where a second definition would
// make every unqualified call under `using namespace metal` ambiguous); half and bfloat compute
// in float and round back; a vector applies the scalar function to each component (a scalar
// operand of a vector function is repeated). fast:: and precise:: name the same functions: the
// emulator has one precision, the C++ library's.
#ifndef TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_MATH_H_
#define TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_MATH_H_

namespace metal {

namespace math_detail {
template <class T>
constexpr bool is_floating = std::is_floating_point<T>::value || std::is_same<T, half>::value ||
                             std::is_same<T, bfloat>::value;
template <class T>
constexpr bool is_16bit_float = std::is_same<T, half>::value || std::is_same<T, bfloat>::value;
template <class T>
constexpr bool is_integer = std::is_integral<T>::value && !std::is_same<T, bool>::value;

template <class... X>
constexpr bool any_vector = (vector_detail::is_vector<X> || ...);
template <class... X>
constexpr bool vector_call = any_vector<X...> &&
                             ((vector_detail::is_vector<X> || vector_detail::is_scalar<X>) && ...);

template <class... X>
struct first_vector {
  using type = void;
};
template <class X, class... Rest>
struct first_vector<X, Rest...> {
  using type = std::conditional_t<vector_detail::is_vector<X>, std::decay_t<X>,
                                  typename first_vector<Rest...>::type>;
};

// The size and element type of a call with these operands: its first vector's.
template <class... X>
struct shape {
  using vector = typename first_vector<X...>::type;
  static constexpr int size = vector_detail::size_of<vector>;
  using element = vector_detail::element_of<vector>;
};

template <class R, class F, class... X>
auto each(F f, const X&... x) {
  using S = shape<X...>;
  using T = typename S::element;
  using Out = std::conditional_t<std::is_void<R>::value, T, R>;
  const std::tuple<decltype(vector_detail::widen<T, S::size>(x))...> wide{
      vector_detail::widen<T, S::size>(x)...};
  vec<Out, S::size> out;
  for (int i = 0; i < S::size; ++i) {
    out[i] = Out(std::apply([&](const auto&... v) { return f(v[i]...); }, wide));
  }
  return out;
}

template <class T>
bool nan_value(T x) { return !(x == x); }
}  // namespace math_detail

// ---- floating-point functions of one argument ------------------------------------------------

#define TFMO_MATH_16BIT_AND_VECTOR(fn)                                                          \
  inline half fn(half x) { return half(fn(static_cast<float>(x))); }                            \
  inline bfloat fn(bfloat x) { return bfloat(fn(static_cast<float>(x))); }                      \
  template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>                    \
  auto fn(const V& v) {                                                                         \
    return vector_detail::map<void>(v, [](const auto& x) { return fn(x); });                    \
  }
#define TFMO_MATH_STD(fn) \
  using std::fn;          \
  TFMO_MATH_16BIT_AND_VECTOR(fn)
#define TFMO_MATH_OWN(fn, expression)         \
  inline float fn(float x) { return expression; } \
  TFMO_MATH_16BIT_AND_VECTOR(fn)

TFMO_MATH_STD(acos)
TFMO_MATH_STD(acosh)
TFMO_MATH_STD(asin)
TFMO_MATH_STD(asinh)
TFMO_MATH_STD(atan)
TFMO_MATH_STD(atanh)
TFMO_MATH_STD(ceil)
TFMO_MATH_STD(cos)
TFMO_MATH_STD(cosh)
TFMO_MATH_STD(exp)
TFMO_MATH_STD(exp2)
TFMO_MATH_STD(fabs)
TFMO_MATH_STD(floor)
TFMO_MATH_STD(log)
TFMO_MATH_STD(log10)
TFMO_MATH_STD(log2)
TFMO_MATH_STD(rint)
TFMO_MATH_STD(round)
TFMO_MATH_STD(sin)
TFMO_MATH_STD(sinh)
TFMO_MATH_STD(sqrt)
TFMO_MATH_STD(tan)
TFMO_MATH_STD(tanh)
TFMO_MATH_STD(trunc)
TFMO_MATH_OWN(rsqrt, 1.0f / std::sqrt(x))
TFMO_MATH_OWN(exp10, std::pow(10.0f, x))
// fract: x - floor(x), below 1 (Metal clamps to the largest float below 1).
TFMO_MATH_OWN(fract, std::fmin(x - std::floor(x), 0x1.fffffep-1f))
TFMO_MATH_OWN(cospi, std::cos(x * 3.14159265358979323846f))
TFMO_MATH_OWN(sinpi, std::sin(x * 3.14159265358979323846f))
TFMO_MATH_OWN(tanpi, std::tan(x * 3.14159265358979323846f))
TFMO_MATH_OWN(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
// sign: 1 or -1, a zero keeps its sign, NaN gives 0.
TFMO_MATH_OWN(sign, x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x == 0.0f ? x : 0.0f)
#undef TFMO_MATH_OWN
#undef TFMO_MATH_STD
#undef TFMO_MATH_16BIT_AND_VECTOR

// sincos: the sine, and the cosine through `c`.
inline float sincos(float x, float& c) {
  c = std::cos(x);
  return std::sin(x);
}

// ---- a float's exponent and parts: frexp, ldexp, ilogb, modf ---------------------------------
// Ti (the exponent) is int, or an int vector of the same size. ilogb and ldexp on float are the
// C++ library's own (a using-declaration, so they are the same functions as the global ones
// libc++ declares); frexp and modf take their outputs by reference, as MSL's do.
using std::ilogb;
using std::ldexp;
inline float frexp(float x, int& exponent) { return std::frexp(x, &exponent); }
inline float modf(float x, float& integral) { return std::modf(x, &integral); }
// half and bfloat through float, which holds every value, mantissa and integral part of theirs.
#define TFMO_MATH_PARTS_16BIT(T)                                          \
  inline T frexp(T x, int& exponent) { return T(frexp(float(x), exponent)); } \
  inline T ldexp(T x, int k) { return T(std::ldexp(float(x), k)); }       \
  inline int ilogb(T x) { return std::ilogb(float(x)); }                  \
  inline T modf(T x, T& integral) {                                       \
    float whole;                                                          \
    const float fraction = modf(float(x), whole);                         \
    integral = T(whole);                                                  \
    return T(fraction);                                                   \
  }                                                                       \
  inline T sincos(T x, T& c) {                                            \
    float cosine;                                                         \
    const float sine = sincos(float(x), cosine);                          \
    c = T(cosine);                                                        \
    return T(sine);                                                       \
  }
TFMO_MATH_PARTS_16BIT(half)
TFMO_MATH_PARTS_16BIT(bfloat)
#undef TFMO_MATH_PARTS_16BIT
// The vector forms, component by component: f(x[i], other[i]), `other` an output (frexp's
// exponent, modf's integral part, sincos's cosine) or ldexp's exponents.
namespace math_detail {
template <class T, int N, class Other, class F>
vec<T, N> per_component(const vec<T, N>& x, Other& other, F f) {
  vec<T, N> out;
  for (int i = 0; i < N; ++i) out[i] = f(x[i], other[i]);
  return out;
}
}  // namespace math_detail
template <class T, int N>
vec<T, N> frexp(const vec<T, N>& x, vec<int, N>& exponent) {
  return math_detail::per_component(x, exponent, [](T v, int& e) { return frexp(v, e); });
}
template <class T, int N>
vec<T, N> ldexp(const vec<T, N>& x, const vec<int, N>& k) {
  return math_detail::per_component(x, k, [](T v, int e) { return ldexp(v, e); });
}
template <class T, int N>
vec<T, N> modf(const vec<T, N>& x, vec<T, N>& integral) {
  return math_detail::per_component(x, integral, [](T v, T& whole) { return modf(v, whole); });
}
template <class T, int N>
vec<T, N> sincos(const vec<T, N>& x, vec<T, N>& c) {
  return math_detail::per_component(x, c, [](T v, T& cosine) { return sincos(v, cosine); });
}
template <class T, int N>
vec<int, N> ilogb(const vec<T, N>& x) {
  return math_detail::each<int>([](const auto& v) { return ilogb(v); }, x);
}

// ---- floating-point functions of two and three arguments ------------------------------------

#define TFMO_MATH_16BIT_AND_VECTOR2(fn)                                                       \
  inline half fn(half x, half y) {                                                            \
    return half(fn(static_cast<float>(x), static_cast<float>(y)));                            \
  }                                                                                           \
  inline bfloat fn(bfloat x, bfloat y) {                                                      \
    return bfloat(fn(static_cast<float>(x), static_cast<float>(y)));                          \
  }                                                                                           \
  template <class A, class B, std::enable_if_t<math_detail::vector_call<A, B>, int> = 0>      \
  auto fn(const A& a, const B& b) {                                                           \
    return math_detail::each<void>([](const auto& x, const auto& y) { return fn(x, y); }, a, b); \
  }
#define TFMO_MATH_STD2(fn) \
  using std::fn;           \
  TFMO_MATH_16BIT_AND_VECTOR2(fn)
#define TFMO_MATH_OWN2(fn, expression)                     \
  inline float fn(float x, float y) { return expression; } \
  TFMO_MATH_16BIT_AND_VECTOR2(fn)

TFMO_MATH_STD2(atan2)
TFMO_MATH_STD2(copysign)
TFMO_MATH_STD2(fdim)
TFMO_MATH_STD2(fmax)
TFMO_MATH_STD2(fmin)
TFMO_MATH_STD2(fmod)
TFMO_MATH_STD2(nextafter)
TFMO_MATH_STD2(pow)
TFMO_MATH_OWN2(powr, std::pow(x, y))
TFMO_MATH_OWN2(divide, x / y)
// step(edge, x): 0 below the edge, else 1.
TFMO_MATH_OWN2(step, y < x ? 0.0f : 1.0f)
#undef TFMO_MATH_OWN2
#undef TFMO_MATH_STD2
#undef TFMO_MATH_16BIT_AND_VECTOR2

#define TFMO_MATH_3(fn, expression)                                                            \
  inline float fn(float x, float y, float z) { return expression; }                            \
  inline half fn(half x, half y, half z) {                                                     \
    return half(fn(float(x), float(y), float(z)));                                             \
  }                                                                                            \
  inline bfloat fn(bfloat x, bfloat y, bfloat z) {                                             \
    return bfloat(fn(float(x), float(y), float(z)));                                           \
  }                                                                                            \
  template <class A, class B, class C,                                                         \
            std::enable_if_t<math_detail::vector_call<A, B, C>, int> = 0>                      \
  auto fn(const A& a, const B& b, const C& c) {                                                \
    return math_detail::each<void>(                                                            \
        [](const auto& x, const auto& y, const auto& z) { return fn(x, y, z); }, a, b, c);     \
  }
using std::fma;
TFMO_MATH_3(mix, x + (y - x) * z)
TFMO_MATH_3(smoothstep, (std::fmin(std::fmax((z - x) / (y - x), 0.0f), 1.0f)) *
                            (std::fmin(std::fmax((z - x) / (y - x), 0.0f), 1.0f)) *
                            (3.0f - 2.0f * std::fmin(std::fmax((z - x) / (y - x), 0.0f), 1.0f)))
TFMO_MATH_3(fmax3, std::fmax(std::fmax(x, y), z))
TFMO_MATH_3(fmin3, std::fmin(std::fmin(x, y), z))
TFMO_MATH_3(fmedian3, std::fmax(std::fmin(x, y), std::fmin(std::fmax(x, y), z)))
#undef TFMO_MATH_3
inline half fma(half x, half y, half z) { return half(std::fma(float(x), float(y), float(z))); }
inline bfloat fma(bfloat x, bfloat y, bfloat z) {
  return bfloat(std::fma(float(x), float(y), float(z)));
}
template <class A, class B, class C, std::enable_if_t<math_detail::vector_call<A, B, C>, int> = 0>
auto fma(const A& a, const B& b, const C& c) {
  return math_detail::each<void>(
      [](const auto& x, const auto& y, const auto& z) { return fma(x, y, z); }, a, b, c);
}

// ---- max, min, clamp, abs: any scalar type, and vectors --------------------------------------
// Floating-point max and min are fmax and fmin: a NaN operand gives the other one.

template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T max(T a, T b) {
  if constexpr (math_detail::is_floating<T>) {
    if (math_detail::nan_value(a)) return b;
    if (math_detail::nan_value(b)) return a;
  }
  return a < b ? b : a;
}
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T min(T a, T b) {
  if constexpr (math_detail::is_floating<T>) {
    if (math_detail::nan_value(a)) return b;
    if (math_detail::nan_value(b)) return a;
  }
  return b < a ? b : a;
}
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T abs(T x) { return x < T(0) ? T(-x) : x; }
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T max3(T a, T b, T c) { return max(max(a, b), c); }
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T min3(T a, T b, T c) { return min(min(a, b), c); }
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }

#define TFMO_VECTOR_OF_SCALAR_TEMPLATE2(fn)                                                     \
  template <class A, class B, std::enable_if_t<math_detail::vector_call<A, B>, int> = 0>        \
  auto fn(const A& a, const B& b) {                                                             \
    return math_detail::each<void>([](const auto& x, const auto& y) { return fn(x, y); }, a, b); \
  }
#define TFMO_VECTOR_OF_SCALAR_TEMPLATE3(fn)                                                   \
  template <class A, class B, class C,                                                        \
            std::enable_if_t<math_detail::vector_call<A, B, C>, int> = 0>                     \
  auto fn(const A& a, const B& b, const C& c) {                                               \
    return math_detail::each<void>(                                                           \
        [](const auto& x, const auto& y, const auto& z) { return fn(x, y, z); }, a, b, c);    \
  }
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(max)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(min)
TFMO_VECTOR_OF_SCALAR_TEMPLATE3(clamp)
TFMO_VECTOR_OF_SCALAR_TEMPLATE3(max3)
TFMO_VECTOR_OF_SCALAR_TEMPLATE3(min3)
TFMO_VECTOR_OF_SCALAR_TEMPLATE3(median3)
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto abs(const V& v) {
  return vector_detail::map<void>(v, [](const auto& x) { return abs(x); });
}

// ---- integer functions ------------------------------------------------------------------------

namespace math_detail {
template <class T>
using unsigned_of = std::make_unsigned_t<T>;
template <class T>
constexpr int bits = int(sizeof(T) * 8);
}  // namespace math_detail

#define TFMO_INTEGER_TEMPLATE \
  template <class T, std::enable_if_t<math_detail::is_integer<T>, int> = 0>
TFMO_INTEGER_TEMPLATE
T clz(T x) {
  using U = math_detail::unsigned_of<T>;
  U u = U(x);
  int n = 0;
  for (U top = U(U(1) << (math_detail::bits<T> - 1)); n < math_detail::bits<T> && !(u & top);
       u = U(u << 1)) {
    ++n;
  }
  return T(n);
}
TFMO_INTEGER_TEMPLATE
T ctz(T x) {
  using U = math_detail::unsigned_of<T>;
  U u = U(x);
  int n = 0;
  while (n < math_detail::bits<T> && !(u & U(1))) {
    u = U(u >> 1);
    ++n;
  }
  return T(n);
}
TFMO_INTEGER_TEMPLATE
T popcount(T x) {
  using U = math_detail::unsigned_of<T>;
  U u = U(x);
  int n = 0;
  for (; u; u = U(u & U(u - 1))) ++n;
  return T(n);
}
TFMO_INTEGER_TEMPLATE
T reverse_bits(T x) {
  using U = math_detail::unsigned_of<T>;
  U u = U(x), r = 0;
  for (int i = 0; i < math_detail::bits<T>; ++i, u = U(u >> 1)) r = U((r << 1) | (u & U(1)));
  return T(r);
}
// absdiff: |x - y| without overflow, as the unsigned type holds it.
TFMO_INTEGER_TEMPLATE
T absdiff(T x, T y) {
  using U = math_detail::unsigned_of<T>;
  return T(x > y ? U(U(x) - U(y)) : U(U(y) - U(x)));
}
TFMO_INTEGER_TEMPLATE
T addsat(T x, T y) {
  T r;
  if (__builtin_add_overflow(x, y, &r)) return y > T(0) ? std::numeric_limits<T>::max()
                                                        : std::numeric_limits<T>::min();
  return r;
}
TFMO_INTEGER_TEMPLATE
T subsat(T x, T y) {
  T r;
  if (__builtin_sub_overflow(x, y, &r)) return y < T(0) ? std::numeric_limits<T>::max()
                                                        : std::numeric_limits<T>::min();
  return r;
}
// hadd: (x + y) >> 1 and rhadd: (x + y + 1) >> 1, without overflow.
TFMO_INTEGER_TEMPLATE
T hadd(T x, T y) { return T((x >> 1) + (y >> 1) + (x & y & 1)); }
TFMO_INTEGER_TEMPLATE
T rhadd(T x, T y) {
  return T((x >> 1) + (y >> 1) + ((x | y) & 1));
}
// mulhi: the high half of the full product.
TFMO_INTEGER_TEMPLATE
T mulhi(T x, T y) {
  if constexpr (sizeof(T) < 8) {
    using W = std::conditional_t<std::is_signed<T>::value, int64_t, uint64_t>;
    return T((W(x) * W(y)) >> math_detail::bits<T>);
  } else {
    using W = std::conditional_t<std::is_signed<T>::value, __int128, unsigned __int128>;
    return T((W(x) * W(y)) >> 64);
  }
}
// rotate: left by y modulo the width.
TFMO_INTEGER_TEMPLATE
T rotate(T x, T y) {
  using U = math_detail::unsigned_of<T>;
  const int n = int(U(y) % U(math_detail::bits<T>));
  const U u = U(x);
  return T(n == 0 ? u : U(U(u << n) | U(u >> (math_detail::bits<T> - n))));
}
TFMO_INTEGER_TEMPLATE
T mul24(T x, T y) { return T(x * y); }
TFMO_INTEGER_TEMPLATE
T mad24(T x, T y, T z) { return T(x * y + z); }
#undef TFMO_INTEGER_TEMPLATE
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto clz(const V& v) { return vector_detail::map<void>(v, [](const auto& x) { return clz(x); }); }
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto ctz(const V& v) { return vector_detail::map<void>(v, [](const auto& x) { return ctz(x); }); }
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto popcount(const V& v) {
  return vector_detail::map<void>(v, [](const auto& x) { return popcount(x); });
}
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto reverse_bits(const V& v) {
  return vector_detail::map<void>(v, [](const auto& x) { return reverse_bits(x); });
}
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(absdiff)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(addsat)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(subsat)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(hadd)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(rhadd)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(mulhi)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(rotate)
TFMO_VECTOR_OF_SCALAR_TEMPLATE2(mul24)
TFMO_VECTOR_OF_SCALAR_TEMPLATE3(mad24)
#undef TFMO_VECTOR_OF_SCALAR_TEMPLATE2
#undef TFMO_VECTOR_OF_SCALAR_TEMPLATE3

// ---- relational functions --------------------------------------------------------------------

using std::isfinite;
using std::isinf;
using std::isnan;
using std::isnormal;
using std::signbit;
#define TFMO_RELATIONAL_16BIT_AND_VECTOR(fn)                                                \
  inline bool fn(half x) { return fn(static_cast<float>(x)); }                              \
  inline bool fn(bfloat x) { return fn(static_cast<float>(x)); }                            \
  template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>                \
  auto fn(const V& v) {                                                                     \
    return vector_detail::map<bool>(v, [](const auto& x) { return fn(x); });                \
  }
TFMO_RELATIONAL_16BIT_AND_VECTOR(isfinite)
TFMO_RELATIONAL_16BIT_AND_VECTOR(isinf)
TFMO_RELATIONAL_16BIT_AND_VECTOR(isnan)
TFMO_RELATIONAL_16BIT_AND_VECTOR(isnormal)
TFMO_RELATIONAL_16BIT_AND_VECTOR(signbit)
#undef TFMO_RELATIONAL_16BIT_AND_VECTOR

inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <int N>
bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) {
    if (!v[i]) return false;
  }
  return true;
}
template <int N>
bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) {
    if (v[i]) return true;
  }
  return false;
}
// select(a, b, c): b where c, else a.
template <class T, std::enable_if_t<vector_detail::is_scalar<T>, int> = 0>
T select(T a, T b, bool c) { return c ? b : a; }
template <class A, class B, int N>
auto select(const A& a, const B& b, const vec<bool, N>& c) {
  using T = typename math_detail::shape<A, B>::element;
  const vec<T, N> x = vector_detail::widen<T, N>(a), y = vector_detail::widen<T, N>(b);
  vec<T, N> out;
  for (int i = 0; i < N; ++i) out[i] = c[i] ? y[i] : x[i];
  return out;
}

// ---- geometric functions ---------------------------------------------------------------------

template <class A, class B, std::enable_if_t<math_detail::vector_call<A, B>, int> = 0>
auto dot(const A& a, const B& b) {
  using T = typename math_detail::shape<A, B>::element;
  const auto p = a * b;
  T sum = p[0];
  for (int i = 1; i < vector_detail::size_of<decltype(p)>; ++i) sum = T(sum + p[i]);
  return sum;
}
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto length_squared(const V& v) { return dot(v, v); }
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto length(const V& v) { return sqrt(dot(v, v)); }
template <class A, class B, std::enable_if_t<math_detail::vector_call<A, B>, int> = 0>
auto distance(const A& a, const B& b) { return length(a - b); }
template <class A, class B, std::enable_if_t<math_detail::vector_call<A, B>, int> = 0>
auto distance_squared(const A& a, const B& b) { return length_squared(a - b); }
template <class V, std::enable_if_t<vector_detail::is_vector<V>, int> = 0>
auto normalize(const V& v) { return v * rsqrt(dot(v, v)); }
template <class A, class B>
auto cross(const A& a, const B& b) {
  static_assert(vector_detail::size_of<A> == 3 && vector_detail::size_of<B> == 3,
                "MSL: cross takes two 3-vectors");
  const vector_detail::as_vec<A> x = a;
  const vector_detail::as_vec<B> y = b;
  return vector_detail::as_vec<A>(x[1] * y[2] - x[2] * y[1], x[2] * y[0] - x[0] * y[2],
                                  x[0] * y[1] - x[1] * y[0]);
}
// reflect(i, n): i - 2 dot(n, i) n.
template <class A, class B>
auto reflect(const A& i, const B& n) {
  return i - n * (dot(n, i) * 2);
}
// faceforward(n, i, nref): n if dot(nref, i) < 0, else -n.
template <class A, class B, class C>
auto faceforward(const A& n, const B& i, const C& nref) {
  const vector_detail::as_vec<A> v = n;
  return dot(nref, i) < 0 ? v : -v;
}

// ---- as_type: the same bits as another type of the same size ---------------------------------

template <class To, class From>
To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "MSL: as_type<T>(x) needs types of the same size");
  To to;
  std::memcpy(static_cast<void*>(&to), static_cast<const void*>(&from), sizeof(To));
  return to;
}

namespace fast {
using metal::acos;
using metal::asin;
using metal::atan;
using metal::atan2;
using metal::ceil;
using metal::clamp;
using metal::cos;
using metal::cosh;
using metal::cospi;
using metal::distance;
using metal::divide;
using metal::exp;
using metal::exp10;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::fmax;
using metal::fmin;
using metal::fmod;
using metal::frexp;
using metal::fract;
using metal::ilogb;
using metal::ldexp;
using metal::length;
using metal::log;
using metal::log10;
using metal::log2;
using metal::max;
using metal::min;
using metal::modf;
using metal::normalize;
using metal::pow;
using metal::powr;
using metal::rint;
using metal::round;
using metal::rsqrt;
using metal::saturate;
using metal::sign;
using metal::sin;
using metal::sincos;
using metal::sinh;
using metal::sinpi;
using metal::sqrt;
using metal::tan;
using metal::tanh;
using metal::tanpi;
using metal::trunc;
}  // namespace fast
namespace precise {
using namespace fast;
}  // namespace precise

}  // namespace metal

#endif  // TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_MATH_H_
