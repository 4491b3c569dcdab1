"""CustomLoss against Keras's own cross-entropy losses, on the cases of Keras's loss tests.

The cases are those of Keras 3's `keras/src/losses/losses_test.py` (its
CategoricalCrossentropy, SparseCategoricalCrossentropy and CategoricalFocalCrossentropy tests):
each is computed here by the installed Keras and by `CustomLoss`, and where Keras's test states
a number, ours is held to it with the tolerance Keras's test uses. `CustomLoss()` is Keras's
sparse and categorical cross-entropy from logits; with `gamma` and `class_weights=alpha` it is
Keras's focal loss. One difference is on purpose: Keras clips probabilities to
`[1e-7, 1 - 1e-7]` (from probabilities, and in the focal loss from logits too), our op does
not. Where the clip moves Keras's value, the test says so and checks ours against the float64
reference instead.

Labels mean the same in every reduction (docs/loss.md, "Labels"): integer one-hot rows are
dense targets, as Keras's `CategoricalCrossentropy` reads them, through every entry point.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import reference

# The inputs of Keras's tests.
ONE_HOT = np.eye(3, dtype=np.int64)
IDS = np.array([0, 1, 2])
PROBABILITIES = np.array([[0.9, 0.05, 0.05], [0.5, 0.89, 0.6], [0.05, 0.01, 0.94]], np.float32)
LOGITS = np.array([[8.0, 1.0, 1.0], [0.0, 9.0, 1.0], [2.0, 3.0, 5.0]], np.float32)
PER_SAMPLE = np.array([[1.2], [3.4], [5.6]])
# Keras's focal defaults, which its tests use: our class_weights are its alpha.
ALPHA, GAMMA = 0.25, 2.0

REDUCTIONS = ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", None, "none"]
# Keras's float32 log-sum-exp loses about one ulp of 1 (1.2e-7) per row, absolutely: a loss of
# 1e-3 is off by 1e-4 relatively there (ours matches the float64 reference to 2e-6). So ours is
# compared with Keras to this absolute tolerance, and with the reference relatively.
KERAS_ATOL = 3e-7


def keras_loss(kind: str, **kwargs) -> keras.losses.Loss:
    if kind == "categorical":
        return keras.losses.CategoricalCrossentropy(**kwargs)
    if kind == "sparse":
        return keras.losses.SparseCategoricalCrossentropy(**kwargs)
    return keras.losses.CategoricalFocalCrossentropy(alpha=ALPHA, gamma=GAMMA, **kwargs)


def our_loss(kind: str, classes: int = 3, **kwargs) -> tf_metal_ops.CustomLoss:
    if kind == "focal":
        kwargs = dict(gamma=GAMMA, class_weights=[ALPHA] * classes, **kwargs)
    return tf_metal_ops.CustomLoss(**kwargs)


def our_options(kind: str, classes: int = 3) -> dict:
    """The reference's arguments for `our_loss(kind)`."""
    return dict(gamma=GAMMA, class_weights=[ALPHA] * classes) if kind == "focal" else {}


def keras_labels(kind: str):
    """The labels Keras's test gives each loss: integer one-hot rows, or class ids."""
    return IDS if kind == "sparse" else ONE_HOT


def mean_over_batch(per_example: np.ndarray, sample_weight) -> float:
    """Keras's "sum_over_batch_size" of per-example values weighted by `sample_weight`."""
    weights = np.ones(()) if sample_weight is None else np.asarray(sample_weight, np.float64)
    if weights.ndim > per_example.ndim:  # [batch, 1] weights of [batch] losses
        weights = weights.reshape(weights.shape[:per_example.ndim])
    return float(np.sum(per_example * weights) / per_example.size)


# ---------------------------------------------------------------------------------------------
# The numbers of Keras's tests

