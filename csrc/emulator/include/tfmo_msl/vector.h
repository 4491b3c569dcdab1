// MSL's vector types for the stand-in <metal_stdlib> (run mode; address-space mode uses clang's
// ext_vector_type instead): vec<T, N> for N = 2, 3, 4 with Metal's sizes and alignments (a
// 3-vector takes the room of 4, as float3 does in Metal), components .x .y .z .w and .r .g .b
// .a, every swizzle of 2 to 4 components read and written (.xy, .zyx, .bgra; a swizzle that
// names a component twice is read-only, as in Metal), constructors from any mix of scalars and
// vectors that adds up to N, explicit conversion between element types, and the component-wise
// operators with a scalar on either side. packed_vec<T, N> (packed_float3, ...) is the
// unaligned storage type: components, [] and conversion to and from vec.
//
// Copies go element by element and are always inlined: the traffic build of tests/msl_host
// (-fsanitize-coverage=trace-loads) must see one load or store per element, at the kernel's
// own instruction (an out-of-line copy constructor is one comdat function, and the linker may
// keep an uninstrumented copy of it), and no element loop clang could turn into a memcpy.
#ifndef TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_VECTOR_H_
#define TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_VECTOR_H_

namespace metal {

template <typename T, int N>
struct vec;
template <typename T, int N, int... I>
struct swizzle;
template <typename T, int N>
struct packed_vec;

namespace vector_detail {

// Storage slots of an N-vector: Metal's float3 has the size and alignment of float4.
template <int N>
constexpr int slots() { return N == 3 ? 4 : N; }

template <int... I>
constexpr bool distinct() {
  const int index[] = {I...};
  for (size_t a = 0; a < sizeof...(I); ++a) {
    for (size_t b = a + 1; b < sizeof...(I); ++b) {
      if (index[a] == index[b]) return false;
    }
  }
  return true;
}

template <class X>
struct traits {
  static constexpr bool is_vector = false;
  static constexpr int size = 1;
  using element = X;
};
template <class T, int N>
struct traits<vec<T, N>> {
  static constexpr bool is_vector = true;
  static constexpr int size = N;
  using element = T;
};
template <class T, int N, int... I>
struct traits<swizzle<T, N, I...>> {
  static constexpr bool is_vector = true;
  static constexpr int size = sizeof...(I);
  using element = T;
};
template <class T, int N>
struct traits<packed_vec<T, N>> {
  static constexpr bool is_vector = true;
  static constexpr int size = N;
  using element = T;
};

template <class X>
constexpr bool is_vector = traits<std::decay_t<X>>::is_vector;
template <class X>
constexpr int size_of = traits<std::decay_t<X>>::size;
template <class X>
using element_of = typename traits<std::decay_t<X>>::element;

// A scalar a vector may be combined with: the arithmetic types, half and bfloat.
template <class X>
constexpr bool is_scalar = std::is_arithmetic<std::decay_t<X>>::value ||
                           std::is_same<std::decay_t<X>, half>::value ||
                           std::is_same<std::decay_t<X>, bfloat>::value;

template <class X>
using as_vec = vec<element_of<X>, size_of<X>>;

// x as a vec<T, N>: a vector converted, a scalar repeated.
template <class T, int N, class X>
TFMO_SHIM_ELEMENTWISE vec<T, N> widen(const X& x) {
  if constexpr (is_vector<X>) {
    static_assert(size_of<X> == N, "MSL: vectors of different sizes in one operation");
    const as_vec<X> v = x;
    vec<T, N> out;
    for (int i = 0; i < N; ++i) out[i] = T(v[i]);
    return out;
  } else {
    return vec<T, N>(T(x));
  }
}

template <class A, class B>
constexpr bool vector_operands =
    (is_vector<A> && (is_vector<B> || is_scalar<B>)) || (is_scalar<A> && is_vector<B>);

// The element type and size of an operation on a and b (one of them a vector). Two vectors must
// have the same element type, as in MSL (convert one first).
template <class A, class B>
struct common {
  static constexpr int size = is_vector<A> ? size_of<A> : size_of<B>;
  using element = std::conditional_t<is_vector<A>, element_of<A>, element_of<B>>;
  static_assert(!(is_vector<A> && is_vector<B>) ||
                    std::is_same<element_of<A>, element_of<B>>::value,
                "MSL: vectors of different element types in one operation (convert one first)");
};

// f applied to each component; R(f(...)) the result's element (void: the operands' type).
template <class R, class A, class B, class F>
TFMO_SHIM_ELEMENTWISE auto zip(const A& a, const B& b, F f) {
  using C = common<A, B>;
  using T = typename C::element;
  using Out = std::conditional_t<std::is_void<R>::value, T, R>;
  const vec<T, C::size> x = widen<T, C::size>(a), y = widen<T, C::size>(b);
  vec<Out, C::size> out;
  for (int i = 0; i < C::size; ++i) out[i] = Out(f(x[i], y[i]));
  return out;
}

template <class R, class A, class F>
TFMO_SHIM_ELEMENTWISE auto map(const A& a, F f) {
  using T = element_of<A>;
  using Out = std::conditional_t<std::is_void<R>::value, T, R>;
  const as_vec<A> x = a;
  vec<Out, size_of<A>> out;
  for (int i = 0; i < size_of<A>; ++i) out[i] = Out(f(x[i]));
  return out;
}

}  // namespace vector_detail

// One swizzle of an N-vector: shares the vector's storage (a member of its union) and reads or
// writes components I... of it.
template <typename T, int N, int... I>
struct swizzle {
  T e[vector_detail::slots<N>()];
  using vector = vec<T, int(sizeof...(I))>;

