"""`custom_loss`: argument checks, the raw op call, and the gradient registration.

Checks happen here, where the values enter, so a mistake is reported with the argument's name
and value at trace time. The native op checks shapes again at run time (for shapes unknown
while tracing) and label values on every call.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_metal_ops import _native, composed, loss_path, runtime

FORWARD_OP = "TfMetalOps>CustomLoss"
GRADIENT_OP = "TfMetalOps>CustomLossGrad"
LOGITS_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

TensorLike = Union[tf.Tensor, tf.Variable, np.ndarray, Sequence[Any], float, int]


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


def _logits_tensor(logits: TensorLike) -> tf.Tensor:
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


def _is_dense(labels: tf.Tensor, logits: tf.Tensor) -> bool:
    """Integer labels are class ids; float labels are dense rows when they have the logits' rank
    (a trailing dimension of 1 beside more than one class means class ids, as Keras passes them)."""
    if labels.dtype.is_integer:
        return False
    if not labels.dtype.is_floating:
        raise TypeError(
            f"labels must be integer class ids or floating-point targets, got dtype {labels.dtype.name}"
        )
    label_rank, logits_rank = labels.shape.rank, logits.shape.rank
    if label_rank is None or logits_rank is None:
        raise ValueError(
            "custom_loss needs the rank of float labels and of logits to tell class ids from "
            f"dense targets; got labels shape {labels.shape} and logits shape {logits.shape}"
        )
    if label_rank == logits_rank - 1:
        return False
    if label_rank == logits_rank:
        return not (labels.shape[-1] == 1 and logits.shape[-1] != 1)
    raise ValueError(
        "labels must have shape logits.shape[:-1] (class ids, optionally with a trailing 1) or "
        f"logits.shape (dense targets); got labels shape {labels.shape} and logits shape "
        f"{logits.shape}"
    )


def _check_sparse_shape(labels: tf.Tensor, logits: tf.Tensor) -> None:
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


def _sparse_labels(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    _check_sparse_shape(labels, logits)
    if labels.dtype in (tf.int32, tf.int64):
        return labels
    if labels.dtype.is_integer:
        return tf.cast(labels, tf.int64)
    # Keras hands class ids over as floats: accept whole numbers, refuse anything else rather
    # than truncating it to a neighbouring class.
    if hasattr(labels, "numpy"):  # eager: check here, with a plain message
        values = labels.numpy().astype(np.float64).reshape(-1)
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.trunc(values)))
        if bad.size:
            index = list(np.unravel_index(int(bad[0]), labels.shape)) if labels.shape.rank else []
            raise tf.errors.InvalidArgumentError(
                None, None,
                f"custom_loss: float labels must hold whole class ids, got labels{index} = "
                f"{values[bad[0]]}",
            )
        return tf.cast(labels, tf.int64)
    as_int = tf.cast(labels, tf.int64)
    flat = tf.reshape(labels, [-1])
    not_whole = tf.not_equal(tf.cast(tf.reshape(as_int, [-1]), labels.dtype), flat)
    # A sentinel at the end keeps argmax and gather defined for an empty batch.
    first = tf.argmax(tf.concat([tf.cast(not_whole, tf.int32), [1]], 0), output_type=tf.int64)
    check = tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(not_whole)),
        [
            "custom_loss: float labels must hold whole class ids; labels.flat[",
            first,
            "] =",
            tf.gather(tf.concat([flat, tf.zeros([1], labels.dtype)], 0), first),
        ],
    )
    with tf.control_dependencies([check]):
        return tf.identity(as_int)


def _dense_labels(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    if not labels.shape.is_compatible_with(logits.shape):
        raise ValueError(
            f"dense labels must have the logits' shape; got labels shape {labels.shape} and "
            f"logits shape {logits.shape}"
        )
    return tf.cast(labels, logits.dtype)


def _class_weights_tensor(class_weights: Any, logits: tf.Tensor) -> tf.Tensor:
    if class_weights is None:
        return tf.zeros([0], tf.float32)  # the op's "every weight is 1"
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


class _Prepared(NamedTuple):
    """A call's checked arguments: the native ops' inputs, or the composed path's losses."""

    logits: tf.Tensor
    labels: tf.Tensor
    class_weights: tf.Tensor
    attrs: dict
    composed: Optional[tf.Tensor]  # per-example losses where the native op cannot run


