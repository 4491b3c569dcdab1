"""The bench's linear-head section: `linear_cross_entropy` against the head and loss composed.

For h [N, d] and W [d, V] (float32, a bias, labels drawn uniformly), one training step of a
language model's head: the mean loss and its gradients with respect to h, W and b, under
`tf.function`. Four cases, at each vocabulary size:

    fused           tf_metal_ops.linear_cross_entropy(labels, h, W, b): on the CPU the
                    native op, its default chunk
    dense_custom    h @ W + b (what Dense(V) computes), then tf_metal_ops.CustomLoss()
    dense_keras     h @ W + b, then keras.losses.SparseCategoricalCrossentropy(from_logits=True)

Per case, in its own child process (MEMORY_REPEATS of them, QUICK_MEMORY_REPEATS with
`--quick`; the cases in turn and the order rotated each time, the medians taken), a warm-up
step and `steps` timed steps:
- the peak extra memory of all of them (VmHWM after clear_refs minus VmRSS after tracing,
  before any step ran: unlike `lm_head_memory`, which starts after a warm-up step, this counts
  what allocators keep between steps);
- the seconds of each timed step. This machine's speed drifts by tens of percent within
  minutes; the cases' children alternate, so a drift falls on every case alike instead of
  reading as a difference between them;
- and, in the first child of fused and dense_custom, on the first ERROR_ROWS rows, the error of
  the loss and of the three gradients against the same step in float64 (`custom_loss` on
  float64 logits, whose kernel is exact to ~1e-15), in the vocabulary-scale measure: max over
  rows of max |got - exact| / (1 + max |exact| of the row); fused runs there with chunks of
  ERROR_CHUNK rows, so the error crosses chunks.
Memory and time come from the same steps, so the section runs each step only once per child
after its warm-up.

The targets the section reports for fused: its peak extra memory at most 1/8 of both
compositions', its time at most TIME_TARGET of dense_custom's and below dense_keras's. The section also reports what decides the compositions' speed and the fused op's: whether
TensorFlow runs oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS) and which BLAS the native op calls.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

from tf_metal_ops.tools.bench.process import reset_peak_rss, run_child, status_kib

CASES = (
    ("fused", "tf_metal_ops.linear_cross_entropy(labels, h, W, b)"),
    ("dense_custom", "h @ W + b (Dense(V)), then tf_metal_ops.CustomLoss()"),
    ("dense_keras", "h @ W + b, then keras SparseCategoricalCrossentropy(from_logits=True)"),
)
DEFAULT_ROWS, DEFAULT_HIDDEN, DEFAULT_CLASSES = 8192, 512, (32000, 128256)
QUICK_ROWS, QUICK_HIDDEN, QUICK_CLASSES = 64, 16, (300,)
DEFAULT_STEPS, QUICK_STEPS = 1, 1  # timed steps of a child after its warm-up
MEMORY_REPEATS = 3  # children per case; the medians are reported
QUICK_MEMORY_REPEATS = 1  # `--quick` proves the section runs: one child per case
ERROR_ROWS, ERROR_CHUNK = 256, 100
FUSED_CASES = ("fused",)
MEMORY_TARGET = 1 / 8  # fused's extra memory over each composition's
TIME_TARGET = 0.95  # fused's time over dense_custom's
CHILD_FLAG = "--_linear-head-child"


def _inputs(rows: int, hidden: int, classes: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    h = rng.standard_normal((rows, hidden), dtype=np.float32)
    w = (rng.standard_normal((hidden, classes), dtype=np.float32) / hidden ** 0.5)
    b = (rng.standard_normal(classes, dtype=np.float32) * 0.1)
    labels = rng.integers(0, classes, rows).astype(np.int32)
    return h, w, b, labels


def _loss_fn(case: str, chunk_size=None):
    import keras

    import tf_metal_ops

    if case == "fused":
        return lambda y, h, w, b: tf_metal_ops.linear_cross_entropy(y, h, w, b,
                                                                    chunk_size=chunk_size)
    loss = (tf_metal_ops.CustomLoss() if case == "dense_custom"
            else keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lambda y, h, w, b: loss(y, h @ w + b)


def _step(case: str, chunk_size=None):
    import tensorflow as tf

    loss_fn = _loss_fn(case, chunk_size)

    @tf.function
    def step(y, h, w, b):
        with tf.GradientTape() as tape:
            tape.watch([h, w, b])
            loss = loss_fn(y, h, w, b)
        return (loss, *tape.gradient(loss, [h, w, b]))

    return step


def _relative_error(got, exact) -> float:
    import numpy as np

    got = np.atleast_2d(np.asarray(got, np.float64))
    exact = np.atleast_2d(np.asarray(exact, np.float64))
    return float(np.max(np.max(np.abs(got - exact), axis=-1)
                        / (1.0 + np.max(np.abs(exact), axis=-1))))


def errors(case: str, h, w, b, labels) -> Dict[str, float]:
    """Errors of the case's loss and gradients against float64, on ERROR_ROWS rows."""
    import numpy as np
    import tensorflow as tf

    import tf_metal_ops

    rows = min(ERROR_ROWS, h.shape[0])
    y = tf.constant(labels[:rows])
    got = _step(case, ERROR_CHUNK)(y, *(tf.constant(a) for a in (h[:rows], w, b)))
    h64, w64, b64 = (tf.constant(a.astype(np.float64)) for a in (h[:rows], w, b))
    with tf.GradientTape() as tape:
        tape.watch([h64, w64, b64])
        exact_loss = tf.reduce_mean(tf_metal_ops.custom_loss(y, h64 @ w64 + b64))
    exact = (exact_loss, *tape.gradient(exact_loss, [h64, w64, b64]))
    return {name: _relative_error(g.numpy(), e.numpy())
            for name, g, e in zip(("loss", "d_hidden", "d_kernel", "d_bias"), got, exact)}


