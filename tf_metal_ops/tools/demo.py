"""`python -m tf_metal_ops demo`: train a small CNN with CustomLoss on real handwritten digits.

The data is scikit-learn's bundled copy of the UCI optical-recognition digits (1797 images of
8x8 pixels, 16 grey levels), so the demo runs offline. Everything random (split, weights,
shuffling, dropout) follows one seed and TensorFlow's deterministic ops are switched on, so two
runs with the same seed print the same figures; only the final wall-time line differs.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

# Defaults chosen so the held-out accuracy is comfortably above 0.95 while the whole run,
# TensorFlow's start-up included, stays well under a minute on two cores.
DEFAULT_EPOCHS = 12
BATCH_SIZE = 32
LEARNING_RATE = 2e-3
HELD_OUT_FRACTION = 0.25
GAMMA = 2.0
LABEL_SMOOTHING = 0.1
_BAR_WIDTH = 30


@dataclass
class DemoResult:
    """What one demo run produced (also printed as it happens)."""

    epochs: int
    seed: int
    held_out_accuracy: float
    held_out_correct: int
    held_out_total: int
    loss_device: str
    gradient_device: str
    history: dict[str, list[float]] = field(default_factory=dict)
    plot_path: str | None = None
    loss_path: str = "native"  # or "composed (XLA)" / "composed (device)": tf_metal_ops.loss_path


def matplotlib_available() -> bool:
    """Whether `--plot` can work (checked before training, so a missing package costs nothing)."""
    return importlib.util.find_spec("matplotlib") is not None


def sklearn_available() -> bool:
    """Whether the digits data can be loaded (scikit-learn ships it; nothing is downloaded)."""
    return importlib.util.find_spec("sklearn") is not None


def load_digits_split(seed: int) -> tuple[Any, Any, Any, Any]:
    """(x_train, y_train, x_test, y_test): images as float32 [n, 8, 8, 1] in [0, 1], int32
    labels; a stratified split so every digit is held out in proportion."""
    import numpy as np  # noqa: PLC0415
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=HELD_OUT_FRACTION, random_state=seed, stratify=labels)
    return x_train, y_train, x_test, y_test


def build_model(num_classes: int = 10) -> Any:
    """Two 3x3 convolutions, a pooling step and a small dense head; returns logits."""
    import keras  # noqa: PLC0415

    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(num_classes),  # logits: CustomLoss(from_logits=True)
    ], name="digits_cnn")


def _progress_callback(epochs: int, steps: int, out: TextIO, live: bool) -> Any:
    import keras  # noqa: PLC0415

    class EpochProgress(keras.callbacks.Callback):
        """One bar per epoch: redrawn per batch on a terminal, printed once otherwise."""

        def _bar(self, epoch: int, done: int) -> str:
            filled = _BAR_WIDTH * done // steps
            return (f"epoch {epoch + 1:>{len(str(epochs))}}/{epochs} "
                    f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done:>{len(str(steps))}}"
                    f"/{steps}")

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch = epoch

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if live:
                out.write("\r" + self._bar(self._epoch, batch + 1))
                out.flush()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            logs = logs or {}
            out.write(("\r" if live else "") + self._bar(epoch, steps)
                      + f"  loss {logs.get('loss', float('nan')):.4f}"
                      + f"  acc {logs.get('accuracy', float('nan')):.4f}"
                      + f"  | held-out loss {logs.get('val_loss', float('nan')):.4f}"
                      + f"  acc {logs.get('val_accuracy', float('nan')):.4f}\n")
            out.flush()

    return EpochProgress()


def _loss_kernel_devices(model: Any, x: Any, y: Any) -> tuple[str, str]:
    """Where TensorFlow places our forward and gradient ops by default, as training does."""
    import tensorflow as tf  # noqa: PLC0415

    import tf_metal_ops  # noqa: PLC0415

    logits = tf.convert_to_tensor(model(x, training=False))
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf_metal_ops.custom_loss(y, logits, gamma=GAMMA, label_smoothing=LABEL_SMOOTHING)
    grad = tape.gradient(loss, logits)
    short = lambda t: t.device.rsplit("device:", 1)[-1]  # noqa: E731
    return short(loss), short(grad)


def _save_plot(history: dict[str, list[float]], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    epochs = range(1, len(history["loss"]) + 1)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(epochs, history["loss"], label="training")
    ax_loss.plot(epochs, history["val_loss"], label="held-out")
    ax_loss.set(title=f"CustomLoss(gamma={GAMMA}, label_smoothing={LABEL_SMOOTHING})",
                xlabel="epoch", ylabel="loss")
    ax_acc.plot(epochs, history["accuracy"], label="training")
    ax_acc.plot(epochs, history["val_accuracy"], label="held-out")
    ax_acc.set(title="accuracy", xlabel="epoch", ylabel="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs only
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _composed_paths_made(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The composed paths (tf_metal_ops.loss_path) that made a loss between two counts."""
    from tf_metal_ops import loss_path  # noqa: PLC0415

    return [p for p in (loss_path.COMPOSED_XLA, loss_path.COMPOSED_DEVICE)
            if after.get(p, 0) > before.get(p, 0)]


