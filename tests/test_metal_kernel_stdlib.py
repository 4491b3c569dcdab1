"""What the CPU path's stand-in <metal_stdlib> covers, each class of it in a kernel run through
tf_metal_ops.metal_kernel and checked against NumPy (integers bit-exact, float32 within 1e-5
relative): vector types and swizzles, math, integer functions, atomics, threadgroup memory and
barriers, the SIMD-group and quad-group functions over active lanes; and what it refuses by
name (textures, simdgroup_matrix, ray tracing, matrix types; the C library's math functions that
MSL lacks, such as erf; the C and C++ libraries and the C++ that MSL leaves out). docs/kernels.md
lists the same.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from kernel_sources import (ATOMICS_SOURCE, INTEGER_FUNCTIONS, INTEGER_FUNCTIONS_SOURCE,
                            MATH_FUNCTIONS, MATH_SOURCE, OWN_ERF_HEADER, OWN_ERF_SOURCE,
                            SIMD_BITWISE_SOURCE, SIMD_REDUCTIONS, SIMD_REDUCTIONS_SOURCE,
                            SIMD_SHUFFLES, SIMD_SHUFFLES_SOURCE, THREADGROUP_REVERSE_SOURCE,
                            VECTOR_SOURCE)

RNG = np.random.default_rng(20261205)
F32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", autouse=True)
def _kernel_cache(kernel_cache):
    """Every test of this module compiles into the shared test cache (conftest.py)."""
    yield kernel_cache


def run(kernel, inputs, shapes, dtypes, grid, threadgroup, **kw):
    return [t.numpy() for t in kernel(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes,
                                      grid=grid, threadgroup=threadgroup, **kw)]


# ---- vector types -----------------------------------------------------------------------------

def test_vectors_swizzles_constructors_and_operators():
    n = 50
    x = RNG.uniform(-3, 3, size=(n, 4)).astype(np.float32)
    k = RNG.integers(-300, 300, size=(n, 4)).astype(np.int32)
    kernel = tf_metal_ops.metal_kernel("vectors", ["x", "k"], ["f", "g"], VECTOR_SOURCE)
    f, g = run(kernel, [x, k], [[n * 12], [n * 8]], [tf.float32, tf.int32], (n, 1, 1),
               (16, 1, 1))
    f, g = f.reshape(n, 3, 4), g.reshape(n, 2, 4)
    X, Y, Z, W = x.T
    np.testing.assert_array_equal(f[:, 0], np.stack([Z, W, Y + 1, X + 2], 1))
    np.testing.assert_allclose(f[:, 1], np.stack([X, 2 * Y - X, 2 * Z - X,
                                                  (x * x).sum(1)], 1), **F32)
    np.testing.assert_allclose(f[:, 2], np.stack([X / 2, W / 2, np.hypot(X, Y),
                                                  np.maximum(X, Y)], 1), **F32)
    a = k
    b = ((a & 0xFFFF) << 1) ^ np.roll(a, -1, axis=1)
    b[:, 3] = np.clip(a[:, 3], -5, 5)
    np.testing.assert_array_equal(g[:, 0], b)
    q = np.fmod(a[:, :2], 7) + np.stack([a[:, 2] > a[:, 3], (a[:, :2] > 0).all(1)], 1)
    signed_char = ((a[:, 0] & 0xFF) ^ 0x80) - 0x80  # MSL's char is signed everywhere
    np.testing.assert_array_equal(g[:, 1], np.stack([q[:, 0], q[:, 1],
                                                     np.maximum(a[:, 2], a[:, 3]),
                                                     signed_char], 1))


def test_half_and_bfloat_vectors():
    source = """
        const uint i = thread_position_in_grid.x;
        const vec<T, 4> h = ((const device vec<T, 4>*)x)[i];
        ((device vec<T, 4>*)out)[i] = exp(h) * h.wzyx + T(1);
    """
    kernel = tf_metal_ops.metal_kernel("small_floats", ["x"], ["out"], source)
    for dtype, rtol in ((tf.float16, 4e-3), (tf.bfloat16, 3e-2)):
        x = tf.cast(RNG.uniform(-2, 2, size=(12, 4)).astype(np.float32), dtype)
        (out,) = kernel(inputs=[x], output_shapes=[[12, 4]], output_dtypes=[dtype],
                        grid=(12, 1, 1), threadgroup=(4, 1, 1), template=[("T", dtype)])
        xf = tf.cast(x, tf.float32).numpy()
        expected = np.exp(xf) * xf[:, ::-1] + 1
        np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(), expected, rtol=rtol,
                                   atol=rtol)


# ---- math -------------------------------------------------------------------------------------

def math_reference(v):
    u = np.stack([v, v + 1, v + 2, v + 3], 1)
    r = u[:, ::-1]
    t = np.clip((v - 0.5) / 1.0, 0, 1)
    eu = np.exp(u) + np.maximum(u, 2.5)
    columns = [
        np.exp(v), np.log(v), np.sqrt(v), 1 / np.sqrt(v), np.sin(v), np.cos(v), np.tan(v),
        np.tanh(v), np.arctan2(v, np.float32(0.7)), v ** 1.5, np.fmod(v * 7, np.float32(1.3)),
        v * 3 - np.floor(v * 3), np.floor(v * 3), np.ceil(v * 3),
        np.sign(v * 3) * np.floor(np.abs(v * 3) + 0.5), np.trunc(v * 3), np.sign(v - 1),
        np.where(v < 1, 0, 1), t * t * (3 - 2 * t), v + (2 - v) * 0.25, np.clip(v, 0.5, 1.5),
        np.clip(v - 0.5, 0, 1), v * v + 1, np.exp2(v), np.log2(v), np.log10(v), 10 ** v,
        np.sinh(v), np.cosh(v), np.arcsin(v / 2), np.arccos(v / 2), np.arctan(v), np.exp(v),
        np.log(v), 1 / np.sqrt(v), np.sqrt(v), np.fmax(v, 1), np.fmin(v, 1), -np.abs(v),
        np.abs(v - 1), v ** 2.5, np.maximum(v, 1), np.minimum(v, 1), eu[:, 0], eu[:, 1],
        u[:, 2] / np.linalg.norm(u, axis=1), np.linalg.norm(u - r, axis=1),
        (u + (r - u) * 0.25)[:, 3],
    ]
    return np.stack([np.asarray(c, np.float64) for c in columns], 1)


def test_math_functions_metal_fast_precise_and_vector():
    n = 200
    # Away from the ties of round, floor and ceil at v * 3 (exact in float32 or not).
    v = RNG.uniform(0.1, 2.0, size=n).astype(np.float32)
    kernel = tf_metal_ops.metal_kernel("math", ["x"], ["out"], MATH_SOURCE)
    (out,) = run(kernel, [v], [[n * len(MATH_FUNCTIONS)]], [tf.float32], (n, 1, 1), (64, 1, 1))
    out = out.reshape(n, len(MATH_FUNCTIONS))
    expected = math_reference(v.astype(np.float64))
    assert expected.shape == out.shape
    for j, name in enumerate(MATH_FUNCTIONS):
        np.testing.assert_allclose(out[:, j], expected[:, j], err_msg=name, **F32)


def test_exponents_and_parts_float_half_and_vectors():
    """frexp, ldexp, ilogb, modf and sincos (MSL's Table 6.4: the outputs through references),
    on float, on half and on a float2, metal:: and fast::, bit-exact against NumPy (sincos
    within float32's error), zero and a half subnormal among the values."""
    x = np.array([0.0, 1.0, -1.5, 3.75, 1e-3, -123.456, 6e-5, 6e4], np.float32)
    n = len(x)
    source = """
        const uint i = thread_position_in_grid.x;
        const float v = x[i];
        int e;
        const float m = frexp(v, e);
        float whole;
        const float fraction = fast::modf(v, whole);
        float c;
        const float s = sincos(v, c);
        const half h = half(v);
        int he;
        const half hm = metal::frexp(h, he);
        half hwhole;
        const half hfraction = modf(h, hwhole);
        int2 e2;
        const float2 m2 = frexp(float2(v, 2.0f * v), e2);
        const float2 l2 = ldexp(m2, e2 + int2(1, 0));
        const float2 i2 = float2(ilogb(float2(v, 4.0f * v)));
        float2 w2;
        const float2 f2 = modf(float2(v, -v), w2);
        float2 c2;
        const float2 s2 = sincos(float2(v, 0.5f * v), c2);
        const float row[] = {m, float(e), ldexp(v, 3), float(ilogb(v)), fraction, whole, s, c,
                             float(hm), float(he), float(hfraction), float(hwhole),
                             float(ldexp(h, -2)), l2.x, l2.y, i2.x, i2.y, f2.y, w2.y, s2.y,
                             c2.y};
        for (uint j = 0; j < 21; ++j) out[i * 21 + j] = row[j];
    """
    kernel = tf_metal_ops.metal_kernel("parts", ["x"], ["out"], source)
    (out,) = run(kernel, [x], [[n * 21]], [tf.float32], (n, 1, 1), (n, 1, 1))
    out = out.reshape(n, 21)
    m, e = np.frexp(x)
    fraction, whole = np.modf(x)
    h = x.astype(np.float16)
    hm, he = np.frexp(h)
    hfraction, hwhole = np.modf(h)
    m2, e2 = np.frexp(2.0 * x)
    with np.errstate(divide="ignore"):
        ilogb = np.where(x == 0, np.iinfo(np.int32).min, np.floor(np.log2(np.abs(x))))
        ilogb4 = np.where(x == 0, np.iinfo(np.int32).min, np.floor(np.log2(np.abs(4 * x))))
    np.testing.assert_array_equal(out[:, 0], m)
    np.testing.assert_array_equal(out[:, 1], e)
    np.testing.assert_array_equal(out[:, 2], np.ldexp(x, 3))
    np.testing.assert_array_equal(out[:, 3], ilogb.astype(np.float32))
    np.testing.assert_array_equal(out[:, 4], fraction)
    np.testing.assert_array_equal(out[:, 5], whole)
    np.testing.assert_allclose(out[:, 6], np.sin(x.astype(np.float64)), **F32)
    np.testing.assert_allclose(out[:, 7], np.cos(x.astype(np.float64)), **F32)
    np.testing.assert_array_equal(out[:, 8], hm.astype(np.float32))
    np.testing.assert_array_equal(out[:, 9], he)
    np.testing.assert_array_equal(out[:, 10], hfraction.astype(np.float32))
    np.testing.assert_array_equal(out[:, 11], hwhole.astype(np.float32))
    np.testing.assert_array_equal(out[:, 12], np.ldexp(h, -2).astype(np.float32))
    np.testing.assert_array_equal(out[:, 13], np.ldexp(m, e + 1))
    np.testing.assert_array_equal(out[:, 14], np.ldexp(m2, e2))
    np.testing.assert_array_equal(out[:, 15], ilogb.astype(np.float32))
    np.testing.assert_array_equal(out[:, 16], ilogb4.astype(np.float32))
    np.testing.assert_array_equal(out[:, 17], -fraction)
    np.testing.assert_array_equal(out[:, 18], -whole)
    np.testing.assert_allclose(out[:, 19], np.sin(0.5 * x.astype(np.float64)), **F32)
    np.testing.assert_allclose(out[:, 20], np.cos(0.5 * x.astype(np.float64)), **F32)


# ---- integer functions ------------------------------------------------------------------------

def integer_reference(x, y, i, bits, signed):
    mask = (1 << bits) - 1
    wrap = (lambda z: ((z + (1 << (bits - 1))) & mask) - (1 << (bits - 1))) if signed else \
        (lambda z: z & mask)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, mask)
    ux, uy = x & mask, y & mask

    def clz(u):
        return bits - u.bit_length()

    def ctz(u):
        return bits if u == 0 else (u & -u).bit_length() - 1

    def rev(u):
        return int(format(u, f"0{bits}b")[::-1], 2)

    def sat(z):
        return max(lo, min(hi, z))

    def rot(u, s):
        s %= bits
        return ((u << s) | (u >> (bits - s))) & mask if s else u

    def med(a, b, c):
        return max(min(a, b), min(max(a, b), c))

    cast = lambda v: wrap(v)  # noqa: E731
    return [cast(clz(ux)), cast(ctz(ux)), cast(bin(ux).count("1")), cast(abs(x - y)),
            sat(x + y), sat(x - y), (x + y) >> 1, (x + y + 1) >> 1, cast((x * y) >> bits),
            cast(rot(ux, i % 40)), cast(rev(ux)), min(x, y), max(x, y), min(x, y, 7),
            med(x, y, 7), cast(bin(uy).count("1")), min(max(x, wrap(-100)), 100)]


@pytest.mark.parametrize("dtype", [tf.int32, tf.uint32])
def test_integer_functions_bit_exact(dtype):
    n = 96
    info = np.iinfo(dtype.as_numpy_dtype)
    low = info.min + 1 if info.min < 0 else 0  # abs / absdiff of INT_MIN aside
    a = RNG.integers(low, info.max, size=n, endpoint=True, dtype=np.int64)
    b = RNG.integers(low, info.max, size=n, endpoint=True, dtype=np.int64)
    a[:4] = [0, 1, 7, info.max]
    b[:4] = [0, info.max, 7, 1]
    kernel = tf_metal_ops.metal_kernel("integers", ["a", "b"], ["out"],
                                       INTEGER_FUNCTIONS_SOURCE)
    count = len(INTEGER_FUNCTIONS)
    (out,) = run(kernel, [a.astype(dtype.as_numpy_dtype), b.astype(dtype.as_numpy_dtype)],
                 [[n * count]], [dtype], (n, 1, 1), (32, 1, 1), template=[("T", dtype)])
    out = out.reshape(n, count).astype(np.int64)
    signed = info.min < 0
    for t in range(n):
        expected = integer_reference(int(a[t]), int(b[t]), t, 32, signed)
        for j, name in enumerate(INTEGER_FUNCTIONS):
            assert out[t, j] == expected[j], (name, int(a[t]), int(b[t]), out[t, j], expected[j])


# ---- atomics ----------------------------------------------------------------------------------

def test_atomics_int_and_float():
    n = 300
    k = RNG.integers(-1000, 1000, size=n).astype(np.int32)
    kernel = tf_metal_ops.metal_kernel("atomics", ["k"], ["n", "r"], ATOMICS_SOURCE,
                                       atomic_outputs=True)
    ints, floats = run(kernel, [k], [[8], [6]], [tf.int32, tf.float32], (n, 1, 1), (64, 1, 1),
                       init_value=0)
    kk = k.astype(np.int64)
    xor = 0
    for v in k:
        xor ^= int(v)
    np.testing.assert_array_equal(ints, [kk.sum(), -kk.sum(), min(0, kk.min()),
                                         max(0, kk.max()), (1 << 31) - 1, xor,
                                         max(0, 3 * kk.max()), 42])
    # Integer-valued floats: every order of the additions gives the exact sum.
    np.testing.assert_array_equal(floats, [kk.sum(), -kk.sum(), min(0, kk.min()),
                                           max(0, kk.max()), max(0, kk.max() * 0.5), 2.5])


# ---- threadgroup memory and barriers ----------------------------------------------------------

def test_threadgroup_memory_with_both_barriers_and_combined_flags():
    n = 150  # threadgroups of 64, 64 and 22 threads
    x = np.arange(n, dtype=np.float32)
    kernel = tf_metal_ops.metal_kernel("reverse", ["x"], ["out"], THREADGROUP_REVERSE_SOURCE)
    assert kernel.lockstep
    (out,) = run(kernel, [x], [[n]], [tf.float32], (n, 1, 1), (64, 1, 1))
    expected = np.concatenate([x[0:64][::-1], x[64:128][::-1], x[128:][::-1]])
    np.testing.assert_array_equal(out, expected)


# ---- SIMD-group and quad-group functions ------------------------------------------------------

WIDTH = 32


def simd_groups(n, threadgroup):
    """(first thread, lane count) of every SIMD-group of a 1-D dispatchThreads grid."""
    groups = []
    for start in range(0, n, threadgroup):
        size = min(threadgroup, n - start)
        for s in range(0, size, WIDTH):
            groups.append((start + s, min(WIDTH, size - s)))
    return groups


def reductions_reference(x, p, n, threadgroup, skip, integer):
    """Expected outputs (per thread, None where the thread returned) of SIMD_REDUCTIONS."""
    out = {}
    for first, lanes in simd_groups(n, threadgroup):
        active = [l for l in range(lanes) if not (skip and l % 3 == 2)]
        vals = {l: x[first + l] for l in active}
        ys = {l: p[first + l] for l in active}
        ballot = sum(1 << l for l in active if vals[l] > 0)
        mask = sum(1 << l for l in active)
        for l in active:
            quad = [m for m in active if m // 4 == l // 4]
            before = [m for m in active if m < l]
            prod = lambda ls: np.prod([ys[m] for m in ls], dtype=x.dtype) if ls else x.dtype.type(1)  # noqa: E731,E501
            sum_ = lambda ls: np.sum([vals[m] for m in ls], dtype=x.dtype) if ls else x.dtype.type(0)  # noqa: E731,E501
            row = [sum_(active), prod(active), max(vals.values()), min(vals.values()),
                   sum_(before), sum_(before + [l]), prod(before), prod(before + [l]),
                   vals[active[0]], int(l == active[0]), int(all(v > 0 for v in vals.values())),
                   int(any(v > 0 for v in vals.values())), sum_(quad),
                   sum_([m for m in quad if m <= l]), max(vals[m] for m in quad)]
            out[first + l] = (row, ballot, mask)
    return out


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32, tf.uint32])
@pytest.mark.parametrize("skip", [False, True])
def test_simd_reductions_prefixes_and_votes_over_active_lanes(dtype, skip):
    """A 100-thread grid in threadgroups of 48: SIMD-groups of 32 and 16 lanes (partial), and
    with `skip` a third of the lanes returned before the calls (inactive)."""
    n, tg = 100, 48
    np_type = dtype.as_numpy_dtype
    if dtype == tf.float32:
        x = RNG.uniform(-4, 4, size=n).astype(np_type)
        p = RNG.uniform(0.8, 1.25, size=n).astype(np_type)
    else:
        x = RNG.integers(0 if dtype == tf.uint32 else -50, 50, size=n).astype(np_type)
        p = RNG.choice([1, 1, 1, 2] if dtype == tf.uint32 else [1, -1, 1, 2], size=n)
        p = p.astype(np_type)
    count = len(SIMD_REDUCTIONS)
    kernel = tf_metal_ops.metal_kernel("simd_reductions", ["x", "p"], ["out", "votes"],
                                       SIMD_REDUCTIONS_SOURCE)
    out, votes = run(kernel, [x, p], [[n * count], [n * 2]], [dtype, tf.uint32], (n, 1, 1),
                     (tg, 1, 1), template=[("T", dtype), ("SKIP", skip)], init_value=0)
    out = out.reshape(n, count)
    votes = votes.reshape(n, 2)
    expected = reductions_reference(x, p, n, tg, skip, dtype != tf.float32)
    for t in range(n):
        if t not in expected:
            assert (out[t] == 0).all() and (votes[t] == 0).all(), t  # returned: wrote nothing
            continue
        row, ballot, mask = expected[t]
        assert list(votes[t]) == [ballot, mask], t
        for j, name in enumerate(SIMD_REDUCTIONS):
            if dtype == tf.float32:
                np.testing.assert_allclose(out[t, j], row[j], err_msg=f"{name} thread {t}",
                                           **F32)
            else:
                assert out[t, j] == np_type(row[j]), (name, t, out[t, j], row[j])


