"""The two raw ops with their optional inputs defaulted to "none", for tests that call them
directly (csrc/problem.h describes every input)."""

from __future__ import annotations

from typing import Tuple

import numpy as np
import tensorflow as tf

from tf_metal_ops import _native

OPS = _native.op_module()
NO_WEIGHTS = tf.zeros([0], tf.float32)
NO_STATS = tf.zeros([0, 3], tf.float32)
NO_SCALES = tf.zeros([0], tf.float32)  # no row_scales: per-example losses, no scaled gradient


def forward(logits, labels, class_weights=NO_WEIGHTS, row_scales=NO_SCALES,
            **attrs) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The forward op: (loss, row_stats, scaled_gradient)."""
    return OPS.tf_metal_ops_custom_loss(logits=logits, labels=labels,
                                        class_weights=class_weights, row_scales=row_scales,
                                        **attrs)


def gradient(logits, labels, class_weights, upstream, row_stats=NO_STATS, **attrs) -> tf.Tensor:
    """The gradient op."""
    return OPS.tf_metal_ops_custom_loss_grad(
        logits=logits, labels=labels, class_weights=class_weights, upstream=upstream,
        row_stats=row_stats, **attrs)


def awkward_logits(rows: int, classes: int, seed: int) -> np.ndarray:
    """Normal logits (scale 5) with the rows that test the edge cases: every class tied at the
    maximum, a confident row, a masked (-inf) class, a NaN logit."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, classes)) * 5
    z[0, :] = 0.0
    if classes > 1:
        z[1, 0] = 60.0
        z[2, -1] = -np.inf
    z[3, 0] = np.nan
    return z


def awkward_inputs(dtype, classes: int, label_kind: str, rows: int = 19):
    """(logits, labels) of `awkward_logits`: class ids row % classes ("int32", "int64") or
    random dense targets ("dense")."""
    z = tf.cast(tf.constant(awkward_logits(rows, classes, seed=classes)), dtype)
    if label_kind == "dense":
        targets = np.random.default_rng(rows).dirichlet(np.ones(classes), size=rows)
        return z, tf.cast(tf.constant(targets), dtype)
    ids = np.arange(rows) % classes
    return z, tf.constant(ids, tf.int32 if label_kind == "int32" else tf.int64)

