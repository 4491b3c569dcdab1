"""The forward op's early gradient and the gradient op that hands it on (csrc/problem.h).

A forward op given a scalar `gradient_upstream` u also writes u * d loss / d logits; the
gradient op given that early gradient returns it when its upstream is u in every row (bit for
bit), and computes the gradient itself otherwise. CustomLoss asks for it while a gradient tape
records, assuming Keras's reduction (1 / N for "sum_over_batch_size", 1 for "sum").

Checked here: the early gradient is, bit for bit, what the gradient op computes from the same
inputs and the forward's row statistics, over every loss mode, storage type, label kind, class
weights and class counts on both sides of the row-group limits (here and on the baseline
instruction set); the gradient op hands it on only when the upstream matches exactly (a fake
early gradient shows which path ran), and computes where the forward was asked but made none
(empty batch, float64); CustomLoss asks for it exactly when its assumption can hold, and its
gradients (fit included) are the same bit for bit with the early gradient on and off;
custom_loss's assumed_upstream serves a loop of one's own (tf.nn.compute_average_loss).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from portable_isa import run_on_portable_isa
from raw_ops import NO_STATS, NO_WEIGHTS, awkward_inputs, forward, gradient
from tf_metal_ops.losses import EARLY_GRADIENT_ENV

# Around the row-group limits (32 / 48 classes at 8 lanes, 24 / 32 at 4) and the vector widths.
CLASS_COUNTS = [1, 7, 24, 25, 33, 48, 49, 100, 1003]
# (gamma, label_smoothing): plain, smoothed, focal (the fast gamma kinds and a general one).
SETTINGS = [(0.0, 0.0), (0.0, 0.1), (1.0, 0.0), (2.0, 0.1), (0.5, 0.0), (3.7, 1.0)]
DTYPES = [tf.float32, tf.float16, tf.bfloat16]
ROWS = 19  # full and partial row groups at both lane widths


def _inputs(dtype, classes: int, label_kind: str):
    return awkward_inputs(dtype, classes, label_kind, rows=ROWS)


def _bits(tensor: tf.Tensor) -> np.ndarray:
    """The values as float64 with NaN where NaN: equal arrays mean equal bits for finite values
    and zeros' signs are checked separately."""
    return tf.cast(tensor, tf.float64).numpy()


def _assert_same_bits(got: tf.Tensor, want: tf.Tensor, where: str) -> None:
    a, b = _bits(got), _bits(want)
    np.testing.assert_array_equal(a, b, err_msg=where)
    np.testing.assert_array_equal(np.signbit(a), np.signbit(b), err_msg=where + " (signs)")


def check_early_gradient_is_the_gradient_ops(classes: int, dtype) -> None:
    upstream_value = 0.375  # the same value in every storage type
    for label_kind in ("int32", "int64", "dense"):
        z, labels = _inputs(dtype, classes, label_kind)
        upstream = tf.cast(tf.fill([ROWS], upstream_value), dtype)
        for gamma, eps in SETTINGS:
            weight_options = [NO_WEIGHTS, tf.constant(np.linspace(0.0, 2.0, classes), tf.float32)]
            for weights in weight_options:
                attrs = dict(gamma=gamma, label_smoothing=eps)
                if label_kind != "dense":  # rows labelled classes - 1 are ignored
                    attrs.update(has_ignore_class=True, ignore_class=classes - 1)
                loss, stats, early = forward(z, labels, weights,
                                             gradient_upstream=tf.constant(upstream_value),
                                             **attrs)
                where = f"{dtype.name} C={classes} {label_kind} gamma={gamma} eps={eps}"
                assert early.shape == z.shape and early.dtype == dtype, where
                plain_loss, plain_stats, none = forward(z, labels, weights, **attrs)
                assert none.shape == (0,), where
                _assert_same_bits(loss, plain_loss, where + " (loss)")
                _assert_same_bits(stats, plain_stats, where + " (row_stats)")
                computed = gradient(z, labels, weights, upstream, stats, **attrs)
                _assert_same_bits(early, computed, where)


