"""Kernel bodies that more than one test runs: tests/test_metal_kernel.py on the CPU path and
tests/msl_cuda/user_kernels.py on an NVIDIA GPU."""

# MLX's elementwise exp (its docs page "Custom Metal Kernels"), the kernel docs/kernels.md opens
# with, templated on T.
EXP_SOURCE = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""

# Every thread attribute of a 3-D dispatchThreads grid, written where the thread can be checked:
# per thread its threadgroup, the threadgroup's size, its linear index (0 when the attributes
# agree) and the threadgroup count.
POSITIONS_SOURCE = """
        uint3 p = thread_position_in_grid;
        uint i = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
        uint3 g = threadgroup_position_in_grid;
        uint3 t = thread_position_in_threadgroup;
        uint3 n = threads_per_threadgroup;
        out[i * 4 + 0] = int(g.x * 100 + g.y * 10 + g.z);
        out[i * 4 + 1] = int(n.x * 100 + n.y * 10 + n.z);
        out[i * 4 + 2] = int((t.z * n.y + t.y) * n.x + t.x) - int(thread_index_in_threadgroup);
        out[i * 4 + 3] = int(threadgroups_per_grid.x * 100 + threadgroups_per_grid.y * 10 +
                             threadgroups_per_grid.z);
    """

# ---- the stand-in <metal_stdlib>'s coverage (tests/test_metal_kernel_stdlib.py) ---------------

# CPU path only (the CUDA stand-in has no vectors beyond what kernels/*.metal use): VECTOR_SOURCE,
# MATH_SOURCE. The rest also runs on the CUDA stand-in (tests/msl_cuda/user_kernels.py), on scalars.

# Vector types: swizzles read and written, constructors from mixed scalars and vectors,
# component-wise operators with scalars, dot / length / select / all, a signed char.
# Inputs x (float, 4 per thread), k (int, 4 per thread); outputs f (12 floats), g (8 ints).
VECTOR_SOURCE = """
        const uint i = thread_position_in_grid.x;
        const float4 w = ((const device float4*)x)[i];
        float4 r = w.wzyx;
        r.xy = r.yx;
        r.zw += float2(1.0f, 2.0f);
        const float3 s = float3(w.x, w.yz) * 2.0f - w.xxx;
        const float2 p = float2(w.r, w.a) / 2;
        device float4* fo = (device float4*)f;
        fo[3 * i] = r;
        fo[3 * i + 1] = float4(s, dot(w, w));
        fo[3 * i + 2] = float4(p, length(w.xy), select(w.x, w.y, w.x < w.y));
        const int4 a = ((const device int4*)k)[i];
        int4 b = ((a & 0xFFFF) << 1) ^ a.yzwx;
        b.w = clamp(a.w, -5, 5);
        const int2 q = int2(a.xy) % 7 + int2(a.z > a.w, all(a.xy > 0));
        const char c = char(a.x);
        device int4* go = (device int4*)g;
        go[2 * i] = b;
        go[2 * i + 1] = int4(q, max(a.z, a.w), int(c));
    """

# metal::, fast:: and precise:: math on float, and on a float4 (MATH_FUNCTIONS entries per
# thread, in this order). Input x in [0.1, 2].
MATH_FUNCTIONS = (
    "exp(v)", "log(v)", "sqrt(v)", "rsqrt(v)", "sin(v)", "cos(v)", "tan(v)", "tanh(v)",
    "atan2(v, 0.7f)", "pow(v, 1.5f)", "fmod(v * 7.0f, 1.3f)", "fract(v * 3.0f)",
    "floor(v * 3.0f)", "ceil(v * 3.0f)", "round(v * 3.0f)", "trunc(v * 3.0f)", "sign(v - 1.0f)",
    "step(1.0f, v)", "smoothstep(0.5f, 1.5f, v)", "mix(v, 2.0f, 0.25f)", "clamp(v, 0.5f, 1.5f)",
    "saturate(v - 0.5f)", "fma(v, v, 1.0f)", "exp2(v)", "log2(v)", "log10(v)", "exp10(v)",
    "sinh(v)", "cosh(v)", "asin(v / 2.0f)", "acos(v / 2.0f)", "atan(v)", "fast::exp(v)",
    "precise::log(v)", "fast::rsqrt(v)", "precise::sqrt(v)", "fmax(v, 1.0f)", "fmin(v, 1.0f)",
    "copysign(v, -1.0f)", "abs(v - 1.0f)", "powr(v, 2.5f)", "max(v, 1.0f)", "min(v, 1.0f)",
    "(exp(u) + max(u, 2.5f)).x", "(exp(u) + max(u, 2.5f)).y", "normalize(u).z",
    "distance(u, u.wzyx)", "mix(u, u.wzyx, 0.25f).w",
)
MATH_SOURCE = """
        const uint i = thread_position_in_grid.x;
        const float v = x[i];
        const float4 u = float4(v, v + 1.0f, v + 2.0f, v + 3.0f);
        const float results[] = {%s};
        for (uint j = 0; j < %d; ++j) out[i * %d + j] = results[j];
    """ % (", ".join(MATH_FUNCTIONS), len(MATH_FUNCTIONS), len(MATH_FUNCTIONS))

