"""Training runs under tf.distribute, one per process (driven by tests/test_distribute.py).

    python tests/distribute_worker.py MODE OUTPUT.npz

MODE:
  single     model.fit on one device, the global batch at once (the reference for mirrored)
  mirrored   model.fit under MirroredStrategy over two logical CPU devices made from the one
             physical CPU
  loop       a custom training loop (strategy.run) on one device, once for each of LOOP_FORMS
             (the ways docs/loss.md gives to average the loss over the global batch): the
             reference for the multi-worker run
  worker     the same loops as one worker of a MultiWorkerMirroredStrategy (TF_CONFIG says
             which; one CPU each). Keras 3's model.fit does not run under
             MultiWorkerMirroredStrategy (keras-team/keras#20585), so multi-worker users write
             this loop, and the test does too.
  mixed      a `mixed_float16` model, once with the loss in float32 (Keras's default) and once
             with CustomLoss(dtype="mixed_float16") so the op itself runs in float16

Every mode trains the same small classifier from the same initial weights (drawn from a seeded
NumPy generator and set explicitly, so no framework seed or device placement can change them)
on the same data in the same global batches, with CustomLoss using gamma, label smoothing, class
weights (one of them 0) and ignore_class, and writes the final weights (plus a few facts about
the run) to OUTPUT.npz. Each mode is a process of its own because the logical-device split and
the multi-worker runtime must be configured before TensorFlow initializes its devices.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

FEATURES, HIDDEN, CLASSES = 6, 16, 5
ROWS, GLOBAL_BATCH, EPOCHS = 64, 16, 2   # 4 steps an epoch, 8 steps in all
LEARNING_RATE = 0.2
IGNORE_CLASS = -1


def dataset_arrays():
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    centers = rng.normal(scale=2.0, size=(CLASSES, FEATURES))
    y = np.argmax(x @ centers.T, axis=1).astype(np.int32)
    # Ignored rows: one in every 8, so each half of every global batch (what each of two
    # replicas sees) has the same number of them. Keras averages a masked loss over the valid
    # rows of each replica; with equal counts that equals the single-device average.
    y[3::8] = IGNORE_CLASS
    return x, y


def initial_weights():
    rng = np.random.default_rng(99)
    return [
        rng.normal(scale=0.5, size=(FEATURES, HIDDEN)).astype(np.float32),
        rng.normal(scale=0.1, size=(HIDDEN,)).astype(np.float32),
        rng.normal(scale=0.5, size=(HIDDEN, CLASSES)).astype(np.float32),
        rng.normal(scale=0.1, size=(CLASSES,)).astype(np.float32),
    ]


def build_and_compile(loss_dtype=None):
    import keras

    import tf_metal_ops

    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="tanh"),
        keras.layers.Dense(CLASSES),   # logits
    ])
    model.set_weights(initial_weights())
    loss = tf_metal_ops.CustomLoss(gamma=2.0, label_smoothing=0.1,
                                   class_weights=[1.0, 2.0, 0.5, 0.0, 1.5],
                                   ignore_class=IGNORE_CLASS, dtype=loss_dtype)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss)
    return model


def train(model, dataset):
    history = model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False)
    return history.history["loss"]


def global_batches():
    import tensorflow as tf

    x, y = dataset_arrays()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    # Split each global batch across the workers (not whole files or batches), so a step of
    # the cluster sees exactly the examples of a step of the single-device run.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def save(path, model, **facts):
    weights = model.get_weights()
    np.savez(path, *weights, facts=json.dumps(facts))


def run_single(path):
    model = build_and_compile()
    losses = train(model, global_batches())
    save(path, model, losses=losses, replicas=1)


def run_mirrored(path):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = build_and_compile()
    losses = train(model, global_batches())
    save(path, model, losses=losses, replicas=strategy.num_replicas_in_sync, devices=devices)


LOSS_SETTINGS = dict(gamma=2.0, label_smoothing=0.1, class_weights=[1.0, 2.0, 0.5, 0.0, 1.5],
                     ignore_class=IGNORE_CLASS)


def replica_loss(form, labels, logits):
    """One replica's share of the loss averaged over the *global* batch (ignored rows count 0):
    sum(its per-example losses) / GLOBAL_BATCH, so the replicas' gradients add up to the
    single-device gradient. The forms are docs/loss.md's custom-loop recipe."""
    import tensorflow as tf

    import tf_metal_ops

    if form == "average":  # per-example losses, reduced by TensorFlow; a second op's gradient
        per_example = tf_metal_ops.custom_loss(labels, logits, **LOSS_SETTINGS)
        return tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    if form == "reduced":  # the scaled sum in one op, its gradient made in the forward
        row_scales = tf.fill(tf.shape(labels), 1.0 / GLOBAL_BATCH)
        return tf_metal_ops.reduced_custom_loss(labels, logits, row_scales, **LOSS_SETTINGS)
    if form == "keras_sum":  # the same through the Keras class
        loss = tf_metal_ops.CustomLoss(reduction="sum", **LOSS_SETTINGS)
        return loss(labels, logits, sample_weight=1.0 / GLOBAL_BATCH)
    raise ValueError(f"unknown form {form!r}")


