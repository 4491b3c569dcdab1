"""`linear_cross_entropy`: a language-model head's loss without its logits.

On the CPU, for float32, float16 and bfloat16 hidden states, one native op runs the whole chunk
loop on the platform's BLAS (csrc/linear_cross_entropy.h, csrc/cpu/linear_cross_entropy_cpu.cc;
`_native_loss` below): its reduced forward returns the loss and the three gradients, which the
backward scales by the upstream scalar; per-row losses get the native gradient op, which makes
each chunk's logits again. Everywhere else (float64, XLA, a device without our kernels, a Mac's
GPU) the loop is a tf.while_loop of TensorFlow ops, which the rest of this docstring describes.

For hidden states `h` [N, d] and a projection `W` [d, V] the logits `h @ W + b` are by far the
largest tensor of a step (at N = 8192 and V = 128256, 4 GiB in float32, and their gradient as
much again). Here they are made `chunk_size` rows at a time, each chunk handed to the same
native op as `custom_loss` and dropped before the next one is made, as Liger-Kernel's fused
linear cross-entropy does for PyTorch (https://github.com/linkedin/Liger-Kernel) and Apple's
Cut Cross-Entropy (Wijmans et al., ICLR 2025) takes further.

Reduced ("mean", "sum"), the scales of the rows are known before the loss, so the gradient is
computed in the forward (Liger-Kernel's rule, as in `reduced_custom_loss`): per chunk the native
op writes `s_i * d loss_i / d z_i`, and it goes at once into `dh = g @ W^T`, `dW += h^T @ g`
and `db += sum g`; the backward only multiplies them by the scalar upstream gradient. Were
autodiff to see the loop, it would keep every chunk's logits alive for the backward, which is
the tensor this function exists to avoid: the loop sits inside `tf.custom_gradient`, and the
loop runs one iteration at a time (`parallel_iterations=1`), so no two chunks' logits coexist.

Unreduced (`reduction=None`), the upstream gradient of each row is only known in the backward,
which makes each chunk's logits again and hands them to the gradient op with the forward's row
statistics (three floats per row).

Each chunk's rows are sliced out when the loop reaches it, and the last chunk may be shorter.
Under XLA, which wants every iteration to have the same static shapes, the rows are padded to a
whole number of chunks instead (scale 0, so they add nothing; a copy of the hidden states), and
the composed loss (`tf_metal_ops.composed`) replaces the native op in each chunk.

The kernel's gradient is a sum over chunks of d x V products. On the CPU it is summed in place
(our AddInto op, csrc/add_into.h): each chunk's product is made whole, in W's layout, where the
chunk has at least d rows (the product is then no larger than the chunk's logits), else in
vocabulary blocks of about KERNEL_BLOCK_BYTES one after the other, so the loop holds the sum and
one block; the hidden states' gradient is written likewise, chunk by chunk, into one [N, d]
tensor. With TensorFlow's
own AddV2 (a GPU, XLA) the loop holds the old sum, the product and the new sum: three d x V
matrices.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_metal_ops import _native, composed, loss_path
from tf_metal_ops.loss_inputs import (
    LossInputs,
    LossOptions,
    TensorLike,
    prepare,
    report_bad_label,
    sum_dtype,
)
from tf_metal_ops.ops import forward_op, forward_writes_gradient, gradient_op, linear_forward_op

REDUCTIONS = ("mean", "sum", None)
# The default chunk holds about this many bytes of logits (float32). Smaller chunks cost time:
# each adds h_c^T g_c, a d x V product, into dW. Larger ones cost more memory than their own
# size: where TensorFlow's CPU allocator pools memory (the oneDNN build's, on by default on
# recent x86 CPUs), a step's chunk-sized buffers (logits, gradient, matmul outputs) settle in
# its pool side by side, several chunks' worth (docs/performance.md has the figures).
DEFAULT_CHUNK_BYTES = 32 * 2**20
HIDDEN_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# The hidden-state dtypes the native op (csrc/linear_cross_entropy.h) takes; float64 runs the
# chunk loop of TensorFlow ops.
NATIVE_DTYPES = (tf.float16, tf.bfloat16, tf.float32)
# Whether linear_cross_entropy may use the native op where it can run. False runs the chunk
# loop of TensorFlow ops everywhere, for comparisons (tests, benchmarks).
USE_NATIVE_OP = True
# Summed in place, a chunk of fewer than d rows makes its d kernel product in vocabulary blocks
# of about this size (see _kernel_gradient_blocks): the loop then holds the sum, one chunk of
# logits and one block, where a whole product would be a second d x V matrix, larger than the
# chunk's logits.
KERNEL_BLOCK_BYTES = 16 * 2**20


def check_reduction(reduction: Any) -> Optional[str]:
    """Returns the reduction, or raises if it is not "mean", "sum" or None."""
    if reduction not in REDUCTIONS or isinstance(reduction, bool):
        raise ValueError(f"reduction must be 'mean', 'sum' or None, got {reduction!r}")
    return reduction


def check_chunk_size(chunk_size: Any) -> Optional[int]:
    """Returns chunk_size as an int (or None for the default), or raises if it is not >= 1."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
    return int(chunk_size)


