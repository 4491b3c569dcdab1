"""The loss's options and inputs, checked once for every entry point.

`custom_loss`, `reduced_custom_loss`, `linear_cross_entropy` and the Keras classes take the
same options (gamma, label_smoothing, class_weights, ignore_class) and the same two kinds of
labels (class ids or dense targets). Here they are checked where they enter, so a mistake is
reported with the argument's name and value at trace time; `prepare` then turns the labels and
class weights into what the chosen implementation (`tf_metal_ops.loss_path`) takes. The native
op checks shapes again at run time (for shapes unknown while tracing) and label values on every
call.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_metal_ops import loss_path

LOGITS_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

TensorLike = Union[tf.Tensor, tf.Variable, np.ndarray, Sequence[Any], float, int]


def sum_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype losses are computed and summed in: float64 for float64, else float32."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def check_gamma(gamma: Any) -> float:
    """Returns gamma as a float, or raises if it is not a finite number >= 0."""
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"gamma must be a real number >= 0, got {gamma!r}")
    if not math.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
    return float(gamma)


def check_label_smoothing(label_smoothing: Any) -> float:
    """Returns label_smoothing as a float, or raises if it is not in [0, 1]."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:  # also rejects NaN
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    return float(label_smoothing)


def check_ignore_class(ignore_class: Any) -> Optional[int]:
    """Returns ignore_class as an int (or None), or raises if it is not a whole number."""
    if ignore_class is None:
        return None
    if isinstance(ignore_class, bool) or not isinstance(ignore_class, numbers.Integral):
        raise TypeError(f"ignore_class must be an int or None, got {ignore_class!r}")
    return int(ignore_class)


def check_class_weights_values(class_weights: Any) -> Optional[np.ndarray]:
    """Checks class weights known in Python (a list, an array, an eager tensor).

    Returns them as a float64 vector, or None when they are a symbolic tensor whose values are
    only known at run time (then the kernel checks them).
    """
    if isinstance(class_weights, (tf.Tensor, tf.Variable)):
        values = tf.get_static_value(class_weights)
        if values is None:
            return None
    else:
        values = class_weights
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"class_weights must be a vector of numbers, got {class_weights!r}") from error
    if array.ndim != 1:
        raise ValueError(f"class_weights must be a vector (rank 1), got shape {list(array.shape)}")
    bad = np.flatnonzero(~(np.isfinite(array) & (array >= 0)))
    if bad.size:
        index = int(bad[0])
        raise ValueError(
            f"class_weights must be finite numbers >= 0, got class_weights[{index}] = {array[index]}"
        )
    return array


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The loss's scalar options, checked: gamma, label_smoothing and ignore_class."""

    gamma: float = 0.0
    label_smoothing: float = 0.0
    ignore_class: Optional[int] = None

    @classmethod
    def checked(cls, gamma: Any = 0.0, label_smoothing: Any = 0.0,
                ignore_class: Any = None) -> "LossOptions":
        """The options, each checked (TypeError / ValueError naming the bad one)."""
        return cls(check_gamma(gamma), check_label_smoothing(label_smoothing),
                   check_ignore_class(ignore_class))

    def op_attrs(self) -> dict:
        """The native ops' attributes."""
        return dict(gamma=self.gamma, label_smoothing=self.label_smoothing,
                    has_ignore_class=self.ignore_class is not None,
                    ignore_class=0 if self.ignore_class is None else self.ignore_class)


def logits_tensor(logits: TensorLike) -> tf.Tensor:
    """The logits as a floating-point tensor of rank >= 1 with at least one class."""
    if isinstance(logits, (tf.Tensor, tf.Variable)):
        tensor = tf.convert_to_tensor(logits)
    else:
        array = np.asarray(logits)
        if array.dtype.kind not in "f":
            raise TypeError(
                f"logits must be floating point (float16, bfloat16, float32 or float64), got "
                f"dtype {array.dtype}"
            )
        tensor = tf.convert_to_tensor(array)
    if tensor.dtype not in LOGITS_DTYPES:
        raise TypeError(
            "logits must be floating point (float16, bfloat16, float32 or float64), got dtype "
            f"{tensor.dtype.name}"
        )
    shape = tensor.shape
    if shape.rank == 0:
        raise ValueError("logits must have shape [..., num_classes] (rank >= 1), got a scalar")
    if shape.rank is not None and shape[-1] == 0:
        raise ValueError(f"logits must have at least one class, got shape {shape}")
    return tensor


