"""Every bad input docs/loss.md (Bad input) names gets a clear Python exception.

* static shape mismatches -> ValueError at trace time naming both shapes;
* shapes known only at run time (tf.function with None dims) -> tf.errors.InvalidArgumentError
  naming the op and the shapes;
* a sparse label outside [0, C) that is not ignore_class -> InvalidArgumentError naming the
  example index and the value (eagerly and in a tf.function);
* gamma < 0 or NaN, label_smoothing outside [0, 1], negative or NaN class weights, non-float
  logits -> ValueError / TypeError naming the argument;
* an empty batch is fine.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops

pytestmark = [pytest.mark.tf_abi, pytest.mark.native]


def shape_pattern(*dims: int) -> str:
    """Matches a shape printed as (5, 7), [5, 7], (6,) or [6]."""
    return r"[\[(]\s*" + r",\s*".join(str(d) for d in dims) + r",?\s*[\])]"


def assert_names_shapes(message: str, *shapes) -> None:
    for dims in shapes:
        assert re.search(shape_pattern(*dims), message), (
            f"message does not name shape {dims}: {message}")


# ----------------------------------------------------------------------------------------
# Static shapes: ValueError naming both shapes
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("labels,logits_shape", [
    (np.zeros([6], np.int32), (5, 7)),                  # wrong batch
    (np.zeros([5, 3], np.int64), (5, 7)),               # rank of dense, but int and not [.., 1]
    (np.zeros([5, 6], np.float32), (5, 7)),             # dense with the wrong C
    (np.zeros([5, 7, 2], np.float32), (5, 7)),          # rank too high
    (np.zeros([2, 3], np.int32), (2, 4, 7)),            # leading dims
])
def test_static_label_shape_mismatch_names_both_shapes(labels, logits_shape):
    with pytest.raises(ValueError) as info:
        tf_metal_ops.custom_loss(labels, np.zeros(logits_shape, np.float32))
    assert_names_shapes(str(info.value), labels.shape, logits_shape)


def test_static_shape_mismatch_is_raised_while_tracing():
    f = tf.function(lambda y, z: tf_metal_ops.custom_loss(y, z))
    with pytest.raises(ValueError) as info:
        f.get_concrete_function(tf.TensorSpec([6], tf.int32), tf.TensorSpec([5, 7], tf.float32))
    assert_names_shapes(str(info.value), (6,), (5, 7))


def test_class_weights_length_mismatch_names_both_shapes():
    with pytest.raises(ValueError) as info:
        tf_metal_ops.custom_loss(np.zeros([5], np.int32), np.zeros([5, 7], np.float32),
                                 class_weights=[1.0, 1.0, 1.0, 1.0])
    message = str(info.value)
    assert "class_weights" in message
    assert re.search(shape_pattern(4), message), message
    assert re.search(shape_pattern(5, 7), message) or re.search(r"\b7\b", message), message


def test_zero_classes_is_a_value_error_naming_the_shape():
    with pytest.raises(ValueError) as info:
        tf_metal_ops.custom_loss(np.zeros([3], np.int32), np.zeros([3, 0], np.float32))
    assert_names_shapes(str(info.value), (3, 0))


def test_scalar_logits_is_a_value_error():
    with pytest.raises(ValueError, match=r"(?i)rank|scalar"):
        tf_metal_ops.custom_loss(np.int32(0), np.float32(1.0))


def test_ignore_class_with_dense_labels_is_a_value_error():
    with pytest.raises(ValueError, match="ignore_class"):
        tf_metal_ops.custom_loss(np.eye(3, dtype=np.float32), np.zeros([3, 3], np.float32),
                                 ignore_class=-1)


# ----------------------------------------------------------------------------------------
# Shapes known only at run time: InvalidArgumentError naming the op and the shapes
# ----------------------------------------------------------------------------------------

def _run_time_call(label_spec, logits_spec, labels, logits, weights_spec=None, weights=None):
    if weights_spec is None:
        f = tf.function(lambda y, z: tf_metal_ops.custom_loss(y, z, gamma=1.0),
                        input_signature=[label_spec, logits_spec])
        return f(labels, logits)
    f = tf.function(lambda y, z, w: tf_metal_ops.custom_loss(y, z, class_weights=w),
                    input_signature=[label_spec, logits_spec, weights_spec])
    return f(labels, logits, weights)


def test_run_time_sparse_label_shape_mismatch():
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        _run_time_call(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, None], tf.float32),
                       tf.zeros([4], tf.int32), tf.zeros([5, 3]))
    message = str(info.value)
    assert "CustomLoss" in message, message
    assert_names_shapes(message, (4,), (5, 3))


def test_run_time_dense_label_shape_mismatch():
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        _run_time_call(tf.TensorSpec([None, None], tf.float32),
                       tf.TensorSpec([None, None], tf.float32),
                       tf.zeros([5, 4]), tf.zeros([5, 3]))
    message = str(info.value)
    assert "CustomLoss" in message, message
    assert_names_shapes(message, (5, 4), (5, 3))


def test_run_time_class_weights_length_mismatch():
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        _run_time_call(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, None], tf.float32),
                       tf.zeros([5], tf.int32), tf.zeros([5, 3]),
                       tf.TensorSpec([None], tf.float32), tf.ones([2]))
    message = str(info.value)
    assert "CustomLoss" in message and "class_weights" in message, message
    assert_names_shapes(message, (2,))


@pytest.mark.parametrize("weights", [[1.0, -0.5, 1.0], [1.0, 1.0, float("nan")]])
def test_run_time_bad_class_weight_values(weights):
    # Weights that are symbolic while tracing are checked by the kernel when they arrive.
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as info:
        _run_time_call(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, None], tf.float32),
                       tf.zeros([5], tf.int32), tf.zeros([5, 3]),
                       tf.TensorSpec([None], tf.float32), tf.constant(weights))
    bad = 1 if weights[1] < 0 else 2
    assert re.search(rf"class_weights\[{bad}\]", str(info.value)), str(info.value)


# ----------------------------------------------------------------------------------------
# Out-of-range labels: InvalidArgumentError naming the example index and the value
# ----------------------------------------------------------------------------------------

OUT_OF_RANGE = [
    # (labels, num_classes, bad example index, bad value)
    (np.array([0, 1, 2, 3, 0, 1, 1234, 2, 3], np.int32), 4, 6, 1234),
    (np.array([0, 1, 2, -3, 0, 1, 2, 3, 0], np.int64), 4, 3, -3),
    (np.array([0, 1, 2, 3, 0, 1, 2, 3, 2**40], np.int64), 4, 8, 2**40),
    (np.array([0, 1, 2, 3, 0, 4, 2, 3, 0], np.int32), 4, 5, 4),        # == C
    (np.array([0, 1, 50257, 3], np.int64), 50257, 2, 50257),
    (np.array([0, 1, 2, 3, 0, 1, 2, 9.0, 0], np.float32), 4, 7, 9),   # Keras-style floats
]


@pytest.mark.simd
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("case", range(len(OUT_OF_RANGE)))
def test_out_of_range_label_names_index_and_value(mode, case):
    labels, num_classes, index, value = OUT_OF_RANGE[case]
    logits = tf.zeros([len(labels), num_classes])
    call = lambda z: tf_metal_ops.custom_loss(labels, z, gamma=2.0)
    if mode == "function":
        call = tf.function(call)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        call(logits).numpy()
    message = str(info.value)
    assert re.search(rf"(?<![\d.-]){index}(?![\d.])", message), (
        f"example index {index} not named: {message}")
    assert re.search(rf"(?<![\d.]){re.escape(str(value))}(?![\d.])", message), (
        f"value {value} not named: {message}")


@pytest.mark.simd
@pytest.mark.parametrize("bad_row", [10, 4000])
def test_out_of_range_label_in_a_batch_split_across_threads(bad_row):
    # 4099 x 37 is large enough for the CPU kernel to use several threads.
    labels = np.zeros([4099], np.int64)
    labels[bad_row] = 37
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        tf_metal_ops.custom_loss(labels, tf.zeros([4099, 37])).numpy()
    message = str(info.value)
    assert re.search(rf"\b{bad_row}\b", message) and re.search(r"\b37\b", message), message


@pytest.mark.simd
def test_out_of_range_label_in_leading_dims_names_the_example():
    labels = np.zeros([2, 3], np.int32)
    labels[1, 2] = 77
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        tf_metal_ops.custom_loss(labels, tf.zeros([2, 3, 5])).numpy()
    message = str(info.value)
    # Either the multi-index [1, 2] or the flat row 5 identifies the example.
    assert re.search(shape_pattern(1, 2), message) or re.search(r"\b5\b", message), message
    assert re.search(r"\b77\b", message), message


@pytest.mark.simd
def test_out_of_range_label_is_raised_when_only_the_gradient_runs():
    labels = tf.constant([0, 7], tf.int32)
    z = tf.zeros([2, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\b7\b"):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf_metal_ops.custom_loss(labels, z)
        tape.gradient(loss, z)


@pytest.mark.simd
def test_label_equal_to_ignore_class_is_not_out_of_range():
    loss = tf_metal_ops.custom_loss(np.array([0, -1, 2]), tf.zeros([3, 3]), ignore_class=-1)
    assert loss.numpy()[1] == 0
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"-2"):
        tf_metal_ops.custom_loss(np.array([0, -2, 2]), tf.zeros([3, 3]),
                                 ignore_class=-1).numpy()


@pytest.mark.parametrize("labels,value", [([0.0, 1.5, 2.0], "1.5"),
                                          ([0.0, float("nan"), 1.0], "nan")])
@pytest.mark.simd
def test_float_labels_that_are_not_whole_numbers(labels, value):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as info:
        tf_metal_ops.custom_loss(np.array(labels, np.float32), tf.zeros([3, 4])).numpy()
    message = str(info.value)
    assert "labels" in message and re.search(r"(?i)whole", message), message
    assert value in message.lower(), f"offending value {value} not named: {message}"


# ----------------------------------------------------------------------------------------
# Parameters and dtypes: ValueError / TypeError where the value enters
# ----------------------------------------------------------------------------------------

BAD_PARAMETERS = [
    (dict(gamma=-0.5), "gamma", "-0.5"),
    (dict(gamma=float("nan")), "gamma", "nan"),
    (dict(label_smoothing=-0.1), "label_smoothing", "-0.1"),
    (dict(label_smoothing=1.5), "label_smoothing", "1.5"),
    (dict(label_smoothing=float("nan")), "label_smoothing", "nan"),
    (dict(class_weights=[1.0, -2.0, 1.0]), "class_weights", "-2"),
    (dict(class_weights=[1.0, 1.0, float("nan")]), "class_weights", "nan"),
    (dict(class_weights=np.array([1.0, -2.0, 1.0], np.float32)), "class_weights", "-2"),
    (dict(class_weights=tf.constant([1.0, 1.0, -1.0])), "class_weights", "-1"),
]


@pytest.mark.parametrize("kw,argument,value", BAD_PARAMETERS,
                         ids=[f"{a}={v}" for _, a, v in BAD_PARAMETERS])
def test_bad_parameters_name_argument_and_value(kw, argument, value):
    with pytest.raises(ValueError) as info:
        tf_metal_ops.custom_loss(np.array([0, 1]), tf.zeros([2, 3]), **kw)
    message = str(info.value)
    assert argument in message and value in message.lower(), message


@pytest.mark.parametrize("kw,argument,value", BAD_PARAMETERS[:5],
                         ids=[f"{a}={v}" for _, a, v in BAD_PARAMETERS[:5]])
def test_bad_parameters_rejected_by_the_keras_loss_constructor(kw, argument, value):
    with pytest.raises(ValueError, match=argument):
        tf_metal_ops.CustomLoss(**kw)


def test_bad_class_weights_rejected_by_the_keras_loss_constructor():
    with pytest.raises(ValueError, match="class_weights"):
        tf_metal_ops.CustomLoss(class_weights=[1.0, -1.0])


@pytest.mark.parametrize("logits", [
    np.zeros([2, 3], np.int32),
    np.zeros([2, 3], np.int64),
    [[1, 2, 3], [4, 5, 6]],
    tf.zeros([2, 3], tf.int32),
    tf.zeros([2, 3], tf.complex64),
    tf.constant([["a", "b", "c"], ["d", "e", "f"]]),
    tf.zeros([2, 3], tf.bool),
], ids=["np-int32", "np-int64", "list-of-ints", "tf-int32", "tf-complex64", "tf-string",
        "tf-bool"])
def test_non_float_logits_is_a_type_error(logits):
    with pytest.raises(TypeError, match="logits"):
        tf_metal_ops.custom_loss(np.array([0, 1]), logits)


def test_non_numeric_labels_is_a_type_error():
    with pytest.raises((TypeError, ValueError), match="labels"):
        tf_metal_ops.custom_loss(tf.constant(["a", "b"]), tf.zeros([2, 3]))


# ----------------------------------------------------------------------------------------
# Empty batches are not an error
# ----------------------------------------------------------------------------------------

@pytest.mark.simd
@pytest.mark.parametrize("shape", [(0, 3), (0, 1), (4, 0, 3)])
def test_empty_batch_gives_empty_loss_and_zero_size_gradient(shape):
    z = tf.zeros(shape)
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = tf_metal_ops.custom_loss(tf.zeros(shape[:-1], tf.int32), z, gamma=2.0,
                                        label_smoothing=0.1, class_weights=[1.0] * shape[-1])
    grad = tape.gradient(loss, z)
    assert loss.shape == shape[:-1] and grad.shape == shape
