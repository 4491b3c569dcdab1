"""NumPy-only reference implementation of the CustomLoss definition (the test oracle).

This module is deliberately slow and plain: every quantity is computed in float64, with
the formulas written out as they are derived below, so that the native kernels (CPU,
Metal) can be checked against it. It imports NumPy only; importing it never imports
TensorFlow, and it can be loaded by file path without the rest of the package.

The loss
--------
Logits ``z`` have shape ``[..., C]``; each row (one example) has targets ``t``: either a
sparse class id ``y`` (then ``t = one_hot(y)``) or a dense row ``t`` of length ``C``.
Parameters: ``gamma >= 0``, ``label_smoothing = eps`` in ``[0, 1]``, class weights ``a_c >= 0``
(default 1) and an optional ``ignore_class`` (sparse labels only). Per row::

    q_c   = (1 - eps) t_c + eps / C
    lp_c  = log p_c = log_softmax(z)_c
    w_c   = a_c q_c
    r_c   = 1 - p_c
    loss  = - sum_c w_c r_c^gamma lp_c          (0^0 = 1; terms with w_c == 0 are 0)

Rows whose sparse label equals ``ignore_class`` have loss 0 and gradient 0.

The gradient (derivation)
-------------------------
Write ``L = sum_c f_c(p_c)`` with ``f_c(p) = -w_c (1 - p)^gamma log p``. Then::

    f_c'(p_c) = -w_c [ -gamma (1-p_c)^(gamma-1) lp_c + (1-p_c)^gamma / p_c ]
              =  w_c [ gamma r_c^(gamma-1) lp_c - r_c^gamma / p_c ]

and the softmax Jacobian is ``dp_c/dz_j = p_c (delta_cj - p_j)``. By the chain rule::

    dL/dz_j = sum_c f_c'(p_c) p_c (delta_cj - p_j)
            = sum_c w_c [ gamma p_c r_c^(gamma-1) lp_c - r_c^gamma ] (delta_cj - p_j)
            = -sum_c g_c (delta_cj - p_j)
            = p_j G - g_j

    with  g_c = w_c [ r_c^gamma - gamma p_c r_c^(gamma-1) lp_c ]
              = w_c r_c^gamma ( 1 - gamma p_c (lp_c / r_c) )
    and   G   = sum_c g_c .

Check: gamma = 0 gives ``g_c = w_c`` and ``dL/dz_j = p_j sum_c w_c - w_j``, which for one-hot
``w`` is the familiar ``p - one_hot(y)``. The gradient returned is ``upstream * dL/dz`` where
``upstream`` is the incoming gradient of the row's loss.

Numerics (each handled explicitly below)
----------------------------------------
* ``log_softmax`` is computed as ``(z - m) - log(sum exp(z - m))`` with ``m`` the row maximum,
  clamped below at the lowest finite float so a row with ``-inf`` entries never forms
  ``-inf - (-inf)``. When the maximum is attained (``exp(z_max - m) == 1``) the sum is
  ``1 + s`` with ``s`` the other classes' share, and ``log1p(s)`` keeps ``lp`` of a confident
  class accurate instead of rounding it to 0.
* ``r_c = -expm1(lp_c)``: no cancellation when ``p_c`` is close to 1.
* ``lp_c / r_c -> -1`` as ``r_c -> 0`` (because ``log(1 - r) = -r + O(r^2)``); we use -1 when
  ``r_c == 0``. So for ``gamma < 1`` the term ``gamma p r^(gamma-1) lp = gamma p (lp/r) r^gamma``
  stays finite and tends to 0: the gradient is finite at ``p_c = 1`` (including ``C = 1``).
* ``p_c == 0`` (a ``-inf`` logit, or an underflowed probability): ``p_c lp_c / r_c`` is taken as
  its limit 0, never ``0 * -inf``.
* ``0^0 = 1`` (``gamma = 0`` with ``r_c = 0``); NumPy's ``0.0 ** 0.0`` already is 1.
* A NaN anywhere in a row's logits makes that row's loss and gradient NaN and touches no other
  row (everything is computed row-wise). A row of only ``-inf`` logits has no defined softmax
  and comes out NaN as well.
* Unlike Keras's composed focal loss, ``p`` is not clipped to ``[1e-7, 1 - 1e-7]``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["custom_loss", "custom_loss_grad"]


# --------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------

def _is_float_dtype(dtype: np.dtype) -> bool:
    """True for NumPy floats and for ml_dtypes floats such as bfloat16 (whose kind is 'V')."""
    if dtype.kind == "f":
        return True
    return dtype.kind == "V" and dtype.name.startswith(("bfloat", "float"))


def _check_params(gamma: float, label_smoothing: float) -> Tuple[float, float]:
    gamma = float(gamma)
    eps = float(label_smoothing)
    if np.isnan(gamma) or gamma < 0:
        raise ValueError(f"gamma must be >= 0 and not NaN; got gamma={gamma!r}")
    if np.isnan(eps) or not 0.0 <= eps <= 1.0:
        raise ValueError(
            f"label_smoothing must be in [0, 1]; got label_smoothing={eps!r}")
    return gamma, eps


def _as_logits(logits: Any) -> np.ndarray:
    z = np.asarray(logits)
    if not _is_float_dtype(z.dtype):
        raise TypeError(f"logits must be floating point; got dtype {z.dtype}")
    if z.ndim == 0:
        raise ValueError("logits must have rank >= 1 (shape [..., C]); got a scalar, shape ()")
    if z.shape[-1] == 0:
        raise ValueError(f"logits must have at least one class (C >= 1); got shape {z.shape}")
    return z.astype(np.float64)


def _class_weights(class_weights: Any, num_classes: int) -> np.ndarray:
    if class_weights is None:
        return np.ones(num_classes, dtype=np.float64)
    a = np.asarray(class_weights, dtype=np.float64)
    if a.shape != (num_classes,):
        raise ValueError(
            f"class_weights must have shape ({num_classes},) to match logits' last "
            f"dimension C={num_classes}; got shape {a.shape}")
    bad = np.isnan(a) | (a < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"class_weights must be >= 0 and not NaN; got class_weights[{i}]={float(a[i])!r}")
    return a


def _label_at(flat_index: int, batch_shape: Tuple[int, ...]) -> str:
    """'labels[1, 2]': the multi-index of a flat example index, for messages."""
    index = np.unravel_index(flat_index, batch_shape) if batch_shape else ()
    return "labels[" + ", ".join(str(int(k)) for k in index) + "]"


def _targets(labels: Any, logits_shape: Tuple[int, ...], eps: float,
             ignore_class: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Returns (q, ignored): smoothed targets [N, C] and a mask [N] of ignored rows.

    Label format rules (docs/loss.md, "Labels"): labels with shape == logits.shape are dense
    targets, float or integer, except integer labels beside one class (shape [..., 1]), which
    are class ids; any other labels are class ids (integers, or floats holding whole numbers)
    of shape logits.shape[:-1], optionally with a trailing 1.
    """
    y = np.asarray(labels)
    num_classes = logits_shape[-1]
    batch_shape = logits_shape[:-1]
    n = int(np.prod(batch_shape, dtype=np.int64))

    if y.dtype.kind == "b" or not (y.dtype.kind in "iu" or _is_float_dtype(y.dtype)):
        raise TypeError(f"labels must be integer or floating point; got dtype {y.dtype}")

    integer = y.dtype.kind in "iu"
    if y.shape == tuple(logits_shape) and not (integer and num_classes == 1):
        # Dense targets (one-hot or probabilities).
        if ignore_class is not None:
            raise ValueError(
                "ignore_class applies to sparse labels only; got dense labels of shape "
                f"{y.shape} with ignore_class={ignore_class!r}")
        t = y.astype(np.float64).reshape(n, num_classes)
        q = (1.0 - eps) * t + eps / num_classes
        return q, np.zeros(n, dtype=bool)

    # Sparse class ids.
    if y.shape == tuple(batch_shape) + (1,):
        y = y.reshape(batch_shape)
    if y.shape != tuple(batch_shape):
        raise ValueError(
            f"labels shape {y.shape} does not match logits shape {tuple(logits_shape)}: "
            f"sparse labels need shape {tuple(batch_shape)} (or with a trailing 1), dense "
            f"labels shape {tuple(logits_shape)}")
    flat = y.reshape(n)
    if _is_float_dtype(y.dtype):
        values = flat.astype(np.float64)
        not_whole = ~np.isfinite(values) | (values != np.round(values))
        if not_whole.any():
            i = int(np.flatnonzero(not_whole)[0])
            raise ValueError(
                f"float labels must hold whole class ids; {_label_at(i, batch_shape)} "
                f"(example {i}) = {float(values[i])!r}")
        ids = values.astype(np.int64)
    else:
        ids = flat.astype(np.int64)

    if ignore_class is not None:
        ignored = ids == int(ignore_class)
    else:
        ignored = np.zeros(n, dtype=bool)
    out_of_range = ((ids < 0) | (ids >= num_classes)) & ~ignored
    if out_of_range.any():
        i = int(np.flatnonzero(out_of_range)[0])
        raise ValueError(
            f"label out of range: {_label_at(i, batch_shape)} (example {i}) = {int(ids[i])} "
            f"is not in [0, {num_classes})")

    t = np.zeros((n, num_classes), dtype=np.float64)
    rows = np.flatnonzero(~ignored)
    t[rows, ids[rows]] = 1.0
    q = (1.0 - eps) * t + eps / num_classes
    return q, ignored


