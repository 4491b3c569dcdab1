// MSL's SIMD-group and quad-group functions for the stand-in <metal_stdlib> (run mode), on every
// scalar type (bool only where Metal takes it: ballot, all, any) and vector, built on one
// emulator primitive: an all-gather over the SIMD-group's active lanes in lockstep
// (msl_host::simd_gather). Each function then computes its own lane's result from every active
// lane's value, as Metal defines it over the active threads: reductions and prefix operations
// skip inactive lanes, and a shuffle or broadcast that reads an inactive lane, or one outside
// the SIMD-group, fails the dispatch (Metal leaves its value undefined). A quad-group is four
// consecutive lanes of a SIMD-group; its functions are SIMD-group collectives here (every active
// lane of the SIMD-group must reach them together), computed over the caller's quad.
#ifndef TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_SIMD_H_
#define TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_SIMD_H_

namespace metal {

namespace simd_detail {

template <class X>
using value_t = std::conditional_t<vector_detail::is_vector<X>, vector_detail::as_vec<X>,
                                   std::decay_t<X>>;

template <class T>
constexpr bool is_value =
    (vector_detail::is_scalar<T> || vector_detail::is_vector<T>) &&
    !std::is_same<vector_detail::element_of<T>, bool>::value;

template <class T>
constexpr bool is_integer_value = is_value<T> && std::is_integral<vector_detail::element_of<T>>::value;

// Every active lane's value of one call, and which lanes are active.
template <class T>
struct Lanes {
  T value[msl_host::kMaxSimdWidth];
  uint64_t active;
  uint32_t lane;
  uint32_t width;
  bool on(uint32_t i) const { return i < width && ((active >> i) & 1u); }
};

template <class T>
void gather(Lanes<T>& g, const char* op, const T& x, uint32_t uniform = 0,
            uint32_t read_lane = msl_host::kNoLane) {
  static_assert(sizeof(T) <= msl_host::kMaxSimdValueBytes,
                "the MSL emulator's SIMD-group functions take values of at most 64 bytes");
  g.lane = msl_host::simd_lane();
  g.width = msl_host::simd_width();
  g.active = msl_host::simd_gather(op, uniform, read_lane, &x, sizeof(T), g.value);
}

// The lanes a function works over: the whole SIMD-group, or the caller's quad.
struct Span {
  uint32_t begin;
  uint32_t size;
};
inline Span simd_span() { return Span{0, msl_host::simd_width()}; }
inline Span quad_span() { return Span{msl_host::simd_lane() & ~3u, 4}; }

// A lane index no SIMD-group has: the emulator reports the read as outside the SIMD-group.
constexpr uint32_t kOutside = msl_host::kMaxSimdWidth;

template <class T>
T reduce(const char* op, const T& x, Span s, T init, T (*combine)(const T&, const T&),
         bool inclusive_prefix, bool exclusive_prefix) {
  Lanes<T> g;
  gather(g, op, x);
  T acc = init;
  const uint32_t end = exclusive_prefix ? g.lane : inclusive_prefix ? g.lane + 1 : s.begin + s.size;
  for (uint32_t i = s.begin; i < end; ++i) {
    if (g.on(i)) acc = combine(acc, g.value[i]);
  }
  return acc;
}

template <class T> T plus(const T& a, const T& b) { return T(a + b); }
template <class T> T times(const T& a, const T& b) { return T(a * b); }
template <class T> T larger(const T& a, const T& b) { return T(metal::max(a, b)); }
template <class T> T smaller(const T& a, const T& b) { return T(metal::min(a, b)); }
template <class T> T bit_and(const T& a, const T& b) { return T(a & b); }
template <class T> T bit_or(const T& a, const T& b) { return T(a | b); }
template <class T> T bit_xor(const T& a, const T& b) { return T(a ^ b); }

// max / min: the first active value, then combined (no identity element needed).
template <class T>
T extreme(const char* op, const T& x, Span s, T (*combine)(const T&, const T&)) {
  Lanes<T> g;
  gather(g, op, x);
  bool first = true;
  T acc = x;
  for (uint32_t i = s.begin; i < s.begin + s.size; ++i) {
    if (!g.on(i)) continue;
    acc = first ? g.value[i] : combine(acc, g.value[i]);
    first = false;
  }
  return acc;
}

// The value of lane `source` (checked by the emulator: inside the SIMD-group and active).
template <class T>
T read(const char* op, const T& x, uint32_t uniform, uint32_t source) {
  Lanes<T> g;
  gather(g, op, x, uniform, source);
  return g.value[source];
}

template <class T>
struct Pair {
  T data;
  T filling;
};

// simd_shuffle_and_fill_up / _down over vectors of `modulo` lanes.
template <class T>
T shuffle_and_fill(const char* op, const T& data, const T& filling, uint32_t delta,
                   uint32_t modulo, bool up, Span s) {
  const uint32_t j = msl_host::simd_lane() - s.begin;
  const uint32_t m = modulo == 0 ? 1 : modulo;
  const uint32_t base = j - j % m, k = j % m;
  uint32_t source;
  bool from_filling;
  if (up) {
    from_filling = k < delta;
    source = s.begin + base + (from_filling ? m - delta + k : k - delta);
  } else {
    from_filling = k + delta >= m;
    source = s.begin + base + (from_filling ? k + delta - m : k + delta);
  }
  if (delta > m) source = kOutside;
  Lanes<Pair<T>> g;
  gather(g, op, Pair<T>{data, filling}, delta | (modulo << 16), source);
  return from_filling ? g.value[source].filling : g.value[source].data;
}

inline uint32_t first_active(Span s, uint64_t active) {
  for (uint32_t i = s.begin; i < s.begin + s.size; ++i) {
    if ((active >> i) & 1u) return i;
  }
  return s.begin;
}

inline uint64_t ballot(const char* op, bool x, Span s, uint64_t* active_out) {
  Lanes<bool> g;
  gather(g, op, x);
  uint64_t bits = 0;
  for (uint32_t i = s.begin; i < s.begin + s.size; ++i) {
    if (g.on(i) && g.value[i]) bits |= uint64_t{1} << (i - s.begin);
  }
  *active_out = (g.active >> s.begin) & (s.size >= 64 ? ~uint64_t{0} : (uint64_t{1} << s.size) - 1);
  return bits;
}

}  // namespace simd_detail

// A ballot's result: bit i is lane i (of the SIMD-group, or of the quad for quad_vote).
template <class Vote>
class basic_vote {
 public:
  using vote_t = Vote;
  explicit basic_vote(vote_t v = 0) : bits_(v), active_(~vote_t(0)) {}
  basic_vote(vote_t v, vote_t active) : bits_(v), active_(active) {}
  explicit operator vote_t() const { return bits_; }
  // Whether every active thread's bit is set / any bit is set.
  bool all() const { return (bits_ & active_) == active_; }
  bool any() const { return bits_ != 0; }

