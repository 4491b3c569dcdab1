"""Float32 errors that do not grow with the number of classes: C = 32000 to 262144.

A row's sums (the softmax's, the loss's, G) have C terms. Accumulated plainly in float32 their
error grows with C, and where one term is large (the labelled class beside the smoothed ones)
the many small terms added to it round alike: before the kernels folded their sums
(csrc/cpu/simd/simd_rows.h's LaneSum, kernels/custom_loss.h's CompensatedSum), the gradient of focal
loss with smoothing was 3.5e-5 off at C = 32000 and the plain loss 2e-6 at C = 262144, where
TensorFlow's own fused op stays near 1e-7.

The bar, per quantity (loss, gradient) and size: error <= max(5e-7, 1.5 x the error of
tf.nn.sparse_softmax_cross_entropy_with_logits on the same plain cross-entropy input), with
error = max over rows of max |got - exact| / (1 + max |exact| of the row) against the float64
NumPy reference on the same float32 inputs (logits ~ N(0, 4^2)). Checked for every option set
through `custom_loss`, through `CustomLoss` under a gradient tape (whose forward op computes
the gradient of the reduced loss), on the portable instruction set, and for the Metal kernels in the emulator;
the float64 kernel stays near 1e-15. A few rows per size keep this file fast.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import reference

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402
from msl_build import msl_cache_dir  # noqa: E402,F401  (pytest fixture)
from portable_isa import run_on_portable_isa  # noqa: E402

SIZES = (32000, 50257, 131072, 262144)
ROWS = 3
FLOOR = 5e-7
# name: (op parameters, label kind). Every parameter set whose sums weigh many classes.
OPTION_SETS = {
    "plain": (dict(), "sparse"),
    "smoothing": (dict(label_smoothing=0.1), "sparse"),
    "focal": (dict(gamma=2.0), "sparse"),
    "focal + smoothing": (dict(gamma=2.0, label_smoothing=0.1), "sparse"),
    "gamma 1 + smoothing": (dict(gamma=1.0, label_smoothing=0.1), "sparse"),
    "class weights + smoothing": (dict(label_smoothing=0.1, class_weights=True), "sparse"),
    "dense soft targets, focal": (dict(gamma=2.0), "dense"),
    "ignore_class, focal + smoothing": (dict(gamma=2.0, label_smoothing=0.1, ignore_class=0),
                                        "sparse"),
}


def relative_error(got, exact) -> float:
    got = np.asarray(got, np.float64)
    exact = np.asarray(exact, np.float64)
    if got.ndim == 1:
        return float(np.max(np.abs(got - exact) / (1.0 + np.abs(exact))))
    return float(np.max(np.max(np.abs(got - exact), axis=-1)
                        / (1.0 + np.max(np.abs(exact), axis=-1))))


@functools.lru_cache(maxsize=None)
def inputs(num_classes: int, option: str):
    """(logits float32, labels, op kwargs, reference kwargs) of one size and option set."""
    params, kind = OPTION_SETS[option]
    rng = np.random.default_rng(num_classes)
    logits = (rng.normal(size=(ROWS, num_classes)) * 4.0).astype(np.float32)
    labels = rng.integers(1, num_classes, size=ROWS)
    if "ignore_class" in params:
        labels[0] = params["ignore_class"]
    op = dict(params)
    if op.pop("class_weights", False):
        op["class_weights"] = rng.uniform(0.5, 2.0, num_classes).astype(np.float32)
    if kind == "dense":
        soft = rng.gamma(0.5, size=(ROWS, num_classes))
        labels = (soft / soft.sum(axis=-1, keepdims=True)).astype(np.float32)
    # The kernels get gamma and label_smoothing as float32 attributes: so does the reference.
    ref = dict(op, gamma=float(np.float32(op.get("gamma", 0.0))),
               label_smoothing=float(np.float32(op.get("label_smoothing", 0.0))))
    if "class_weights" in ref:
        ref["class_weights"] = ref["class_weights"].astype(np.float64)
    return logits, labels, op, ref


@functools.lru_cache(maxsize=None)
def exact(num_classes: int, option: str):
    logits, labels, _, ref = inputs(num_classes, option)
    z = logits.astype(np.float64)
    y = labels.astype(np.float64) if labels.dtype.kind == "f" else labels
    return reference.custom_loss(y, z, **ref), reference.custom_loss_grad(y, z, **ref)


@functools.lru_cache(maxsize=None)
def bars(num_classes: int):
    """(loss bar, gradient bar): the floor or 1.5 x TensorFlow's fused op on the plain input."""
    logits, labels, _, _ = inputs(num_classes, "plain")
    z = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=z)
        total = tf.reduce_sum(loss)
    grad = tape.gradient(total, z)
    exact_loss, exact_grad = exact(num_classes, "plain")
    return (max(FLOOR, 1.5 * relative_error(loss.numpy(), exact_loss)),
            max(FLOOR, 1.5 * relative_error(grad.numpy(), exact_grad)))