LOOP_FORMS = ("average", "reduced", "keras_sum")


def gradient_op_count(concrete_function):
    """How many CustomLossGrad ops the traced training step holds (in nested functions too)."""
    graph_def = concrete_function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(node.op == "TfMetalOps>CustomLossGrad" for node in nodes)


def train_with_loop(strategy, form):
    """EPOCHS passes of a custom loop; returns (model, the mean loss of each epoch, how many
    gradient ops the training step holds)."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = build_and_compile()
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = replica_loss(form, y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    batches = strategy.experimental_distribute_dataset(global_batches())
    epoch_losses = []
    for _ in range(EPOCHS):
        total, steps = 0.0, 0
        for x, y in batches:
            total += float(step(x, y))
            steps += 1
        epoch_losses.append(total / steps)
    return model, epoch_losses, gradient_op_count(step.get_concrete_function(x, y))


def train_every_form(path, strategy, **facts):
    """Trains each of LOOP_FORMS from the same initial weights; OUTPUT.npz holds the weights
    as `<form>_<i>`, and the facts each form's losses and gradient-op count."""
    arrays, losses, gradient_ops = {}, {}, {}
    for form in LOOP_FORMS:
        model, losses[form], gradient_ops[form] = train_with_loop(strategy, form)
        for i, weight in enumerate(model.get_weights()):
            arrays[f"{form}_{i}"] = weight
    facts.update(losses=losses, gradient_ops=gradient_ops,
                 replicas=strategy.num_replicas_in_sync)
    np.savez(path, facts=json.dumps(facts), **arrays)


def run_loop(path):
    import tensorflow as tf

    train_every_form(path, tf.distribute.get_strategy())  # the default strategy: one device


def run_worker(path):
    import tensorflow as tf

    # A dead peer must end this process, not leave it waiting forever.
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    train_every_form(path, strategy, task=json.loads(os.environ["TF_CONFIG"])["task"])


def run_mixed(path):
    import keras
    import tensorflow as tf

    from tf_metal_ops import ops

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = dataset_arrays()
    facts = {}
    arrays = {}
    original_forward = ops.forward_op
    for variant, loss_dtype in (("float32_loss", None), ("float16_loss", "mixed_float16")):
        model = build_and_compile(loss_dtype)
        seen = []

        def recording_forward(logits, *args, seen=seen):
            seen.append(logits.dtype.name)  # the dtype the op runs on (at trace time)
            return original_forward(logits, *args)

        ops.forward_op = recording_forward  # every path to the forward op goes through it
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        history = model.fit(dataset, epochs=15, verbose=0, shuffle=False)
        facts[variant] = dict(
            losses=[float(v) for v in history.history["loss"]],
            logits_dtype=model(x[:2]).dtype.name,
            loss_input_dtypes=sorted(set(seen)),
            optimizer=type(model.optimizer).__name__,
            compute_dtype=model.layers[0].compute_dtype,
            variable_dtype=model.layers[0].variable_dtype,
        )
        for i, w in enumerate(model.get_weights()):
            arrays[f"{variant}_{i}"] = w
    np.savez(path, facts=json.dumps(facts), **arrays)


def main(argv):
    mode, path = argv[1], argv[2]
    {"single": run_single, "mirrored": run_mirrored, "loop": run_loop, "worker": run_worker,
     "mixed": run_mixed}[mode](path)
    print(f"{mode}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