 private:
  vote_t bits_;
  vote_t active_;
};
using simd_vote = basic_vote<uint64_t>;
using quad_vote = basic_vote<ushort>;

inline void simdgroup_barrier(mem_flags) {
  msl_host::simd_gather("simdgroup_barrier", 0, msl_host::kNoLane, nullptr, 0, nullptr);
}

#define TFMO_SIMD_CHECK(T, what)                                                          \
  static_assert(simd_detail::is_value<T>, "MSL: " what " takes a scalar or vector of a "  \
                                          "number type (not bool)")
#define TFMO_GROUP_FUNCTIONS(prefix, span)                                                     \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_sum(const X& x) {                                                                 \
    TFMO_SIMD_CHECK(T, #prefix "_sum");                                                        \
    return simd_detail::reduce<T>(#prefix "_sum", T(x), span(), T(0), simd_detail::plus<T>,    \
                                  false, false);                                               \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_product(const X& x) {                                                             \
    TFMO_SIMD_CHECK(T, #prefix "_product");                                                    \
    return simd_detail::reduce<T>(#prefix "_product", T(x), span(), T(1),                      \
                                  simd_detail::times<T>, false, false);                        \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_prefix_inclusive_sum(const X& x) {                                                \
    TFMO_SIMD_CHECK(T, #prefix "_prefix_inclusive_sum");                                       \
    return simd_detail::reduce<T>(#prefix "_prefix_inclusive_sum", T(x), span(), T(0),         \
                                  simd_detail::plus<T>, true, false);                          \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_prefix_exclusive_sum(const X& x) {                                                \
    TFMO_SIMD_CHECK(T, #prefix "_prefix_exclusive_sum");                                       \
    return simd_detail::reduce<T>(#prefix "_prefix_exclusive_sum", T(x), span(), T(0),         \
                                  simd_detail::plus<T>, false, true);                          \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_prefix_inclusive_product(const X& x) {                                            \
    TFMO_SIMD_CHECK(T, #prefix "_prefix_inclusive_product");                                   \
    return simd_detail::reduce<T>(#prefix "_prefix_inclusive_product", T(x), span(), T(1),     \
                                  simd_detail::times<T>, true, false);                         \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_prefix_exclusive_product(const X& x) {                                            \
    TFMO_SIMD_CHECK(T, #prefix "_prefix_exclusive_product");                                   \
    return simd_detail::reduce<T>(#prefix "_prefix_exclusive_product", T(x), span(), T(1),     \
                                  simd_detail::times<T>, false, true);                         \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_max(const X& x) {                                                                 \
    TFMO_SIMD_CHECK(T, #prefix "_max");                                                        \
    return simd_detail::extreme<T>(#prefix "_max", T(x), span(), simd_detail::larger<T>);      \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_min(const X& x) {                                                                 \
    TFMO_SIMD_CHECK(T, #prefix "_min");                                                        \
    return simd_detail::extreme<T>(#prefix "_min", T(x), span(), simd_detail::smaller<T>);     \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_and(const X& x) {                                                                 \
    static_assert(simd_detail::is_integer_value<T>, "MSL: " #prefix "_and takes integers");    \
    return simd_detail::reduce<T>(#prefix "_and", T(x), span(), T(~vector_detail::element_of<T>(0)), \
                                  simd_detail::bit_and<T>, false, false);                      \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_or(const X& x) {                                                                  \
    static_assert(simd_detail::is_integer_value<T>, "MSL: " #prefix "_or takes integers");     \
    return simd_detail::reduce<T>(#prefix "_or", T(x), span(), T(0), simd_detail::bit_or<T>,   \
                                  false, false);                                               \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_xor(const X& x) {                                                                 \
    static_assert(simd_detail::is_integer_value<T>, "MSL: " #prefix "_xor takes integers");    \
    return simd_detail::reduce<T>(#prefix "_xor", T(x), span(), T(0), simd_detail::bit_xor<T>, \
                                  false, false);                                               \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle(const X& x, ushort index) {                                               \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle");                                                    \
    const simd_detail::Span s = span();                                                        \
    return simd_detail::read<T>(#prefix "_shuffle", T(x), 0,                                   \
                                index < s.size ? s.begin + index : simd_detail::kOutside);     \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_up(const X& x, ushort delta) {                                            \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_up");                                                 \
    const simd_detail::Span s = span();                                                        \
    const uint32_t j = msl_host::simd_lane() - s.begin;                                        \
    return simd_detail::read<T>(#prefix "_shuffle_up", T(x), delta,                            \
                                s.begin + (j >= delta ? j - delta : j));                       \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_down(const X& x, ushort delta) {                                          \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_down");                                               \
    const simd_detail::Span s = span();                                                        \
    const uint32_t j = msl_host::simd_lane() - s.begin;                                        \
    return simd_detail::read<T>(#prefix "_shuffle_down", T(x), delta,                          \
                                s.begin + (j + delta < s.size ? j + delta : j));               \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_rotate_up(const X& x, ushort delta) {                                     \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_rotate_up");                                          \
    const simd_detail::Span s = span();                                                        \
    const uint32_t j = msl_host::simd_lane() - s.begin;                                        \
    return simd_detail::read<T>(#prefix "_shuffle_rotate_up", T(x), delta,                     \
                                s.begin + (j + s.size - delta % s.size) % s.size);             \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_rotate_down(const X& x, ushort delta) {                                   \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_rotate_down");                                        \
    const simd_detail::Span s = span();                                                        \
    const uint32_t j = msl_host::simd_lane() - s.begin;                                        \
    return simd_detail::read<T>(#prefix "_shuffle_rotate_down", T(x), delta,                   \
                                s.begin + (j + delta) % s.size);                               \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_xor(const X& x, ushort mask) {                                            \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_xor");                                                \
    const simd_detail::Span s = span();                                                        \
    const uint32_t j = (msl_host::simd_lane() - s.begin) ^ mask;                               \
    return simd_detail::read<T>(#prefix "_shuffle_xor", T(x), mask,                            \
                                j < s.size ? s.begin + j : simd_detail::kOutside);             \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_and_fill_up(const X& data, const X& filling, ushort delta) {              \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_and_fill_up");                                        \
    return simd_detail::shuffle_and_fill<T>(#prefix "_shuffle_and_fill_up", T(data),           \
                                            T(filling), delta, span().size, true, span());     \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_and_fill_up(const X& data, const X& filling, ushort delta,                \
                                 ushort modulo) {                                              \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_and_fill_up");                                        \
    return simd_detail::shuffle_and_fill<T>(#prefix "_shuffle_and_fill_up", T(data),           \
                                            T(filling), delta, modulo, true, span());          \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_and_fill_down(const X& data, const X& filling, ushort delta) {            \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_and_fill_down");                                      \
    return simd_detail::shuffle_and_fill<T>(#prefix "_shuffle_and_fill_down", T(data),         \
                                            T(filling), delta, span().size, false, span());    \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_shuffle_and_fill_down(const X& data, const X& filling, ushort delta,              \
                                   ushort modulo) {                                            \
    TFMO_SIMD_CHECK(T, #prefix "_shuffle_and_fill_down");                                      \
    return simd_detail::shuffle_and_fill<T>(#prefix "_shuffle_and_fill_down", T(data),         \
                                            T(filling), delta, modulo, false, span());         \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_broadcast(const X& x, ushort index) {                                             \
    TFMO_SIMD_CHECK(T, #prefix "_broadcast");                                                  \
    const simd_detail::Span s = span();                                                        \
    return simd_detail::read<T>(#prefix "_broadcast", T(x), index,                             \
                                index < s.size ? s.begin + index : simd_detail::kOutside);     \
  }                                                                                            \
  template <class X, class T = simd_detail::value_t<X>>                                        \
  T prefix##_broadcast_first(const X& x) {                                                     \
    TFMO_SIMD_CHECK(T, #prefix "_broadcast_first");                                            \
    simd_detail::Lanes<T> g;                                                                   \
    simd_detail::gather(g, #prefix "_broadcast_first", T(x));                                  \
    return g.value[simd_detail::first_active(span(), g.active)];                               \
  }                                                                                            \
  inline bool prefix##_is_first() {                                                            \
    simd_detail::Lanes<char> g;                                                                \
    simd_detail::gather(g, #prefix "_is_first", char(0));                                      \
    return g.lane == simd_detail::first_active(span(), g.active);                              \
  }                                                                                            \
  inline bool prefix##_all(bool x) {                                                           \
    uint64_t active;                                                                           \
    const uint64_t bits = simd_detail::ballot(#prefix "_all", x, span(), &active);             \
    return bits == active;                                                                     \
  }                                                                                            \
  inline bool prefix##_any(bool x) {                                                           \
    uint64_t active;                                                                           \
    return simd_detail::ballot(#prefix "_any", x, span(), &active) != 0;                       \
  }                                                                                            \
  inline prefix##_vote prefix##_ballot(bool x) {                                               \
    uint64_t active;                                                                           \
    const uint64_t bits = simd_detail::ballot(#prefix "_ballot", x, span(), &active);          \
    return prefix##_vote(prefix##_vote::vote_t(bits), prefix##_vote::vote_t(active));          \
  }                                                                                            \
  inline prefix##_vote prefix##_active_threads_mask() {                                        \
    uint64_t active;                                                                           \
    simd_detail::ballot(#prefix "_active_threads_mask", true, span(), &active);                \
    return prefix##_vote(prefix##_vote::vote_t(active), prefix##_vote::vote_t(active));        \
  }                                                                                            \
  inline bool prefix##_is_helper_thread() { return false; }

TFMO_GROUP_FUNCTIONS(simd, simd_detail::simd_span)
TFMO_GROUP_FUNCTIONS(quad, simd_detail::quad_span)
#undef TFMO_GROUP_FUNCTIONS
#undef TFMO_SIMD_CHECK

}  // namespace metal

#endif  // TF_METAL_OPS_CSRC_EMULATOR_TFMO_MSL_SIMD_H_
