"""A reduced loss computes its gradient in the forward op (Liger-Kernel's rule; csrc/problem.h).

A forward op given `row_scales` s also writes s_i * d loss_i / d logits_i, and the backward of
`CustomLoss`'s reduction (every reduction but None) only multiplies it by the scalar upstream.

Checked here: the scaled gradient is, bit for bit, what the gradient op computes with upstream
s from the forward's row statistics, over every loss mode, storage type, label kind, class
weights and class counts on both sides of the row-group limits (here and on the baseline
instruction set), and the forward's loss and statistics do not change with it; CustomLoss's
value and gradient equal Keras's own reduction of our per-example losses for every reduction,
sample-weight shape, Keras mask and ignore_class, also under a scale applied after it, the
mixed_float16 policy and loss weights in `fit`; the training graph runs no gradient op where
the forward made the gradient, and does where it cannot (float64).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
# Keras has no public setter of a tensor's mask. This module defines it; `keras.src.backend`
# re-exports it up to Keras 3.15 but not in the 3.16 previews that TensorFlow 2.22 installs.
from keras.src.backend.common.masking import set_keras_mask

from portable_isa import run_on_portable_isa
from raw_ops import NO_WEIGHTS, awkward_inputs, forward, gradient
import tf_metal_ops
from tf_metal_ops import CustomLoss


# Around the row-group limits (32 / 48 classes at 8 lanes, 24 / 32 at 4) and the vector widths.
CLASS_COUNTS = [1, 7, 24, 25, 33, 48, 49, 100, 1003]
# (gamma, label_smoothing): plain, smoothed, focal (the fast gamma kinds and a general one).
SETTINGS = [(0.0, 0.0), (0.0, 0.1), (1.0, 0.0), (2.0, 0.1), (0.5, 0.0), (3.7, 1.0)]
DTYPES = [tf.float32, tf.float16, tf.bfloat16]
ROWS = 19  # full and partial row groups at both lane widths


def _assert_same_bits(got: tf.Tensor, want: tf.Tensor, where: str) -> None:
    """Equal values (NaN where NaN) with equal signs, zeros' and NaNs' included."""
    a, b = tf.cast(got, tf.float64).numpy(), tf.cast(want, tf.float64).numpy()
    np.testing.assert_array_equal(a, b, err_msg=where)
    np.testing.assert_array_equal(np.signbit(a), np.signbit(b), err_msg=where + " (signs)")


def check_scaled_gradient_is_the_gradient_ops(classes: int, dtype) -> None:
    # Scales every storage type holds exactly, one per row, zero and negative ones among them.
    scales = (np.arange(ROWS) % 5 - 1) * 0.375
    for label_kind in ("int32", "int64", "dense"):
        z, labels = awkward_inputs(dtype, classes, label_kind, rows=ROWS)
        for gamma, eps in SETTINGS:
            for weights in (NO_WEIGHTS,
                            tf.constant(np.linspace(0.0, 2.0, classes), tf.float32)):
                attrs = dict(gamma=gamma, label_smoothing=eps)
                if label_kind != "dense":  # rows labelled classes - 1 are ignored
                    attrs.update(has_ignore_class=True, ignore_class=classes - 1)
                loss, stats, scaled = forward(z, labels, weights,
                                              row_scales=tf.constant(scales, tf.float32),
                                              **attrs)
                where = f"{dtype.name} C={classes} {label_kind} gamma={gamma} eps={eps}"
                assert scaled.shape == z.shape and scaled.dtype == dtype, where
                plain_loss, plain_stats, none = forward(z, labels, weights, **attrs)
                assert none.shape == (0,), where
                _assert_same_bits(loss, plain_loss, where + " (loss)")
                _assert_same_bits(stats, plain_stats, where + " (row_stats)")
                computed = gradient(z, labels, weights, tf.cast(scales, dtype), stats, **attrs)
                _assert_same_bits(scaled, computed, where)


@pytest.mark.native
@pytest.mark.simd
@pytest.mark.parametrize("classes", CLASS_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_gradient_is_the_gradient_ops_bit_for_bit(classes, dtype):
    check_scaled_gradient_is_the_gradient_ops(classes, dtype)


@pytest.mark.simd
@pytest.mark.baseline_isa
def test_scaled_gradient_on_the_baseline_instruction_set():
    run_on_portable_isa("test_reduced_loss", """
        for dtype in (tf.float32, tf.bfloat16):
            for classes in t.CLASS_COUNTS:
                t.check_scaled_gradient_is_the_gradient_ops(classes, dtype)
    """)


@pytest.mark.native
@pytest.mark.tf_abi
@pytest.mark.simd
def test_float64_and_empty_batches_make_no_scaled_gradient():
    z, labels = awkward_inputs(tf.float64, 10, "int32", rows=4)
    assert forward(z, labels, row_scales=tf.ones([4]))[2].shape == (0,)
    empty = forward(tf.zeros([0, 10]), tf.zeros([0], tf.int32), row_scales=tf.zeros([0]))
    assert empty[2].shape == (0,)


def test_float64_reduced_loss_keeps_the_scales_float64_digits():
    """A mean over 3 rows (1/3) and weights float32 cannot hold: the reduced loss and its
    gradient are those of the per-example float64 losses weighed in float64, to float64's
    precision, not to float32's (which rounding the scales to float32 would give: 3e-8)."""
    z = tf.constant(np.random.default_rng(3).standard_normal((3, 10)) * 3)
    labels = tf.constant([1, 4, 9])
    scales = tf.constant([0.1, 1.0 / 3.0, 2.2], tf.float64)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(z)
        got = tf_metal_ops.reduced_custom_loss(labels, z, scales, label_smoothing=0.1)
        want = tf.reduce_sum(tf_metal_ops.custom_loss(labels, z, label_smoothing=0.1) * scales)
    assert got.dtype == tf.float64
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-15)
    np.testing.assert_allclose(tape.gradient(got, z).numpy(), tape.gradient(want, z).numpy(),
                               rtol=1e-15, atol=1e-18)