  TFMO_SHIM_ELEMENTWISE operator vector() const { return vector(e[I]...); }
  TFMO_SHIM_ELEMENTWISE swizzle& operator=(const vector& v) {
    static_assert(vector_detail::distinct<I...>(),
                  "MSL: a swizzle that names a component twice cannot be assigned to");
    int k = 0;
    ((e[I] = v[k++]), ...);
    return *this;
  }
  TFMO_SHIM_ELEMENTWISE swizzle& operator=(const swizzle& o) { return *this = vector(o); }
  T operator[](int i) const { return vector(*this)[i]; }
  template <class B>
  swizzle& operator+=(const B& b) { return *this = vector(*this) + b; }
  template <class B>
  swizzle& operator-=(const B& b) { return *this = vector(*this) - b; }
  template <class B>
  swizzle& operator*=(const B& b) { return *this = vector(*this) * b; }
  template <class B>
  swizzle& operator/=(const B& b) { return *this = vector(*this) / b; }
};

// The swizzle members: every sequence of 2, 3 and 4 component letters of one set (xyzw or
// rgba) of an N-vector. One macro per nesting level, since a macro does not expand inside its
// own expansion: TFMO_SWZ_<level>_<set><N>(M, args...) calls M(args..., letter, index) for
// each component.
#define TFMO_SWZ_A_xyzw2(M, ...) M(__VA_ARGS__, x, 0) M(__VA_ARGS__, y, 1)
#define TFMO_SWZ_B_xyzw2(M, ...) M(__VA_ARGS__, x, 0) M(__VA_ARGS__, y, 1)
#define TFMO_SWZ_C_xyzw2(M, ...) M(__VA_ARGS__, x, 0) M(__VA_ARGS__, y, 1)
#define TFMO_SWZ_D_xyzw2(M, ...) M(__VA_ARGS__, x, 0) M(__VA_ARGS__, y, 1)
#define TFMO_SWZ_A_xyzw3(M, ...) TFMO_SWZ_A_xyzw2(M, __VA_ARGS__) M(__VA_ARGS__, z, 2)
#define TFMO_SWZ_B_xyzw3(M, ...) TFMO_SWZ_B_xyzw2(M, __VA_ARGS__) M(__VA_ARGS__, z, 2)
#define TFMO_SWZ_C_xyzw3(M, ...) TFMO_SWZ_C_xyzw2(M, __VA_ARGS__) M(__VA_ARGS__, z, 2)
#define TFMO_SWZ_D_xyzw3(M, ...) TFMO_SWZ_D_xyzw2(M, __VA_ARGS__) M(__VA_ARGS__, z, 2)
#define TFMO_SWZ_A_xyzw4(M, ...) TFMO_SWZ_A_xyzw3(M, __VA_ARGS__) M(__VA_ARGS__, w, 3)
#define TFMO_SWZ_B_xyzw4(M, ...) TFMO_SWZ_B_xyzw3(M, __VA_ARGS__) M(__VA_ARGS__, w, 3)
#define TFMO_SWZ_C_xyzw4(M, ...) TFMO_SWZ_C_xyzw3(M, __VA_ARGS__) M(__VA_ARGS__, w, 3)
#define TFMO_SWZ_D_xyzw4(M, ...) TFMO_SWZ_D_xyzw3(M, __VA_ARGS__) M(__VA_ARGS__, w, 3)
#define TFMO_SWZ_A_rgba2(M, ...) M(__VA_ARGS__, r, 0) M(__VA_ARGS__, g, 1)
#define TFMO_SWZ_B_rgba2(M, ...) M(__VA_ARGS__, r, 0) M(__VA_ARGS__, g, 1)
#define TFMO_SWZ_C_rgba2(M, ...) M(__VA_ARGS__, r, 0) M(__VA_ARGS__, g, 1)
#define TFMO_SWZ_D_rgba2(M, ...) M(__VA_ARGS__, r, 0) M(__VA_ARGS__, g, 1)
#define TFMO_SWZ_A_rgba3(M, ...) TFMO_SWZ_A_rgba2(M, __VA_ARGS__) M(__VA_ARGS__, b, 2)
#define TFMO_SWZ_B_rgba3(M, ...) TFMO_SWZ_B_rgba2(M, __VA_ARGS__) M(__VA_ARGS__, b, 2)
#define TFMO_SWZ_C_rgba3(M, ...) TFMO_SWZ_C_rgba2(M, __VA_ARGS__) M(__VA_ARGS__, b, 2)
#define TFMO_SWZ_D_rgba3(M, ...) TFMO_SWZ_D_rgba2(M, __VA_ARGS__) M(__VA_ARGS__, b, 2)
#define TFMO_SWZ_A_rgba4(M, ...) TFMO_SWZ_A_rgba3(M, __VA_ARGS__) M(__VA_ARGS__, a, 3)
#define TFMO_SWZ_B_rgba4(M, ...) TFMO_SWZ_B_rgba3(M, __VA_ARGS__) M(__VA_ARGS__, a, 3)
#define TFMO_SWZ_C_rgba4(M, ...) TFMO_SWZ_C_rgba3(M, __VA_ARGS__) M(__VA_ARGS__, a, 3)
#define TFMO_SWZ_D_rgba4(M, ...) TFMO_SWZ_D_rgba3(M, __VA_ARGS__) M(__VA_ARGS__, a, 3)
#define TFMO_SWZ2_1(S, N, c0, i0) TFMO_SWZ_B_##S(TFMO_SWZ2_2, N, c0, i0)
#define TFMO_SWZ2_2(N, c0, i0, c1, i1) swizzle<T, N, i0, i1> c0##c1;
#define TFMO_SWZ3_1(S, N, c0, i0) TFMO_SWZ_B_##S(TFMO_SWZ3_2, S, N, c0, i0)
#define TFMO_SWZ3_2(S, N, c0, i0, c1, i1) TFMO_SWZ_C_##S(TFMO_SWZ3_3, N, c0, i0, c1, i1)
#define TFMO_SWZ3_3(N, c0, i0, c1, i1, c2, i2) swizzle<T, N, i0, i1, i2> c0##c1##c2;
#define TFMO_SWZ4_1(S, N, c0, i0) TFMO_SWZ_B_##S(TFMO_SWZ4_2, S, N, c0, i0)
#define TFMO_SWZ4_2(S, N, c0, i0, c1, i1) TFMO_SWZ_C_##S(TFMO_SWZ4_3, S, N, c0, i0, c1, i1)
#define TFMO_SWZ4_3(S, N, c0, i0, c1, i1, c2, i2) \
  TFMO_SWZ_D_##S(TFMO_SWZ4_4, N, c0, i0, c1, i1, c2, i2)
#define TFMO_SWZ4_4(N, c0, i0, c1, i1, c2, i2, c3, i3) \
  swizzle<T, N, i0, i1, i2, i3> c0##c1##c2##c3;
#define TFMO_SWIZZLES(S, N)                  \
  TFMO_SWZ_A_##S(TFMO_SWZ2_1, S, N)          \
  TFMO_SWZ_A_##S(TFMO_SWZ3_1, S, N)          \
  TFMO_SWZ_A_##S(TFMO_SWZ4_1, S, N)

namespace vector_detail {
// The storage of an N-vector: its elements, its components and its swizzles, one union.
template <class T, int N>
struct storage;
template <class T>
struct alignas(2 * sizeof(T)) storage<T, 2> {
  union {
    T e[2];
    struct { T x, y; };
    struct { T r, g; };
    TFMO_SWIZZLES(xyzw2, 2)
    TFMO_SWIZZLES(rgba2, 2)
  };
};
template <class T>
struct alignas(4 * sizeof(T)) storage<T, 3> {
  union {
    T e[4];
    struct { T x, y, z; };
    struct { T r, g, b; };
    TFMO_SWIZZLES(xyzw3, 3)
    TFMO_SWIZZLES(rgba3, 3)
  };
};
template <class T>
struct alignas(4 * sizeof(T)) storage<T, 4> {
  union {
    T e[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    TFMO_SWIZZLES(xyzw4, 4)
    TFMO_SWIZZLES(rgba4, 4)
  };
};
}  // namespace vector_detail

template <typename T, int N>
struct vec : vector_detail::storage<T, N> {
  static_assert(N >= 2 && N <= 4, "MSL vectors have 2, 3 or 4 components");
  using vector_detail::storage<T, N>::e;