@pytest.mark.parametrize("classes", CLASS_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_early_gradient_is_the_gradient_ops_bit_for_bit(classes, dtype):
    check_early_gradient_is_the_gradient_ops(classes, dtype)


def test_early_gradient_on_the_baseline_instruction_set():
    run_on_portable_isa("test_early_gradient", """
        for dtype in (tf.float32, tf.bfloat16):
            for classes in t.CLASS_COUNTS:
                t.check_early_gradient_is_the_gradient_ops(classes, dtype)
    """)


def _fake_early_gradient(shape) -> tf.Tensor:
    return tf.fill(shape, 7.0)  # no gradient of this loss is 7 everywhere


@pytest.mark.parametrize("upstream_value, assumed, handed_on", [
    (0.25, 0.25, True),
    (0.25, 0.5, False),
    (0.0, -0.0, False),  # +0 and -0 give gradients of different signs
    (float("nan"), float("nan"), True),  # the same bits: the same computation, the same NaNs
])
def test_gradient_op_hands_on_the_early_gradient_only_for_its_upstream(upstream_value, assumed,
                                                                       handed_on):
    z, labels = _inputs(tf.float32, 10, "int32")
    # NumPy values: TensorFlow caches eager constants of Python floats, and -0.0 == 0.0 there.
    upstream = tf.constant(np.full([ROWS], upstream_value, np.float32))
    before = tf_metal_ops.early_gradient_info()
    got = gradient(z, labels, NO_WEIGHTS, upstream, early_gradient=_fake_early_gradient(z.shape),
                   early_gradient_upstream=tf.constant(np.float32(assumed)))
    after = tf_metal_ops.early_gradient_info()
    if handed_on:
        np.testing.assert_array_equal(got.numpy(), 7.0)
        assert after["handed_on"] == before["handed_on"] + 1
    else:
        want = gradient(z, labels, NO_WEIGHTS, upstream)
        _assert_same_bits(got, want, f"upstream {upstream_value}, assumed {assumed}")
        assert after["recomputed"] == before["recomputed"] + 1


def test_one_differing_row_makes_the_gradient_op_compute():
    z, labels = _inputs(tf.float32, 10, "int32")
    upstream = np.full([ROWS], 0.25, np.float32)
    upstream[-1] = 0.5
    got = gradient(z, labels, NO_WEIGHTS, tf.constant(upstream),
                   early_gradient=_fake_early_gradient(z.shape),
                   early_gradient_upstream=tf.constant(0.25))
    _assert_same_bits(got, gradient(z, labels, NO_WEIGHTS, tf.constant(upstream)), "last row")


def test_half_upstream_is_compared_as_its_float_value():
    z, labels = _inputs(tf.float16, 10, "int32")
    upstream = tf.fill([ROWS], tf.constant(0.25, tf.float16))
    got = gradient(z, labels, NO_WEIGHTS, upstream,
                   early_gradient=tf.cast(_fake_early_gradient(z.shape), tf.float16),
                   early_gradient_upstream=tf.constant(0.25))
    np.testing.assert_array_equal(got.numpy(), 7.0)


def test_float64_and_empty_batches_make_no_early_gradient():
    z = tf.random.stateless_normal([4, 50], seed=[1, 2], dtype=tf.float64)
    labels = tf.constant([0, 1, 2, 3])
    _, _, early = forward(z, labels, gradient_upstream=tf.constant(1.0))
    assert early.shape == (0,) and early.dtype == tf.float64
    _, _, early = forward(tf.zeros([0, 5]), tf.zeros([0], tf.int32),
                          gradient_upstream=tf.constant(1.0))
    assert early.shape == (0,)


def test_early_gradient_shape_errors_name_the_inputs():
    z, labels = _inputs(tf.float32, 10, "int32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="gradient_upstream"):
        forward(z, labels, gradient_upstream=tf.ones([2]))
    upstream = tf.ones([ROWS])
    with pytest.raises(tf.errors.InvalidArgumentError, match="early_gradient must have"):
        gradient(z, labels, NO_WEIGHTS, upstream, NO_STATS, early_gradient=tf.zeros([ROWS, 9]),
                 early_gradient_upstream=tf.constant(1.0))
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs the early_gradient_upstream"):
        gradient(z, labels, NO_WEIGHTS, upstream, NO_STATS, early_gradient=tf.zeros(z.shape))


@pytest.mark.parametrize("rows, dtype", [(0, tf.float32), (5, tf.float64)])
def test_an_early_gradient_asked_for_but_not_made_is_computed(rows, dtype):
    # The forward op was given an upstream but made no early gradient (an empty batch, the
    # float64 kernel; the Metal kernels alike): the gradient op computes, as without one.
    logits = tf.random.stateless_normal([rows, 7], seed=[1, 2], dtype=dtype)
    labels = tf.zeros([rows], tf.int32)

    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf.reduce_sum(tf_metal_ops.custom_loss(labels, z, assumed_upstream=1.0))
        return tape.gradient(loss, z)

    want = gradient(logits, labels, NO_WEIGHTS, tf.ones([rows], dtype))
    _assert_same_bits(step(logits), want, f"{rows} rows of {dtype.name}")
    loss = tf_metal_ops.CustomLoss()

    @tf.function
    def keras_step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z)
        return tape.gradient(value, z)

    assert keras_step(tf.cast(logits, tf.float32)).shape == (rows, 7)


# ---- CustomLoss: when it asks for an early gradient, and that its gradients do not change ----

def _early_gradient_requested(loss_fn, *args) -> bool:
    """Whether the forward op in loss_fn's graph was given a scalar gradient_upstream."""
    graph = tf.function(loss_fn).get_concrete_function(*args).graph
    forwards = [op for op in graph.get_operations() if op.type == "TfMetalOps>CustomLoss"]
    assert len(forwards) == 1, [op.type for op in graph.get_operations()]
    return forwards[0].inputs[3].shape.rank == 0


def _keras_inputs(rows=64, classes=50):  # past the row-group limits: one kernel each way
    rng = np.random.default_rng(5)
    return (tf.constant(rng.integers(0, classes, rows).astype(np.int32)),
            tf.constant(rng.standard_normal((rows, classes)).astype(np.float32)))


def _loss_and_gradient(loss, labels, logits, sample_weight=None):
    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z, sample_weight=sample_weight)
        return value, tape.gradient(value, z)

    return step(logits)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
