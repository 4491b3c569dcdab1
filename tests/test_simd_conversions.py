"""The CPU kernels' 16-bit loads and stores against NumPy's float16 and ml_dtypes' bfloat16.

tests/cpu_math/conversion_check.cc runs the vector loads and stores of half and bfloat16
(csrc/cpu/simd/simd_vector.h) in every instruction-set build the kernels use. A store must
round once, to nearest with ties to even, as the references do, for normal, subnormal (float32
subnormals too, which AVX-512 BF16's own conversion would flush to zero), halfway, overflowing,
infinite and NaN inputs; a NaN stays a NaN of the same sign (its payload is not compared: the
kernels keep the top payload bits, ml_dtypes writes the default NaN). A load must be exact.
"""

from __future__ import annotations

import subprocess

import ml_dtypes
import numpy as np
import pytest

from cpu_checks import BUILDS, REPO_ROOT, build_check

pytestmark = pytest.mark.simd

SOURCE = REPO_ROOT / "tests" / "cpu_math" / "conversion_check.cc"


def _inputs() -> np.ndarray:
    """float32 bit patterns: every 4096th, and the cases each rounding rule decides."""
    rng = np.random.default_rng(5)
    parts = [np.arange(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)]
    # bfloat16 keeps the top 16 bits: below, exactly at and above the halfway point, with the
    # kept part even and odd, at every exponent (subnormals and the largest finite included).
    top = np.concatenate([np.arange(0, 0x10000, 7, dtype=np.uint32),
                          np.array([0x0000, 0x0001, 0x007f, 0x0080, 0x7f7f, 0x7f7e, 0x7f80,
                                    0x8000, 0x8001, 0xff7f], dtype=np.uint32)])
    for low in (0x7fff, 0x8000, 0x8001, 0x0001, 0xffff):
        parts.append((top << 16) | low)
    # half keeps 10 of float32's 23 mantissa bits: halfway points at every half exponent,
    # normal and subnormal, and around the overflow to inf at 65520.
    halves = np.arange(0, 0x10000, 3, dtype=np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    with np.errstate(over="ignore"):  # the spacing past 65504 is inf; its middles are dropped
        spacing = np.spacing(halves.astype(np.float16)).astype(np.float32)
    for offset in (-0.5, 0.5):
        middle = halves + np.float32(offset) * spacing
        parts.append(middle.view(np.uint32))
        parts.append(np.nextafter(middle, np.float32(np.inf)).view(np.uint32))
        parts.append(np.nextafter(middle, np.float32(-np.inf)).view(np.uint32))
    parts.append(np.array([65504, 65519.996, 65520, 65536, 1e-8, 2.98e-8, 5.96e-8],
                          dtype=np.float32).view(np.uint32))
    # float32 subnormals, both signs; infinities; NaNs quiet and signalling, with payloads.
    subnormal = rng.integers(1, 0x800000, 20000, dtype=np.uint32)
    parts += [subnormal, subnormal | 0x80000000]
    parts.append(np.array([0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001,
                           0xff800001, 0x7fbfffff, 0x7fffffff, 0xffffffff, 0x7fa00000],
                          dtype=np.uint32))
    parts.append(rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32))
    return np.concatenate(parts).astype(np.uint32)


@pytest.fixture(scope="module", params=BUILDS)
def converted(request, tmp_path_factory):
    binary = build_check(SOURCE, request.param, tmp_path_factory.mktemp(
        f"conversions_{request.param}"))
    inputs = _inputs()
    ran = subprocess.run([str(binary)], input=inputs.tobytes(), capture_output=True,
                         timeout=600, check=False)
    assert ran.returncode == 0, ran.stderr.decode()[-3000:]
    out = np.frombuffer(ran.stdout, dtype=np.uint8)
    n = inputs.size
    bf16 = out[:2 * n].view(np.uint16)
    half = out[2 * n:4 * n].view(np.uint16)
    loads = out[4 * n:].view(np.uint32)
    assert loads.size == 2 * 65536
    return inputs, bf16, half, loads[:65536], loads[65536:], binary


def _assert_rounded_like(got: np.ndarray, want: np.ndarray, inputs: np.ndarray, name: str):
    """Bit for bit, except NaN: a NaN of the input's sign."""
    exponent_all_ones = {"bfloat16": 0x7f80, "half": 0x7c00}[name]
    mantissa = {"bfloat16": 0x007f, "half": 0x03ff}[name]
    got_nan = ((got & exponent_all_ones) == exponent_all_ones) & ((got & mantissa) != 0)
    input_nan = np.isnan(inputs.view(np.float32))
    np.testing.assert_array_equal(got_nan, input_nan, err_msg=f"{name}: NaN lanes")
    np.testing.assert_array_equal((got[input_nan] >> 15), (inputs[input_nan] >> 31),
                                  err_msg=f"{name}: NaN signs")
    keep = ~input_nan
    wrong = np.flatnonzero(got[keep] != want[keep])
    assert wrong.size == 0, (f"{name}: {wrong.size} of {keep.sum()} differ, e.g. inputs "
                             + ", ".join(f"{x:#010x} -> {g:#06x} (want {w:#06x})" for x, g, w in
                                         zip(inputs[keep][wrong[:5]], got[keep][wrong[:5]],
                                             want[keep][wrong[:5]])))


def test_bfloat16_store_rounds_like_ml_dtypes(converted):
    inputs, bf16, _, _, _, _ = converted
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = inputs.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    _assert_rounded_like(bf16, want, inputs, "bfloat16")
    # The cases the reference must have covered for this to mean anything.
    floats = inputs.view(np.float32)
    subnormal_kept = (np.abs(floats) < np.float32(1.1754944e-38)) & (want & 0x7fff != 0)
    assert subnormal_kept.sum() > 10000


def test_half_store_rounds_like_numpy(converted):
    inputs, _, half, _, _, _ = converted
    with np.errstate(over="ignore"):
        want = inputs.view(np.float32).astype(np.float16).view(np.uint16)
    _assert_rounded_like(half, want, inputs, "half")


def test_loads_are_exact(converted):
    _, _, _, from_bf16, from_half, _ = converted
    _assert_loads_exact(from_bf16, from_half)


def test_loads_are_exact_where_denormals_are_flushed(converted):
    """The kernels run on TensorFlow's threads, which flush denormals: a subnormal half (down to
    6e-8, a class weight or a small target) must still load as its value, not as zero."""
    binary = converted[-1]
    ran = subprocess.run([str(binary), "flush"], input=b"", capture_output=True, timeout=600,
                         check=False)
    assert ran.returncode == 0, ran.stderr.decode()[-3000:]
    loads = np.frombuffer(ran.stdout, dtype=np.uint32)
    assert loads.size == 2 * 65536
    _assert_loads_exact(loads[:65536], loads[65536:])


def _assert_loads_exact(from_bf16: np.ndarray, from_half: np.ndarray) -> None:
    patterns = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    for got, reference in ((from_bf16, ml_dtypes.bfloat16), (from_half, np.float16)):
        want = patterns.view(reference).astype(np.float32)
        got_f = got.view(np.float32)
        np.testing.assert_array_equal(np.isnan(got_f), np.isnan(want))
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(got[finite], want.view(np.uint32)[finite])