  vec() = default;
  TFMO_SHIM_ELEMENTWISE vec(const vec& o) { assign(o, std::make_index_sequence<N>()); }
  TFMO_SHIM_ELEMENTWISE vec& operator=(const vec& o) {
    assign(o, std::make_index_sequence<N>());
    return *this;
  }
  // float4(x): every component x.
  TFMO_SHIM_ELEMENTWISE vec(T s) {
    for (int i = 0; i < N; ++i) e[i] = s;
  }
  // float4(a, b.xy, c): scalars and vectors whose components add up to N.
  template <class... A,
            std::enable_if_t<(sizeof...(A) >= 2) && ((vector_detail::size_of<A> + ...) == N) &&
                                 ((vector_detail::is_vector<A> || vector_detail::is_scalar<A>) &&
                                  ...),
                             int> = 0>
  TFMO_SHIM_ELEMENTWISE vec(const A&... parts) {
    int k = 0;
    (put(parts, k), ...);
  }
  // float4(int4): explicit, as in MSL.
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  TFMO_SHIM_ELEMENTWISE explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) e[i] = T(o[i]);
  }
  TFMO_SHIM_ELEMENTWISE vec(const packed_vec<T, N>& p) {
    for (int i = 0; i < N; ++i) e[i] = p.e[i];
  }

