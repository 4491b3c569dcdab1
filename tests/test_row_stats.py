"""The forward op's row statistics and the gradient that uses them (csrc/problem.h).

The forward op's second output holds, per flattened row, max_c z_c, log sum_c exp(z_c - max) and
1 / sum_c exp(z_c - max). `tf_metal_ops.custom_loss`'s gradient passes them to the gradient op,
which then skips the passes that would find them again. Checked here: the statistics are those
numbers (the maximum exactly), ignored rows get zeros, the float64 kernel returns none
([0, 3]); and a gradient given the statistics is, bit for bit, the gradient computed without
them (within an ulp or two where the forward's rows went through the row-group kernel and the
gradient's did not), over every loss mode, storage type, label kind and class counts on both
sides of the row-group limits, on this CPU's instruction set and on the baseline one. (Against the reference,
the statistics path is what test_custom_loss_op.py and test_cpu_kernels.py check, since they go
through custom_loss's gradient.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from portable_isa import run_on_portable_isa
from raw_ops import NO_STATS, NO_WEIGHTS, awkward_inputs, forward, gradient
from tf_metal_ops import _native

pytestmark = pytest.mark.simd

# Around the row-group limits (32 / 48 classes at 8 and 16 lanes, 24 / 32 at 4) and the vector
# widths.
CLASS_COUNTS = [1, 7, 24, 25, 33, 48, 49, 100, 1003]
# (gamma, label_smoothing): plain, smoothed, focal (the fast gamma kinds and a general one).
SETTINGS = [(0.0, 0.0), (0.0, 0.1), (1.0, 0.0), (2.0, 0.1), (0.5, 0.0), (3.7, 1.0)]
DTYPES = [tf.float32, tf.float16, tf.bfloat16]


# Forward rows of few classes go through the row-group kernel (csrc/cpu/simd/simd_row_groups.h),
# whose vector log1p may end log_sum an ulp or two away from the single-row kernel's libm log1p.
# Where the forward used groups but the gradient single rows (between the two limits), the gradient
# given the forward's statistics is then that close, not bit for bit, to the one without.
GROUP_LIMITS = {"avx512": (32, 48), "avx2": (32, 48), "portable": (24, 32)}  # (gradient, forward) class counts


def _exact_expected(classes: int) -> bool:
    gradient_limit, forward_limit = GROUP_LIMITS[_native.runtime().cpu_kernel_isa()]
    return not gradient_limit < classes <= forward_limit


def _gradients_agree(dtype, classes: int, label_kind: str) -> None:
    exact = _exact_expected(classes)
    z, labels = awkward_inputs(dtype, classes, label_kind)
    upstream = tf.cast(tf.linspace(0.5, 2.0, z.shape[0]), dtype)
    weight_options = [NO_WEIGHTS, tf.constant(np.linspace(0.0, 2.0, classes), tf.float32)]
    for gamma, eps in SETTINGS:
        for weights in weight_options:
            attrs = dict(gamma=gamma, label_smoothing=eps)
            if label_kind != "dense":  # rows labelled classes - 1 are ignored
                attrs.update(has_ignore_class=True, ignore_class=classes - 1)
            _, stats, _ = forward(z, labels, weights, **attrs)
            assert stats.shape == (z.shape[0], 3)
            with_stats = gradient(z, labels, weights, upstream, stats, **attrs)
            without = gradient(z, labels, weights, upstream, NO_STATS, **attrs)
            got = tf.cast(with_stats, tf.float64).numpy()
            want = tf.cast(without, tf.float64).numpy()
            where = f"{dtype.name} C={classes} {label_kind} gamma={gamma} eps={eps}"
            if exact:  # bit for bit, NaN where NaN
                np.testing.assert_array_equal(got, want, err_msg=where)
            else:
                # focal gradients subtract nearly equal terms (p_c G - g_c), so an ulp of
                # log_sum can move a small element by more than an ulp of its own: the
                # tolerance is absolute as well, far below the row's mass (upstream <= 2)
                tol = 1e-6 if dtype == tf.float32 else 1e-3
                np.testing.assert_allclose(got, want, rtol=10 * tol, atol=tol, err_msg=where)


@pytest.mark.native
@pytest.mark.parametrize("label_kind", ["int32", "int64", "dense"])
@pytest.mark.parametrize("classes", CLASS_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_with_row_stats_is_the_gradient_without(dtype, classes, label_kind):
    _gradients_agree(dtype, classes, label_kind)


@pytest.mark.baseline_isa
def test_portable_variant_gradient_with_row_stats_is_the_gradient_without():
    run_on_portable_isa("test_row_stats", """
        for dtype in t.DTYPES:
            for classes in t.CLASS_COUNTS:
                for label_kind in ("int64", "dense"):
                    t._gradients_agree(dtype, classes, label_kind)
    """)


@pytest.mark.native
@pytest.mark.parametrize("classes", [10, 33, 1003])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_row_stats_are_the_softmax_pieces(dtype, classes):
    z, labels = awkward_inputs(dtype, classes, "int32")
    ignored = classes - 1
    loss, stats, _ = forward(z, labels, has_ignore_class=True, ignore_class=ignored)
    stats = stats.numpy()
    zq = tf.cast(z, tf.float64).numpy()
    is_ignored = labels.numpy() == ignored
    np.testing.assert_array_equal(stats[is_ignored], 0.0)
    kept = ~is_ignored & ~np.isnan(zq).any(axis=1)
    zk = zq[kept]
    top = zk.max(axis=1)
    total = np.exp(zk - top[:, None]).sum(axis=1)
    np.testing.assert_array_equal(stats[kept, 0], top)  # the maximum is exact
    np.testing.assert_allclose(stats[kept, 1], np.log(total), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stats[kept, 2], 1.0 / total, rtol=1e-6)
    # a NaN logit makes its row's statistics NaN, as its loss
    nan_rows = ~is_ignored & np.isnan(zq).any(axis=1)
    assert np.isnan(loss.numpy()[nan_rows]).all()


@pytest.mark.native
def test_row_stats_shape_follows_the_flattened_rows():
    z = tf.random.stateless_normal([2, 3, 50], seed=[1, 2])
    labels = tf.zeros([2, 3], tf.int32)
    loss, stats, _ = forward(z, labels)
    assert loss.shape == (2, 3) and stats.shape == (6, 3)
    np.testing.assert_array_equal(stats.numpy()[:, 0], tf.reduce_max(z, -1).numpy().ravel())


@pytest.mark.native
def test_float64_kernel_returns_no_row_stats_and_its_gradient_works_without():
    z = tf.random.stateless_normal([4, 50], seed=[1, 2], dtype=tf.float64)
    labels = tf.constant([0, 1, 2, 3])
    _, stats, _ = forward(z, labels)
    assert stats.shape == (0, 3)
    grad = gradient(z, labels, NO_WEIGHTS, tf.ones([4], tf.float64), stats)
    assert np.isfinite(grad.numpy()).all()


@pytest.mark.native
def test_empty_batch_row_stats():
    _, stats, _ = forward(tf.zeros([0, 5]), tf.zeros([0], tf.int32))
    assert stats.shape == (0, 3)
