"""The Keras face of the library: `CustomLoss`, `LinearCrossEntropyHead` and `PerTokenLoss`.

`CustomLoss` is `custom_loss` as a Keras loss; reduced, it hands Keras's per-example weights to
`reduced_custom_loss`, whose forward op also writes the gradient.

`LinearCrossEntropyHead` is a language model's output layer that never makes its logits in
training, and `PerTokenLoss` the Keras loss that reduces what it returns. Called with
`[hidden, labels]` the head returns per-token losses (`linear_cross_entropy` with
`reduction=None`), not a reduced loss added with `add_loss`: returned as the model's output, the
losses go through Keras's own reduction in `compile(loss=PerTokenLoss())`, which applies what a
layer never sees (the sample weights given to `fit`, loss weights, the 1 / replicas scaling under
a distribution strategy) and the mask the losses carry (the hidden states' Keras mask, and the
tokens labelled `ignore_class`), exactly as it does for Keras's own losses. The price is that
the backward makes each chunk's logits a second time (per-row upstream gradients are only known
there). Called with the hidden states alone it returns the logits, for inference.

The three classes are registered with Keras under the package name "tf_metal_ops", so
`keras.models.load_model` finds them after `import tf_metal_ops`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_metal_ops.linear_cross_entropy import check_chunk_size, linear_cross_entropy
from tf_metal_ops.loss_inputs import LossOptions, check_class_weights_values, labels_are_dense
from tf_metal_ops.ops import custom_loss, reduced_custom_loss

try:  # Keras >= 3.6 keeps tensor attributes in its own table
    from keras.src.backend.common.masking import get_keras_mask as _get_keras_mask
    from keras.src.backend.common.masking import set_keras_mask as _set_keras_mask
except ImportError:  # older Keras 3 reads the attribute straight off the tensor

    def _get_keras_mask(tensor: Any) -> Any:
        return getattr(tensor, "_keras_mask", None)

    def _set_keras_mask(tensor: tf.Tensor, mask: tf.Tensor) -> None:
        tensor._keras_mask = mask


def _require_tensorflow_backend(owner: str) -> None:
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"tf_metal_ops.{owner} runs as a TensorFlow op and needs the TensorFlow Keras "
            f"backend, but KERAS_BACKEND is '{backend}': set KERAS_BACKEND=tensorflow."
        )


def _checked_options(owner: str, gamma: Any, label_smoothing: Any, class_weights: Any,
                     ignore_class: Any, num_classes: Optional[int] = None
                     ) -> "tuple[LossOptions, Optional[List[float]]]":
    """A layer's or loss's options, checked where they enter: class weights must be known
    values, kept as a list of floats so that `get_config` can save them."""
    options = LossOptions.checked(gamma, label_smoothing, ignore_class)
    if class_weights is None:
        return options, None
    weights = check_class_weights_values(class_weights)
    if weights is None:
        raise ValueError(
            f"class_weights of {owner} must be known values (a list or an array), not a "
            "symbolic tensor; for weights that change during training call "
            "tf_metal_ops.custom_loss directly")
    if num_classes is not None and len(weights) != num_classes:
        raise ValueError(f"class_weights must have one entry per class (units={num_classes}), "
                         f"got {len(weights)}")
    return options, [float(w) for w in weights]


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
    dense targets with the predictions' shape (floats, or integer one-hot rows), meaning the
    same in every reduction (docs/loss.md, "Labels").

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
        dtype: dtype of the loss computation, as for every Keras loss: left at `None`,
            float32 (`keras.backend.floatx()`), and predictions are converted to it, so 16-bit
            logits give the float32 loss Keras's own losses give. `dtype="mixed_bfloat16"` (or
            `"mixed_float16"`) hands the op the 16-bit logits as they are, without a float32
            copy, and returns a loss of that dtype (docs/loss.md, "Mixed precision").

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
        _require_tensorflow_backend("CustomLoss")
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        options, self.class_weights = _checked_options(
            "CustomLoss", gamma, label_smoothing, class_weights, ignore_class)
        self.gamma = options.gamma
        self.label_smoothing = options.label_smoothing
        self.ignore_class = options.ignore_class
        if not isinstance(from_logits, (bool, np.bool_)):
            raise TypeError(f"from_logits must be True or False, got {from_logits!r}")
        self.from_logits = bool(from_logits)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Optional[Any] = None) -> Any:
        in_mask = _get_keras_mask(y_pred)
        with tf.name_scope(self.name):
            predictions = keras.ops.convert_to_tensor(y_pred, dtype=self.dtype)
            # The labels reach the loss as given, in every reduction: Keras's own
            # `Loss.__call__` would convert them to the loss's dtype first, which rounds class
            # ids (above 2048 in float16) and would let the reduction decide what integer
            # labels mean (loss_inputs.labels_are_dense decides, for every entry point).
            labels = tf.convert_to_tensor(y_true)
            loss_shape = predictions.shape[:-1]
            if (self.reduction in (None, "none") or loss_shape.rank == 0
                    or loss_shape.as_list() == [0]):
                # Per-example losses, or ones Keras leaves unreduced (a scalar, a statically
                # empty batch): Keras's reduction applies the sample weights and masks.
                losses = self.call(labels, predictions)
                return self._keras_reduction(losses, _get_keras_mask(losses), in_mask,
                                             sample_weight)
            scales = self._row_scales(labels, predictions, sample_weight, in_mask)
            return reduced_custom_loss(labels, self._logits(predictions), scales,
                                       dtype=self.dtype, **self._loss_options())

    def _logits(self, y_pred: tf.Tensor) -> tf.Tensor:
        return y_pred if self.from_logits else tf.math.log(y_pred)

    def _loss_options(self) -> Dict[str, Any]:
        return dict(gamma=self.gamma, label_smoothing=self.label_smoothing,
                    class_weights=self.class_weights, ignore_class=self.ignore_class)

    def _keras_reduction(self, values: tf.Tensor, mask: Optional[tf.Tensor],
                         in_mask: Optional[tf.Tensor], sample_weight: Optional[Any]) -> tf.Tensor:
        """Keras's own reduction of per-example values, with the predictions' mask."""
        # A stand-in for the predictions carries their mask: Keras reads only that of them,
        # and converting the real ones would cost a pass over N x C.
        predictions_mask_carrier = tf.identity(values)
        if in_mask is not None:
            _set_keras_mask(predictions_mask_carrier, in_mask)
        return _ReductionProbe(values, mask, self.reduction, self.dtype)(
            predictions_mask_carrier, predictions_mask_carrier, sample_weight=sample_weight)

    def _row_scales(self, labels: tf.Tensor, predictions: tf.Tensor, sample_weight: Optional[Any],
                    in_mask: Optional[tf.Tensor]) -> tf.Tensor:
        """d (Keras's reduction of the per-example losses) / d loss_i, for every example."""
        probe = tf.zeros(tf.shape(predictions)[:-1], self.dtype)
        with tf.GradientTape() as tape:
            tape.watch(probe)
            reduced = self._keras_reduction(probe, self._ignored_mask(labels, predictions),
                                            in_mask, sample_weight)
        scales = tape.gradient(reduced, probe)
        return tf.stop_gradient(tf.zeros_like(probe) if scales is None else scales)

    def _ignored_mask(self, labels: tf.Tensor, predictions: tf.Tensor) -> Optional[tf.Tensor]:
        """False for the examples labelled ignore_class: they drop out of the average too."""
        if self.ignore_class is None:
            return None
        labels_are_dense(labels, predictions, self.ignore_class)  # raises: ids only
        if labels.shape.rank == predictions.shape.rank:
            labels = tf.squeeze(labels, axis=-1)
        return tf.not_equal(labels, tf.cast(self.ignore_class, labels.dtype))

    def call(self, y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        losses = custom_loss(y_true, self._logits(y_pred), **self._loss_options())
        mask = self._ignored_mask(tf.convert_to_tensor(y_true), y_pred)
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


@keras.saving.register_keras_serializable(package="tf_metal_ops")
class LinearCrossEntropyHead(keras.layers.Layer):
    """A `Dense(units)` projection fused with `CustomLoss`, per token, without the logits.

    `head([hidden, labels])` returns the loss of every token, float32, of shape
    `hidden.shape[:-1]`, masked (as a Keras mask) where the hidden states are masked or the
    label is `ignore_class`; its gradient reaches `hidden`, the kernel and the bias. At no time
    does it hold more than `chunk_size` rows of logits. `head(hidden)` returns the logits
    `hidden @ kernel + bias` (the compute dtype), for inference.

    Args:
        units: the number of classes (the vocabulary).
        use_bias: whether the projection has a bias.
        gamma, label_smoothing, class_weights, ignore_class: as for `CustomLoss`.
        chunk_size: rows of logits made at once (default: `linear_cross_entropy`'s).
        kernel_initializer, bias_initializer: as for `Dense`.
        **kwargs: as for every layer (name, dtype: under a `mixed_float16` policy the hidden
            states are float16 and the kernel float32; the native op on the CPU computes the
            logits in float32, the tf.while_loop route in float16 as `Dense` does; the losses
            stay float32).

    Example (compile with `PerTokenLoss`; `fit` takes the labels as an input and as `y`):

    ```python
    tokens = keras.Input((None,), dtype="int32")
    labels = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(vocab, 256, mask_zero=True)(tokens)
    h = keras.layers.LSTM(256, return_sequences=True)(h)
    losses = tf_metal_ops.LinearCrossEntropyHead(vocab)([h, labels])
    model = keras.Model([tokens, labels], losses)
    model.compile("adam", loss=tf_metal_ops.PerTokenLoss())
    model.fit([x, y], y, sample_weight=w)
    ```
    """

    def __init__(self, units: int, *, use_bias: bool = True, gamma: float = 0.0,
                 label_smoothing: float = 0.0, class_weights: Optional[Sequence[float]] = None,
                 ignore_class: Optional[int] = None, chunk_size: Optional[int] = None,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 **kwargs: Any) -> None:
        _require_tensorflow_backend("LinearCrossEntropyHead")
        super().__init__(**kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"units must be a positive int (the number of classes), got "
                             f"{units!r}")
        self.units = units
        self.use_bias = bool(use_bias)
        options, self.class_weights = _checked_options(
            "LinearCrossEntropyHead", gamma, label_smoothing, class_weights, ignore_class,
            num_classes=units)
        self.gamma = options.gamma
        self.label_smoothing = options.label_smoothing
        self.ignore_class = options.ignore_class
        self.chunk_size = check_chunk_size(chunk_size)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True

    def build(self, input_shape: Any) -> None:
        hidden_shape = input_shape[0] if _is_pair(input_shape) else input_shape
        d = hidden_shape[-1]
        if d is None:
            raise ValueError(f"LinearCrossEntropyHead needs the hidden states' last dimension, "
                             f"got shape {hidden_shape}")
        self.kernel = self.add_weight(name="kernel", shape=(d, self.units),
                                      initializer=self.kernel_initializer)
        self.bias = (self.add_weight(name="bias", shape=(self.units,),
                                     initializer=self.bias_initializer)
                     if self.use_bias else None)

    def call(self, inputs: Any, mask: Any = None) -> tf.Tensor:
        if not _is_pair(inputs):
            logits = tf.matmul(inputs, tf.cast(self.kernel, inputs.dtype))
            return logits if self.bias is None else tf.nn.bias_add(
                logits, tf.cast(self.bias, inputs.dtype))
        hidden, labels = inputs
        return linear_cross_entropy(
            labels, hidden, self.kernel, self.bias, gamma=self.gamma,
            label_smoothing=self.label_smoothing, class_weights=self.class_weights,
            ignore_class=self.ignore_class, reduction=None, chunk_size=self.chunk_size)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Optional[tf.Tensor]:
        if not _is_pair(inputs):
            return mask
        hidden_mask = mask[0] if isinstance(mask, (list, tuple)) else mask
        if hidden_mask is None:
            hidden_mask = _get_keras_mask(inputs[0])
        labels = inputs[1]
        token_mask = None
        ops = keras.ops  # also called on symbolic (Keras) tensors
        if self.ignore_class is not None:
            ids = labels
            if len(labels.shape) == len(inputs[0].shape):  # class ids with a trailing 1
                ids = ops.squeeze(labels, axis=-1)
            token_mask = ops.not_equal(ids, ops.cast(self.ignore_class, ids.dtype))
        if hidden_mask is None:
            return token_mask
        if token_mask is None:
            return hidden_mask
        return ops.logical_and(ops.cast(hidden_mask, "bool"), token_mask)

    def compute_output_shape(self, input_shape: Any) -> Any:
        if _is_pair(input_shape):
            return tuple(input_shape[0][:-1])
        return tuple(input_shape[:-1]) + (self.units,)

    def compute_output_spec(self, inputs: Any, mask: Any = None) -> Any:
        if _is_pair(inputs):
            return keras.KerasTensor(tuple(inputs[0].shape[:-1]), dtype="float32")
        return keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.units,),
                                 dtype=self.compute_dtype)

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(
            units=self.units, use_bias=self.use_bias, gamma=self.gamma,
            label_smoothing=self.label_smoothing, class_weights=self.class_weights,
            ignore_class=self.ignore_class, chunk_size=self.chunk_size,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return config


def _is_pair(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2


@keras.saving.register_keras_serializable(package="tf_metal_ops")
class PerTokenLoss(keras.losses.Loss):
    """Keras's reduction of losses a model computed itself (`LinearCrossEntropyHead`'s).

    `y_pred` are the per-token losses; `y_true` is not read (`fit` needs a `y`: pass the
    labels). Sample weights, the losses' mask and every reduction apply as for Keras's own
    losses: `"sum_over_batch_size"` averages over the unmasked tokens.
    """

    def __init__(self, reduction: Optional[str] = "sum_over_batch_size",
                 name: str = "per_token_loss", dtype: Any = None) -> None:
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true: Any, y_pred: tf.Tensor) -> tf.Tensor:
        del y_true
        return y_pred