# (loss, from_logits, sample_weight, reduction, Keras's number, decimals of Keras's assertion:
# an int for assertAlmostEqual, None for assertAllClose's 1e-6 / 1e-6)
KERAS_CASES = [
    ("categorical", False, None, "sum_over_batch_size", 0.3239, 3),
    ("categorical", True, None, "sum_over_batch_size", 0.0573, 3),
    ("categorical", False, 2.3, "sum_over_batch_size", 0.7449, 3),
    ("categorical", True, 2.3, "sum_over_batch_size", 0.1317, 3),
    ("categorical", False, PER_SAMPLE, "sum_over_batch_size", 1.0696, 3),
    ("categorical", True, PER_SAMPLE, "sum_over_batch_size", 0.31829, 3),
    ("categorical", True, None, None, (0.001822, 0.000459, 0.169846), None),
    ("sparse", False, None, "sum_over_batch_size", 0.3239, 3),
    ("sparse", True, None, "sum_over_batch_size", 0.0573, 3),
    ("sparse", False, 2.3, "sum_over_batch_size", 0.7449, 3),
    ("sparse", True, 2.3, "sum_over_batch_size", 0.1317, 3),
    ("sparse", False, PER_SAMPLE, "sum_over_batch_size", 1.0696, 3),
    ("sparse", True, PER_SAMPLE, "sum_over_batch_size", 0.31829, 3),
    ("sparse", True, None, None, (0.001822, 0.000459, 0.169846), None),
    ("focal", False, None, "sum_over_batch_size", 0.02059, 3),
    ("focal", True, None, "sum_over_batch_size", 0.000345, 3),
    ("focal", False, 2.3, "sum_over_batch_size", 0.047368, 3),
    ("focal", True, 2.3, "sum_over_batch_size", 0.000794, 4),
    ("focal", False, PER_SAMPLE, "sum_over_batch_size", 0.06987, 3),
    ("focal", True, PER_SAMPLE, "sum_over_batch_size", 0.001933, 3),
    ("focal", True, None, None, (1.5096224e-09, 2.4136547e-11, 1.0360638e-03), None),
]