def _prepared(labels: TensorLike, logits: TensorLike, gamma: float, label_smoothing: float,
              class_weights: Optional[TensorLike], ignore_class: Optional[int]) -> _Prepared:
    gamma = check_gamma(gamma)
    label_smoothing = check_label_smoothing(label_smoothing)
    ignore_class = check_ignore_class(ignore_class)
    logits_t = _logits_tensor(logits)
    labels_t = tf.convert_to_tensor(labels)
    dense = _is_dense(labels_t, logits_t)
    if dense and ignore_class is not None:
        raise ValueError(
            f"ignore_class={ignore_class} applies to class-id labels only, but the "
            f"labels are dense targets (shape {labels_t.shape})"
        )
    attrs = dict(gamma=gamma, label_smoothing=label_smoothing,
                 has_ignore_class=ignore_class is not None,
                 ignore_class=0 if ignore_class is None else ignore_class)
    path, reason = loss_path.choose(logits_t)
    loss_path.record(path, reason)
    if path != loss_path.NATIVE:
        # Where the native op cannot run (tf_metal_ops.loss_path): the same loss as TF ops.
        if dense:
            labels_t = _dense_labels(labels_t, logits_t)
        else:
            _check_sparse_shape(labels_t, logits_t)  # values: checked by the composed path
        weights_t = _class_weights_tensor(class_weights, logits_t)
        losses = composed.custom_loss(
            logits_t, labels_t, dense=dense,
            class_weights=None if class_weights is None else weights_t,
            gamma=gamma, label_smoothing=label_smoothing, ignore_class=ignore_class,
            can_raise=path != loss_path.COMPOSED_XLA)
        return _Prepared(logits_t, labels_t, weights_t, attrs, losses)
    labels_t = _dense_labels(labels_t, logits_t) if dense else _sparse_labels(labels_t, logits_t)
    return _Prepared(logits_t, labels_t, _class_weights_tensor(class_weights, logits_t), attrs,
                     None)


def _forward(logits: tf.Tensor, labels: tf.Tensor, class_weights: tf.Tensor,
             row_scales: Optional[tf.Tensor], attrs: dict):
    """The forward op: (per-example loss, row statistics, scaled gradient or [0]). Without
    row scales (shape [0] for the op) it makes no gradient: per-example losses."""
    runtime.follow_tensorflow_threads()
    scales = tf.zeros([0], tf.float32) if row_scales is None else row_scales
    return _native.op_module().tf_metal_ops_custom_loss(
        logits=logits, labels=labels, class_weights=class_weights, row_scales=scales, **attrs)


