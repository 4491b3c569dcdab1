"""csrc/cpu/gemm.h, the one matrix product of the CPU kernels, through the pybind11 module: the
platform's BLAS (OpenBLAS from scipy-openblas32 on Linux, Accelerate on macOS) with row-major
operands, transpose flags, alpha and beta, checked against NumPy in float64."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import tf_metal_ops
from tf_metal_ops import _native

RUNTIME = _native.runtime()


@pytest.mark.native
@pytest.mark.simd
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_sgemm_matches_float64(trans_a, trans_b):
    rng = np.random.default_rng(1)
    m, n, k = 37, 53, 129
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    c0 = rng.standard_normal((m, n), dtype=np.float32)
    op_a = (a.T if trans_a else a).astype(np.float64)
    op_b = (b.T if trans_b else b).astype(np.float64)
    for alpha, beta in ((1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)):
        c = c0.copy()
        RUNTIME.sgemm(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)
        want = alpha * op_a @ op_b + beta * c0.astype(np.float64)
        np.testing.assert_allclose(c, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.native
def test_sgemm_beta_zero_never_reads_c():
    a = np.ones((2, 3), np.float32)
    b = np.ones((3, 4), np.float32)
    c = np.full((2, 4), np.nan, np.float32)
    RUNTIME.sgemm(a, b, c)
    np.testing.assert_array_equal(c, 3.0)


@pytest.mark.native
def test_sgemm_rejects_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match=r"sgemm: shapes do not fit: op\(a\) 2x3, op\(b\) 4x4"):
        RUNTIME.sgemm(np.ones((2, 3), np.float32), np.ones((4, 4), np.float32),
                      np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="c must be a C-contiguous float32 array"):
        RUNTIME.sgemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
                      np.zeros((2, 4), np.float64))


def test_build_info_names_the_blas():
    info = tf_metal_ops._native.build_info()
    assert info["blas_available"] is True
    assert ("Accelerate" if sys.platform == "darwin" else "OpenBLAS") in info["blas"]


@pytest.mark.native
@pytest.mark.simd
@pytest.mark.parametrize("columns", [0, 1, 15, 511, 512, 1023, 1201, 8191, 32000, 128256, 10**6])
def test_column_blocks_cover_the_columns_once(columns):
    """The blocks the linear op cuts its products into: every column in exactly one block,
    whole 64-byte rows but for the last, at most kMaxGemmColumnBlocks (one on Accelerate)."""
    width, count = RUNTIME.gemm_column_blocks(columns)
    if columns == 0:
        assert count == 0
        return
    assert count >= 1 and (count - 1) * width < columns <= count * width
    if sys.platform == "darwin":
        assert (width, count) == (columns, 1)
        return
    assert width % 16 == 0 and count <= 16
    assert count == 1 or width >= 512  # a block is never narrower than kMinGemmColumnBlock
    assert count == min(16, max(1, columns // 512)) or count * width - columns < width


def test_column_blocks_refuse_a_negative_width():
    with pytest.raises(ValueError, match="columns must be >= 0, got -1"):
        RUNTIME.gemm_column_blocks(-1)