def run_demo(epochs: int | None = None, seed: int = 0, plot_path: str | None = None,
             out: TextIO | None = None, jit_compile: bool | str = "auto") -> DemoResult:
    """Trains the CNN and prints the progress, the loss kernels' device and the accuracy.

    Args:
        epochs: Training epochs; default `DEFAULT_EPOCHS`.
        seed: Seed of the split, the initial weights, the shuffling and dropout.
        plot_path: Where to save a PNG of the training curves (needs matplotlib), or None.
        out: Stream for the report; default `sys.stdout`.
        jit_compile: Keras's `compile(jit_compile=...)`: `"auto"` (XLA on machines with a GPU
            or TPU that is not an Apple GPU; Keras turns it off here, as the demo enables op
            determinism), True (then op determinism stays off, which Keras's XLA needs) or
            False. Under XLA the loss is the composed path (`tf_metal_ops.composed`), and the
            report says so.

    Returns:
        A `DemoResult`.
    """
    out = out or sys.stdout
    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    if epochs < 1:
        raise ValueError(f"run_demo: `epochs` must be >= 1, got {epochs}")
    start = time.perf_counter()

    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import tf_metal_ops  # noqa: PLC0415
    from tf_metal_ops import loss_path  # noqa: PLC0415
    from tf_metal_ops.tools import environment  # noqa: PLC0415

    keras.utils.set_random_seed(seed)
    if jit_compile is not True:
        # Keras turns XLA off while op determinism is on (keras/src/trainers/trainer.py,
        # model_supports_jit); XLA on the CPU is deterministic for this model anyway.
        tf.config.experimental.enable_op_determinism()

    x_train, y_train, x_test, y_test = load_digits_split(seed)
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=tf_metal_ops.CustomLoss(gamma=GAMMA, label_smoothing=LABEL_SMOOTHING),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=jit_compile,
    )
    steps = -(-len(x_train) // BATCH_SIZE)
    out.write(f"tf_metal_ops demo: CustomLoss(gamma={GAMMA}, label_smoothing={LABEL_SMOOTHING})"
              f" on scikit-learn's handwritten digits\n")
    out.write(f"data: {len(x_train) + len(x_test)} images of 8x8 pixels, 10 classes; "
              f"{len(x_train)} for training, {len(x_test)} held out (seed {seed})\n")
    out.write(f"model: small CNN, {model.count_params():,} parameters; Adam(lr={LEARNING_RATE})"
              f", batch {BATCH_SIZE}, {epochs} epochs\n")
    out.flush()

    live = bool(getattr(out, "isatty", lambda: False)())
    paths_before = tf_metal_ops.loss_path_info()["counts"]
    fit = model.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, shuffle=True,
                    validation_data=(x_test, y_test), verbose=0,
                    callbacks=[_progress_callback(epochs, steps, out, live)])
    history = {k: [float(v) for v in vals] for k, vals in fit.history.items()}

    predictions = np.argmax(model.predict(x_test, batch_size=256, verbose=0), axis=-1)
    correct = int(np.sum(predictions == y_test))
    accuracy = correct / len(y_test)

    composed_paths = _composed_paths_made(paths_before, tf_metal_ops.loss_path_info()["counts"])
    registered = environment.kernel_devices(environment.OP_NAMES[0])
    gpus = tf.config.list_logical_devices("GPU")
    gpu_found = bool(gpus)
    if composed_paths:
        # Training ran the loss as TensorFlow ops (under XLA, or on a device without our
        # kernels): no native kernel ran, so there is no op placement to report.
        loss_device = grad_device = gpus[0].name.rsplit("device:", 1)[-1] if gpus else "CPU:0"
        why = {loss_path.COMPOSED_XLA: "compiled by XLA, which has no kernel of our op",
               loss_path.COMPOSED_DEVICE: f"{loss_device} has no kernel of our op"}
        ran_on = (f"{' and '.join(composed_paths)} on {loss_device} (the loss as TensorFlow "
                  f"ops: {'; '.join(why[p] for p in composed_paths)})")
    else:
        loss_device, grad_device = _loss_kernel_devices(model, x_test[:BATCH_SIZE],
                                                        y_test[:BATCH_SIZE])
        ran_on = (f"{loss_device} (forward {environment.OP_NAMES[0]}), "
                  f"{grad_device} (gradient {environment.OP_NAMES[1]})")
    out.write(f"loss kernels ran on: {ran_on}; kernels registered for: "
              f"{', '.join(registered) or 'none'}"
              f"{'' if gpu_found else '; no GPU found'}\n")
    out.write(f"held-out accuracy: {accuracy:.4f} ({correct}/{len(y_test)})\n")

    if plot_path is not None:
        _save_plot(history, plot_path)
        out.write(f"training curves saved to {plot_path}\n")
    out.write(f"done in {time.perf_counter() - start:.1f} s\n")
    out.flush()
    return DemoResult(epochs=epochs, seed=seed, held_out_accuracy=accuracy,
                      held_out_correct=correct, held_out_total=len(y_test),
                      loss_device=loss_device, gradient_device=grad_device, history=history,
                      plot_path=plot_path,
                      loss_path=" and ".join(composed_paths) if composed_paths else "native")
