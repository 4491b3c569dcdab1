"""The loss written with TensorFlow ops: what `custom_loss` runs where the native op cannot.

Inside an XLA compilation (`jit_compile=True`) and on a device with no kernel of ours (a CUDA
GPU, a TPU; see `tf_metal_ops.loss_path`), `custom_loss` builds this instead of the native op,
as MLX's fast ops pair a fused kernel with a composed fallback of the same function. The
formulas and the numerics are the native kernels' (kernels/custom_loss_math.h derives them):

    log p = (z - m) - log_sum                stable; m the row maximum, started at the lowest
                                             finite value; log_sum = log1p(others + ties - 1)
                                             keeps the digits of a confident row
    r     = 1 - p = -expm1(log p)            no cancellation near p = 1
    loss  = - sum_c w_c r_c^gamma log p_c    w_c = a_c q_c; terms with w_c = 0 are 0, also at a
                                             masked (-inf) class; no clipping of p
    d loss / d z_j = p_j G - g_j,  g_c = w_c r_c^gamma (1 - gamma p_c log p_c / r_c)

(for a sparse, unsmoothed row, whose only weighted class is the label y: p_j g_y off the label
and expm1(log p_y) g_y on it, without the cancellation of p_y G - g_y), with the limits
p log p / r -> 0 at p = 0 and log p / r -> -1 at p = 1, so the gradient is finite
at p = 1 also for gamma < 1, where autodiff of the composition would give NaN: the gradient is
this analytic one (`tf.custom_gradient`), computed from the logits and the forward's row
statistics (under XLA also from its exp(z - m), as the native kernels reuse it). float16 and
bfloat16 are computed in float32 and cast back; float64 in float64.
gamma and label_smoothing are rounded to float32 first, as the native op's float attributes
are, so both paths compute with the same parameters.

Bad labels (a class id outside `[0, C)` that is not `ignore_class`, a float label that is not a
whole number): where TensorFlow can raise (eager, or a graph not compiled by XLA) the call
raises `InvalidArgumentError` naming the example and the value, as the native op does. An XLA
program cannot raise, so there the bad example's loss and gradient row are NaN, and no other
row changes. Class weights known only at run time that are negative or NaN make every row NaN
under XLA (they are no one row's fault) and raise elsewhere.

A reduced CustomLoss on this path is the sum of these losses times Keras's per-example weights,
differentiated through their analytic gradient: no gradient is made in a forward op here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_metal_ops.loss_inputs import LossInputs, report_bad_label, sum_dtype


# Rows up to this many classes take their sums in one stacked reduction (see _row_log_softmax).
_SHORT_ROW = 256


def _short_rows(z: tf.Tensor) -> bool:
    return z.shape[-1] is not None and z.shape[-1] <= _SHORT_ROW


class _RowSoftmax(NamedTuple):
    """One row's softmax statistics: log p = (z - m) - log_sum, p = e * inv_sum."""
    m: tf.Tensor
    log_sum: tf.Tensor
    inv_sum: tf.Tensor      # 1 / (others + ties), NaN on the `nan_rows`
    others_terms: tf.Tensor  # N x C: exp(z - m) off the ties, z - m on them
    tie: tf.Tensor           # N x C: z == m
    shifted_sum: Optional[tf.Tensor]  # S = sum_c w_c (z - m), with `with_shifted_sum`

    def probabilities(self) -> tf.Tensor:
        """p = e * inv_sum, e = exp(z - m) taken from the share's terms (1 at the ties): XLA
        then writes one N x C tensor for both, where e and the terms apart were two."""
        e = tf.where(self.tie, tf.ones_like(self.others_terms), self.others_terms)
        return e * self.inv_sum[..., None]