def _assert_keras_number(got, number, decimals) -> None:
    if decimals is None:
        np.testing.assert_allclose(got, number, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_almost_equal(got, number, decimal=decimals)


@pytest.mark.parametrize("kind,from_logits,sample_weight,reduction,number,decimals", KERAS_CASES)
def test_the_cases_of_keras_tests(kind, from_logits, sample_weight, reduction, number, decimals):
    labels = keras_labels(kind)
    predictions = LOGITS if from_logits else PROBABILITIES
    options = dict(from_logits=from_logits, reduction=reduction)
    ours = our_loss(kind, **options)(labels, predictions, sample_weight=sample_weight).numpy()
    theirs = keras_loss(kind, **options)(labels, predictions,
                                         sample_weight=sample_weight).numpy()
    _assert_keras_number(ours, number, decimals)
    # Focal: Keras forms 1 - p in float32 (relative error 1e-7 / (1 - p), up to 3e-4 here).
    np.testing.assert_allclose(ours, theirs, rtol=2e-3 if kind == "focal" else 2e-6,
                               atol=KERAS_ATOL)
    # Ours is the exact value: the float64 reference on the same float32 inputs.
    logits = LOGITS if from_logits else np.log(PROBABILITIES.astype(np.float64))
    per_example = reference.custom_loss(labels, logits, **our_options(kind))
    exact = per_example if reduction is None else mean_over_batch(per_example, sample_weight)
    np.testing.assert_allclose(ours, exact, rtol=2e-6, atol=0)


@pytest.mark.parametrize("kind", ["categorical", "sparse", "focal"])
@pytest.mark.parametrize("from_logits", [True, False])
def test_all_correct(kind, from_logits):
    labels = keras_labels(kind)
    if from_logits:  # Keras's all-correct logits: no clip is reached, the two agree
        logits = 10.0 * np.eye(3, dtype=np.float32)
        ours = our_loss(kind)(labels, logits).numpy()
        theirs = keras_loss(kind, from_logits=True)(labels, logits).numpy()
        # Focal: Keras's float32 1 - p, with p = 0.99991, keeps about 3 digits.
        np.testing.assert_allclose(ours, theirs, rtol=1e-2 if kind == "focal" else 1e-6,
                                   atol=KERAS_ATOL)
        exact = reference.custom_loss(labels, logits, **our_options(kind)).mean()
        np.testing.assert_allclose(ours, exact, rtol=1e-6)
        return
    # One-hot probabilities. Keras clips p = 1 to 1 - 1e-7 (and 0 to 1e-7) and so reports
    # -log(1 - 1e-7) > 0, within its test's 1e-3; our op takes log(0) = -inf as a masked class
    # and gives the exact 0.
    probabilities = np.eye(3, dtype=np.float32)
    ours = our_loss(kind, from_logits=False)(labels, probabilities).numpy()
    theirs = keras_loss(kind)(labels, probabilities).numpy()
    assert ours == 0.0
    assert 0.0 < theirs < 1e-3, "Keras no longer clips: the difference documented is stale"


def test_label_smoothing_as_keras_tests_it():
    # Keras's categorical case: 400 * 0.1 / 3 (the two off classes are 200 below in log p).
    logits = np.array([[100.0, -100.0, -100.0]], np.float32)
    one_hot = np.array([[1, 0, 0]])
    smoothed = dict(label_smoothing=0.1)
    ours = our_loss("categorical", **smoothed)(one_hot, logits).numpy()
    theirs = keras_loss("categorical", from_logits=True, **smoothed)(one_hot, logits).numpy()
    np.testing.assert_almost_equal(ours, 400.0 * 0.1 / 3.0, decimal=3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(our_loss("categorical", **smoothed)([0], logits).numpy(), ours,
                               rtol=1e-6)
    # Keras's focal case (0.06685).
    logits = np.array([[4.9, -0.5, 2.05]], np.float32)
    ours = our_loss("focal", **smoothed)(one_hot, logits).numpy()
    theirs = keras_loss("focal", from_logits=True, **smoothed)(one_hot, logits).numpy()
    np.testing.assert_almost_equal(ours, 0.06685, decimal=3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    exact = reference.custom_loss(one_hot, logits, label_smoothing=0.1, **our_options("focal"))
    np.testing.assert_allclose(ours, exact[0], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# 3-D inputs, every reduction, every sample-weight shape


def _sequence_batch(seed: int = 0, batch: int = 4, steps: int = 5, classes: int = 6):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, (batch, steps, classes)).astype(np.float32)
    ids = rng.integers(0, classes, (batch, steps))
    return logits, ids


def _sample_weights(batch: int = 4, steps: int = 5) -> dict:
    """Each form Keras takes; a [batch] vector weighs 2-D inputs only (Keras's rule)."""
    rng = np.random.default_rng(1)
    return {
        "none": None,
        "scalar": 2.3,
        "per_sample": rng.uniform(0.0, 2.0, batch).astype(np.float32),
        "per_sample_column": rng.uniform(0.0, 2.0, (batch, 1)).astype(np.float32),
        "per_timestep": rng.uniform(0.0, 2.0, (batch, steps)).astype(np.float32),
    }


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weights", list(_sample_weights()))
def test_every_reduction_and_sample_weight(reduction, weights):
    logits, ids = _sequence_batch()
    sample_weight = _sample_weights()[weights]
    if weights == "per_sample":  # one weight per row of [batch, classes] logits
        logits, ids = logits[:, 0], ids[:, 0]
    one_hot = np.eye(6, dtype=np.int32)[ids]
    sparse = keras_loss("sparse", from_logits=True, reduction=reduction)(
        ids, logits, sample_weight=sample_weight).numpy()
    categorical = keras_loss("categorical", from_logits=True, reduction=reduction)(
        one_hot, logits, sample_weight=sample_weight).numpy()
    loss = tf_metal_ops.CustomLoss(reduction=reduction)
    for labels, theirs in [(ids, sparse), (ids[..., None], sparse), (one_hot, categorical),
                           (one_hot.astype(np.float32), categorical)]:
        ours = loss(labels, logits, sample_weight=sample_weight)
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=2e-6, atol=KERAS_ATOL,
                                   err_msg=f"labels {labels.dtype} {labels.shape}")


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", None])
def test_probabilities_on_3d_inputs(reduction):
    # Keras's segmentation cases: [4, 4] pixels of 3 classes, one-hot probabilities but for a
    # few pixels; the labelled classes' probabilities are never 0 or 1 - 1e-7 < p < 1, so the
    # only clip that moves Keras's value is that of the p = 1 pixels: -log(1 - 1e-7) each.
    ids = np.array([[0, 1, 2, 0], [1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 0, 1]])
    probabilities = np.eye(3, dtype=np.float32)[ids]
    probabilities[0, 3] = [0.2, 0.0, 0.8]
    probabilities[1, 0] = [0.7, 0.3, 0.0]
    probabilities[3, 2] = [0.5, 0.5, 0.0]
    ours = tf_metal_ops.CustomLoss(from_logits=False, reduction=reduction)(
        ids, probabilities).numpy()
    theirs = keras_loss("sparse", reduction=reduction)(ids, probabilities).numpy()
    exact = reference.custom_loss(ids, np.log(probabilities.astype(np.float64)))
    if reduction == "sum_over_batch_size":
        # Keras's number: (-log 0.2 - log 0.3 - log 0.5) / 16.
        np.testing.assert_allclose(ours, -np.log([0.2, 0.3, 0.5]).sum() / 16.0, rtol=1e-6)
    reduced_exact = {"sum_over_batch_size": exact.mean(), "sum": exact.sum(), None: exact}
    np.testing.assert_allclose(ours, reduced_exact[reduction], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignore_class(reduction):
    # Keras's case, with the ids given both ways.
    logits = np.array([[[0.854, 0.698, 0.598], [0.088, 0.86, 0.018]]], np.float32)
    for ids in (np.array([[-1, 2]]), np.array([[[-1], [2]]])):
        ours = tf_metal_ops.CustomLoss(ignore_class=-1, reduction=None)(ids, logits).numpy()
        np.testing.assert_allclose(ours, [[0.0, 1.480129]], rtol=1e-6, atol=1e-6)
    # Every reduction, with per-timestep weights: the ignored steps leave the average.
    logits, ids = _sequence_batch(seed=2)
    ids[0, :3] = -1
    ids[2, 1] = -1
    sample_weight = _sample_weights()["per_timestep"]
    ours = tf_metal_ops.CustomLoss(ignore_class=-1, reduction=reduction)(
        ids, logits, sample_weight=sample_weight).numpy()
    theirs = keras_loss("sparse", from_logits=True, ignore_class=-1, reduction=reduction)(
        ids, logits, sample_weight=sample_weight).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=KERAS_ATOL)


@pytest.mark.parametrize("alpha", [ALPHA, [0.1, 0.6, 0.3, 0.5, 0.2, 0.9]])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("from_logits", [True, False])
def test_focal_with_keras_alpha_as_class_weights(alpha, gamma, from_logits):
    # Moderate logits: every p in [1e-3, 0.9], where Keras's clip is idle.
    logits, ids = _sequence_batch(seed=3)
    logits = 0.5 * logits
    predictions = logits if from_logits else tf.nn.softmax(logits).numpy()
    one_hot = np.eye(6, dtype=np.int64)[ids]
    class_weights = list(alpha) if isinstance(alpha, list) else [alpha] * 6
    theirs = keras.losses.CategoricalFocalCrossentropy(
        alpha=alpha, gamma=gamma, from_logits=from_logits, label_smoothing=0.1,
        reduction=None)(one_hot, predictions).numpy()
    loss = tf_metal_ops.CustomLoss(gamma=gamma, label_smoothing=0.1, class_weights=class_weights,
                                   from_logits=from_logits, reduction=None)
    for labels in (one_hot, ids):
        np.testing.assert_allclose(loss(labels, predictions).numpy(), theirs, rtol=1e-5)


def test_a_labelled_probability_of_zero_is_infinite_not_clipped():
    # On purpose: Keras clips p = 0 to 1e-7 and reports -log(1e-7) = 16.1; the loss of a
    # probability 0 is +inf, which ours gives (as the reference does).
    probabilities = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], np.float32)
    ids = np.array([0, 2])
    ours = tf_metal_ops.CustomLoss(from_logits=False, reduction=None)(ids, probabilities)
    theirs = keras_loss("sparse", reduction=None)(ids, probabilities).numpy()
    exact = reference.custom_loss(ids, np.log(probabilities.astype(np.float64)))
    assert np.isposinf(exact[0]) and np.isposinf(ours.numpy()[0])
    np.testing.assert_allclose(ours.numpy()[1], exact[1], rtol=1e-6)
    np.testing.assert_allclose(theirs[0], -np.log(1e-7), rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Dtypes


@pytest.mark.parametrize("kind", ["categorical", "sparse", "focal"])
@pytest.mark.parametrize("dtype,rtol", [("bfloat16", 2e-2), ("float16", 2e-3),
                                        ("float32", 2e-6), ("float64", 1e-11)])
def test_the_loss_dtype_as_in_keras(kind, dtype, rtol):
    # Keras's dtype test gives bfloat16 and checks the loss's dtype; here every float dtype,
    # and the value: ours computes in float32 (float64 for float64) from the rounded logits.
    labels = keras_labels(kind)
    ours = our_loss(kind, dtype=dtype)(labels, LOGITS)
    theirs = keras_loss(kind, from_logits=True, dtype=dtype)(labels, LOGITS)
    assert ours.dtype == theirs.dtype == tf.as_dtype(dtype)
    rounded = tf.cast(tf.cast(LOGITS, dtype), tf.float64).numpy()
    exact = reference.custom_loss(labels, rounded, **our_options(kind))
    per_example = our_loss(kind, dtype=dtype, reduction=None)(labels, LOGITS)
    assert per_example.dtype == tf.as_dtype(dtype)
    # float16's smallest step is 6e-8: the focal losses of 1e-9 and 1e-11 are 0 there.
    np.testing.assert_allclose(tf.cast(per_example, tf.float64).numpy(), exact, rtol=rtol,
                               atol=6e-8 if dtype == "float16" else 0)
    # Reduced, the op weighs each example by Keras's weight for it, taken in float32 (the op's
    # row_scales input): a float64 mean is exact to float32's 6e-8 only.
    np.testing.assert_allclose(tf.cast(ours, tf.float64).numpy(), exact.mean(),
                               rtol=max(rtol, 6e-8))


def test_class_ids_above_what_the_loss_dtype_holds_exactly():
    # float16 holds whole numbers exactly only up to 2048: the labels reach the loss as given,
    # in every reduction, not converted to the loss's dtype first.
    rng = np.random.default_rng(4)
    logits = rng.normal(0.0, 1.0, (2, 4096)).astype(np.float32)
    ids = np.array([2049, 4093])
    exact = reference.custom_loss(ids, tf.cast(logits, tf.float16).numpy().astype(np.float64))
    for reduction in (None, "sum"):
        ours = tf_metal_ops.CustomLoss(dtype="float16", reduction=reduction)(ids, logits)
        want = exact if reduction is None else exact.sum()
        np.testing.assert_allclose(tf.cast(ours, tf.float64).numpy(), want, rtol=2e-3)


LABEL_DTYPES = ["int32", "int64", "uint8", "float32", "float64"]


@pytest.mark.parametrize("label_dtype", LABEL_DTYPES)
@pytest.mark.parametrize("logits_dtype", ["float16", "bfloat16", "float32", "float64"])
def test_label_and_logits_dtypes(label_dtype, logits_dtype):
    logits = tf.cast(LOGITS, logits_dtype)  # converted to the loss's float32, as Keras does
    for reduction in ("sum_over_batch_size", None):
        loss = tf_metal_ops.CustomLoss(reduction=reduction)
        theirs = keras_loss("sparse", from_logits=True, reduction=reduction)(IDS, logits)
        for labels in (IDS.astype(label_dtype), ONE_HOT.astype(label_dtype)):
            np.testing.assert_allclose(loss(labels, logits).numpy(), theirs.numpy(), rtol=2e-6,
                                       atol=KERAS_ATOL, err_msg=f"labels {labels.dtype} {labels.shape}")


# ---------------------------------------------------------------------------------------------
# Config round trips (Keras's serialization test, as its loss tests run it)


@pytest.mark.tf_abi
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_config_and_serialization_round_trips(reduction):
    loss = tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1, class_weights=[0.25, 0.5, 1.0],
                                   from_logits=False, ignore_class=-1, reduction=reduction,
                                   name="cfce")
    config = loss.get_config()
    revived = tf_metal_ops.CustomLoss.from_config(json.loads(json.dumps(config)))
    assert revived.get_config() == config
    serialized = json.loads(json.dumps(keras.saving.serialize_keras_object(loss)))
    deserialized = keras.saving.deserialize_keras_object(serialized)
    assert type(deserialized) is tf_metal_ops.CustomLoss
    assert deserialized.get_config() == config
    assert set(dir(deserialized)) == set(dir(loss))
    ids = np.array([0, -1, 2])
    np.testing.assert_array_equal(deserialized(ids, PROBABILITIES).numpy(),
                                  loss(ids, PROBABILITIES).numpy())