def default_chunk_size(num_classes: int, rows: Optional[int] = None,
                       width: Optional[int] = None) -> int:
    """Rows per chunk: about DEFAULT_CHUNK_BYTES of float32 logits, or `width / 2` rows where
    that is more (a chunk then holds half as much as the kernel's gradient, d x V, of which a
    step holds several anyway, and each chunk's pass over W, which costs what the chunk's own
    work does at `width` rows, is paid less often); at most `rows` (when known and non-zero),
    at least 1."""
    chunk = max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, num_classes)), (width or 0) // 2)
    if rows:
        chunk = min(chunk, rows)
    return int(chunk)


def _float_tensor(value: TensorLike, name: str) -> tf.Tensor:
    tensor = tf.convert_to_tensor(value)
    if tensor.dtype not in HIDDEN_DTYPES:
        raise TypeError(f"{name} must be floating point (float16, bfloat16, float32 or float64), "
                        f"got dtype {tensor.dtype.name}")
    return tensor


def _checked_inputs(hidden: TensorLike, kernel: TensorLike, bias: Optional[TensorLike]):
    """(hidden, kernel, bias or None) as tensors, with their shapes checked against each other.
    The kernel and bias keep their own dtype (a float32 variable under mixed_float16): they are
    cast to the hidden states' dtype, the compute dtype, inside the loss."""
    h = _float_tensor(hidden, "hidden")
    w = _float_tensor(kernel, "kernel")
    if h.shape.rank == 0:
        raise ValueError("hidden must have shape [..., d] (rank >= 1), got a scalar")
    if w.shape.rank is not None and w.shape.rank != 2:
        raise ValueError(f"kernel must have shape [d, num_classes] (Dense layout), got shape "
                         f"{w.shape}")
    if not h.shape[-1:].is_compatible_with(w.shape[:1]):
        raise ValueError(f"hidden's last dimension must equal kernel's first (d); got hidden "
                         f"shape {h.shape} and kernel shape {w.shape}")
    if w.shape.rank is not None and w.shape[1] == 0:
        raise ValueError(f"kernel must have at least one class, got shape {w.shape}")
    b = None
    if bias is not None:
        b = _float_tensor(bias, "bias")
        if b.shape.rank is not None and b.shape.rank != 1:
            raise ValueError(f"bias must be a vector of num_classes entries, got shape {b.shape}")
        if not b.shape.is_compatible_with(w.shape[1:]):
            raise ValueError(f"bias must have one entry per class; got bias shape {b.shape} and "
                             f"kernel shape {w.shape}")
    return h, w, b


def _pad_rows(tensor: tf.Tensor, padded_rows: tf.Tensor) -> tf.Tensor:
    extra = padded_rows - tf.shape(tensor)[0]
    paddings = tf.concat([[[0, extra]], tf.zeros([tf.rank(tensor) - 1, 2], tf.int32)], 0)
    return tf.pad(tensor, paddings)