def _row_log_softmax(z: tf.Tensor, shift_weights: Optional[tf.Tensor] = None,
                     with_shifted_sum: bool = False,
                     nan_rows: Optional[tf.Tensor] = None,
                     ties_first: bool = False) -> _RowSoftmax:
    """The row statistics of `z` (kernels/custom_loss_math.h); with `with_shifted_sum` also
    S = sum_c w_c (z - m) (w_c the `shift_weights`, broadcast against z, or 1; a term of weight
    0 is 0, also at z = -inf). log_sum and inv_sum are NaN where `nan_rows` (a mask of the rows,
    or a scalar) is True, so every log p and p of such a row is NaN. `ties_first`: long rows
    sum their tie count before they write exp(z - m) (see the caller)."""
    lowest = np.finfo(z.dtype.as_numpy_dtype).min
    # Started at the lowest finite value, so a row of -inf logits never forms -inf - (-inf).
    m = tf.maximum(tf.reduce_max(z, axis=-1), lowest)
    shifted = z - m[..., None]
    tie = tf.equal(z, m[..., None])
    # Each logit equal to m contributes exactly 1: kept out of the float sum so the other
    # classes' small share keeps its digits. A NaN logit is no tie and makes the sum NaN. In
    # the float sum a tie adds z - m: 0, or NaN for a +inf logit (inf - inf), which makes the
    # whole row NaN as in the native op (the softmax is inf / inf). The tie count is summed as
    # floats selected by the test, not as the test cast to float: XLA (TensorFlow 2.21) sums a
    # float tensor with its fast row reduction (YNNPACK's), a cast predicate in slower windows.
    tie_terms = tf.where(tie, tf.ones_like(z), tf.zeros_like(z))
    shift_terms = None
    if with_shifted_sum:
        shift_terms = shifted if shift_weights is None else _not_zero(shift_weights, shifted)
    if _short_rows(z):
        # Short rows: one reduction over the stacked terms, which XLA compiles as one loop
        # reading the row once for all the sums.
        others_terms = tf.where(tie, shifted, tf.exp(shifted))
        parts = [others_terms, tie_terms] + ([shift_terms] if with_shifted_sum else [])
        sums = tf.unstack(tf.reduce_sum(tf.stack(parts), axis=-1))
    else:
        # Long rows: one reduction per sum. Stacked, or as the two parts of one complex sum,
        # XLA writes the terms out whole (2 or 3 x N x C, fresh pages on every step where
        # TensorFlow's allocator does not cache) and sums them in windows, slower than
        # separate row sums (docs/performance.md, "Under XLA").
        ties = tf.reduce_sum(tie_terms, axis=-1)
        exp_of = shifted
        if ties_first:
            # m through a test of the tie count that always holds (a count is never
            # negative): XLA then sums the tie terms before it writes the exponentials, which
            # take the tie terms' buffer instead of one of their own.
            m_of_e = tf.where(ties >= 0, m, tf.constant(np.nan, z.dtype))
            exp_of = z - m_of_e[..., None]
        others_terms = tf.where(tie, shifted, tf.exp(exp_of))
        sums = [tf.reduce_sum(others_terms, axis=-1), ties]
        if with_shifted_sum:
            sums.append(tf.reduce_sum(shift_terms, axis=-1))
    others, ties = sums[0], sums[1]
    # No tie (ties = 0) only in a row of -inf logits, where others = 0 and log1p(-1) = -inf =
    # log(0), or in a row with a NaN, where others is NaN: one log1p serves every row. Under
    # XLA every cheap per-row operation after it would be fused into the N x C consumers and
    # recomputed per element; the row's NaN mask is applied before it, once per row.
    shares = others + (ties - 1)
    inv_sum = 1.0 / (others + ties)  # as the native kernels round it
    if nan_rows is not None:
        nan = tf.constant(np.nan, z.dtype)
        shares = tf.where(nan_rows, nan, shares)
        inv_sum = tf.where(nan_rows, nan, inv_sum)
    log_sum = tf.math.log1p(shares)
    return _RowSoftmax(m, log_sum, inv_sum, others_terms, tie,
                       sums[2] if with_shifted_sum else None)


def _focal_factors(lp: tf.Tensor, gamma: float) -> tuple[tf.Tensor, tf.Tensor]:
    """(r^gamma lp, r^gamma (1 - gamma p lp / r)): the loss term and g_c / w_c."""
    if gamma == 0.0:
        return lp, tf.ones_like(lp)
    p = tf.exp(lp)
    r = -tf.math.expm1(lp)
    r_pow = tf.pow(r, gamma)  # pow(0, gamma > 0) = 0
    safe_r = tf.where(r == 0, tf.ones_like(r), r)
    # The limits: p lp / r -> 0 at p = 0 (lp may be -inf), lp / r -> -1 at r = 0.
    p_lp_over_r = tf.where(p == 0, tf.zeros_like(p), tf.where(r == 0, -p, p * lp / safe_r))
    return r_pow * lp, r_pow * (1.0 - gamma * p_lp_over_r)