# --------------------------------------------------------------------------------------
# The math, row-wise on [N, C] float64 arrays
# --------------------------------------------------------------------------------------

def _log_softmax(z: np.ndarray) -> np.ndarray:
    """Stable log-softmax of each row of z [N, C] (see "Numerics" in the module doc)."""
    n, c = z.shape
    if n == 0:
        return z.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        lowest = np.finfo(np.float64).min
        m = np.maximum(np.max(z, axis=1), lowest)           # NaN propagates; -inf does not
        shifted = z - m[:, None]                             # <= 0, or NaN
        e = np.exp(shifted)
        top = np.argmax(shifted, axis=1)
        e_top = e[np.arange(n), top]
        # The other classes' share, summed without the top element so it is not rounded
        # into the 1 that the top element contributes.
        mask = np.ones_like(e, dtype=bool)
        mask[np.arange(n), top] = False
        others = np.where(mask, e, 0.0).sum(axis=1)
        lse = np.where(e_top == 1.0, np.log1p(others), np.log(e_top + others))
        return shifted - lse[:, None]


def _prepare(labels, logits, gamma, label_smoothing, class_weights, ignore_class):
    gamma, eps = _check_params(gamma, label_smoothing)
    z = _as_logits(logits)
    shape = z.shape
    num_classes = shape[-1]
    a = _class_weights(class_weights, num_classes)
    q, ignored = _targets(labels, shape, eps, ignore_class)
    w = a[None, :] * q                                       # w_c = a_c q_c, [N, C]
    lp = _log_softmax(z.reshape(-1, num_classes))
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lp)
        r = -np.expm1(lp)                                    # 1 - p without cancellation
    return shape, gamma, w, lp, p, r, ignored


