"""`CustomLoss`: the Keras face of `custom_loss`."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_metal_ops.ops import (
    check_class_weights_values,
    check_gamma,
    check_ignore_class,
    check_label_smoothing,
    custom_loss,
)

# Whether a gradient tape records (TensorFlow's own test, private: where it moved or vanished,
# CustomLoss assumes no tape and never asks for an early gradient, which is only slower).
try:  # TensorFlow 2.13 and later
    from tensorflow.python.eager.record import could_possibly_record as _tape_may_record
except ImportError:  # pragma: no cover - older layouts
    try:
        from tensorflow.python.eager.tape import could_possibly_record as _tape_may_record
    except ImportError:

        def _tape_may_record() -> bool:
            return False


try:  # Keras >= 3.6 keeps tensor attributes in its own table
    from keras.src.backend.common.masking import get_keras_mask as _get_keras_mask
    from keras.src.backend.common.masking import set_keras_mask as _set_keras_mask
except ImportError:  # older Keras 3 reads the attribute straight off the tensor

    def _get_keras_mask(tensor: Any) -> Any:
        return getattr(tensor, "_keras_mask", None)

    def _set_keras_mask(tensor: tf.Tensor, mask: tf.Tensor) -> None:
        tensor._keras_mask = mask


def _require_tensorflow_backend() -> None:
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"tf_metal_ops.CustomLoss runs as a TensorFlow op and needs the TensorFlow Keras "
            f"backend, but KERAS_BACKEND is '{backend}': set KERAS_BACKEND=tensorflow."
        )


# Switch for the early gradient (csrc/problem.h): "0" turns it off, for comparisons.
EARLY_GRADIENT_ENV = "TF_METAL_OPS_EARLY_GRADIENT"


def early_gradients_enabled() -> bool:
    """False when TF_METAL_OPS_EARLY_GRADIENT=0 is in the environment (read at each call)."""
    return os.environ.get(EARLY_GRADIENT_ENV, "1") != "0"


# Reductions whose upstream gradient per example is known before the loss is computed, as Keras
# computes it (keras/src/losses/loss.py: reduce_values): sum / N, where N is the number of
# losses as an int32 product cast to the loss dtype, differentiates to div_no_nan(1, N); a sum
# to 1. "mean_with_sample_weight" is "mean" when no sample weight is given.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _mean_upstream(logits: tf.Tensor) -> tf.Tensor:
    count = tf.reduce_prod(tf.shape(logits, out_type=tf.int32)[:-1])
    return tf.math.divide_no_nan(tf.constant(1.0, tf.float32), tf.cast(count, tf.float32))


def _sum_upstream(logits: tf.Tensor) -> tf.Tensor:
    del logits
    return tf.constant(1.0, tf.float32)


# What CustomLoss.__call__ learned about this call, for CustomLoss.call (which Keras calls
# without the sample weight); per thread, as replicas may call one loss object at once.
_call_context = threading.local()


@keras.saving.register_keras_serializable(package="tf_metal_ops")
class CustomLoss(keras.losses.Loss):
    """Fused focal / label-smoothed softmax cross-entropy for Keras.

    Computes, per example, `- sum_c a_c * q_c * (1 - p_c)^gamma * log p_c` with
    `q = (1 - label_smoothing) * one_hot(y) + label_smoothing / C` and `p = softmax(logits)`, as
    one native op (CPU, or Apple GPU through tensorflow-metal). With the defaults it equals
    `keras.losses.SparseCategoricalCrossentropy(from_logits=True)`; with
    `class_weights=alpha` it equals `keras.losses.CategoricalFocalCrossentropy(alpha, gamma,
    from_logits=True, label_smoothing)` without Keras's clipping of `p` to `[1e-7, 1 - 1e-7]`.

    Labels may be class ids (`[batch, ...]` or `[batch, ..., 1]`, ints or whole floats) or
    dense targets with the predictions' shape.

    Inside an XLA compilation (`compile(jit_compile=True)`, or `"auto"` on a machine with a GPU
    or TPU that is not an Apple GPU) and on a device without our kernels (a CUDA GPU, a TPU),
    the same loss runs as TensorFlow ops instead (`tf_metal_ops.composed`), without the early
    gradient below; `tf_metal_ops.loss_path_info()` says which path ran.

    While a gradient tape records (as in `fit`), a float32 loss reduced with
    `"sum_over_batch_size"` or `"sum"` and called without sample weights has its op compute the
    gradient together with the loss, assuming the upstream gradient that reduction gives every
    example (`1 / N` or 1); the gradient op then hands it on instead of reading the logits again,
    and computes as usual if the assumption did not hold. The values are the same either way
    (see `tf_metal_ops.early_gradient_info`).

    Args:
        gamma: focusing parameter `>= 0`; 0 is plain cross-entropy.
        label_smoothing: in `[0, 1]`.
        class_weights: optional list of `C` weights `>= 0`.
        from_logits: whether `y_pred` holds logits (default) or probabilities; probabilities
            are turned into logits with `log`, so a probability of 0 is a masked class.
        ignore_class: optional class id whose examples get loss 0 and are left out of the
            `"sum_over_batch_size"` average, as in Keras's sparse cross-entropy.
        reduction: as for every Keras loss (`"sum_over_batch_size"`, `"sum"`, `None`, ...).
        name: name of the loss.
        dtype: dtype of the loss computation, as for every Keras loss.

    Example:

    ```python
    model.compile(optimizer="adam",
                  loss=tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1))
    ```
    """

    def __init__(
        self,
        gamma: float = 0.0,
        label_smoothing: float = 0.0,
        class_weights: Optional[Sequence[float]] = None,
        from_logits: bool = True,
        ignore_class: Optional[int] = None,
        reduction: Optional[str] = "sum_over_batch_size",
        name: str = "custom_loss",
        dtype: Any = None,
    ) -> None:
        _require_tensorflow_backend()
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.gamma = check_gamma(gamma)
        self.label_smoothing = check_label_smoothing(label_smoothing)
        weights = None if class_weights is None else check_class_weights_values(class_weights)
        if class_weights is not None and weights is None:
            raise ValueError(
                "class_weights of CustomLoss must be known values (a list or an array), not a "
                "symbolic tensor; for weights that change during training call "
                "tf_metal_ops.custom_loss directly"
            )
        self.class_weights = None if weights is None else [float(w) for w in weights]
        if not isinstance(from_logits, (bool, np.bool_)):
            raise TypeError(f"from_logits must be True or False, got {from_logits!r}")
        self.from_logits = bool(from_logits)
        self.ignore_class = check_ignore_class(ignore_class)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Optional[Any] = None) -> Any:
        _call_context.assumed_upstream = self._assumed_upstream(y_pred, sample_weight)
        try:
            return super().__call__(y_true, y_pred, sample_weight=sample_weight)
        finally:
            _call_context.assumed_upstream = None

    def _assumed_upstream(
        self, y_pred: Any, sample_weight: Optional[Any]
    ) -> Optional[Callable[[tf.Tensor], tf.Tensor]]:
        """The upstream gradient Keras's reduction will give each example's loss, when it is
        certain and a gradient may be taken: the op then computes the gradient early
        (csrc/problem.h). None where sample weights, masks (ignore_class too), replicas or
        mixed_float16's loss scaling rescale it, or where no gradient tape records (evaluation,
        prediction)."""
        if not early_gradients_enabled():
            return None
        if sample_weight is not None or self.ignore_class is not None:
            return None
        if _get_keras_mask(y_pred) is not None or not _tape_may_record():
            return None
        if tf.distribute.get_strategy().num_replicas_in_sync != 1:
            return None
        if keras.mixed_precision.global_policy().name == "mixed_float16":
            return None  # compile() then scales the loss (LossScaleOptimizer): never 1 / N
        if self.reduction in _MEAN_REDUCTIONS:
            return _mean_upstream
        if self.reduction == "sum":
            return _sum_upstream
        return None

    def call(self, y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        logits = y_pred if self.from_logits else tf.math.log(y_pred)
        # Keras converts y_pred to the loss's dtype; the reduction's upstream is then exactly
        # the float32 value assumed only for float32 losses.
        assumed = getattr(_call_context, "assumed_upstream", None)
        if tf.as_dtype(logits.dtype) != tf.float32:
            assumed = None
        losses = custom_loss(
            y_true,
            logits,
            gamma=self.gamma,
            label_smoothing=self.label_smoothing,
            class_weights=self.class_weights,
            ignore_class=self.ignore_class,
            assumed_upstream=assumed,
        )
        if self.ignore_class is not None:
            # Ignored examples drop out of the average, not only out of the sum.
            labels = tf.convert_to_tensor(y_true)
            if labels.shape.rank == losses.shape.rank + 1:
                labels = tf.squeeze(labels, axis=-1)
            _set_keras_mask(losses, tf.not_equal(labels, tf.cast(self.ignore_class, labels.dtype)))
        return losses

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(
            gamma=self.gamma,
            label_smoothing=self.label_smoothing,
            class_weights=self.class_weights,
            from_logits=self.from_logits,
            ignore_class=self.ignore_class,
        )
        return config