def _not_zero(w: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """w * values, with 0 where w is 0 (a masked class that carries no weight adds nothing,
    not 0 * -inf)."""
    return tf.where(w == 0, tf.zeros_like(values), w * values)


def _class_ids(labels: tf.Tensor, logits: tf.Tensor, ignore_class: Optional[int],
               can_raise: bool) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(ids, ignored, bad) for sparse labels, each of the rows' shape.

    `bad` marks class ids outside [0, C) that are not ignore_class and float labels that are not
    whole numbers. With `can_raise` a bad label raises InvalidArgumentError (eagerly, or through
    an assertion in the graph) naming the example and the value.
    """
    shape = tf.shape(logits)
    row_shape, num_classes = shape[:-1], shape[-1]
    if labels.shape.rank is not None and labels.shape.rank == logits.shape.rank:
        labels = tf.squeeze(labels, axis=-1)  # the trailing 1 Keras passes (checked before)
    if can_raise and not labels.shape.is_fully_defined():
        tf.debugging.assert_equal(
            tf.shape(labels, out_type=row_shape.dtype), row_shape,
            message="custom_loss: sparse labels must have shape logits.shape[:-1] (optionally "
                    "with a trailing 1)")
    labels = tf.reshape(labels, row_shape)
    ids = tf.cast(labels, tf.int64)
    whole = None
    if labels.dtype.is_floating:
        # NaN, infinities and fractions fail this (a huge value casts to an unrelated integer).
        whole = tf.equal(tf.cast(ids, labels.dtype), labels)
    if ignore_class is None:
        ignored = tf.zeros_like(ids, dtype=tf.bool)
    else:
        ignored = tf.equal(ids, ignore_class)
        if whole is not None:
            ignored = tf.logical_and(ignored, whole)
    in_range = tf.logical_and(ids >= 0, ids < tf.cast(num_classes, tf.int64))
    bad = tf.logical_not(tf.logical_or(in_range, ignored))
    if whole is not None:
        bad = tf.logical_or(bad, tf.logical_not(whole))
    if can_raise:
        _raise_on_bad_labels(labels, bad, num_classes, ignore_class)
    return ids, ignored, bad


def _raise_on_bad_labels(labels: tf.Tensor, bad: tf.Tensor, num_classes: tf.Tensor,
                         ignore_class: Optional[int]) -> None:
    also = "" if ignore_class is None else f" nor ignore_class ({ignore_class})"
    report_bad_label(labels, bad, "custom_loss",
                     ["is not a class id in [0, ", num_classes, f"){also}"])


def _weights_ok(class_weights: tf.Tensor, num_classes: tf.Tensor, can_raise: bool) -> tf.Tensor:
    """True when the run-time class weights are finite and >= 0 (raises instead, where it can)."""
    ok = tf.reduce_all(tf.logical_and(tf.math.is_finite(class_weights), class_weights >= 0))
    if can_raise:
        tf.debugging.assert_equal(tf.size(class_weights, out_type=num_classes.dtype),
                                  num_classes,
                                  message="custom_loss: class_weights must have one entry per "
                                          "class")
        tf.debugging.Assert(ok, ["custom_loss: class_weights must be finite numbers >= 0, got",
                                 class_weights])
    return ok


def custom_loss(
    logits: tf.Tensor,
    labels: tf.Tensor,
    *,
    dense: bool,
    class_weights: Optional[tf.Tensor] = None,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
    ignore_class: Optional[int] = None,
    can_raise: bool = True,
) -> tf.Tensor:
    """The per-example loss of `tf_metal_ops.custom_loss`, composed of TensorFlow ops.

    Called by `tf_metal_ops.custom_loss` after its argument checks; see the module docstring.

    Args:
        logits: `[..., C]`, float16, bfloat16, float32 or float64.
        labels: class ids of shape `logits.shape[:-1]` (or with a trailing 1; integers, or
            floats holding whole numbers) when `dense` is False, else targets of the logits'
            shape.
        dense: whether `labels` are dense targets.
        class_weights: optional float vector of `C` weights, or None for ones.
        gamma: focusing parameter, `>= 0` (already checked).
        label_smoothing: in `[0, 1]` (already checked).
        ignore_class: optional class id whose examples get loss 0 and gradient 0.
        can_raise: whether bad labels may raise `InvalidArgumentError` (False inside XLA, where
            they give NaN rows instead).

    Returns:
        The per-example loss, shape `logits.shape[:-1]`, dtype of `logits`; differentiable with
        respect to `logits` by the analytic gradient.
    """
    acc = sum_dtype(logits.dtype)
    # The native op receives both as float32 attributes; the same rounding here.
    gamma = float(np.float32(gamma))
    eps = float(np.float32(label_smoothing))
    shape = tf.shape(logits)
    num_classes = shape[-1]

    ignored = bad = None
    weights_ok = weights = None
    if class_weights is not None:
        weights = tf.cast(class_weights, tf.float32)
        weights_ok = _weights_ok(weights, num_classes, can_raise)
        weights = tf.cast(weights, acc)
    # A sparse, unsmoothed row has one weighted class y: w_y = a_y, everything else 0. Its
    # gradient is then p_j g_y off the label and -r_y g_y = expm1(log p_y) g_y on it, as the
    # native kernel computes it: p_y G - g_y would cancel the digits of a confident row.
    labelled_only = not dense and eps == 0.0
    in_xla = not can_raise  # only an XLA program cannot raise
    is_label = w_y = w = None
    if dense:
        if can_raise and not (labels.shape.is_fully_defined() and logits.shape.is_fully_defined()):
            tf.debugging.assert_equal(tf.shape(labels), shape,
                                      message="custom_loss: dense labels must have the logits' "
                                              "shape")
        w = tf.cast(labels, acc)
    else:
        ids, ignored, bad = _class_ids(labels, logits, ignore_class, can_raise)
        # A clipped id (TensorFlow's CPU gather refuses one out of range), in the classes' int32:
        # the comparison with every class is then half as wide as with int64 ids. A bad or
        # ignored row's clipped id names some class, but its loss and gradient are NaN (bad)
        # or 0 (ignored) whatever that class is.
        safe_ids = tf.cast(tf.clip_by_value(ids, 0, tf.cast(num_classes - 1, tf.int64)),
                           num_classes.dtype)
        # Compared unclipped: a bad row's id may match any class or none (its row is NaN
        # anyway, through its log_sum), and XLA then compares each class with the label alone,
        # without clipping it again for every element.
        is_label = tf.equal(tf.range(num_classes), tf.cast(ids, num_classes.dtype)[..., None])
        w_y = tf.ones_like(ids, dtype=acc) if weights is None else tf.gather(weights, safe_ids)
        if not labelled_only:
            w = tf.cast(is_label, acc)
    if w is not None:
        # q = (1 - eps) t + eps / C, then w = a q.
        if eps != 0.0:
            w = (1.0 - eps) * w + eps / tf.cast(num_classes, acc)
        if weights is not None:
            w = w * weights

    # Rows whose loss and gradient are NaN: bad labels, and all of them for bad run-time
    # weights. Folded into log_sum (`_row_log_softmax`), which makes every log p of the row NaN
    # and so every gradient element: no per-element test in the gradient.
    nan_rows = bad
    if weights_ok is not None:
        nan_rows = (tf.logical_not(weights_ok) if nan_rows is None
                    else tf.logical_or(nan_rows, tf.logical_not(weights_ok)))

    def finish(values: tf.Tensor, row_axis_extra: bool) -> tf.Tensor:
        """0 on ignored rows; for the per-row loss also NaN on the `nan_rows` (a row's loss
        can be 0 by its weights alone, whatever its log_sum)."""
        if row_axis_extra:
            if ignored is not None:
                values = tf.where(ignored[..., None], tf.zeros_like(values), values)
            return values
        if ignored is not None:
            values = tf.where(ignored, tf.zeros_like(values), values)
        if nan_rows is not None:
            nan = tf.fill(tf.shape(values), tf.constant(np.nan, values.dtype))
            values = tf.where(nan_rows, nan, values)
        return values

    def log_p(logits_in: tf.Tensor, m: tf.Tensor, log_sum: tf.Tensor) -> tf.Tensor:
        return (tf.cast(logits_in, acc) - m[..., None]) - log_sum[..., None]

    def at_label(values: tf.Tensor) -> tf.Tensor:
        """values[..., y] per row: a gather, not a pass over every class, where the rank is
        known."""
        rank = safe_ids.shape.rank
        if rank is not None:
            return tf.gather(values, safe_ids[..., None], batch_dims=rank)[..., 0]
        return tf.reduce_sum(tf.where(is_label, values, tf.zeros_like(values)), axis=-1)

    def total_weight() -> tf.Tensor:
        """G = sum_c w_c of a cross-entropy row (gamma = 0), per row without a pass over the
        classes for class ids: (1 - eps) a_y + eps / C sum_c a_c."""
        if dense:
            return tf.reduce_sum(w, axis=-1, keepdims=True)
        share = tf.cast(num_classes, acc) if weights is None else tf.reduce_sum(weights)
        return ((1.0 - eps) * w_y + eps / tf.cast(num_classes, acc) * share)[..., None]

    # 16-bit logits under XLA: z is a float32 copy, which XLA writes out as an N x C temporary
    # beside exp(z - m) and the tie terms. With the tie count summed first, the exponentials take
    # the tie terms' buffer: one N x C temporary fewer, fresh pages on every step where
    # TensorFlow's allocator does not cache (docs/performance.md, "Under XLA"). Float32 logits
    # have as many temporaries either way, and the order only takes away XLA's concurrency;
    # outside XLA each op has a buffer of its own whatever the order.
    ties_first = in_xla and logits.dtype != acc

    @tf.custom_gradient
    def loss_of(logits_in: tf.Tensor):
        z = tf.cast(logits_in, acc)
        if labelled_only:
            sm = _row_log_softmax(z, nan_rows=nan_rows, ties_first=ties_first)
            m, log_sum = sm.m, sm.log_sum
            lp_y = (tf.cast(at_label(logits_in), acc) - m) - log_sum
            loss_factor, _ = _focal_factors(lp_y, gamma)
            loss = -_not_zero(w_y, loss_factor)
        elif gamma == 0.0 and _short_rows(z):
            # loss = W log_sum - S: no N x C term per class, only per-row sums, all of them
            # in the log-softmax's one reduction. (A long row's sums are separate reductions,
            # and there the classes' terms summed in one more reduction cost XLA less than a
            # fourth sum S.)
            # Sparse labels: the sum over the classes is S_a = sum_c a_c (z_c - m).
            sm = _row_log_softmax(z, shift_weights=w if dense else weights,
                                  with_shifted_sum=True, nan_rows=nan_rows)
            m, log_sum, shifted = sm.m, sm.log_sum, sm.shifted_sum
            total = total_weight()
            if not dense:
                # S = (1 - eps) a_y (z_y - m) + (eps / C) S_a; the label's term is 0 where
                # it carries no weight (also at a masked label).
                label_term = _not_zero((1.0 - eps) * w_y,
                                       tf.cast(at_label(logits_in), acc) - m)
                shifted = label_term + eps / tf.cast(num_classes, acc) * shifted
            loss = tf.where(total[..., 0] == 0, tf.zeros_like(log_sum),
                            total[..., 0] * log_sum - shifted)
        else:
            sm = _row_log_softmax(z, nan_rows=nan_rows, ties_first=ties_first)
            m, log_sum = sm.m, sm.log_sum
            total = total_weight() if gamma == 0.0 else None
            loss_factor, _ = _focal_factors(log_p(logits_in, m, log_sum), gamma)
            loss = -tf.reduce_sum(_not_zero(w, loss_factor), axis=-1)
        loss = finish(loss + 0.0, row_axis_extra=False)  # + 0.0: no -0.0

        def probabilities(lp: tf.Tensor) -> tf.Tensor:
            """p: for long rows inside XLA, whose one program holds the forward and the
            gradient, from the forward's e = exp(z - m) times 1 / sum, as the native kernels
            take it (one exponential per element, not two); elsewhere exp(log p), so that no
            N x C tensor of the forward stays alive until the gradient runs. Short rows
            recompute it under XLA too: their sums read the row in one loop that writes no e,
            and the exponential in the gradient's loop costs less than writing and reading one
            (docs/performance.md, "Under XLA")."""
            if in_xla and not _short_rows(z):
                return sm.probabilities()
            return tf.exp(lp)

        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            # From the logits and the row statistics, as the native gradient op does.
            lp = log_p(logits_in, m, log_sum)
            if labelled_only:
                lp_y = (tf.cast(at_label(logits_in), acc) - m) - log_sum
                _, grad_factor = _focal_factors(lp_y, gamma)
                g_y = _not_zero(w_y, grad_factor)
                # expm1 once per row: tf.where would evaluate both branches on every class.
                grad = tf.where(is_label, (g_y * tf.math.expm1(lp_y))[..., None],
                                g_y[..., None] * probabilities(lp))
            elif gamma == 0.0:
                grad = probabilities(lp) * total - w  # g_c = w_c
            else:
                _, grad_factor = _focal_factors(lp, gamma)
                g = _not_zero(w, grad_factor)
                grad = probabilities(lp) * tf.reduce_sum(g, axis=-1, keepdims=True) - g
            grad = grad * tf.cast(upstream, acc)[..., None]
            return tf.cast(finish(grad, row_axis_extra=True), logits_in.dtype)

        return tf.cast(loss, logits_in.dtype), gradient

    return loss_of(logits)


def losses(logits: tf.Tensor, inputs: LossInputs) -> tf.Tensor:
    """`custom_loss` for inputs that `tf_metal_ops.loss_inputs.prepare` checked."""
    options = inputs.options
    return custom_loss(
        logits, inputs.labels, dense=inputs.dense,
        class_weights=inputs.class_weights if inputs.weighted else None,
        gamma=options.gamma, label_smoothing=options.label_smoothing,
        ignore_class=options.ignore_class, can_raise=inputs.can_raise)