def _arguments(h, w, b, labels):
    """A step's arguments, (labels, h, W, b), as tensors."""
    import tensorflow as tf

    return [tf.constant(labels), tf.constant(h), tf.constant(w), tf.constant(b)]


def _run_step(step, args) -> float:
    """Runs one step to the end; returns its seconds."""
    start = time.perf_counter()
    outputs = step(*args)
    outputs[0].numpy()
    return time.perf_counter() - start


def child(case: str, rows: int, hidden: int, classes: int, steps: int,
          with_errors: bool = True) -> Dict[str, Any]:
    """Runs in a fresh process: a warm-up and `steps` timed steps, their peak extra memory and
    the timed steps' milliseconds, what the times depend on, and (but for dense_keras, and
    unless not `with_errors`) the errors against float64."""

    arrays = _inputs(rows, hidden, classes)
    args = _arguments(*arrays)
    step = _step(case)
    # Traced without running, so that what the steps keep cached between them (allocators'
    # pools, a buffer set aside for the next step) counts too: the baseline is taken before
    # any step ran, and the first step is inside the measured peak.
    step.get_concrete_function(*args)
    gc.collect()
    if not reset_peak_rss():
        raise RuntimeError("the linear-head memory figure needs Linux's /proc/self/clear_refs")
    before = status_kib("VmRSS")
    _run_step(step, args)  # the warm-up: its first allocations are in the peak, not the times
    times_ms = [1e3 * _run_step(step, args) for _ in range(steps)]
    peak = status_kib("VmHWM")
    result: Dict[str, Any] = {"case": case, "extra_bytes": 1024 * (peak - before),
                              "times_ms": times_ms, "backends": backends()}
    if case != "dense_keras" and with_errors:
        result["errors"] = errors(case, *arrays)
    return result


def backends() -> Dict[str, Any]:
    """What the times depend on: TensorFlow's oneDNN setting and the native op's BLAS."""
    import os

    import tensorflow as tf

    from tf_metal_ops import _native

    try:
        # TensorFlow's own answer: built with oneDNN, and on for this CPU and
        # TF_ENABLE_ONEDNN_OPTS (what its "oneDNN custom operations are on" line reports).
        from tensorflow.python.util import _pywrap_util_port
        onednn_on = bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):  # private: a TensorFlow that moved it
        onednn_on = None
    info = _native.build_info()
    return {"tensorflow": tf.__version__,
            "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS",
                                                    "unset (TensorFlow's default)"),
            "onednn_on": onednn_on,
            "blas": info.get("blas"), "blas_config": info.get("blas_config"),
            "cpu_threads": _native.runtime().get_cpu_threads()}


def settings(quick: bool) -> Tuple[int, int, Tuple[int, ...], int, int]:
    """(rows, hidden, classes, steps, repeats) of the section: tiny sizes and one child per case
    with `--quick`, which only proves that the section runs."""
    if quick:
        return QUICK_ROWS, QUICK_HIDDEN, QUICK_CLASSES, QUICK_STEPS, QUICK_MEMORY_REPEATS
    return DEFAULT_ROWS, DEFAULT_HIDDEN, DEFAULT_CLASSES, DEFAULT_STEPS, MEMORY_REPEATS


