"""LinearCrossEntropyHead in model.fit on one device and under MirroredStrategy, one process
(driven by tests/test_linear_cross_entropy.py).

    python tests/linear_head_worker.py OUTPUT.json

The process splits its CPU into two logical devices before TensorFlow initializes them, then
trains the same small causal language model (Embedding with mask_zero, Dense, the head with
ignore_class and label smoothing) from the same initial weights on the same global batches,
once under the default strategy and once mirrored over both devices, and writes the largest
weight difference, how far the weights moved and the replica count to OUTPUT.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

VOCAB, WIDTH, STEPS_LONG, ROWS, GLOBAL_BATCH = 50, 8, 6, 32, 8
IGNORE_CLASS = 1


def data():
    rng = np.random.default_rng(7)
    tokens = rng.integers(2, VOCAB, (ROWS, STEPS_LONG)).astype(np.int32)
    tokens[:, 5:] = 0  # padding, masked by the embedding
    labels = np.roll(tokens, -1, axis=1)
    labels[::4, 0] = IGNORE_CLASS  # the same count of ignored tokens in each replica's half
    weights = np.repeat(rng.uniform(0.5, 2.0, (ROWS, 1)), STEPS_LONG, axis=1).astype(np.float32)
    return tokens, labels, weights


def build():
    import keras

    import tf_metal_ops

    tokens = keras.Input((STEPS_LONG,), dtype="int32")
    labels = keras.Input((STEPS_LONG,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(tokens)
    h = keras.layers.Dense(WIDTH, activation="tanh")(h)
    losses = tf_metal_ops.LinearCrossEntropyHead(VOCAB, ignore_class=IGNORE_CLASS,
                                                 label_smoothing=0.1, chunk_size=7)([h, labels])
    model = keras.Model([tokens, labels], losses)
    rng = np.random.default_rng(99)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype(np.float32)
                       for w in model.get_weights()])
    model.compile(keras.optimizers.SGD(0.5), loss=tf_metal_ops.PerTokenLoss())
    return model


def train(model):
    tokens, labels, weights = data()
    model.fit([tokens, labels], labels, sample_weight=weights, batch_size=GLOBAL_BATCH,
              epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def main(path):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    start = build().get_weights()
    single = train(build())
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = build()
    mirrored = train(model)
    facts = {
        "replicas": strategy.num_replicas_in_sync,
        "max_difference": max(float(np.max(np.abs(a - b))) for a, b in zip(single, mirrored)),
        "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(single, start)),
    }
    with open(path, "w") as out:
        json.dump(facts, out)


if __name__ == "__main__":
    main(sys.argv[1])