def labels_are_dense(labels: tf.Tensor, logits: Any, ignore_class: Optional[int] = None) -> bool:
    """True for dense targets, False for class ids: the one rule for every entry point and
    reduction, written out in docs/loss.md ("Labels"). Integer labels with the logits' full
    shape and more than one class are dense (Keras's integer one-hot rows); `[..., 1]` labels
    beside more than one class, or integer ones beside one class, are class ids. Raises for
    `ignore_class` with dense targets."""
    if not (labels.dtype.is_integer or labels.dtype.is_floating):
        raise TypeError(
            f"labels must be integer or floating point (class ids or dense targets), got dtype "
            f"{labels.dtype.name}"
        )
    label_rank, logits_rank = labels.shape.rank, logits.shape.rank
    if label_rank is None or logits_rank is None:
        raise ValueError(
            "custom_loss needs the rank of the labels and of the logits to tell class ids from "
            f"dense targets; got labels shape {labels.shape} and logits shape {logits.shape}"
        )
    if label_rank == logits_rank - 1:
        dense = False
    elif label_rank == logits_rank:
        ids_in_last_dimension = labels.shape[-1] == 1 and (
            labels.dtype.is_integer or logits.shape[-1] != 1)
        dense = not ids_in_last_dimension
    else:
        raise ValueError(
            "labels must have shape logits.shape[:-1] (class ids, optionally with a trailing 1) "
            f"or logits.shape (dense targets); got labels shape {labels.shape} and logits shape "
            f"{logits.shape}"
        )
    if dense and ignore_class is not None:
        raise ValueError(
            f"ignore_class={ignore_class} applies to class-id labels only, but labels of shape "
            f"{labels.shape} beside logits of shape {logits.shape} are dense targets"
        )
    return dense


def check_sparse_shape(labels: tf.Tensor, logits: Any) -> None:
    """Raises unless class-id labels have the logits' rows' shape (a trailing 1 allowed)."""
    rows = logits.shape[:-1]
    shape = labels.shape
    if shape.rank is not None and rows.rank is not None and shape.rank == rows.rank + 1:
        if shape[-1] not in (1, None):
            raise ValueError(
                f"sparse labels must have shape logits.shape[:-1] (optionally with a trailing 1); "
                f"got labels shape {shape} and logits shape {logits.shape}"
            )
        shape = shape[:-1]
    if not shape.is_compatible_with(rows):
        raise ValueError(
            f"sparse labels must have shape logits.shape[:-1] (optionally with a trailing 1); "
            f"got labels shape {labels.shape} and logits shape {logits.shape}"
        )


def report_bad_label(labels: tf.Tensor, bad: tf.Tensor, caller: str,
                     requirement: Sequence[Any]) -> Optional[tf.Operation]:
    """Raises for the first label marked `bad`, naming its index and value.

    `requirement` is what the label fails, as pieces of text and scalar tensors (a number of
    classes known only at run time). Eagerly this raises InvalidArgumentError
    `"{caller}: labels[i, j] = v {requirement}"` and returns None; in a graph it returns the
    assertion that raises it when it runs (with the index into the flattened labels).
    """
    if tf.executing_eagerly():
        flat = bad.numpy().reshape(-1)
        if flat.any():
            first = int(np.flatnonzero(flat)[0])
            index = np.unravel_index(first, tuple(labels.shape)) if labels.shape.rank else ()
            value = labels.numpy().reshape(-1)[first]
            value = value.item() if labels.dtype.is_floating else int(value)
            text = "".join(str(int(p)) if isinstance(p, tf.Tensor) else str(p)
                           for p in requirement)
            raise tf.errors.InvalidArgumentError(
                None, None,
                f"{caller}: labels[{', '.join(str(int(k)) for k in index)}] = {value} {text}")
        return None
    flat_bad = tf.reshape(bad, [-1])
    # A sentinel at the end keeps argmax and gather defined for an empty batch.
    first = tf.argmax(tf.concat([tf.cast(flat_bad, tf.int32), [1]], 0), output_type=tf.int64)
    flat_labels = tf.concat([tf.reshape(labels, [-1]), tf.zeros([1], labels.dtype)], 0)
    return tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(bad)),
        [f"{caller}: labels.flat[", first, "] =", tf.gather(flat_labels, first), *requirement])