def assert_within_bars(num_classes, option, loss, grad, grad_scale=1.0, what=""):
    exact_loss, exact_grad = exact(num_classes, option)
    loss_bar, grad_bar = bars(num_classes)
    loss_error = relative_error(loss, exact_loss)
    grad_error = relative_error(np.asarray(grad, np.float64) * grad_scale, exact_grad)
    assert loss_error <= loss_bar, (
        f"{what} C={num_classes} {option}: loss error {loss_error:.3g} > {loss_bar:.3g}")
    assert grad_error <= grad_bar, (
        f"{what} C={num_classes} {option}: gradient error {grad_error:.3g} > {grad_bar:.3g}")


def custom_loss_and_gradient(num_classes: int, option: str):
    """The per-example losses and the gradient of their sum, through `custom_loss`."""
    logits, labels, op, _ = inputs(num_classes, option)
    z = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = tf_metal_ops.custom_loss(labels, z, **op)
        total = tf.reduce_sum(loss)
    return loss.numpy(), tape.gradient(total, z).numpy()


@pytest.mark.simd
@pytest.mark.parametrize("option", list(OPTION_SETS))
@pytest.mark.parametrize("num_classes", SIZES)
def test_custom_loss_error_does_not_grow_with_classes(num_classes, option):
    loss, grad = custom_loss_and_gradient(num_classes, option)
    assert_within_bars(num_classes, option, loss, grad, what="custom_loss")


@pytest.mark.parametrize("option", list(OPTION_SETS))
@pytest.mark.parametrize("num_classes", SIZES)
def test_keras_loss_under_a_tape_is_as_exact(num_classes, option):
    """CustomLoss's sum: the forward op makes the gradient of the reduced loss."""
    logits, labels, op, _ = inputs(num_classes, option)
    loss_fn = tf_metal_ops.CustomLoss(reduction="sum", **op)
    z = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(z)
        total = loss_fn(labels, z)
    grad = tape.gradient(total, z)
    per_example = tf_metal_ops.custom_loss(labels, z, **op).numpy()
    np.testing.assert_allclose(float(total), per_example.sum(), rtol=1e-6)
    assert_within_bars(num_classes, option, per_example, grad.numpy(), what="CustomLoss")


@pytest.mark.simd
@pytest.mark.baseline_isa
def test_portable_instruction_set_is_as_exact():
    run_on_portable_isa("test_vocabulary_scale", """
        for num_classes in t.SIZES:
            for option in t.OPTION_SETS:
                loss, grad = t.custom_loss_and_gradient(num_classes, option)
                t.assert_within_bars(num_classes, option, loss, grad, what="portable")
    """)


@pytest.mark.simd
@pytest.mark.parametrize("option", ["plain", "focal + smoothing", "dense soft targets, focal"])
def test_float64_kernel_stays_exact(option):
    num_classes = SIZES[-1]
    logits, labels, op, ref = inputs(num_classes, option)
    z = tf.constant(logits.astype(np.float64))
    y = labels.astype(np.float64) if labels.dtype.kind == "f" else labels
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = tf_metal_ops.custom_loss(y, z, **op)
        total = tf.reduce_sum(loss)
    grad = tape.gradient(total, z)
    exact_loss, exact_grad = exact(num_classes, option)
    assert relative_error(loss.numpy(), exact_loss) < 1e-13
    assert relative_error(grad.numpy(), exact_grad) < 1e-13


@pytest.fixture(scope="module")
def emu(msl_cache_dir) -> mb.Emulator:
    return mb.Emulator(mb.build_emulator_library(msl_cache_dir))


@pytest.mark.parametrize("option", list(OPTION_SETS))
@pytest.mark.parametrize("num_classes", SIZES)
def test_metal_kernels_in_the_emulator_are_as_exact(emu, num_classes, option):
    logits, labels, op, _ = inputs(num_classes, option)
    dense = labels.dtype.kind == "f"
    kind = "dense" if dense else "int32"
    stored_labels = labels if dense else np.ascontiguousarray(labels, np.int32)
    common = dict(logits=logits, labels=stored_labels, label_kind=kind, **op)
    forward = emu.run(direction="forward", **common)
    gradient = emu.run(direction="gradient", upstream=np.ones(ROWS, np.float32), **common)
    assert forward.ok and gradient.ok, forward.error or gradient.error
    assert forward.variant == "rowtg"
    assert_within_bars(num_classes, option, forward.output, gradient.output, what="Metal")