# Integer functions on T (int or uint), per thread from a[i] and b[i].
INTEGER_FUNCTIONS = (
    "clz(x)", "ctz(x)", "popcount(x)", "absdiff(x, y)", "addsat(x, y)", "subsat(x, y)",
    "hadd(x, y)", "rhadd(x, y)", "mulhi(x, y)", "rotate(x, T(i % 40))", "reverse_bits(x)",
    "min(x, y)", "max(x, y)", "min3(x, y, T(7))", "median3(x, y, T(7))",
    "popcount(y)", "clamp(x, T(-100), T(100))",
)
INTEGER_FUNCTIONS_SOURCE = """
        const uint i = thread_position_in_grid.x;
        const T x = a[i];
        const T y = b[i];
        const T results[] = {%s};
        for (uint j = 0; j < %d; ++j) out[i * %d + j] = results[j];
    """ % (", ".join(INTEGER_FUNCTIONS), len(INTEGER_FUNCTIONS), len(INTEGER_FUNCTIONS))

# Atomics on device memory (atomic_outputs=True, init_value 0), int and float outputs:
# n[0..7] and r[0..5].
ATOMICS_SOURCE = """
        const uint i = thread_position_in_grid.x;
        const int v = k[i];
        atomic_fetch_add_explicit(&n[0], v, memory_order_relaxed);
        atomic_fetch_sub_explicit(&n[1], v, memory_order_relaxed);
        atomic_fetch_min_explicit(&n[2], v, memory_order_relaxed);
        atomic_fetch_max_explicit(&n[3], v, memory_order_relaxed);
        atomic_fetch_or_explicit(&n[4], 1 << (i % 31), memory_order_relaxed);
        atomic_fetch_xor_explicit(&n[5], v, memory_order_relaxed);
        int expected = atomic_load_explicit(&n[6], memory_order_relaxed);
        while (3 * v > expected &&
               !atomic_compare_exchange_weak_explicit(&n[6], &expected, 3 * v,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {
        }
        if (i == 0) {
            atomic_store_explicit(&n[7], 40, memory_order_relaxed);
            atomic_exchange_explicit(&n[7], atomic_load_explicit(&n[7], memory_order_relaxed) + 2,
                                     memory_order_relaxed);
        }
        const float f = float(v);
        atomic_fetch_add_explicit(&r[0], f, memory_order_relaxed);
        atomic_fetch_sub_explicit(&r[1], f, memory_order_relaxed);
        atomic_fetch_min_explicit(&r[2], f, memory_order_relaxed);
        atomic_fetch_max_explicit(&r[3], f, memory_order_relaxed);
        float seen = atomic_load_explicit(&r[4], memory_order_relaxed);
        while (f * 0.5f > seen &&
               !atomic_compare_exchange_weak_explicit(&r[4], &seen, f * 0.5f,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {
        }
        if (i == 1) atomic_exchange_explicit(&r[5], 2.5f, memory_order_relaxed);
    """

# Threadgroup memory and both barriers with combined flags: each threadgroup reverses its part.
THREADGROUP_REVERSE_SOURCE = """
        threadgroup float tile[64];
        const uint t = thread_index_in_threadgroup;
        tile[t] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
        const float mine = tile[threads_per_threadgroup.x - 1 - t];
        simdgroup_barrier(mem_flags::mem_none);
        out[thread_position_in_grid.x] = mine;
    """