def shuffles_reference(x, p, n):
    out = np.zeros((n, len(SIMD_SHUFFLES)), x.dtype)
    for first in range(0, n, WIDTH):
        v, y = x[first:first + WIDTH], p[first:first + WIDTH]
        for lane in range(WIDTH):
            def fill(delta, m, up):
                base, k = lane - lane % m, lane % m
                if up:
                    return v[base + k - delta] if k >= delta else y[base + m - delta + k]
                return v[base + k + delta] if k + delta < m else y[base + k + delta - m]
            q, ql = lane - lane % 4, lane % 4
            out[first + lane] = [
                v[(lane + 3) % 32], v[lane - 3] if lane >= 3 else v[lane],
                v[lane + 3] if lane + 3 < 32 else v[lane], v[lane ^ 5], v[(lane - 3) % 32],
                v[(lane + 3) % 32], fill(3, 32, True), fill(3, 32, False), fill(2, 8, True),
                fill(2, 8, False), v[7], v[q + (ql + 1) % 4], v[q + 2], v[q + (ql ^ 1)],
                v[q + ql - 1] if ql >= 1 else v[lane], v[q + ql + 1] if ql < 3 else v[lane],
                v[q], (first + lane) % 64 // 4]
    return out


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32, tf.uint32, tf.float16])
def test_simd_and_quad_shuffles_and_broadcasts(dtype):
    n = 128  # threadgroups of 64: full SIMD-groups
    np_type = dtype.as_numpy_dtype
    x = RNG.integers(0, 1000, size=n).astype(np_type)
    p = RNG.integers(0, 1000, size=n).astype(np_type)
    count = len(SIMD_SHUFFLES)
    kernel = tf_metal_ops.metal_kernel("simd_shuffles", ["x", "p"], ["out"],
                                       SIMD_SHUFFLES_SOURCE)
    (out,) = run(kernel, [x, p], [[n * count]], [dtype], (n, 1, 1), (64, 1, 1),
                 template=[("T", dtype)])
    out = out.reshape(n, count)
    expected = shuffles_reference(x, p, n)
    for j, name in enumerate(SIMD_SHUFFLES):
        np.testing.assert_array_equal(out[:, j], expected[:, j], err_msg=name)