# ---- CustomLoss against Keras's own reduction of our per-example losses ----------------------

def _inputs(rows=64, classes=50, seed=5):  # past the row-group limits: one kernel each way
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.integers(0, classes, rows).astype(np.int32)),
            tf.constant(rng.standard_normal((rows, classes)).astype(np.float32) * 3))


class TwoOpCustomLoss(CustomLoss):
    """CustomLoss reduced by Keras itself: per-example losses from `call`, the gradient op."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.losses.Loss.__call__(self, y_true, y_pred, sample_weight=sample_weight)


def _value_and_gradient(loss, labels, logits, sample_weight=None, after=None):
    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z, sample_weight=sample_weight)
            total = value if after is None else after(value)
        return value, tape.gradient(total, z)

    return step(logits)


def _gradient_ops(loss, labels, logits, **kwargs) -> tuple:
    """Gradient ops in the training graph of `loss`: (on its main path, inside functions such
    as the branches of a tf.cond)."""
    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z, **kwargs)
        return tape.gradient(value, z)

    graph_def = step.get_concrete_function(logits).graph.as_graph_def()
    main = sum(node.op == "TfMetalOps>CustomLossGrad" for node in graph_def.node)
    inner = sum(node.op == "TfMetalOps>CustomLossGrad"
                for function in graph_def.library.function for node in function.node_def)
    return main, inner


def _assert_matches_keras(loss_kwargs, labels, logits, sample_weight=None, after=None,
                          rtol=2e-6):
    ours = _value_and_gradient(CustomLoss(**loss_kwargs), labels, logits, sample_weight, after)
    keras_reduced = _value_and_gradient(TwoOpCustomLoss(**loss_kwargs), labels, logits,
                                        sample_weight, after)
    np.testing.assert_allclose(ours[0].numpy(), keras_reduced[0].numpy(), rtol=rtol, atol=1e-7)
    got, want = ours[1].numpy(), keras_reduced[1].numpy()
    scale = np.max(np.abs(want)) + 1e-30
    np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=rtol)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
@pytest.mark.parametrize("weighting", ["none", "vector", "column", "scalar"])
@pytest.mark.parametrize("settings", [{}, dict(gamma=2.0, label_smoothing=0.1),
                                      dict(class_weights=[0.5] * 25 + [2.0] * 25,
                                           ignore_class=3)])
@pytest.mark.native
@pytest.mark.tf_abi
def test_reduced_loss_equals_keras_reduction(reduction, weighting, settings):
    labels, logits = _inputs()
    rng = np.random.default_rng(1)
    sample_weight = {
        "none": None,
        "vector": tf.constant(rng.uniform(0.0, 2.0, 64).astype(np.float32)),
        "column": tf.constant(rng.uniform(0.0, 2.0, (64, 1)).astype(np.float32)),
        "scalar": tf.constant(0.7),
    }[weighting]
    _assert_matches_keras(dict(reduction=reduction, **settings), labels, logits, sample_weight)


@pytest.mark.native
@pytest.mark.tf_abi
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
def test_reduced_loss_equals_keras_reduction_with_a_keras_mask_over_sequences(reduction):
    rng = np.random.default_rng(2)
    logits = tf.constant(rng.standard_normal((4, 9, 30)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 30, (4, 9)).astype(np.int64))
    mask = tf.constant(rng.uniform(size=(4, 9)) > 0.3)
    sample_weight = tf.constant(rng.uniform(0.5, 1.5, (4, 9)).astype(np.float32))

    for weights in (None, sample_weight):
        def with_mask(loss):
            def masked(y, z, sample_weight=None):
                z = tf.identity(z)
                set_keras_mask(z, mask)
                return loss(y, z, sample_weight=sample_weight)
            return masked

        ours = _value_and_gradient(with_mask(CustomLoss(reduction=reduction, gamma=1.0)),
                                   labels, logits, weights)
        theirs = _value_and_gradient(with_mask(TwoOpCustomLoss(reduction=reduction, gamma=1.0)),
                                     labels, logits, weights)
        np.testing.assert_allclose(ours[0].numpy(), theirs[0].numpy(), rtol=2e-6)
        np.testing.assert_allclose(ours[1].numpy(), theirs[1].numpy(), rtol=2e-5, atol=1e-8)
        # Masked positions get no gradient.
        assert np.all(ours[1].numpy()[~mask.numpy()] == 0)


@pytest.mark.native
@pytest.mark.tf_abi
def test_a_scale_after_the_reduction_multiplies_the_gradient():
    labels, logits = _inputs()
    _assert_matches_keras(dict(gamma=2.0), labels, logits, after=lambda value: value * 3.0)
    _assert_matches_keras(dict(label_smoothing=0.2), labels, logits,
                          after=lambda value: value * 1024.0)  # a loss scale


@pytest.mark.native
@pytest.mark.tf_abi
def test_training_runs_no_gradient_op_where_the_forward_made_the_gradient():
    labels, logits = _inputs()
    # Every kernel that can run a float32 forward (CPU or Metal) writes the gradient: no
    # gradient op at all, and the backward holds no logits for a fallback (which would keep
    # them alive and stop the CPU forward from writing the gradient over them).
    expected = (0, 0)
    assert _gradient_ops(CustomLoss(gamma=2.0), labels, logits) == expected
    assert _gradient_ops(CustomLoss(), labels, logits, sample_weight=tf.ones([64])) == expected
    assert _gradient_ops(CustomLoss(reduction=None), labels, logits) == (1, 0)
    float64 = tf.cast(logits, tf.float64)
    value, grad = _value_and_gradient(CustomLoss(dtype="float64"), labels, float64)
    want = _value_and_gradient(TwoOpCustomLoss(dtype="float64"), labels, float64)
    np.testing.assert_allclose(value.numpy(), want[0].numpy(), rtol=1e-13)
    np.testing.assert_allclose(grad.numpy(), want[1].numpy(), rtol=1e-12, atol=1e-17)


INTERMEDIATE_CLASS_COUNTS = [7, 45, 1003]  # row groups, one row at a time, long rows
INTERMEDIATE_SETTINGS = [dict(), dict(gamma=2.0, label_smoothing=0.1), dict(gamma=0.5)]


@pytest.mark.native
@pytest.mark.simd
@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
@pytest.mark.parametrize("classes", INTERMEDIATE_CLASS_COUNTS)
@pytest.mark.parametrize("settings", INTERMEDIATE_SETTINGS)
def test_scaled_gradient_over_intermediate_logits(dtype, classes, settings):
    check_scaled_gradient_over_intermediate_logits(dtype, classes, settings)


@pytest.mark.simd
@pytest.mark.baseline_isa
def test_scaled_gradient_over_intermediate_logits_on_the_baseline_instruction_set():
    run_on_portable_isa("test_reduced_loss", """
        for dtype in (tf.float32, tf.bfloat16):
            for classes in t.INTERMEDIATE_CLASS_COUNTS:
                for settings in t.INTERMEDIATE_SETTINGS:
                    t.check_scaled_gradient_over_intermediate_logits(dtype, classes, settings)
    """)


def check_scaled_gradient_over_intermediate_logits(dtype, classes: int, settings: dict) -> None:
    """Logits made inside the step (a model's last layer) are read by the reduced loss alone,
    so its forward may write the scaled gradient over their buffer: it must be right in place.
    Checked through d loss / d W of z = h W against the same step on a copy of z that the
    caller keeps (which the forward cannot take over)."""
    rng = np.random.default_rng(classes)
    h = tf.cast(rng.standard_normal((37, 16)), dtype)
    w = tf.cast(rng.standard_normal((16, classes)), dtype)
    labels = tf.constant(rng.integers(0, classes, 37), tf.int32)
    loss = CustomLoss(**settings)

    @tf.function
    def over_intermediate(w_t):
        with tf.GradientTape() as tape:
            tape.watch(w_t)
            value = loss(labels, tf.matmul(h, w_t))
        return value, tape.gradient(value, w_t)

    @tf.function
    def over_kept(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z)
        return value, tape.gradient(value, z)

    value, grad_w = over_intermediate(w)
    z = tf.matmul(h, w)
    kept_value, grad_z = over_kept(z)
    assert tf.reduce_all(tf.math.is_finite(tf.cast(grad_w, tf.float32)))
    np.testing.assert_array_equal(tf.cast(value, tf.float32).numpy(),
                                  tf.cast(kept_value, tf.float32).numpy())
    # The same gradient of z, in place or not, then the same matmul: the same bits.
    np.testing.assert_array_equal(
        tf.cast(grad_w, tf.float32).numpy(),
        tf.cast(tf.matmul(h, grad_z, transpose_a=True), tf.float32).numpy())


@pytest.mark.native
@pytest.mark.tf_abi
def test_empty_and_unknown_batches():
    empty_labels, empty_logits = tf.zeros([0], tf.int32), tf.zeros([0, 7])
    value, grad = _value_and_gradient(CustomLoss(), empty_labels, empty_logits)
    want = _value_and_gradient(TwoOpCustomLoss(), empty_labels, empty_logits)
    assert value.shape == want[0].shape and grad.shape == (0, 7)
    labels, logits = _inputs()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None, 50], tf.float32)])
    def step(y, z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = CustomLoss(gamma=2.0)(y, z)
        return value, tape.gradient(value, z)

    ours = step(labels, logits)
    theirs = _value_and_gradient(TwoOpCustomLoss(gamma=2.0), labels, logits)
    np.testing.assert_allclose(ours[0].numpy(), theirs[0].numpy(), rtol=2e-6)
    np.testing.assert_allclose(ours[1].numpy(), theirs[1].numpy(), rtol=2e-5, atol=1e-9)
    zero_rows = step(tf.zeros([0], tf.int32), tf.zeros([0, 50]))
    assert zero_rows[1].shape == (0, 50) and float(zero_rows[0]) == 0.0


def _fit(loss, *, loss_weights=None, policy="float32") -> list:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 12)).astype(np.float32)
    y = rng.integers(0, 5, 256).astype(np.int32)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(5, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, loss_weights=loss_weights,
                      metrics=["accuracy"])
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  sample_weight=np.linspace(0.5, 1.5, 256).astype(np.float32))
        return [w.numpy() for w in model.weights]
    finally:
        keras.mixed_precision.set_global_policy(previous)


@pytest.mark.parametrize("options", [dict(), dict(loss_weights=0.25),
                                     dict(policy="mixed_float16")])
@pytest.mark.native
@pytest.mark.tf_abi
def test_fit_trains_as_keras_reduction_does(options):
    settings = dict(gamma=2.0, label_smoothing=0.1)
    ours = _fit(CustomLoss(**settings), **options)
    theirs = _fit(TwoOpCustomLoss(**settings), **options)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