@pytest.mark.parametrize("settings", [{}, dict(gamma=2.0, label_smoothing=0.1),
                                      dict(class_weights=[0.5] * 50)])
def test_custom_loss_under_a_tape_hands_on_the_same_gradient(monkeypatch, reduction, settings):
    labels, logits = _keras_inputs()
    loss = tf_metal_ops.CustomLoss(reduction=reduction, **settings)

    def under_tape(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            return loss(labels, z)

    assert _early_gradient_requested(under_tape, logits)
    before = tf_metal_ops.early_gradient_info()
    value, grad = _loss_and_gradient(loss, labels, logits)
    after = tf_metal_ops.early_gradient_info()
    assert after["made"] == before["made"] + 1
    assert after["handed_on"] == before["handed_on"] + 1, (before, after)
    monkeypatch.setenv(EARLY_GRADIENT_ENV, "0")
    assert not _early_gradient_requested(under_tape, logits)
    plain_value, plain_grad = _loss_and_gradient(
        tf_metal_ops.CustomLoss(reduction=reduction, **settings), labels, logits)
    _assert_same_bits(value, plain_value, "loss")
    _assert_same_bits(grad, plain_grad, "gradient")


def test_custom_loss_asks_for_no_early_gradient_where_the_upstream_is_unknown():
    labels, logits = _keras_inputs()

    def tape_around(loss, **kwargs):
        def fn(z):
            with tf.GradientTape() as tape:
                tape.watch(z)
                return loss(labels, z, **kwargs)
        return fn

    plain = tf_metal_ops.CustomLoss()
    assert not _early_gradient_requested(lambda z: plain(labels, z), logits)  # no tape
    weights = tf.ones([64])
    assert not _early_gradient_requested(tape_around(plain, sample_weight=weights), logits)
    assert not _early_gradient_requested(
        tape_around(tf_metal_ops.CustomLoss(ignore_class=0)), logits)
    assert not _early_gradient_requested(tape_around(tf_metal_ops.CustomLoss(reduction=None)),
                                         logits)
    assert not _early_gradient_requested(
        tape_around(tf_metal_ops.CustomLoss(dtype="float64")), logits)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")  # fit() would scale the loss
    try:
        assert not _early_gradient_requested(tape_around(tf_metal_ops.CustomLoss()), logits)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_a_wrong_assumption_costs_time_not_accuracy():
    # A loss scaled after the reduction (as a loss-scale optimizer does) gives an upstream other
    # than 1 / N: the gradient op computes, and the result is the plain gradient scaled.
    labels, logits = _keras_inputs()
    loss = tf_metal_ops.CustomLoss(gamma=2.0)

    @tf.function
    def scaled(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z) * 3.0
        return tape.gradient(value, z)

    before = tf_metal_ops.early_gradient_info()
    got = scaled(logits)
    after = tf_metal_ops.early_gradient_info()
    assert after["recomputed"] == before["recomputed"] + 1
    upstream = tf.fill([64], np.float32(3.0) * np.float32(1.0 / 64))
    want = gradient(logits, labels, NO_WEIGHTS, upstream, gamma=2.0)
    _assert_same_bits(got, want, "scaled loss")


def test_fit_uses_early_gradients_and_trains_the_same(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 12)).astype(np.float32)
    y = rng.integers(0, 5, 256).astype(np.int32)

    def train() -> list:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(5)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1),
                      metrics=["accuracy"])
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        return [w.numpy() for w in model.weights]

    before = tf_metal_ops.early_gradient_info()
    early = train()
    after = tf_metal_ops.early_gradient_info()
    assert after["handed_on"] - before["handed_on"] == 8  # 4 steps per epoch, 2 epochs
    assert after["recomputed"] == before["recomputed"]
    monkeypatch.setenv(EARLY_GRADIENT_ENV, "0")
    plain = train()
    assert tf_metal_ops.early_gradient_info()["made"] == after["made"]
    for a, b in zip(early, plain):
        np.testing.assert_array_equal(a, b)