@pytest.mark.parametrize("dtype", [tf.int32, tf.uint32])
def test_simd_and_quad_bitwise_reductions(dtype):
    n = 64
    x = RNG.integers(0, 2 ** 31 - 1, size=n).astype(dtype.as_numpy_dtype)
    kernel = tf_metal_ops.metal_kernel("simd_bitwise", ["x"], ["out"], SIMD_BITWISE_SOURCE)
    (out,) = run(kernel, [x], [[n * 6]], [dtype], (n, 1, 1), (64, 1, 1),
                 template=[("T", dtype)])
    out = out.reshape(n, 6)
    for t in range(n):
        group = x[t - t % 32:t - t % 32 + 32]
        quad = x[t - t % 4:t - t % 4 + 4]
        expected = [np.bitwise_and.reduce(group), np.bitwise_or.reduce(group),
                    np.bitwise_xor.reduce(group), np.bitwise_and.reduce(quad),
                    np.bitwise_or.reduce(quad), np.bitwise_xor.reduce(quad)]
        np.testing.assert_array_equal(out[t], expected)


def test_simd_functions_on_vectors():
    source = """
        const uint i = thread_position_in_grid.x;
        const float4 v = ((const device float4*)x)[i];
        ((device float4*)out)[2 * i] = simd_sum(v);
        ((device float4*)out)[2 * i + 1] = simd_shuffle_xor(v.wzyx, 1) + quad_broadcast(v, 0);
    """
    n = 64
    x = RNG.uniform(-1, 1, size=(n, 4)).astype(np.float32)
    kernel = tf_metal_ops.metal_kernel("simd_vectors", ["x"], ["out"], source)
    (out,) = run(kernel, [x], [[n, 2, 4]], [tf.float32], (n, 1, 1), (64, 1, 1))
    sums = np.repeat(x.reshape(2, 32, 4).sum(1), 32, axis=0)
    np.testing.assert_allclose(out[:, 0], sums, **F32)
    partner = x[np.arange(n) ^ 1][:, ::-1] + x[np.arange(n) - np.arange(n) % 4]
    np.testing.assert_allclose(out[:, 1], partner, **F32)