  T& operator[](int i) { return e[i]; }
  const T& operator[](int i) const { return e[i]; }

  template <class B>
  vec& operator+=(const B& b) { return *this = *this + b; }
  template <class B>
  vec& operator-=(const B& b) { return *this = *this - b; }
  template <class B>
  vec& operator*=(const B& b) { return *this = *this * b; }
  template <class B>
  vec& operator/=(const B& b) { return *this = *this / b; }
  template <class B>
  vec& operator%=(const B& b) { return *this = *this % b; }
  template <class B>
  vec& operator&=(const B& b) { return *this = *this & b; }
  template <class B>
  vec& operator|=(const B& b) { return *this = *this | b; }
  template <class B>
  vec& operator^=(const B& b) { return *this = *this ^ b; }
  template <class B>
  vec& operator<<=(const B& b) { return *this = *this << b; }
  template <class B>
  vec& operator>>=(const B& b) { return *this = *this >> b; }

 private:
  template <size_t... I>
  TFMO_SHIM_ELEMENTWISE void assign(const vec& o, std::index_sequence<I...>) {
    ((e[I] = o.e[I]), ...);
  }
  template <class A>
  TFMO_SHIM_ELEMENTWISE void put(const A& part, int& k) {
    if constexpr (vector_detail::is_vector<A>) {
      const vector_detail::as_vec<A> v = part;
      for (int j = 0; j < vector_detail::size_of<A>; ++j) e[k++] = T(v[j]);
    } else {
      e[k++] = T(part);
    }
  }
};