# ---------------------------------------------------------------------------------------------
# Integer one-hot labels: dense targets through every entry point, and in fit


def test_integer_one_hot_labels_give_keras_value_in_every_reduction():
    want = keras.losses.CategoricalCrossentropy(from_logits=True)(ONE_HOT, LOGITS).numpy()
    assert want == pytest.approx(0.0573756, abs=5e-8)
    for reduction in REDUCTIONS:
        ours = tf_metal_ops.CustomLoss(reduction=reduction)(ONE_HOT, LOGITS).numpy()
        mean = ours / 3 if reduction == "sum" else np.mean(ours)
        assert mean == pytest.approx(0.0573756, abs=1e-7), reduction


def _entry_points(labels, logits):
    """The per-example loss, the reduced loss and its gradient through each entry point."""
    scales = tf.fill([3], 1.0 / 3)

    def native_and_composed(jit_compile):
        @tf.function(jit_compile=jit_compile)
        def run(y, z):
            with tf.GradientTape() as tape:
                tape.watch(z)
                reduced = tf_metal_ops.reduced_custom_loss(y, z, scales, label_smoothing=0.1)
            return (tf_metal_ops.custom_loss(y, z, label_smoothing=0.1), reduced,
                    tape.gradient(reduced, z))
        return run(tf.constant(labels), tf.constant(logits))

    out = {"native": native_and_composed(False), "composed (XLA)": native_and_composed(True)}
    z = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(z)
        reduced = tf_metal_ops.CustomLoss(label_smoothing=0.1)(labels, z)
    per_example = tf_metal_ops.CustomLoss(label_smoothing=0.1, reduction=None)(labels, z)
    out["CustomLoss"] = (per_example, reduced, tape.gradient(reduced, z))
    hidden, kernel = np.eye(3, dtype=np.float32), tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(kernel)
        reduced = tf_metal_ops.linear_cross_entropy(labels, hidden, kernel, label_smoothing=0.1)
    per_example = tf_metal_ops.linear_cross_entropy(labels, hidden, kernel, label_smoothing=0.1,
                                                    reduction=None)
    out["linear_cross_entropy"] = (per_example, reduced, tape.gradient(reduced, kernel))
    return out


