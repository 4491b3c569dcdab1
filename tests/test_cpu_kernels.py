"""The CPU kernels' own paths: every instruction-set variant the CPU has, row tails, and the
gradient written over the logits' buffer.

test_custom_loss_op.py checks the op against the reference in depth on whatever variant this
CPU selects. Here, the same comparison runs on the narrower variants too (TF_METAL_OPS_CPU_ISA=
portable forces the SSE2/NEON one, =avx2 the AVX2 one on an AVX-512 CPU, each in a subprocess
since the choice is made once per process), over class counts around the vector widths (4, 8
and 16 lanes), and with logits that are an intermediate of the step, which lets TensorFlow hand
their buffer to the gradient (in place). The variants are not compared with one another bit for
bit: a row's sums are taken lane by lane, so each width adds in its own order
(csrc/cpu/simd/rows_dispatch.h); each must be within the same tolerances of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from portable_isa import run_on_isa, run_on_portable_isa
from tf_metal_ops import _native
from tf_metal_ops import reference as ref

pytestmark = [pytest.mark.native, pytest.mark.simd]

# (rtol, atol) against the float64 reference on the dtype-rounded inputs.
TOLERANCES = {tf.float32: (2e-5, 2e-5), tf.float16: (2e-3, 2e-3), tf.bfloat16: (1.6e-2, 1.6e-2),
              tf.float64: (1e-9, 1e-9)}
CLASS_COUNTS = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 100]
SETTINGS = [(0.0, 0.0), (0.0, 0.1), (2.0, 0.1), (0.5, 0.0), (3.7, 1.0)]


def _logits(rows: int, classes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, classes)) * 5
    z[0, :] = 0.0  # every class tied at the maximum
    if classes > 1:
        z[1, 0] = 60.0  # a confident row: p_0 rounds to 1 in float32
        z[2, -1] = -np.inf  # a masked class
    return z


def _check(dtype, classes: int, gamma: float, eps: float, rows: int = 6,
           ignore_class: int | None = None, class_weights: np.ndarray | None = None,
           dense: bool = False, margin: float = 0.0) -> None:
    z64 = _logits(rows, classes, seed=classes)
    labels = np.arange(rows) % classes
    labels[2] = 0
    z64[np.arange(rows), labels] += margin  # a trained model's rows: p_y near 1
    if dense:
        labels = np.random.default_rng(rows).dirichlet(np.ones(classes), size=rows)
    z = tf.cast(tf.constant(z64), dtype)
    zq = tf.cast(z, tf.float64).numpy()
    upstream = np.linspace(0.5, 2.0, rows)
    kwargs = dict(gamma=gamma, class_weights=class_weights, ignore_class=ignore_class)
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = tf_metal_ops.custom_loss(tf.cast(labels, dtype) if dense else labels, z,
                                        label_smoothing=eps, **kwargs)
    grad = tape.gradient(loss, z, output_gradients=tf.cast(upstream, dtype))
    uq = tf.cast(tf.cast(upstream, dtype), tf.float64).numpy()
    eps32 = float(np.float32(eps))
    if dense:
        labels = tf.cast(tf.cast(labels, dtype), tf.float64).numpy()
    if class_weights is not None:
        kwargs["class_weights"] = np.asarray(class_weights, np.float32).astype(np.float64)
    want_loss = ref.custom_loss(labels, zq, label_smoothing=eps32, **kwargs)
    want_grad = ref.custom_loss_grad(labels, zq, label_smoothing=eps32, upstream=uq, **kwargs)
    rtol, atol = TOLERANCES[dtype]
    for got, want in ((loss, want_loss), (grad, want_grad)):
        got = tf.cast(got, tf.float64).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


@pytest.mark.parametrize("classes", CLASS_COUNTS)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_vector_tails_match_reference(dtype, classes):
    for gamma, eps in SETTINGS:
        _check(dtype, classes, gamma, eps)


# Rows of few classes run a group of 16 (AVX-512), 8 (AVX2) or 4 (SSE2/NEON) rows at a time,
# transposed (csrc/cpu/simd/simd_row_groups.h): up to 48 / 32 classes forward and 32 / 24 for the
# gradient at 16 and 8 / 4 lanes, so the counts straddle each limit. 19 rows make full groups and
# a partial one at every width, with the special rows of _logits (all tied, confident, masked) in
# the first group.
GROUP_CLASS_COUNTS = [1, 2, 10, 24, 25, 32, 33, 48, 49]


def _check_groups(dtype, classes: int) -> None:
    weights = np.linspace(0.0, 2.0, classes)  # class 0 weighs 0
    for gamma, eps in SETTINGS:
        _check(dtype, classes, gamma, eps, rows=19)
        _check(dtype, classes, gamma, eps, rows=19, class_weights=weights)
        _check(dtype, classes, gamma, eps, rows=19, class_weights=weights, dense=True)
        # Rows labelled `classes - 1` are ignored: a few inside each group.
        _check(dtype, classes, gamma, eps, rows=19, ignore_class=classes - 1)


@pytest.mark.parametrize("classes", GROUP_CLASS_COUNTS)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_row_groups_match_reference(dtype, classes):
    _check_groups(dtype, classes)


# A trained model's rows: nearly every row's labelled class has p > 1/2, where the focal
# passes take r = 1 - p from lp (for gamma 1 and 2 in the vector, for other gamma in scalar),
# in rows of few classes (groups), a vector and a tail, and long rows.
def _check_confident(dtype) -> None:
    for classes in (10, 33, 1000):
        for gamma in (1.0, 2.0, 0.5):
            for eps in (0.0, 0.1):
                _check(dtype, classes, gamma, eps, rows=40, margin=12.0)
        _check(dtype, classes, 2.0, 0.1, rows=40, margin=12.0, dense=True)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_confident_rows_match_reference(dtype):
    _check_confident(dtype)


# The tail, group and confident-row tests above, as a child process runs them on a narrower
# variant.
VARIANT_CHECKS = """
        for dtype in (tf.float32, tf.float16, tf.bfloat16):
            for classes in t.CLASS_COUNTS:
                for gamma, eps in t.SETTINGS:
                    t._check(dtype, classes, gamma, eps)
            for classes in t.GROUP_CLASS_COUNTS:
                t._check_groups(dtype, classes)
            t._check_confident(dtype)
    """


@pytest.mark.baseline_isa
def test_portable_variant_matches_reference():
    """Runs the tail and group tests above in a process that uses the baseline (SSE2 / NEON)
    variant."""
    run_on_portable_isa("test_cpu_kernels", VARIANT_CHECKS, timeout=600)


def _skip_unless_default_is_avx512() -> None:
    isa = _native.runtime().cpu_kernel_isa()
    if isa != "avx512":
        pytest.skip(f"this CPU's default variant is {isa}: the AVX2 variant is the default (tested "
                    "by the tests above) or absent")


def test_avx2_variant_matches_reference():
    """The tail and group tests above on the AVX2 variant, where the CPU's default is AVX-512."""
    _skip_unless_default_is_avx512()
    run_on_isa("avx2", "test_cpu_kernels", VARIANT_CHECKS, timeout=600)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16, tf.float64])
