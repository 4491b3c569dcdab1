"""`custom_loss` and `reduced_custom_loss`: the native op's calls and its gradient registration.

The arguments are checked, and the implementation chosen, by `tf_metal_ops.loss_inputs`; where
the native op cannot run (`tf_metal_ops.loss_path`) the composed loss runs instead.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tf_metal_ops import _native, composed, runtime
from tf_metal_ops._native import FORWARD_OP, GRADIENT_OP, LINEAR_GRADIENT_OP, LINEAR_OP
from tf_metal_ops.loss_inputs import (
    LossInputs,
    LossOptions,
    TensorLike,
    logits_tensor,
    prepare,
    sum_dtype,
)

def forward_op(logits: tf.Tensor, inputs: LossInputs, row_scales: Optional[tf.Tensor]):
    """The forward op: (per-example loss, row statistics, scaled gradient or [0]). Without
    row scales (shape [0] for the op) it makes no gradient: per-example losses."""
    runtime.follow_tensorflow_threads()
    scales = tf.zeros([0], tf.float32) if row_scales is None else row_scales
    return _native.op_module().tf_metal_ops_custom_loss(
        logits=logits, labels=inputs.labels, class_weights=inputs.class_weights,
        row_scales=scales, **inputs.options.op_attrs())


def gradient_op(logits: tf.Tensor, inputs: LossInputs, upstream: tf.Tensor,
                row_stats: tf.Tensor) -> tf.Tensor:
    """The gradient op: `upstream * d loss / d logits`, per-row upstream gradients, from the
    forward op's row statistics."""
    return _native.op_module().tf_metal_ops_custom_loss_grad(
        logits=logits, labels=inputs.labels, class_weights=inputs.class_weights,
        upstream=tf.cast(upstream, logits.dtype), row_stats=row_stats,
        **inputs.options.op_attrs())


def linear_forward_op(hidden: tf.Tensor, kernel: tf.Tensor, bias: tf.Tensor, inputs: LossInputs,
                      row_scales: Optional[tf.Tensor], chunk_rows: int = 0):
    """The fused linear head's forward op (csrc/linear_cross_entropy.h): (per-row loss, row
    statistics, d hidden, d kernel, d bias). `hidden` is [N, d] of float16, bfloat16 or float32;
    `kernel` [d, V] and `bias` [V] float32. Given row scales [N] (a reduced loss) it returns the
    gradients of `sum(row_scales * loss)`; without (None) the three are [0]. `chunk_rows` 0: the
    op's default chunk."""
    runtime.follow_tensorflow_threads()
    scales = tf.zeros([0], tf.float32) if row_scales is None else row_scales
    return _native.op_module().tf_metal_ops_linear_cross_entropy(
        hidden=hidden, kernel=kernel, bias=bias, labels=inputs.labels,
        class_weights=inputs.class_weights, row_scales=scales, chunk_rows=chunk_rows,
        **inputs.options.op_attrs())


def forward_writes_gradient(logits: tf.Tensor) -> bool:
    """True where every kernel that can take the forward op writes the scaled gradient: the
    CPU's vectorized kernels and the Metal kernels (float32, float16, bfloat16) do; float64
    runs on the CPU's scalar kernel, which writes none."""
    return logits.dtype != tf.float64


def _checked(labels: TensorLike, logits: TensorLike, gamma: float, label_smoothing: float,
             class_weights: Optional[TensorLike], ignore_class: Optional[int]):
    options = LossOptions.checked(gamma, label_smoothing, ignore_class)
    logits_t = logits_tensor(logits)
    return logits_t, prepare(labels, logits_t, options, class_weights, placed_with=logits_t)


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
            `logits.shape` (floats, or integer one-hot rows beside more than one class); the
            rule is in docs/loss.md, "Labels".
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
        logits_t, inputs = _checked(labels, logits, gamma, label_smoothing, class_weights,
                                    ignore_class)
        if not inputs.native:
            return composed.losses(logits_t, inputs)
        # The rows' softmax statistics are for the gradient only.
        loss, _, _ = forward_op(logits_t, inputs, None)
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
    dtype: Optional[Any] = None,
) -> tf.Tensor:
    """`sum(row_scales * custom_loss(labels, logits, ...))`, its gradient made with the loss.

    Liger-Kernel's rule for reduced losses: the scales are known before the loss (a mean's
    `1 / N`, sample weights, masks), so the forward op writes `row_scales * d loss / d logits`
    while each row's softmax is at hand, and the backward only multiplies it by the scalar
    upstream gradient (not at all when that is exactly 1, as in Keras's `fit`). The forward
    writes the gradient over the logits' buffer when nothing else reads them, so a model's last
    layer costs one N x C tensor, as with Keras's own losses (the CPU's kernels and the Metal
    kernels alike: TensorFlow decides, by forwarding the logits' buffer to the gradient output
    only when no other op holds them). Where the forward makes no gradient (float64 logits),
    the backward runs the gradient op with the upstream `upstream * row_scales`.

    Args:
        labels, logits, gamma, label_smoothing, class_weights, ignore_class, name: as for
            `custom_loss`.
        row_scales: one scale per example, shape `logits.shape[:-1]`; no gradient flows to it.
            Taken as float32, or float64 for float64 logits.
        dtype: the dtype of the returned scalar (default: the logits'). The sum is taken in
            float32 (float64 for float64 logits) and rounded once to it, so float16 or bfloat16
            logits can give a float32 loss, as Keras's losses do, without a float32 copy of
            the logits; the gradient stays in the logits' dtype.

    Returns:
        A scalar of `dtype` (summed in float32, or float64 for float64 logits).
    """
    with tf.name_scope(name or "reduced_custom_loss"):
        logits_t, inputs = _checked(labels, logits, gamma, label_smoothing, class_weights,
                                    ignore_class)
        out_dtype = logits_t.dtype if dtype is None else _result_dtype(dtype)
        # float32 scales, as the forward op takes them, except for float64 logits: their
        # forward writes no gradient, and the loss and gradient keep the scales' float64 digits
        # (a mean's 1 / N is rarely a float32).
        scales = tf.stop_gradient(tf.cast(row_scales, sum_dtype(logits_t.dtype)))
        if not scales.shape.is_compatible_with(logits_t.shape[:-1]):
            raise ValueError(
                f"row_scales must have shape logits.shape[:-1]; got row_scales shape "
                f"{scales.shape} and logits shape {logits_t.shape}")
        if not inputs.native:  # autodiff of the composed losses' analytic gradient
            losses = composed.losses(logits_t, inputs)
            total_dtype = sum_dtype(losses.dtype)
            total = tf.reduce_sum(tf.cast(losses, total_dtype) * tf.cast(scales, total_dtype))
            return tf.cast(total, out_dtype)
        return _reduced(logits_t, inputs, scales, out_dtype)