def measure(rows: int, hidden: int, classes: Sequence[int], steps: int,
            progress=None, repeats: int = MEMORY_REPEATS) -> Dict[str, Any]:
    """The section: every case at every vocabulary size, `repeats` child processes per case,
    each giving its memory and its steps' times."""

    results: Dict[str, Any] = {
        "rows": rows, "hidden": hidden, "steps": steps, "repeats": repeats,
        "dtype": "float32",
        "method": (f"each case in {repeats} processes, the cases in turn: memory, VmHWM "
                   f"after clear_refs minus VmRSS before any step ran (a warm-up and {steps} "
                   f"timed steps), and the timed steps' time; medians over the processes"),
        "cases": {name: description for name, description in CASES},
        "sizes": [],
    }
    for num_classes in classes:
        size: Dict[str, Any] = {"classes": num_classes, "logits_bytes": 4 * rows * num_classes,
                                "extra_bytes": {}, "median_ms": {}, "times_ms": {},
                                "errors": {}, "failures": {}}
        names = [case for case, _ in CASES]
        memory: Dict[str, List[int]] = {case: [] for case in names}
        times: Dict[str, List[float]] = {case: [] for case in names}
        for repeat in range(repeats):  # the cases in turn, one case later each time
            for k in range(len(names)):
                case = names[(repeat + k) % len(names)]
                if case in size["failures"]:
                    continue
                found, failure = run_child(
                    [CHILD_FLAG, case, f"{rows}x{hidden}x{num_classes}x{steps}"]
                    + ([] if repeat == 0 else ["--no-errors"]))
                if progress is not None:
                    progress.step(f"linear head V={num_classes} {case} {repeat + 1}")
                if failure:
                    size["failures"][case] = failure
                    continue
                memory[case].append(found["extra_bytes"])
                times[case].extend(found["times_ms"])
                results["backends"] = found["backends"]
                if "errors" in found:
                    size["errors"][case] = found["errors"]
        ok = [case for case in names if memory[case] and case not in size["failures"]]
        size["extra_bytes_runs"] = {case: memory[case] for case in ok}
        size["extra_bytes"] = {case: int(statistics.median(memory[case])) for case in ok}
        size["times_ms"] = {case: times[case] for case in ok}
        size["median_ms"] = {case: statistics.median(times[case]) for case in ok}
        size["targets"] = targets(size)
        results["sizes"].append(size)
    return results


def targets(size: Dict[str, Any]) -> Dict[str, Any]:
    """Each fused case's memory over each composition's (target <= 1/8), its time over
    dense_custom's (target <= 1), and whether each is met; absent where a case failed."""
    out: Dict[str, Any] = {}
    extra, ms = size["extra_bytes"], size["median_ms"]
    for fused in FUSED_CASES:
        for other in ("dense_custom", "dense_keras"):
            if fused in extra and extra.get(other):
                ratio = extra[fused] / extra[other]
                out[f"memory {fused} / {other}"] = ratio
                out[f"memory {fused} <= 1/8 of {other}"] = ratio <= MEMORY_TARGET
        if fused in ms and ms.get("dense_custom"):
            out[f"time {fused} / dense_custom"] = ms[fused] / ms["dense_custom"]
            out[f"time {fused} <= {TIME_TARGET} x dense_custom"] = (
                ms[fused] <= TIME_TARGET * ms["dense_custom"])
        if fused in ms and ms.get("dense_keras"):
            out[f"time {fused} / dense_keras"] = ms[fused] / ms["dense_keras"]
            out[f"time {fused} < dense_keras"] = ms[fused] < ms["dense_keras"]
    return out


def format_section(section: Dict[str, Any]) -> List[str]:
    lines = [f"linear head, h [{section['rows']}, {section['hidden']}] @ W [{section['hidden']}, V]"
             f" + b, mean loss, forward + backward ({section['method']}):"]
    for name, description in CASES:
        lines.append(f"  {name:<13} {description}")
    for name, value in section.get("backends", {}).items():
        lines.append(f"  {name}: {value}")
    for size in section["sizes"]:
        lines.append(f"  V = {size['classes']} (the logits alone are "
                     f"{size['logits_bytes'] / 2**20:.0f} MiB)")
        for case, _ in CASES:
            if case in size["failures"]:
                lines.append(f"    {case:<13} failed: {size['failures'][case]}")
                continue
            text = (f"    {case:<13} {size['extra_bytes'][case] / 2**20:9.1f} MiB extra "
                    f"{size['median_ms'][case]:10.1f} ms")
            if case in size["errors"]:
                text += "  error " + ", ".join(f"{k} {v:.2g}"
                                                for k, v in size["errors"][case].items())
            lines.append(text)
        for name, value in size["targets"].items():
            lines.append(f"    {name}: {value:.3f}" if isinstance(value, float)
                         else f"    {name}: {'yes' if value else 'NO'}")
    return lines


def parse_child_size(text: str) -> Tuple[int, int, int, int]:
    """rows x hidden x classes x steps, as the children are given them."""
    rows, hidden, classes, steps = (int(part) for part in text.split("x"))
    return rows, hidden, classes, steps