@pytest.mark.parametrize("gamma,eps", SETTINGS)
def test_gradient_over_intermediate_logits(dtype, gamma, eps):
    """Logits made inside the step (as a model's last layer makes them) are read by the loss
    and its gradient only, so the gradient may take over their buffer: the kernels must be
    right in place. Checked through d loss / d W of z = h W."""
    rng = np.random.default_rng(11)
    h = rng.standard_normal((37, 16))
    w = rng.standard_normal((16, 45))
    labels = rng.integers(0, 45, 37)

    @tf.function
    def step(h_t, w_t):
        with tf.GradientTape() as tape:
            tape.watch(w_t)
            z = tf.matmul(h_t, w_t)
            loss = tf.reduce_sum(
                tf_metal_ops.custom_loss(labels, z, gamma=gamma, label_smoothing=eps))
        return tape.gradient(loss, w_t)

    h_t, w_t = tf.cast(h, dtype), tf.cast(w, dtype)
    grad_w = tf.cast(step(h_t, w_t), tf.float64).numpy()
    z = tf.cast(tf.matmul(h_t, w_t), tf.float64).numpy()
    grad_z = ref.custom_loss_grad(labels, z, gamma=gamma,
                                  label_smoothing=float(np.float32(eps)))
    want = tf.cast(h_t, tf.float64).numpy().T @ grad_z
    rtol, atol = TOLERANCES[dtype]
    scale = 1.0 + np.abs(want).max()
    # The matmul's rounding in `dtype` adds to the kernel's; 20 x the kernel tolerance bounds it.
    np.testing.assert_allclose(grad_w, want, rtol=0, atol=20 * max(rtol, atol) * scale)