def test_integer_one_hot_labels_are_dense_through_every_entry_point():
    exact = reference.custom_loss(IDS, LOGITS, label_smoothing=0.1)
    exact_gradient = reference.custom_loss_grad(IDS, LOGITS, label_smoothing=0.1) / 3
    for labels in (ONE_HOT, ONE_HOT.astype(np.int32), ONE_HOT.astype(np.float32)):
        for where, (per_example, reduced, gradient) in _entry_points(labels, LOGITS).items():
            message = f"{where}, labels {labels.dtype}"
            np.testing.assert_allclose(per_example.numpy(), exact, rtol=2e-6, err_msg=message)
            np.testing.assert_allclose(reduced.numpy(), exact.mean(), rtol=2e-6, err_msg=message)
            np.testing.assert_allclose(gradient.numpy(), exact_gradient, rtol=1e-5, atol=1e-7,
                                       err_msg=message)


def test_one_class_and_unknown_last_dimension_edges():
    logits = np.zeros([3, 1], np.float32)
    # One class: integer [..., 1] labels are class ids, so a 1 is out of range ...
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"labels\[0(, 0)?\] = 1 "):
        tf_metal_ops.CustomLoss()(np.array([[1], [0], [0]]), logits)
    with pytest.raises(ValueError, match="out of range"):
        reference.custom_loss(np.array([[1], [0], [0]]), logits)
    # ... and float ones are dense targets; a one-class softmax has loss 0 either way.
    for labels in (np.zeros([3, 1], np.int64), np.array([[1.0], [0.0], [0.5]], np.float32)):
        for reduction in ("sum", None):
            np.testing.assert_array_equal(
                tf_metal_ops.CustomLoss(reduction=reduction)(labels, logits).numpy(), 0.0)
    # A last dimension unknown while tracing is not 1: integer labels are dense targets.
    run = tf.function(lambda y, z: tf_metal_ops.custom_loss(y, z), input_signature=[
        tf.TensorSpec([None, None], tf.int64), tf.TensorSpec([None, 3], tf.float32)])
    np.testing.assert_allclose(run(ONE_HOT, LOGITS).numpy(), reference.custom_loss(IDS, LOGITS),
                               rtol=2e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="shape"):
        run(IDS[:, None], LOGITS)
    # ignore_class with dense targets: the argument and both shapes named, in every reduction.
    for reduction in REDUCTIONS:
        with pytest.raises(ValueError, match=r"ignore_class=0 .*\(3, 3\).*dense targets"):
            tf_metal_ops.CustomLoss(ignore_class=0, reduction=reduction)(ONE_HOT, LOGITS)