namespace vector_detail {
// A packed vector's storage: its elements and components, no padding, the element's alignment.
template <class T, int N>
struct packed_storage;
template <class T>
struct packed_storage<T, 2> {
  union {
    T e[2];
    struct { T x, y; };
    struct { T r, g; };
  };
};
template <class T>
struct packed_storage<T, 3> {
  union {
    T e[3];
    struct { T x, y, z; };
    struct { T r, g, b; };
  };
};
template <class T>
struct packed_storage<T, 4> {
  union {
    T e[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
  };
};
}  // namespace vector_detail

template <typename T, int N>
struct packed_vec : vector_detail::packed_storage<T, N> {
  using vector_detail::packed_storage<T, N>::e;
  packed_vec() = default;
  TFMO_SHIM_ELEMENTWISE packed_vec(const vec<T, N>& v) {
    for (int i = 0; i < N; ++i) e[i] = v[i];
  }
  template <class... A, std::enable_if_t<(sizeof...(A) >= 2), int> = 0>
  TFMO_SHIM_ELEMENTWISE packed_vec(const A&... parts) : packed_vec(vec<T, N>(parts...)) {}
  T& operator[](int i) { return e[i]; }
  const T& operator[](int i) const { return e[i]; }
};

#undef TFMO_SWIZZLES

// ---- component-wise operators ---------------------------------------------------------------

#define TFMO_VEC_BINARY(op, result)                                                           \
  template <class A, class B,                                                                 \
            std::enable_if_t<vector_detail::vector_operands<A, B>, int> = 0>                  \
  TFMO_SHIM_ELEMENTWISE auto operator op(const A& a, const B& b) {                            \
    return vector_detail::zip<result>(a, b, [](const auto& x, const auto& y) { return x op y; }); \
  }
TFMO_VEC_BINARY(+, void)
TFMO_VEC_BINARY(-, void)
TFMO_VEC_BINARY(*, void)
TFMO_VEC_BINARY(/, void)
TFMO_VEC_BINARY(%, void)
TFMO_VEC_BINARY(&, void)
TFMO_VEC_BINARY(|, void)
TFMO_VEC_BINARY(^, void)
TFMO_VEC_BINARY(<<, void)
TFMO_VEC_BINARY(>>, void)
TFMO_VEC_BINARY(==, bool)
TFMO_VEC_BINARY(!=, bool)
TFMO_VEC_BINARY(<, bool)
TFMO_VEC_BINARY(<=, bool)
TFMO_VEC_BINARY(>, bool)
TFMO_VEC_BINARY(>=, bool)
TFMO_VEC_BINARY(&&, bool)
TFMO_VEC_BINARY(||, bool)
#undef TFMO_VEC_BINARY

#define TFMO_VEC_UNARY(op, result)                                                       \
  template <class A, std::enable_if_t<vector_detail::is_vector<A>, int> = 0>             \
  TFMO_SHIM_ELEMENTWISE auto operator op(const A& a) {                                   \
    return vector_detail::map<result>(a, [](const auto& x) { return op x; });            \
  }
TFMO_VEC_UNARY(-, void)
TFMO_VEC_UNARY(+, void)
TFMO_VEC_UNARY(~, void)
TFMO_VEC_UNARY(!, bool)
#undef TFMO_VEC_UNARY

}  // namespace metal

#endif  // TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_VECTOR_H_