# Rows of at least 65536 classes, sparse and unsmoothed, are cut into blocks of classes spread
# over the threads (csrc/cpu/simd/simd_split_rows.h): fewer rows than 4 per thread run as blocks,
# more as whole rows, and both must give the same bits whatever the thread count.
SPLIT_CLASSES = 65536 + 16384 + 37  # a partial last block and a vector tail


def _split_step(z: np.ndarray, labels: np.ndarray, gamma: float, ignore_class=None):
    """Loss, the gradient op's gradient (given the forward's statistics) and the reduced loss's
    scaled gradient written by the forward op."""
    zt = tf.constant(z)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(zt)
        losses = tf_metal_ops.custom_loss(labels, zt, gamma=gamma, ignore_class=ignore_class)
        reduced = tf_metal_ops.reduced_custom_loss(labels, zt, np.full(len(labels), 0.25),
                                                   gamma=gamma, ignore_class=ignore_class)
    upstream = (0.5 + 0.25 * np.arange(len(labels))).astype(np.float32)  # row i: the same in any batch
    grad = tape.gradient(losses, zt, output_gradients=tf.constant(upstream))
    scaled = tape.gradient(reduced, zt)
    return losses.numpy(), grad.numpy(), scaled.numpy(), upstream


def _split_logits(rows: int) -> np.ndarray:
    z = _logits(rows, SPLIT_CLASSES, seed=3)
    z[1, 0] = 120.0  # confident beyond Exp's plain range: the row takes the range-checked Exp
    return z.astype(np.float32)


def _check_split_rows(gamma: float) -> None:
    z = _split_logits(3)
    labels = np.array([5, 0, SPLIT_CLASSES - 1])
    losses, grad, scaled, upstream = _split_step(z, labels, gamma)
    zq = z.astype(np.float64)
    want_loss = ref.custom_loss(labels, zq, gamma=gamma)
    want_grad = ref.custom_loss_grad(labels, zq, gamma=gamma, upstream=upstream.astype(np.float64))
    np.testing.assert_allclose(losses, want_loss, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(scaled, 0.25 * want_grad / upstream[:, None], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_split_rows_match_reference(gamma):
    _check_split_rows(gamma)


def test_split_rows_same_bits_for_any_thread_count_and_batch():
    z = _split_logits(20)
    labels = np.arange(20) * 4099 % SPLIT_CLASSES
    labels[4] = 17  # ignored below
    runs = []
    try:
        for threads in (1, 2, 3):
            tf_metal_ops.set_cpu_threads(threads)
            runs.append(_split_step(z, labels, 2.0, ignore_class=17)[:3])
            runs.append(_split_step(z[:5], labels[:5], 2.0, ignore_class=17)[:3])
    finally:
        tf_metal_ops.set_cpu_threads(0)
    for many, few in zip(runs[0::2], runs[1::2]):
        # 20 rows against 5: whole-row tasks against block tasks from 2 threads on.
        for a, b in zip(many, few):
            np.testing.assert_array_equal(a[:5].view(np.uint32), b.view(np.uint32))
    for i in range(2, len(runs)):  # 2 and 3 threads against 1, batch by batch
        for a, b in zip(runs[i % 2], runs[i]):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert not np.any(runs[0][1][4]) and not np.any(runs[0][2][4])  # the ignored row: +0


@pytest.mark.baseline_isa
def test_portable_split_rows_match_reference():
    run_on_portable_isa("test_cpu_kernels", """
        for gamma in (0.0, 2.0):
            t._check_split_rows(gamma)
        t.test_split_rows_same_bits_for_any_thread_count_and_batch()
    """, timeout=600)


def test_avx2_split_rows_match_reference():
    _skip_unless_default_is_avx512()
    run_on_isa("avx2", "test_cpu_kernels", """
        for gamma in (0.0, 2.0):
            t._check_split_rows(gamma)
        t.test_split_rows_same_bits_for_any_thread_count_and_batch()
    """, timeout=600)