def sparse_labels(labels: tf.Tensor, logits: Any) -> tf.Tensor:
    """Class ids as the native op takes them: int32 / int64, float labels checked to be whole."""
    check_sparse_shape(labels, logits)
    if labels.dtype in (tf.int32, tf.int64):
        return labels
    as_int = tf.cast(labels, tf.int64)
    if labels.dtype.is_integer:
        return as_int
    # Keras hands class ids over as floats: accept whole numbers, refuse anything else rather
    # than truncating it to a neighbouring class. NaN and infinities fail the comparison too.
    not_whole = tf.not_equal(tf.cast(as_int, labels.dtype), labels)
    check = report_bad_label(labels, not_whole, "custom_loss", ["is not a whole class id"])
    if check is None:
        return as_int
    with tf.control_dependencies([check]):
        return tf.identity(as_int)


def dense_labels(labels: tf.Tensor, logits: Any) -> tf.Tensor:
    """Dense targets in the logits' dtype, their shape checked against the logits'."""
    if not labels.shape.is_compatible_with(logits.shape):
        raise ValueError(
            "labels with the logits' rank must have the logits' shape (dense targets) or a last "
            f"dimension of 1 (class ids); got labels shape {labels.shape} and logits shape "
            f"{logits.shape}"
        )
    return tf.cast(labels, logits.dtype)


def class_weights_tensor(class_weights: Any, logits: Any) -> tf.Tensor:
    """The class weights as the native op takes them: float32 `[C]`, or `[0]` for all ones."""
    if class_weights is None:
        return tf.zeros([0], tf.float32)
    values = check_class_weights_values(class_weights)
    tensor = tf.cast(class_weights if values is None else values, tf.float32)
    if tensor.shape.rank not in (None, 1):
        raise ValueError(f"class_weights must be a vector (rank 1), got shape {tensor.shape}")
    num_classes = logits.shape[-1]
    length = tensor.shape[0] if tensor.shape.rank == 1 else None
    if num_classes is not None and length is not None and length != num_classes:
        raise ValueError(
            f"class_weights must have one entry per class; got class_weights shape "
            f"{tensor.shape} and logits shape {logits.shape}"
        )
    return tensor


class LossInputs(NamedTuple):
    """A call's checked labels, class weights and options, and the implementation chosen."""

    labels: tf.Tensor  # class ids (int32 / int64 on the native path) or dense targets
    class_weights: tf.Tensor  # float32 [C], or [0] for all ones (the native op's convention)
    weighted: bool  # whether class weights were given
    dense: bool
    options: LossOptions
    path: str  # one of loss_path.PATHS

    @property
    def native(self) -> bool:
        return self.path == loss_path.NATIVE

    @property
    def can_raise(self) -> bool:
        """False inside XLA, where a bad label gives a NaN row instead of an error."""
        return self.path != loss_path.COMPOSED_XLA


def prepare(labels: TensorLike, logits: Any, options: LossOptions,
            class_weights: Optional[TensorLike], placed_with: Any) -> LossInputs:
    """Checks labels and class weights against `logits` and chooses the implementation.

    `logits` is a tensor, or a `tf.TensorSpec` of logits made later (linear_cross_entropy);
    `placed_with` is a tensor whose device the loss's ops follow. The choice is counted
    (`loss_path_info`). Class-id values are checked here for the native op only: the composed
    path checks them itself, and under XLA gives bad rows NaN instead.
    """
    labels_t = tf.convert_to_tensor(labels)
    dense = labels_are_dense(labels_t, logits, options.ignore_class)
    path, reason = loss_path.choose(placed_with)
    loss_path.record(path, reason)
    if dense:
        labels_t = dense_labels(labels_t, logits)
    elif path == loss_path.NATIVE:
        labels_t = sparse_labels(labels_t, logits)
    else:
        check_sparse_shape(labels_t, logits)
    return LossInputs(labels_t, class_weights_tensor(class_weights, logits),
                      class_weights is not None, dense, options, path)