# SIMD-group reductions, prefix operations, votes and broadcast_first on T, over the active
# lanes: with SKIP, lanes whose index in the SIMD-group is 2 mod 3 return first (inactive).
# Outputs: out (SIMD_REDUCTIONS entries per thread, T), votes (2 per thread: ballot, active).
SIMD_REDUCTIONS = (
    "simd_sum(v)", "simd_product(y)", "simd_max(v)", "simd_min(v)",
    "simd_prefix_exclusive_sum(v)", "simd_prefix_inclusive_sum(v)",
    "simd_prefix_exclusive_product(y)", "simd_prefix_inclusive_product(y)",
    "simd_broadcast_first(v)", "T(simd_is_first())", "T(simd_all(v > T(0)))",
    "T(simd_any(v > T(0)))", "quad_sum(v)",
    "quad_prefix_inclusive_sum(v)", "quad_max(v)",
)
SIMD_REDUCTIONS_SOURCE = """
        const uint i = thread_position_in_grid.x;
        if (SKIP && thread_index_in_simdgroup %% 3 == 2) return;
        const T v = x[i];
        const T y = p[i];
        const T results[] = {%s};
        for (uint j = 0; j < %d; ++j) out[i * %d + j] = results[j];
        const simd_vote vote = simd_ballot(v > T(0));
        votes[2 * i] = uint(simd_vote::vote_t(vote));
        votes[2 * i + 1] = uint(simd_vote::vote_t(simd_active_threads_mask()));
    """ % (", ".join(SIMD_REDUCTIONS), len(SIMD_REDUCTIONS), len(SIMD_REDUCTIONS))

# SIMD-group and quad-group shuffles and broadcasts on T, in full SIMD-groups.
SIMD_SHUFFLES = (
    "simd_shuffle(v, ushort((lane + 3) % 32))", "simd_shuffle_up(v, 3)",
    "simd_shuffle_down(v, 3)", "simd_shuffle_xor(v, 5)", "simd_shuffle_rotate_up(v, 3)",
    "simd_shuffle_rotate_down(v, 3)", "simd_shuffle_and_fill_up(v, y, 3)",
    "simd_shuffle_and_fill_down(v, y, 3)", "simd_shuffle_and_fill_up(v, y, 2, 8)",
    "simd_shuffle_and_fill_down(v, y, 2, 8)", "simd_broadcast(v, 7)",
    "quad_shuffle(v, ushort((thread_index_in_quadgroup + 1) % 4))", "quad_broadcast(v, 2)",
    "quad_shuffle_xor(v, 1)", "quad_shuffle_up(v, 1)", "quad_shuffle_down(v, 1)",
    "quad_broadcast_first(v)", "T(quadgroup_index_in_threadgroup)",
)
SIMD_SHUFFLES_SOURCE = """
        const uint i = thread_position_in_grid.x;
        const uint lane = thread_index_in_simdgroup;
        const T v = x[i];
        const T y = p[i];
        const T results[] = {%s};
        for (uint j = 0; j < %d; ++j) out[i * %d + j] = results[j];
    """ % (", ".join(SIMD_SHUFFLES), len(SIMD_SHUFFLES), len(SIMD_SHUFFLES))

# The bitwise reductions on integers.
SIMD_BITWISE_SOURCE = """
        const uint i = thread_position_in_grid.x;
        const T v = x[i];
        out[i * 6 + 0] = simd_and(v);
        out[i * 6 + 1] = simd_or(v);
        out[i * 6 + 2] = simd_xor(v);
        out[i * 6 + 3] = quad_and(v);
        out[i * 6 + 4] = quad_or(v);
        out[i * 6 + 5] = quad_xor(v);
    """


# A function MSL lacks (erf), written in the header as MLX writes its own (Abramowitz and Stegun
# 7.1.26, |error| < 1.5e-7, and float32 rounding), beside a local variable named like a C
# function: the kernel's own erf is called on every host compiler and under the CUDA stand-in.
OWN_ERF_HEADER = """
    float erf(float v) {
        const float t = 1.0f / (1.0f + 0.3275911f * fabs(v));
        const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f
                         + t * (-1.453152027f + t * 1.061405429f))));
        return copysign(1.0f - poly * exp(-v * v), v);
    }
"""
OWN_ERF_SOURCE = """
    const uint i = thread_position_in_grid.x;
    const float remainder = x[i] * 0.5f;
    out[i] = erf(x[i]) + remainder - remainder;
"""