def test_custom_loss_function_takes_an_assumed_upstream():
    labels, logits = _keras_inputs()

    @tf.function
    def half_sum(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf.reduce_sum(tf_metal_ops.custom_loss(labels, z, gamma=1.0,
                                                          assumed_upstream=0.5)) * 0.5
        return tape.gradient(loss, z)

    before = tf_metal_ops.early_gradient_info()
    got = half_sum(logits)
    assert tf_metal_ops.early_gradient_info()["handed_on"] == before["handed_on"] + 1
    want = gradient(logits, labels, NO_WEIGHTS, tf.fill([64], 0.5), gamma=1.0)
    _assert_same_bits(got, want, "assumed 0.5")
    # A function of the logits works too (here: the mean's 1 / N).
    assert _early_gradient_requested(
        lambda z: tf_metal_ops.custom_loss(labels, z, assumed_upstream=lambda t: 1.0 / 64),
        logits)


@pytest.mark.parametrize("value, error, words", [
    ("0.5", TypeError, "assumed_upstream"),
    (True, TypeError, "assumed_upstream"),
    ([0.5, 0.5], TypeError, "assumed_upstream"),
    (np.ones([2], np.float32), ValueError, "assumed_upstream must be a scalar"),
    (lambda z: tf.ones([3]), ValueError, "assumed_upstream must be a scalar"),
])
def test_custom_loss_refuses_a_bad_assumed_upstream(value, error, words):
    labels, logits = _keras_inputs()
    with pytest.raises(error, match=words):
        tf_metal_ops.custom_loss(labels, logits, assumed_upstream=value)


def test_assumed_upstream_of_compute_average_loss_is_handed_on():
    labels, logits = _keras_inputs()
    global_batch_size = 256  # as if four replicas shared the batch

    @tf.function
    def step(z):
        upstream = tf.math.divide_no_nan(1.0, tf.cast(global_batch_size, tf.float32))
        with tf.GradientTape() as tape:
            tape.watch(z)
            per_example = tf_metal_ops.custom_loss(labels, z, label_smoothing=0.1,
                                                   assumed_upstream=upstream)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        return tape.gradient(loss, z)

    before = tf_metal_ops.early_gradient_info()
    got = step(logits)
    assert tf_metal_ops.early_gradient_info()["handed_on"] == before["handed_on"] + 1
    want = gradient(logits, labels, NO_WEIGHTS, tf.fill([64], np.float32(1 / 256)),
                    label_smoothing=0.1)
    _assert_same_bits(got, want, "compute_average_loss")
