"""CustomLoss as a Keras loss: equivalences with Keras's own losses, training, serialization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import reference

pytestmark = pytest.mark.tf_abi


def _logits_and_labels(rows: int = 64, classes: int = 10, scale: float = 2.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal((rows, classes))).astype(np.float32)
    labels = rng.integers(0, classes, size=rows)
    return logits, labels


def test_default_equals_keras_sparse_categorical_crossentropy():
    logits, labels = _logits_and_labels()
    ours = tf_metal_ops.CustomLoss()(labels, logits)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    np.testing.assert_allclose(ours.numpy(), keras_loss.numpy(), rtol=1e-6)


def test_focal_equals_keras_categorical_focal_crossentropy_far_from_the_clip():
    # Moderate logits: every p in [1e-3, 0.9], so Keras's clip to [1e-7, 1 - 1e-7] is inactive.
    logits, labels = _logits_and_labels(scale=0.5)
    alpha, gamma, eps = 0.25, 2.0, 0.1
    ours = tf_metal_ops.CustomLoss(
        gamma=gamma, label_smoothing=eps, class_weights=[alpha] * 10
    )(labels, logits)
    keras_loss = keras.losses.CategoricalFocalCrossentropy(
        alpha=alpha, gamma=gamma, from_logits=True, label_smoothing=eps
    )(tf.one_hot(labels, 10), logits)
    np.testing.assert_allclose(ours.numpy(), keras_loss.numpy(), rtol=1e-5)


def test_no_clip_on_a_confident_model_with_label_smoothing():
    # A confident model: the non-target probabilities are ~1e-9, far below Keras's 1e-7 clip.
    # Label smoothing puts weight eps/C on each of them, so the clip changes Keras's value by
    # percents; the fused op matches the float64 reference instead.
    rows, classes, eps = 32, 10, 0.1
    labels = np.arange(rows) % classes
    logits = np.full((rows, classes), -10.0, np.float32)
    logits[np.arange(rows), labels] = 10.0
    ours = tf_metal_ops.custom_loss(labels, logits, label_smoothing=eps).numpy()
    exact = reference.custom_loss(labels, logits, label_smoothing=eps)
    np.testing.assert_allclose(ours, exact, rtol=1e-5)
    keras_value = keras.losses.CategoricalFocalCrossentropy(
        alpha=1.0, gamma=0.0, from_logits=True, label_smoothing=eps, reduction=None
    )(tf.one_hot(labels, classes), logits).numpy()
    relative_shift = np.abs(keras_value - exact) / exact
    assert relative_shift.min() > 0.01, "the clip no longer moves Keras's value: test is stale"


def test_sample_weight_and_reductions():
    logits, labels = _logits_and_labels(rows=16)
    weights = np.linspace(0.0, 2.0, 16).astype(np.float32)
    per_example = reference.custom_loss(labels, logits, gamma=1.0)
    loss = tf_metal_ops.CustomLoss(gamma=1.0)
    np.testing.assert_allclose(
        loss(labels, logits, sample_weight=weights).numpy(),
        np.sum(per_example * weights) / 16,
        rtol=1e-5,
    )
    summed = tf_metal_ops.CustomLoss(gamma=1.0, reduction="sum")(labels, logits)
    np.testing.assert_allclose(summed.numpy(), per_example.sum(), rtol=1e-5)
    unreduced = tf_metal_ops.CustomLoss(gamma=1.0, reduction=None)(labels, logits)
    np.testing.assert_allclose(unreduced.numpy(), per_example, rtol=1e-5)


def test_ignore_class_is_left_out_of_the_average_like_keras():
    logits, labels = _logits_and_labels(rows=20)
    labels = labels.copy()
    labels[::3] = -1
    ours = tf_metal_ops.CustomLoss(ignore_class=-1)(labels, logits)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)(
        labels, logits
    )
    np.testing.assert_allclose(ours.numpy(), keras_loss.numpy(), rtol=1e-6)


def test_from_logits_false_takes_probabilities():
    logits, labels = _logits_and_labels()
    probabilities = tf.nn.softmax(logits)
    from_probs = tf_metal_ops.CustomLoss(gamma=2.0, from_logits=False, reduction=None)(
        labels, probabilities
    )
    np.testing.assert_allclose(
        from_probs.numpy(), reference.custom_loss(labels, logits, gamma=2.0), rtol=1e-4
    )


def test_dense_one_hot_labels_in_keras():
    logits, labels = _logits_and_labels()
    one_hot = tf.one_hot(labels, 10)
    dense = tf_metal_ops.CustomLoss(label_smoothing=0.2)(one_hot, logits)
    sparse = tf_metal_ops.CustomLoss(label_smoothing=0.2)(labels, logits)
    np.testing.assert_allclose(dense.numpy(), sparse.numpy(), rtol=1e-6)


def test_get_config_round_trips_every_argument():
    arguments = dict(
        gamma=1.5,
        label_smoothing=0.05,
        class_weights=[1.0, 2.0, 0.5],
        from_logits=False,
        ignore_class=255,
        reduction="sum",
        name="my_loss",
    )
    config = tf_metal_ops.CustomLoss(**arguments).get_config()
    json.dumps(config)  # serializable as plain JSON
    again = tf_metal_ops.CustomLoss.from_config(config)
    assert again.get_config() == config
    for key, value in arguments.items():
        assert config[key] == value, key


def _small_convnet(classes: int = 4) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(classes),
        ]
    )


def _toy_images(rows: int = 256, classes: int = 4, seed: int = 0):
    # Each class lights up one quadrant of the image: learnable in a few epochs.
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=rows)
    images = 0.1 * rng.standard_normal((rows, 8, 8, 1)).astype(np.float32)
    for i, label in enumerate(labels):
        r, c = divmod(int(label), 2)
        images[i, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4, 0] += 1.0
    return images, labels.astype(np.float32)  # float labels, as Keras datasets often have


@pytest.mark.native
def test_a_small_convnet_trains_and_its_loss_falls():
    keras.utils.set_random_seed(0)
    images, labels = _toy_images()
    model = _small_convnet()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1),
        metrics=["accuracy"],
    )
    history = model.fit(images, labels, epochs=5, batch_size=32, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert history.history["accuracy"][-1] > 0.9


def test_model_save_and_load_without_custom_objects(tmp_path):
    keras.utils.set_random_seed(1)
    images, labels = _toy_images(rows=64)
    model = _small_convnet()
    model.compile(
        optimizer="adam",
        loss=tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1, class_weights=[1, 2, 1, 1]),
    )
    model.fit(images, labels, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.loss, tf_metal_ops.CustomLoss)
    assert loaded.loss.get_config() == model.loss.get_config()
    np.testing.assert_allclose(
        loaded.evaluate(images, labels, verbose=0), model.evaluate(images, labels, verbose=0),
        rtol=1e-6,
    )
    # A fresh process that only imports the package (no custom_objects, no use of CustomLoss
    # before loading): the import alone registers the class with Keras.
    script = (
        "import keras, sys, tf_metal_ops; m = keras.models.load_model(sys.argv[1]); "
        "print(type(m.loss).__module__, type(m.loss).__name__, m.loss.gamma)"
    )
    # Run outside the checkout so the child imports the same tf_metal_ops as this process (the
    # installed one in CI, the in-place build in development), not the bare source tree.
    package_parent = str(Path(tf_metal_ops.__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": package_parent},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["tf_metal_ops.keras", "CustomLoss", "2.0"]


def test_bad_arguments_are_refused_where_they_enter():
    with pytest.raises(ValueError, match="gamma"):
        tf_metal_ops.CustomLoss(gamma=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        tf_metal_ops.CustomLoss(label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"class_weights\[1\]"):
        tf_metal_ops.CustomLoss(class_weights=[1.0, float("nan")])
    with pytest.raises(TypeError, match="from_logits"):
        tf_metal_ops.CustomLoss(from_logits="yes")
    with pytest.raises(TypeError, match="ignore_class"):
        tf_metal_ops.CustomLoss(ignore_class=1.5)


@pytest.mark.parametrize("loss_dtype, op_dtype", [(None, tf.float32),
                                                   ("mixed_bfloat16", tf.bfloat16)])
def test_a_mixed_bfloat16_model_hands_the_op_the_loss_dtype(monkeypatch, loss_dtype, op_dtype):
    # Keras's Loss.__call__ converts predictions to the loss's dtype: float32 by default (a
    # float32 copy of the logits), the 16-bit logits themselves with dtype="mixed_bfloat16".
    from tf_metal_ops import ops

    seen = []
    forward_op = ops.forward_op

    def recording_forward_op(logits, inputs, row_scales):
        seen.append(logits.dtype)
        return forward_op(logits, inputs, row_scales)

    monkeypatch.setattr(ops, "forward_op", recording_forward_op)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=64)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
        model.compile("sgd", loss=tf_metal_ops.CustomLoss(label_smoothing=0.1, dtype=loss_dtype),
                      jit_compile=False)
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert seen and set(seen) == {op_dtype}
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", None])
def test_16_bit_logits_give_the_float32_loss_of_the_same_values(dtype, reduction):
    # Left at dtype=None, the loss is Keras's float32 computation on the (exactly widened)
    # 16-bit logits: the same bits as on float32 logits holding those values, and the gradient
    # that one rounded once to the logits' dtype.
    logits, labels = _logits_and_labels(rows=256, classes=100)
    z = tf.cast(tf.constant(logits), dtype)
    loss = tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1, reduction=reduction)
    with tf.GradientTape() as tape:
        tape.watch(z)
        value = tf.reduce_sum(loss(labels, z))
    grad = tape.gradient(value, z)
    assert loss(labels, z).dtype == tf.float32
    assert grad.dtype == dtype
    z32 = tf.cast(z, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(z32)
        expected = tf.reduce_sum(loss(labels, z32))
    expected_grad = tape.gradient(expected, z32)
    np.testing.assert_array_equal(value.numpy(), expected.numpy())
    np.testing.assert_array_equal(tf.cast(grad, tf.float32).numpy(),
                                  tf.cast(tf.cast(expected_grad, dtype), tf.float32).numpy())


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_a_16_bit_loss_dtype_rounds_each_example_to_it(dtype):
    # dtype="mixed_..." runs the op on the 16-bit logits: each example's loss is rounded to the
    # logits' dtype before the float32 sum, which is rounded once to the loss's dtype.
    logits, labels = _logits_and_labels(rows=256, classes=100)
    z = tf.cast(tf.constant(logits), dtype)
    policy = "mixed_bfloat16" if dtype == tf.bfloat16 else "mixed_float16"
    value = tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1, dtype=policy)(labels, z)
    assert value.dtype == dtype
    expected = tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1)(labels, z)
    unit = 2.0 ** -8 if dtype == tf.bfloat16 else 2.0 ** -11  # the dtype's half ulp at 1
    np.testing.assert_allclose(tf.cast(value, tf.float32).numpy(), expected.numpy(),
                               rtol=2 * unit)