def custom_loss(
    labels: TensorLike,
    logits: TensorLike,
    *,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
    class_weights: Optional[TensorLike] = None,
    ignore_class: Optional[int] = None,
    name: Optional[str] = None,
) -> tf.Tensor:
    """Fused focal / label-smoothed softmax cross-entropy, one value per example.

    For logits `z` of shape `[..., C]` and targets `t` (one-hot of the class ids, or dense rows):

        q_c   = (1 - label_smoothing) * t_c + label_smoothing / C
        loss  = - sum_c a_c * q_c * (1 - p_c)^gamma * log p_c,     p = softmax(z)

    computed stably in float32 (float64 for float64 logits) with no clipping of `p`. With the
    defaults it is exactly sparse softmax cross-entropy.

    Args:
        labels: class ids of shape `logits.shape[:-1]` (any integer dtype, or floats holding
            whole numbers; a trailing dimension of 1 is accepted), or dense targets of shape
            `logits.shape` (a float dtype).
        logits: unnormalized scores, `[..., C]`, float16, bfloat16, float32 or float64.
        gamma: focusing parameter, `>= 0`; 0 gives cross-entropy.
        label_smoothing: in `[0, 1]`.
        class_weights: optional vector of `C` weights `>= 0` (`a_c`). Passed as a tensor input,
            so changing its values retraces nothing.
        ignore_class: optional class id (sparse labels only) whose rows get loss 0 and
            gradient 0; it may lie outside `[0, C)` (e.g. -1 or 255).
        name: optional name scope.

    Returns:
        The per-example loss, shape `logits.shape[:-1]`, dtype of `logits`.

    Raises:
        TypeError: logits that are not floating point; labels of another kind.
        ValueError: shapes that do not match (both are named), gamma < 0 or NaN,
            label_smoothing outside [0, 1], negative or NaN class weights.
        tf.errors.InvalidArgumentError: at run time, a class id outside `[0, C)` that is not
            `ignore_class` (the message names the example's index and the value), or shapes
            that were unknown while tracing and do not match.

    Inside an XLA compilation (`tf.function(jit_compile=True)`, Keras's `jit_compile`) and on
    a device with no kernel of ours (a CUDA GPU, a TPU) the same loss is computed by TensorFlow
    ops instead of the native op (`tf_metal_ops.composed`; `tf_metal_ops.loss_path_info()` says
    which ran): same numerics, an analytic gradient; under XLA a bad class
    id gives that example a NaN loss and gradient row instead of an error.

    Differentiable with respect to `logits` (labels and class weights get no gradient). The
    gradient op recomputes the softmax from the logits instead of saving it (it reuses the
    forward op's per-row maximum and log-sum). Second derivatives of the native op are not
    implemented: asking for one raises `NotImplementedError` (the composed path differentiates
    its analytic gradient).
    """
    with tf.name_scope(name or "custom_loss"):
        p = _prepared(labels, logits, gamma, label_smoothing, class_weights, ignore_class)
        if p.composed is not None:
            return p.composed
        # The rows' softmax statistics are for the gradient only.
        loss, _, _ = _forward(p.logits, p.labels, p.class_weights, None, p.attrs)
        return loss


def reduced_custom_loss(
    labels: TensorLike,
    logits: TensorLike,
    row_scales: TensorLike,
    *,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
    class_weights: Optional[TensorLike] = None,
    ignore_class: Optional[int] = None,
    name: Optional[str] = None,
) -> tf.Tensor:
    """`sum(row_scales * custom_loss(labels, logits, ...))`, its gradient made with the loss.

    Liger-Kernel's rule for reduced losses: the scales are known before the loss (a mean's
    `1 / N`, sample weights, masks), so the forward op writes `row_scales * d loss / d logits`
    while each row's softmax is at hand, and the backward only multiplies it by the scalar
    upstream gradient (not at all when that is exactly 1, as in Keras's `fit`). The forward
    writes the gradient over the logits' buffer when nothing else reads them, so a model's last
    layer costs one N x C tensor, as with Keras's own losses (on the CPU; the Metal forward
    writes it to a buffer of its own). Where the forward makes no gradient (float64 logits),
    the backward runs the gradient op with the upstream `upstream * row_scales`.

    Args:
        labels, logits, gamma, label_smoothing, class_weights, ignore_class, name: as for
            `custom_loss`.
        row_scales: one scale per example, shape `logits.shape[:-1]`; no gradient flows to it.

    Returns:
        A scalar of the logits' dtype (summed in float32, or float64 for float64 logits).
    """
    with tf.name_scope(name or "reduced_custom_loss"):
        p = _prepared(labels, logits, gamma, label_smoothing, class_weights, ignore_class)
        scales = tf.stop_gradient(tf.cast(row_scales, tf.float32))
        if not scales.shape.is_compatible_with(p.logits.shape[:-1]):
            raise ValueError(
                f"row_scales must have shape logits.shape[:-1]; got row_scales shape "
                f"{scales.shape} and logits shape {p.logits.shape}")
        if p.composed is not None:  # autodiff of the composed losses' analytic gradient
            sum_dtype = tf.float64 if p.composed.dtype == tf.float64 else tf.float32
            total = tf.reduce_sum(tf.cast(p.composed, sum_dtype) * tf.cast(scales, sum_dtype))
            return tf.cast(total, p.composed.dtype)
        return _reduced(p.logits, p.labels, p.class_weights, scales, p.attrs)