def custom_loss(labels: Any, logits: Any, *, gamma: float = 0.0,
                label_smoothing: float = 0.0, class_weights: Any = None,
                ignore_class: Optional[int] = None) -> np.ndarray:
    """Per-example CustomLoss in float64 (the definition in the module docstring).

    Args:
        labels: sparse class ids (integer dtype, or float holding whole numbers) of shape
            `logits.shape[:-1]` (a trailing 1 is allowed), or dense targets of shape
            `logits.shape` (floats, or integers beside more than one class).
        logits: float array of shape `[..., C]`, C >= 1 (any float dtype; used as float64).
        gamma: focal exponent, >= 0.
        label_smoothing: eps in [0, 1].
        class_weights: None (all ones) or C non-negative weights.
        ignore_class: sparse label whose rows get loss 0 (may lie outside [0, C)).

    Returns:
        float64 array of shape `logits.shape[:-1]`.

    Raises:
        ValueError: bad shapes, parameters, or a sparse label outside [0, C) (the message
            names the example index and the value).
        TypeError: non-float logits or non-numeric labels.
    """
    shape, gamma, w, lp, p, r, ignored = _prepare(
        labels, logits, gamma, label_smoothing, class_weights, ignore_class)
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.where(w == 0.0, 0.0, w * r ** gamma * lp)  # w == 0 terms are 0 even at lp=-inf
        loss = -terms.sum(axis=1) + 0.0                     # + 0.0 turns -0.0 into 0.0
    loss = np.where(ignored, 0.0, loss)
    return loss.reshape(shape[:-1])


def custom_loss_grad(labels: Any, logits: Any, *, gamma: float = 0.0,
                     label_smoothing: float = 0.0, class_weights: Any = None,
                     ignore_class: Optional[int] = None, upstream: Any = None) -> np.ndarray:
    """Gradient of `custom_loss` with respect to the logits, times `upstream`, in float64.

    Args:
        labels, logits, gamma, label_smoothing, class_weights, ignore_class: as for
            `custom_loss`.
        upstream: the incoming gradient of each example's loss, broadcastable to
            `logits.shape[:-1]`; default all ones.

    Returns:
        float64 array of shape `logits.shape`: `upstream[..., None] * (p * G - g)` (see the
        derivation in the module docstring); exactly 0 on ignored rows.
    """
    shape, gamma, w, lp, p, r, ignored = _prepare(
        labels, logits, gamma, label_smoothing, class_weights, ignore_class)
    batch_shape = shape[:-1]
    if upstream is None:
        u = np.ones(batch_shape, dtype=np.float64)
    else:
        u = np.broadcast_to(np.asarray(upstream, dtype=np.float64), batch_shape)
    u = u.reshape(-1)

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # lp / r, with its limit -1 where r == 0 (p == 1).
        ratio = np.where(r == 0.0, -1.0, lp / np.where(r == 0.0, 1.0, r))
        # p * lp / r, with its limit 0 where p == 0 (lp = -inf or underflow).
        p_ratio = np.where(p == 0.0, 0.0, p * ratio)
        g = np.where(w == 0.0, 0.0, w * r ** gamma * (1.0 - gamma * p_ratio))
        big_g = g.sum(axis=1)
        grad = (p * big_g[:, None] - g) * u[:, None]
    grad = np.where(ignored[:, None], 0.0, grad)
    return grad.reshape(shape)