# ---- what Metal leaves undefined fails the op -------------------------------------------------

@pytest.mark.parametrize("body, match", [
    # Lane 16 of a 16-lane SIMD-group does not exist.
    ("out[i] = simd_shuffle_down(x[i], 8);", "simd_shuffle_down reads lane 16, which is inactive"),
    ("out[i] = simd_broadcast(x[i], ushort(i % 2));",
     "an argument that must be the same in every lane differs"),
    ("out[i] = simd_shuffle(x[i], 40);", "reads lane 64, outside the SIMD-group of 32"),
])
def test_undefined_simd_reads_fail_the_op(body, match):
    kernel = tf_metal_ops.metal_kernel("undefined_read", ["x"], ["out"],
                                       "const uint i = thread_position_in_grid.x;\n" + body)
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        kernel(inputs=[tf.ones([16])], output_shapes=[[16]], output_dtypes=[tf.float32],
               grid=(16, 1, 1), threadgroup=(16, 1, 1))


# ---- refused by name --------------------------------------------------------------------------

@pytest.mark.parametrize("header, body, word, feature", [
    ("float first(texture2d<float, access::read> t) { return t.read(uint2(0, 0)).x; }", "",
     "texture2d", "textures"),
    ("", "constexpr sampler s(filter::linear);", "sampler", r"textures \(samplers\)"),
    ("", "texture3d<half> volume;", "texture3d", "textures"),
    ("", "simdgroup_float8x8 m;", "simdgroup_float8x8", "simdgroup_matrix"),
    ("", "simdgroup_matrix<float, 8, 8> m;", "simdgroup_matrix", "simdgroup_matrix"),
    ("", "simdgroup_load(m, x, 8);", "simdgroup_load", "simdgroup_matrix"),
    ("", "simdgroup_multiply_accumulate(d, a, b, c);", "simdgroup_multiply_accumulate",
     "simdgroup_matrix"),
    ("", "raytracing::intersector<> hit;", "raytracing", "ray tracing"),
    ("", "acceleration_structure<> scene;", "acceleration_structure", "ray tracing"),
    ("", "float4x4 m = float4x4(1.0f);", "float4x4", "matrix types"),
])
def test_unsupported_features_are_refused_by_name(header, body, word, feature):
    kernel = tf_metal_ops.metal_kernel("refused", ["x"], ["out"], body + "\nout[0] = x[0];",
                                       header=header)
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        kernel(inputs=[tf.ones([1])], output_shapes=[[1]], output_dtypes=[tf.float32],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    message = str(error.value)
    assert "metal_kernel 'custom_kernel_refused_float_float'" in message
    assert f"{word} ({feature.replace(chr(92), '')}) is not supported by the CPU path" in message


def test_refused_names_used_otherwise_are_left_alone():
    """An input called `sampler`, a variable `matrix` and a comment naming texture2d compile."""
    source = """
        // texture2d<float> would be refused here, but this is a comment
        const float matrix = sampler[0] * 2.0f;
        out[0] = matrix;
    """
    kernel = tf_metal_ops.metal_kernel("not_refused", ["sampler"], ["out"], source)
    (out,) = run(kernel, [np.array([1.5], np.float32)], [[1]], [tf.float32], (1, 1, 1),
                 (1, 1, 1))
    assert out[0] == 3.0


# ---- C library math that MSL does not have ----------------------------------------------------

@pytest.mark.parametrize("call, word", [
    ("erf(x[0])", "erf"),
    ("metal::erf(x[0])", "erf"),
    ("precise::log1p(x[0])", "log1p"),
    ("expm1 (x[0])", "expm1"),
    ("erff(x[0])", "erff"),
    ("lgamma(x[0])", "lgamma"),
    ("hypot(x[0], 2.0f)", "hypot"),
])
def test_c_math_functions_msl_lacks_are_refused(call, word):
    """The host compiler would take these from <cmath>; the Metal compiler has none of them."""
    kernel = tf_metal_ops.metal_kernel("c_math", ["x"], ["out"], f"out[0] = {call};")
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        kernel(inputs=[tf.ones([1])], output_shapes=[[1]], output_dtypes=[tf.float32],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert f"{word} is not a function of the Metal Shading Language" in str(error.value)


def test_a_kernel_may_define_a_function_msl_lacks():
    """erf written in the header, as MLX writes its own: compiled and called, not refused (the
    CPU path compiles the kernel in a namespace of its own, so a C library's erf in the global
    namespace, which libc++ declares for float too, does not clash with it)."""
    kernel = tf_metal_ops.metal_kernel("own_erf", ["x"], ["out"], OWN_ERF_SOURCE,
                                       header=OWN_ERF_HEADER)
    x = np.linspace(-3, 3, 25).astype(np.float32)
    (out,) = run(kernel, [x], [x.shape], [tf.float32], (25, 1, 1), (25, 1, 1))
    np.testing.assert_allclose(out, [math.erf(v) for v in x], atol=1e-6)


# ---- C and C++ that MSL does not have ---------------------------------------------------------

MAC_REJECTS = "so the Metal compiler rejects this kernel on a Mac; the CPU path refuses it too"


def refusal(body, header=""):
    """The CPU path's message for a kernel it refuses."""
    kernel = tf_metal_ops.metal_kernel("not_msl", ["x"], ["out"], body, header=header)
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        kernel(inputs=[tf.ones([1])], output_shapes=[[1]], output_dtypes=[tf.float32],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    return str(error.value)


@pytest.mark.parametrize("header, body, start", [
    ("", 'printf("%f", x[0]); out[0] = x[0];', "printf is a C library function"),
    ("", "float t; memcpy(&t, &x[0], 4); out[0] = t;", "memcpy is a C library function"),
    ("", "thread float* p = (thread float*)malloc(4); out[0] = x[0]; free(p);",
     "malloc is a C library function"),
    ("", "if (x[0] > 5) abort(); out[0] = x[0];", "abort is a C library function"),
    ("", "out[0] = expf(x[0]);", "expf is C's float form of a math function"),
    ("", "out[0] = fmaxf(x[0], 0.5f);", "fmaxf is C's float form of a math function"),
    ("", "out[0] = std::min(x[0], 2.0f);", "std (the C++ standard library) is not part of"),
    ("using namespace std;", "out[0] = x[0];", "std (the C++ standard library) is not part of"),
    ("", "thread float* p = new float(x[0]); out[0] = *p;",
     "new (the new operator) is not part of the Metal Shading Language (its specification, "
     "section 1.5.4)"),
    ("", "if (x[0] > 5) throw 1; out[0] = x[0];", "throw (exception handling) is not part of"),
    ("", "double d = x[0]; out[0] = float(d);",
     "double (the double type: use float) is not part of the Metal Shading Language (its "
     "specification, section 2.1)"),
    ("", "long long n = 1; out[0] = float(n);", "long long is not part of"),
    ("struct Base { float v; };\nstruct Derived : Base {};", "Derived d; out[0] = x[0];",
     "struct Derived : ... (a derived class) is not part of"),
    ("#include <cstdio>", "out[0] = x[0];", "#include <cstdio>: a Metal kernel includes only"),
    ('#include "helpers.h"', "out[0] = x[0];", '#include "helpers.h": a Metal kernel includes'),
])
def test_c_and_cpp_msl_lacks_are_refused(header, body, start):
    """The host compiler takes all of these (the C and C++ libraries, the C++ that MSL leaves
    out: the MSL specification's sections 1.5.4 and 2.1); the Metal compiler takes none."""
    message = refusal(body, header)
    assert start in message
    assert MAC_REJECTS in message


def test_metal_headers_the_emulator_lacks_are_refused_by_feature():
    assert ("<metal_texture> (textures) is not supported by the CPU path of metal_kernel"
            in refusal("out[0] = x[0];", "#include <metal_texture>"))


def test_cpp_that_msl_keeps_is_not_refused():
    """Parts of <metal_stdlib> included alone, an enum class with its integer type, a bit-field,
    a template's `class`, a deleted copy constructor, `long`, a kernel's own printf, and the
    refused words in a comment and in a string: compiled and run, not refused."""
    header = """
        #include <metal_math>
        #include <metal_simdgroup>
        enum class Scale : uint { twice = 2 };
        struct Flags { uint low : 4; uint high : 4; };
        struct Once { Once() = default; Once(const thread Once&) = delete; float v; };
        template <class T> T times(T v, uint k) { return v * T(k); }
        float printf(float v) { return v + 1.0f; }  // the kernel's own, not the C library's
        // std::min, double, new and #include <cstdio> in a comment
        constant char kNote[] = "printf(), std::min, double";
    """
    body = """
        Flags f; f.low = 3u; f.high = 1u;
        Once once; once.v = x[0];
        long big = long(f.low) << 33;
        out[0] = printf(times(once.v, uint(Scale::twice))) + float(big >> 33) + sqrt(4.0f);
    """
    kernel = tf_metal_ops.metal_kernel("msl_keeps", ["x"], ["out"], body, header=header)
    (out,) = run(kernel, [np.array([1.5], np.float32)], [[1]], [tf.float32], (1, 1, 1),
                 (1, 1, 1))
    assert out[0] == 1.5 * 2 + 1 + 3 + 2