class _ChunkLoss:
    """The loss of one chunk of logits, and everything else that is the same for every chunk."""

    def __init__(self, inputs: LossInputs, compute_dtype: tf.DType, sums_in_place: bool,
                 kernel_blocks: int) -> None:
        self.inputs = inputs  # the labels: all rows, each chunk's are passed to the methods
        self.native = inputs.native
        self.can_raise = inputs.can_raise
        self.compute_dtype = compute_dtype
        self.sums_in_place = sums_in_place
        self.kernel_blocks = kernel_blocks  # see _kernel_gradient_blocks

    def add_into(self, total: tf.Tensor, addend: tf.Tensor, first, shape,
                 row_offset=0) -> tf.Tensor:
        """A running sum of shape `shape` after `addend` went into its rows from `row_offset`
        on (`total` is ignored where `first`), written by our AddInto op into the sum's own
        buffer (csrc/add_into.h); only where `sums_in_place`."""
        total = _native.op_module().tf_metal_ops_add_into(
            accumulator=total, addend=addend, first=first,
            row_offset=tf.cast(row_offset, tf.int64), shape=tf.cast(shape, tf.int64))
        total.set_shape(tf.TensorShape([None]).concatenate(addend.shape[1:]))
        return total

    def losses_and_scaled_gradient(self, z: tf.Tensor, y: tf.Tensor, scales: tf.Tensor):
        """(per-row loss in float32 / float64, scales * d loss / d z in z's dtype)."""
        if not self.native:
            with tf.GradientTape() as tape:
                tape.watch(z)
                losses = self._composed(z, y)
                total = tf.reduce_sum(tf.cast(losses, scales.dtype) * scales)
            return tf.cast(losses, scales.dtype), tape.gradient(total, z)
        loss, row_stats, scaled = forward_op(z, self._with_labels(y),
                                             tf.cast(scales, tf.float32))
        if not forward_writes_gradient(z):
            # The forward may make no gradient (float64, a Metal kernel): then the gradient op.
            made = tf.equal(tf.size(scaled), tf.size(z))
            scaled = tf.cond(made, lambda: tf.reshape(scaled, tf.shape(z)),
                             lambda: self.gradient(z, y, tf.cast(scales, z.dtype), row_stats))
        return tf.cast(loss, scales.dtype), tf.reshape(scaled, tf.shape(z))

    def losses_and_row_stats(self, z: tf.Tensor, y: tf.Tensor):
        """(per-row loss, the row statistics the gradient op reuses, or None when composed)."""
        if not self.native:
            return self._composed(z, y), None
        loss, row_stats, _ = forward_op(z, self._with_labels(y), None)
        return loss, row_stats

    def gradient(self, z: tf.Tensor, y: tf.Tensor, upstream: tf.Tensor,
                 row_stats: Optional[tf.Tensor]) -> tf.Tensor:
        """upstream * d loss / d z, for per-row upstream gradients."""
        if not self.native:
            with tf.GradientTape() as tape:
                tape.watch(z)
                losses = self._composed(z, y)
            return tape.gradient(losses, z, output_gradients=tf.cast(upstream, losses.dtype))
        # The statistics went through the loop in the sum dtype (float64 for float64 logits);
        # the op takes float32.
        return gradient_op(z, self._with_labels(y), upstream, tf.cast(row_stats, tf.float32))

    def _with_labels(self, y: tf.Tensor) -> LossInputs:
        return self.inputs._replace(labels=y)

    def _composed(self, z: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return composed.losses(z, self._with_labels(y))


def _runs_on_cpu(hidden: tf.Tensor) -> bool:
    """Whether ops made now with these hidden states run on the CPU, where AddInto has its
    kernel (a Metal GPU sums with AddV2)."""
    device_type = loss_path.target_device_type(loss_path.requested_device(hidden),
                                               loss_path.visible_device_types())
    return device_type == "CPU"


@functools.lru_cache(maxsize=None)
def _blas_available() -> bool:
    """Whether the native op has its BLAS here (always on Linux; on macOS, Accelerate's current
    interface, macOS 13.3 and later)."""
    return bool(_native.runtime().build_info().get("blas_available", False))


def _valid_rows(labels: tf.Tensor, dense: bool, ignore_class: Optional[int]) -> tf.Tensor:
    """1.0 for the rows that count in a mean, 0.0 for those labelled ignore_class."""
    rows = tf.shape(labels)[0]
    if dense or ignore_class is None:
        return tf.ones([rows], tf.float32)
    ids = tf.cast(labels, tf.int64)
    return tf.cast(tf.not_equal(ids, ignore_class), tf.float32)


def _check_class_ids(labels: tf.Tensor, num_classes: tf.Tensor,
                     ignore_class: Optional[int]) -> tf.Tensor:
    """Raises (at run time) for a class id outside [0, V) that is not ignore_class, naming its
    index among all the labels: the native op would only know its index within its chunk."""
    ids = tf.cast(labels, tf.int64)
    good = tf.logical_and(ids >= 0, ids < tf.cast(num_classes, tf.int64))
    if ignore_class is not None:
        good = tf.logical_or(good, tf.equal(ids, ignore_class))
    also = "" if ignore_class is None else f" nor ignore_class ({ignore_class})"
    check = report_bad_label(labels, tf.logical_not(good), "linear_cross_entropy",
                             ["is not a class id in [0, ", num_classes, f"){also}"])
    if check is None:
        return labels
    with tf.control_dependencies([check]):
        return tf.identity(labels)


def linear_cross_entropy(
    labels: TensorLike,
    hidden: TensorLike,
    kernel: TensorLike,
    bias: Optional[TensorLike] = None,
    *,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
    class_weights: Optional[TensorLike] = None,
    ignore_class: Optional[int] = None,
    reduction: Optional[str] = "mean",
    chunk_size: Optional[int] = None,
    name: Optional[str] = None,
) -> tf.Tensor:
    """The loss of `custom_loss(labels, hidden @ kernel + bias, ...)` without its logits.

    The logits are made `chunk_size` rows at a time and never all at once, nor is their
    gradient: beside its inputs and gradients the call holds one chunk of logits (and of their
    gradient). See the module docstring for how.

    Args:
        labels: class ids of shape `hidden.shape[:-1]` (any integer dtype or whole floats, a
            trailing dimension of 1 accepted), or dense targets of shape
            `hidden.shape[:-1] + [num_classes]`.
        hidden: hidden states `[..., d]`, float16, bfloat16, float32 or float64. On the
            native op (the CPU, but for float64) every product is float32, 16-bit hidden
            states converted a chunk at a time; on the tf.while_loop route their dtype is the
            compute dtype of the logits.
        kernel: the projection `[d, num_classes]` (Keras's Dense layout; for a tied embedding
            matrix `[num_classes, d]`, pass its transpose). A kernel of another float dtype (a
            float32 variable under `mixed_float16`) is cast to float32 for the native op, to
            the hidden states' dtype on the tf.while_loop route (as Keras's Dense does); its
            gradient has its own dtype.
        bias: optional `[num_classes]`, cast likewise.
        gamma, label_smoothing, class_weights, ignore_class: as for `custom_loss`.
        reduction: `"mean"` (over the rows not labelled `ignore_class`; 0 when there are
            none), `"sum"`, or None (per-row losses of shape `hidden.shape[:-1]`).
        chunk_size: rows of logits made at once. Default on the native op: about N x d
            logits, at least 256 rows (csrc/linear_cross_entropy.h); on the tf.while_loop
            route: about 32 MiB of float32 logits, or d / 2 rows where that is more
            (`default_chunk_size`). At most the number of rows. On the tf.while_loop
            route, with at least d rows each chunk's d kernel product is made whole: no
            copies of the gradient's columns, but that d x V product, not a block of it, is
            held beside the sum.
        name: optional name scope.

    Returns:
        A scalar (reduced) or the per-row losses, float32 (float64 for float64 hidden states).

    Raises:
        TypeError: hidden, kernel or bias not floating point; labels of another kind; options
            of the wrong type.
        ValueError: shapes that do not match (each is named), a bad option (gamma,
            label_smoothing, class_weights, reduction, chunk_size: the value is named).
        tf.errors.InvalidArgumentError: at run time, a class id outside `[0, num_classes)` that
            is not `ignore_class` (its index in the labels and its value).

    Differentiable with respect to `hidden`, `kernel` and `bias` (labels and class weights get
    no gradient). Inside an XLA compilation, and on a device without kernels of ours, each
    chunk runs the composed loss (`tf_metal_ops.composed`), where a bad class id gives its row
    a NaN loss instead of an error.
    """
    options = LossOptions.checked(gamma, label_smoothing, ignore_class)
    ignore_class = options.ignore_class
    reduction = check_reduction(reduction)
    chunk_size = check_chunk_size(chunk_size)
    with tf.name_scope(name or "linear_cross_entropy"):
        h, w, b = _checked_inputs(hidden, kernel, bias)
        compute_dtype = h.dtype
        num_classes = w.shape[1]
        # What the logits would be, for the label and class-weight checks custom_loss makes.
        logits_spec = tf.TensorSpec(h.shape[:-1].concatenate([num_classes]), compute_dtype)
        inputs = prepare(labels, logits_spec, options, class_weights, placed_with=h)
        labels_t, dense, native = inputs.labels, inputs.dense, inputs.native

        rows_shape = tf.shape(h)[:-1]
        d = tf.shape(h)[-1]
        h2 = tf.reshape(h, [-1, h.shape[-1] if h.shape[-1] is not None else d])
        v_dynamic = tf.shape(w)[1]
        if not dense and inputs.can_raise:
            labels_t = _check_class_ids(labels_t, v_dynamic, ignore_class)
        flat_labels = (tf.reshape(labels_t, [-1, num_classes if num_classes is not None
                                             else v_dynamic]) if dense
                       else tf.reshape(labels_t, [-1]))
        if (native and USE_NATIVE_OP and compute_dtype in NATIVE_DTYPES and _runs_on_cpu(h)
                and _blas_available()):
            return _native_loss(h2, w, b, inputs._replace(labels=flat_labels), reduction,
                                chunk_size, rows_shape, ignore_class)
        static_rows = h2.shape[0]
        if chunk_size is None:
            chunk_size = default_chunk_size(num_classes or 1, static_rows, h.shape[-1])
        elif static_rows:
            chunk_size = min(chunk_size, static_rows)
        problem = _ChunkLoss(inputs._replace(labels=flat_labels), compute_dtype,
                             native and compute_dtype in (tf.float32, tf.float64)
                             and _runs_on_cpu(h),
                             _kernel_gradient_blocks(w.shape, chunk_size))
        if static_rows is None:
            # A batch of unknown size (Keras traces fit with one) is not padded to a chunk
            # much larger than itself: the chunk is no more than the rows, at run time.
            chunk_size = tf.minimum(chunk_size, tf.maximum(tf.shape(h2)[0], 1))
        total_dtype = sum_dtype(compute_dtype)
        valid = tf.cast(_valid_rows(flat_labels, dense, ignore_class), total_dtype)
        if reduction == "mean":
            scales = tf.math.divide_no_nan(valid, tf.reduce_sum(valid))
        else:
            scales = tf.ones_like(valid)
        scales = tf.stop_gradient(scales)
        args = (problem, flat_labels, scales, chunk_size, total_dtype)
        if b is None:  # a zero bias: its gradient, computed and dropped, is one row of V
            b = tf.zeros([v_dynamic], compute_dtype)
        if reduction is None:
            return tf.reshape(_unreduced(h2, w, b, *args), rows_shape)
        return _reduced(h2, w, b, *args)


def _native_loss(h2: tf.Tensor, w: tf.Tensor, b: Optional[tf.Tensor], inputs: LossInputs,
                 reduction: Optional[str], chunk_size: Optional[int], rows_shape: tf.Tensor,
                 ignore_class: Optional[int]) -> tf.Tensor:
    """The loss on the native op, which runs the whole chunk loop (csrc/cpu/
    linear_cross_entropy_cpu.cc). The kernel and bias go in as float32 (the products are
    float32 for every hidden dtype); their gradients come back in their own dtype."""
    labels = inputs.labels
    if inputs.dense:
        labels = tf.cast(labels, tf.float32)
    inputs = inputs._replace(labels=labels)
    chunk_rows = chunk_size or 0  # 0: the op's default (csrc/linear_cross_entropy.h)
    w_dtype = w.dtype
    b_dtype = w.dtype if b is None else b.dtype
    if b is None:  # a zero bias: its gradient, computed and dropped, is one row of V
        b = tf.zeros(tf.shape(w)[1:], tf.float32)
    if reduction is None:
        loss, _, _, _, _ = linear_forward_op(h2, tf.cast(w, tf.float32), tf.cast(b, tf.float32),
                                             inputs, None, chunk_rows)
        return tf.reshape(loss, rows_shape)
    valid = _valid_rows(labels, inputs.dense, ignore_class)
    if reduction == "mean":
        scales = tf.math.divide_no_nan(valid, tf.reduce_sum(valid))
    else:
        scales = tf.ones_like(valid)
    scales = tf.stop_gradient(scales)

    @tf.custom_gradient
    def fused(h, w_own, b_own):
        loss, _, dh, dw, db = linear_forward_op(h, tf.cast(w_own, tf.float32),
                                                tf.cast(b_own, tf.float32), inputs, scales,
                                                chunk_rows)
        total = tf.reduce_sum(loss * scales)
        dh = tf.ensure_shape(dh, h.shape)
        dw = tf.cast(tf.ensure_shape(dw, w_own.shape), w_dtype)
        db = tf.cast(tf.ensure_shape(db, b_own.shape), b_dtype)

        def backward(upstream):
            return _scaled_gradients(upstream, dh, dw, db)

        return total, backward

    return fused(h2, w, b)


def _scaled_gradients(upstream: tf.Tensor, *gradients: tf.Tensor) -> Tuple[tf.Tensor, ...]:
    """The gradients a reduced forward computed, times the upstream scalar (skipped when it is 1,
    as under Keras's fit without loss scaling)."""
    u = tf.cast(upstream, tf.float32)
    return tuple(
        tf.cond(tf.equal(u, 1.0), lambda g=g: g, lambda g=g: g * tf.cast(u, g.dtype))
        for g in gradients)


def _static(chunk_size: Union[int, tf.Tensor]) -> Optional[int]:
    return chunk_size if isinstance(chunk_size, int) else None


class _Chunks:
    """A [rows, ...] tensor read `chunk_size` rows at a time: chunk i is sliced out when read
    (the last one may be shorter), or, padded, it is a row of one [chunks, chunk_size, ...]
    tensor made at once with zero rows at the end (static shapes, for XLA)."""

    def __init__(self, tensor: tf.Tensor, rows, chunks, chunk_size, padded: bool) -> None:
        self.tensor = tensor
        self.rows = rows
        self.chunks = chunks
        self.chunk_size = chunk_size
        self.stacked = None
        if padded:
            padded_tensor = _pad_rows(tensor, chunks * chunk_size)
            shaped = tf.reshape(padded_tensor,
                                tf.concat([[-1, chunk_size], tf.shape(tensor)[1:]], 0))
            self.stacked = tf.ensure_shape(
                shaped, [None, _static(chunk_size)] + tensor.shape[1:].as_list())

    def __getitem__(self, i) -> tf.Tensor:
        if self.stacked is not None:
            return self.stacked[i]
        start = i * self.chunk_size
        return self.tensor[start:tf.minimum(start + self.chunk_size, self.rows)]

    @property
    def row_shape(self) -> tf.TensorShape:
        """A chunk's static shape."""
        rows = _static(self.chunk_size) if self.stacked is not None else None
        return tf.TensorShape([rows]).concatenate(self.tensor.shape[1:])

    def like(self, tensor: tf.Tensor) -> "_Chunks":
        """Another [rows, ...] tensor, chunked the same way."""
        return _Chunks(tensor, self.rows, self.chunks, self.chunk_size,
                       self.stacked is not None)


def _logits(hc: tf.Tensor, w: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.nn.bias_add(tf.matmul(hc, w), b)


def _chunked_inputs(problem: "_ChunkLoss", h: tf.Tensor, w_own: tf.Tensor, b_own: tf.Tensor,
                    labels: tf.Tensor, chunk_size):
    """The projection in the compute dtype, the row and chunk counts, and the hidden states and
    labels as _Chunks (padded under XLA)."""
    rows = tf.shape(h)[0]
    # At least one chunk, empty when there are no rows: every loop then runs, and each part
    # list has an entry to concatenate.
    chunks = tf.maximum((rows + chunk_size - 1) // chunk_size, 1)
    h_chunks = _Chunks(h, rows, chunks, chunk_size, padded=not problem.can_raise)
    return (tf.cast(w_own, problem.compute_dtype), tf.cast(b_own, problem.compute_dtype), rows,
            chunks, h_chunks, h_chunks.like(labels))


def _gradient_accumulators(problem: "_ChunkLoss", chunks, h_chunks: "_Chunks", w: tf.Tensor,
                           b: tf.Tensor):
    """d hidden, d kernel and d bias before any chunk. Summed in place, d hidden and d kernel
    start as empty placeholders that AddInto ignores (so the loop holds no zeros beside the
    sums); otherwise d hidden is a list of the chunks' rows, d kernel zeros."""
    total_dtype = sum_dtype(problem.compute_dtype)
    if problem.sums_in_place:
        dh = tf.zeros([0, 0], problem.compute_dtype)
        dw = tf.zeros([0, 0], total_dtype)
    else:
        dh = _parts(problem.compute_dtype, chunks, h_chunks.row_shape)
        dw = tf.zeros(tf.shape(w), total_dtype)
    return dh, dw, tf.zeros(tf.shape(b), total_dtype)


def _gradient_loop(problem: "_ChunkLoss", chunks, body, loop_vars: tuple, h: tf.Tensor,
                   w: tf.Tensor):
    """Runs `body` over the chunks (at least one), one at a time, with d hidden, d kernel and
    d bias as the last loop variables (see _gradient_accumulators); returns the loop's final
    variables, d hidden as [rows, d] and d kernel with w's shape."""
    invariants = None
    if problem.sums_in_place:  # the placeholders are [0, 0], the sums [rows, d] and [d, V]
        invariants = [tf.TensorShape(tf.convert_to_tensor(v).shape) for v in loop_vars[:-3]]
        invariants += [tf.TensorShape([None, None])] * 2 + [loop_vars[-1].shape]
    out = list(tf.while_loop(lambda i, *_: i < chunks, body, loop_vars,
                             shape_invariants=None if invariants is None else tuple(invariants),
                             parallel_iterations=1))  # one chunk's logits at a time
    if problem.sums_in_place:
        out[-3] = tf.ensure_shape(out[-3], h.shape)
        dw = out[-2] if problem.kernel_blocks == 1 else tf.transpose(out[-2])
        out[-2] = tf.ensure_shape(dw, w.shape)
    else:
        out[-3] = _stacked_rows(out[-3], tf.shape(h)[0])
    return out


def _kernel_gradient_blocks(kernel_shape: tf.TensorShape, chunk_size: int) -> int:
    """How many vocabulary blocks a chunk's d kernel product is made in when summed in place.

    1, the whole product in W's layout, where the chunk has at least d rows: the product is then
    no larger than the chunk's logits, of which the step holds two (logits and gradient) anyway,
    and it needs no copies of the gradient's columns nor a transpose of the sum at the end.
    Else blocks of about KERNEL_BLOCK_BYTES, so that beside the sum the loop holds one block
    rather than a second d x V matrix. 1 also where d or V is not known when tracing."""
    d, v = kernel_shape
    if d is None or v is None or chunk_size >= d:
        return 1
    return int(max(1, min(v, -(-4 * d * v // KERNEL_BLOCK_BYTES))))


def _add_chunk_gradients(problem: "_ChunkLoss", i, h_chunks: "_Chunks", g: tf.Tensor, w: tf.Tensor,
                         dh, dw, db):
    """Chunk i's share of the three gradients, from its d loss / d logits `g`. Summed in place
    in vocabulary blocks, d kernel is kept transposed ([V, d]) so that its blocks are rows, and
    `_gradient_loop` transposes it once at the end; made whole, it has W's layout."""
    hc = h_chunks[i]
    dh_rows = tf.matmul(g, w, transpose_b=True)
    if problem.sums_in_place:
        first = tf.equal(i, 0)
        dh = problem.add_into(dh, dh_rows, first, tf.shape(h_chunks.tensor),
                              row_offset=i * h_chunks.chunk_size)
        blocks = problem.kernel_blocks
        if blocks == 1:
            part = tf.matmul(hc, g, transpose_a=True)
            dw = problem.add_into(dw, tf.cast(part, dw.dtype), first, tf.shape(w))
        else:
            v = tf.shape(w)[1]
            for j in range(blocks):  # rows [start, stop) of d kernel transposed
                start, stop = v * j // blocks, v * (j + 1) // blocks
                # One block at a time: without the dependency the executor would make every
                # block's product at once, as they are all ready.
                with tf.control_dependencies([dw] if j else []):
                    part = tf.matmul(g[:, start:stop], hc, transpose_a=True)
                dw = problem.add_into(dw, tf.cast(part, dw.dtype), first if j == 0 else False,
                                      tf.reverse(tf.shape(w), [0]), row_offset=start)
    else:
        dh = dh.write(i, dh_rows)
        dw += tf.cast(tf.matmul(hc, g, transpose_a=True), dw.dtype)
    db += tf.cast(tf.reduce_sum(g, axis=0), db.dtype)
    return dh, dw, db


def _parts(dtype: tf.DType, chunks, element_shape: tf.TensorShape) -> tf.TensorArray:
    """One entry per chunk (of the chunk's rows, which may differ for the last)."""
    return tf.TensorArray(dtype, size=chunks, element_shape=element_shape,
                          infer_shape=element_shape[0] is not None)


def _stacked_rows(parts: tf.TensorArray, rows) -> tf.Tensor:
    """The chunks' parts as one tensor of `rows` rows, any padding rows dropped."""
    return parts.concat()[:rows]


def _reduced(h2, w_in, b_in, problem: _ChunkLoss, labels, scales, chunk_size, total_dtype):
    @tf.custom_gradient
    def fused(h, w_own, b_own):
        w, b, rows, chunks, h_chunks, y_chunks = _chunked_inputs(problem, h, w_own, b_own, labels,
                                                     chunk_size)
        scale_chunks = h_chunks.like(scales)
        dh0, dw0, db0 = _gradient_accumulators(problem, chunks, h_chunks, w, b)

        def body(i, total, dh, dw, db):
            loss, g = problem.losses_and_scaled_gradient(_logits(h_chunks[i], w, b), y_chunks[i],
                                                         scale_chunks[i])
            total += tf.reduce_sum(loss * scale_chunks[i])
            return (i + 1, total) + _add_chunk_gradients(problem, i, h_chunks, g, w, dh, dw, db)

        _, total, dh, dw, db = _gradient_loop(
            problem, chunks, body, (tf.constant(0), tf.zeros([], total_dtype), dh0, dw0, db0),
            h, w)
        dw = tf.cast(dw, w_own.dtype)
        db = tf.cast(db, b_own.dtype)

        def backward(upstream):
            return _scaled_gradients(upstream, dh, dw, db)

        return total, backward

    return fused(h2, w_in, b_in)


def _unreduced(h2, w_in, b_in, problem: _ChunkLoss, labels, scales, chunk_size, total_dtype):
    del scales

    @tf.custom_gradient
    def per_row(h, w_own, b_own):
        w, b, rows, chunks, h_chunks, y_chunks = _chunked_inputs(problem, h, w_own, b_own, labels,
                                                     chunk_size)
        loss_parts = _parts(total_dtype, chunks, h_chunks.row_shape[:1])
        stats_parts = _parts(total_dtype, chunks, h_chunks.row_shape[:1].concatenate([3]))

        def body(i, loss_parts, stats_parts):
            z = _logits(h_chunks[i], w, b)
            loss, stats = problem.losses_and_row_stats(z, y_chunks[i])
            loss_parts = loss_parts.write(i, tf.cast(loss, total_dtype))
            if stats is None:  # the composed gradient finds its statistics again
                stats = tf.zeros([tf.shape(z)[0], 3], total_dtype)
            return i + 1, loss_parts, stats_parts.write(i, tf.cast(stats, total_dtype))

        _, loss_parts, stats_parts = tf.while_loop(
            lambda i, *_: i < chunks, body, (tf.constant(0), loss_parts, stats_parts),
            parallel_iterations=1)
        losses = _stacked_rows(loss_parts, rows)

        def backward(upstream):
            upstream_chunks = h_chunks.like(tf.cast(upstream, problem.compute_dtype))
            dh0, dw0, db0 = _gradient_accumulators(problem, chunks, h_chunks, w, b)

            def back_body(i, dh, dw, db):
                g = problem.gradient(_logits(h_chunks[i], w, b), y_chunks[i], upstream_chunks[i],
                                     stats_parts.read(i) if problem.native else None)
                return (i + 1,) + _add_chunk_gradients(problem, i, h_chunks, g, w, dh, dw, db)

            _, dh, dw, db = _gradient_loop(
                problem, chunks, back_body, (tf.constant(0), dh0, dw0, db0), h, w)
            return dh, tf.cast(dw, w_own.dtype), tf.cast(db, b_own.dtype)

        return losses, backward

    return per_row(h2, w_in, b_in)
