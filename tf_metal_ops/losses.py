"""`CustomLoss`: the Keras face of `custom_loss`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_metal_ops.ops import (
    check_class_weights_values,
    check_gamma,
    check_ignore_class,
    check_label_smoothing,
    custom_loss,
    reduced_custom_loss,
)

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


class _ReductionProbe(keras.losses.Loss):
    """Keras's own reduction applied to given per-example values.

    Every Keras reduction but `None` is linear in the per-example losses once the sample weights
    and masks are fixed: `sum_i s_i * loss_i`. Reducing a watched tensor of zeros through
    Keras's own `Loss.__call__` and differentiating gives each `s_i` exactly as this Keras
    version weighs, masks, averages and scales for replicas, with nothing of it written again.
    """

    def __init__(self, values: tf.Tensor, mask: Optional[tf.Tensor], reduction: str,
                 dtype: Any) -> None:
        super().__init__(name="reduction_probe", reduction=reduction, dtype=dtype)
        self._values = values
        self._mask = mask

    def call(self, y_true: Any, y_pred: Any) -> tf.Tensor:
        values = tf.identity(self._values)  # a tensor of its own, to carry the mask
        if self._mask is not None:
            _set_keras_mask(values, self._mask)
        return values


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

    Reduced (every reduction but `None`), the loss is `sum_i s_i * loss_i` with the weights
    `s_i` Keras's reduction gives each example (`1 / N` for the mean, times sample weights and
    masks); the op then computes the gradient together with the loss, and the backward only
    scales it by the upstream gradient (Liger-Kernel's rule). With `reduction=None` it returns
    the per-example losses, whose gradient a second op computes.

    Inside an XLA compilation (`compile(jit_compile=True)`, or `"auto"` on a machine with a GPU
    or TPU that is not an Apple GPU) and on a device without our kernels (a CUDA GPU, a TPU),
    the same loss runs as TensorFlow ops instead (`tf_metal_ops.composed`);
    `tf_metal_ops.loss_path_info()` says which path ran.

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
        if self.reduction in (None, "none"):
            return super().__call__(y_true, y_pred, sample_weight=sample_weight)
        loss_shape = tf.TensorShape(getattr(y_pred, "shape", np.shape(y_pred)))[:-1]
        if loss_shape.rank == 0 or loss_shape.as_list() == [0]:
            # Keras leaves a scalar or a statically empty loss unreduced: so do we.
            return super().__call__(y_true, y_pred, sample_weight=sample_weight)
        in_mask = _get_keras_mask(y_pred)
        with tf.name_scope(self.name):
            predictions = keras.ops.convert_to_tensor(y_pred, dtype=self.dtype)
            scales = self._row_scales(y_true, predictions, sample_weight, in_mask)
            return reduced_custom_loss(y_true, self._logits(predictions), scales,
                                       **self._loss_options())

    def _logits(self, y_pred: tf.Tensor) -> tf.Tensor:
        return y_pred if self.from_logits else tf.math.log(y_pred)

    def _loss_options(self) -> Dict[str, Any]:
        return dict(gamma=self.gamma, label_smoothing=self.label_smoothing,
                    class_weights=self.class_weights, ignore_class=self.ignore_class)

    def _row_scales(self, y_true: Any, predictions: tf.Tensor, sample_weight: Optional[Any],
                    in_mask: Optional[tf.Tensor]) -> tf.Tensor:
        """d (Keras's reduction of the per-example losses) / d loss_i, for every example."""
        probe = tf.zeros(tf.shape(predictions)[:-1], self.dtype)
        # The probe stands in for the predictions too, carrying their mask: Keras reads only
        # that of them, and converting the real ones would cost a pass over N x C.
        probe_predictions = tf.identity(probe)
        if in_mask is not None:
            _set_keras_mask(probe_predictions, in_mask)
        with tf.GradientTape() as tape:
            tape.watch(probe)
            reduced = _ReductionProbe(probe, self._ignored_mask(y_true, probe), self.reduction,
                                      self.dtype)(probe, probe_predictions,
                                                  sample_weight=sample_weight)
        scales = tape.gradient(reduced, probe)
        return tf.stop_gradient(tf.zeros_like(probe) if scales is None else scales)

    def _ignored_mask(self, y_true: Any, losses: tf.Tensor) -> Optional[tf.Tensor]:
        """False for the examples labelled ignore_class: they drop out of the average too."""
        if self.ignore_class is None:
            return None
        labels = tf.convert_to_tensor(y_true)
        if labels.shape.rank == losses.shape.rank + 1:
            labels = tf.squeeze(labels, axis=-1)
        return tf.not_equal(labels, tf.cast(self.ignore_class, labels.dtype))

    def call(self, y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        losses = custom_loss(y_true, self._logits(y_pred), **self._loss_options())
        mask = self._ignored_mask(y_true, losses)
        if mask is not None:
            _set_keras_mask(losses, mask)
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