def _result_dtype(dtype: Any) -> tf.DType:
    try:
        out_dtype = tf.as_dtype(dtype)
    except TypeError:
        out_dtype = None
    if out_dtype is None or not out_dtype.is_floating:
        raise TypeError(f"dtype must be a floating-point dtype (float16, bfloat16, float32 or "
                        f"float64), got {dtype!r}")
    return out_dtype


def _reduced(logits: tf.Tensor, inputs: LossInputs, scales: tf.Tensor,
             out_dtype: tf.DType) -> tf.Tensor:
    total_dtype = sum_dtype(logits.dtype)
    always_written = forward_writes_gradient(logits)

    @tf.custom_gradient
    def reduced(z):
        loss, row_stats, scaled = forward_op(z, inputs, scales if always_written else None)
        total = tf.reduce_sum(tf.cast(loss, total_dtype) * tf.cast(scales, total_dtype))

        def scaled_by(u):
            return tf.cond(tf.equal(u, 1.0), lambda: scaled,
                           lambda: scaled * tf.cast(u, scaled.dtype))

        if always_written:
            # The backward holds nothing but the scaled gradient: were it to hold the logits
            # too (for a fallback), they would outlive the forward op, which then could not
            # write the gradient over their buffer, and a step would hold two N x C tensors
            # where Keras's own loss holds one. An empty batch's gradient is [0]: the reshape
            # gives it the logits' shape (and is free otherwise).
            logits_shape = tf.shape(z)

            def backward(upstream):
                return tf.reshape(scaled_by(tf.cast(upstream, tf.float32)), logits_shape)

            return tf.cast(total, out_dtype), backward

        def backward_from_written_or_gradient_op(upstream):
            u = tf.cast(upstream, scales.dtype)
            written = tf.logical_and(tf.equal(tf.size(scaled), tf.size(z)), tf.size(z) > 0)
            return tf.cond(written, lambda: scaled_by(u),
                           lambda: gradient_op(z, inputs, u * scales, row_stats))

        return tf.cast(total, out_dtype), backward_from_written_or_gradient_op

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


def _linear_attrs(op: tf.Operation) -> dict:
    return dict(_op_attrs(op), chunk_rows=op.get_attr("chunk_rows"))


@tf.RegisterGradient(LINEAR_OP)
def _linear_cross_entropy_gradient(op: tf.Operation, upstream: Optional[tf.Tensor],
                                   *_unused_upstreams):
    # The gradient op makes each chunk's logits again (with the forward's chunk_rows, so that
    # they are the logits the row statistics came from) and runs the gradient rows with the
    # per-row upstream. The forward's own gradient outputs (reduced losses) and its statistics
    # are not differentiable: their upstream gradients are ignored. A reduced loss does not come
    # here: tf_metal_ops.linear_cross_entropy scales the forward's gradients instead.
    hidden, kernel, bias, labels, class_weights, _ = op.inputs
    if upstream is None:
        upstream = tf.zeros(tf.shape(op.outputs[0]), tf.float32)
    d_hidden, d_kernel, d_bias = _native.op_module().tf_metal_ops_linear_cross_entropy_grad(
        hidden=hidden, kernel=kernel, bias=bias, labels=labels, class_weights=class_weights,
        upstream=upstream, row_stats=op.outputs[1], **_linear_attrs(op))
    return [tf.ensure_shape(d_hidden, hidden.shape), tf.ensure_shape(d_kernel, kernel.shape),
            tf.ensure_shape(d_bias, bias.shape), None, None, None]


@tf.RegisterGradient(LINEAR_GRADIENT_OP)
def _linear_second_derivative(op: tf.Operation, *upstreams):
    raise NotImplementedError(
        "Second derivatives of tf_metal_ops.linear_cross_entropy's native op are not "
        f"implemented (gradient of {LINEAR_GRADIENT_OP}); use the composed path (XLA) for "
        "Hessian-vector products."
    )