def _clusters(rows: int = 96, seed: int = 5):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 3, rows)
    centres = np.array([[2.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, -1.0], [0.0, 0.0, 2.0, 0.0]])
    features = (centres[ids] + 0.7 * rng.standard_normal((rows, 4))).astype(np.float32)
    return features, ids


def _fit(loss, features, labels):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    history = model.fit(features, labels, epochs=4, batch_size=16, shuffle=False, verbose=0)
    return history.history["loss"], model.get_weights()


def test_fit_with_integer_one_hot_labels_trains_as_keras_does():
    features, ids = _clusters()
    one_hot = np.eye(3, dtype=np.int64)[ids]
    losses, weights = _fit(tf_metal_ops.CustomLoss(), features, one_hot)
    keras_losses, keras_weights = _fit(keras.losses.CategoricalCrossentropy(from_logits=True),
                                       features, one_hot)
    id_losses, id_weights = _fit(tf_metal_ops.CustomLoss(), features, ids)
    assert losses[-1] < 0.5 * losses[0], losses
    np.testing.assert_allclose(losses, keras_losses, rtol=1e-5)
    np.testing.assert_allclose(losses, id_losses, rtol=1e-6)
    for ours, theirs, with_ids in zip(weights, keras_weights, id_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours, with_ids, rtol=1e-6, atol=1e-7)
