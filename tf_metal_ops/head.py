"""`LinearCrossEntropyHead`: a language model's output layer that never makes its logits in
training, and `PerTokenLoss`, the Keras loss that reduces what it returns.

Called with `[hidden, labels]` the head returns per-token losses (`linear_cross_entropy` with
`reduction=None`), not a reduced loss added with `add_loss`: returned as the model's output, the
losses go through Keras's own reduction in `compile(loss=PerTokenLoss())`, which applies what a
layer never sees (the sample weights given to `fit`, loss weights, the 1 / replicas scaling under
a distribution strategy) and the mask the losses carry (the hidden states' Keras mask, and the
tokens labelled `ignore_class`), exactly as it does for Keras's own losses. The price is that
the backward makes each chunk's logits a second time (per-row upstream gradients are only known
there). Called with the hidden states alone it returns the logits, for inference.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import keras
import tensorflow as tf

from tf_metal_ops.linear_loss import check_chunk_size, linear_cross_entropy
from tf_metal_ops.losses import _get_keras_mask, _require_tensorflow_backend
from tf_metal_ops.ops import (
    check_class_weights_values,
    check_gamma,
    check_ignore_class,
    check_label_smoothing,
)


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
        **kwargs: as for every layer (name, dtype: a `mixed_float16` policy computes the
            logits in float16 from a float32 kernel, as `Dense` does; the losses stay float32).

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
        _require_tensorflow_backend()
        super().__init__(**kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"units must be a positive int (the number of classes), got "
                             f"{units!r}")
        self.units = units
        self.use_bias = bool(use_bias)
        self.gamma = check_gamma(gamma)
        self.label_smoothing = check_label_smoothing(label_smoothing)
        weights = None if class_weights is None else check_class_weights_values(class_weights)
        if class_weights is not None and weights is None:
            raise ValueError("class_weights of LinearCrossEntropyHead must be known values (a "
                             "list or an array), not a symbolic tensor")
        if weights is not None and len(weights) != units:
            raise ValueError(f"class_weights must have one entry per class (units={units}), got "
                             f"{len(weights)}")
        self.class_weights = None if weights is None else [float(w) for w in weights]
        self.ignore_class = check_ignore_class(ignore_class)
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