def _forward_surely_makes_the_gradient(logits: tf.Tensor) -> bool:
    """True where every kernel that can take the forward op writes the scaled gradient: the
    CPU's vectorized kernels and the Metal kernels (float32, float16, bfloat16) do; float64
    runs on the CPU's scalar kernel, which writes none."""
    return logits.dtype != tf.float64


def _reduced(logits: tf.Tensor, labels: tf.Tensor, class_weights: tf.Tensor,
             scales: tf.Tensor, attrs: dict) -> tf.Tensor:
    sum_dtype = tf.float64 if logits.dtype == tf.float64 else tf.float32
    surely_made = _forward_surely_makes_the_gradient(logits)

    @tf.custom_gradient
    def reduced(z):
        loss, row_stats, scaled = _forward(z, labels, class_weights, scales, attrs)
        total = tf.reduce_sum(tf.cast(loss, sum_dtype) * tf.cast(scales, sum_dtype))

        def scaled_by(u):
            return tf.cond(tf.equal(u, 1.0), lambda: scaled,
                           lambda: scaled * tf.cast(u, scaled.dtype))

        if surely_made:
            # The backward holds nothing but the scaled gradient: were it to hold the logits
            # too (for a fallback), they would outlive the forward op, which then could not
            # write the gradient over their buffer, and a step would hold two N x C tensors
            # where Keras's own loss holds one. An empty batch's gradient is [0]: the reshape
            # gives it the logits' shape (and is free otherwise).
            logits_shape = tf.shape(z)

            def backward(upstream):
                return tf.reshape(scaled_by(tf.cast(upstream, tf.float32)), logits_shape)

            return tf.cast(total, z.dtype), backward

        def backward_either_way(upstream):
            u = tf.cast(upstream, tf.float32)

            def from_gradient_op():
                return _native.op_module().tf_metal_ops_custom_loss_grad(
                    logits=z, labels=labels, class_weights=class_weights,
                    upstream=tf.cast(u * scales, z.dtype), row_stats=row_stats, **attrs)

            made = tf.logical_and(tf.equal(tf.size(scaled), tf.size(z)), tf.size(z) > 0)
            return tf.cond(made, lambda: scaled_by(u), from_gradient_op)

        return tf.cast(total, z.dtype), backward_either_way

    return reduced(logits)


def _op_attrs(op: tf.Operation) -> dict:
    return {
        key: op.get_attr(key)
        for key in ("gamma", "label_smoothing", "has_ignore_class", "ignore_class")
    }


@tf.RegisterGradient(FORWARD_OP)
def _custom_loss_gradient(op: tf.Operation, upstream: tf.Tensor, *_unused_upstreams):
    logits, labels, class_weights, _ = op.inputs
    # The forward op's row statistics (max, log-sum, 1/sum per row; csrc/problem.h) spare the
    # gradient the passes that would find them again. They and the scaled gradient are not
    # differentiable: their own upstream gradients are ignored (the loss depends on neither).
    grad_logits = _native.op_module().tf_metal_ops_custom_loss_grad(
        logits=logits,
        labels=labels,
        class_weights=class_weights,
        upstream=upstream,
        row_stats=op.outputs[1],
        **_op_attrs(op),
    )
    return [grad_logits, None, None, None]


@tf.RegisterGradient(GRADIENT_OP)
def _second_derivative(op: tf.Operation, upstream: tf.Tensor):
    # Zeros would be silently wrong (d grad / d logits is a dense Hessian-vector product), so
    # say plainly that it is missing.
    raise NotImplementedError(
        "Second derivatives of tf_metal_ops.custom_loss are not implemented "
        f"(gradient of {GRADIENT_OP}); use a composed loss for Hessian-vector products."
    )
