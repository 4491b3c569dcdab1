"""`python -m tf_metal_ops bench`: CustomLoss on the CPU against the losses users write by hand.

For each problem size (N rows x C classes, float32 logits unless `--dtype` says otherwise,
forward + backward under
`tf.function`, the loss reduced to its mean as Keras does) it times

    tf_sparse_ce    tf.nn.sparse_softmax_cross_entropy_with_logits   (TensorFlow's fused op)
    keras_ce_ls     keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    keras_focal     keras.losses.CategoricalFocalCrossentropy(from_logits=True, gamma=2,
                    label_smoothing=0.1)
    ours_ce         tf_metal_ops.CustomLoss()
    ours_ce_ls      tf_metal_ops.CustomLoss(label_smoothing=0.1)
    ours_focal      tf_metal_ops.CustomLoss(gamma=2, label_smoothing=0.1)
    *_xla           keras_ce_ls, keras_focal, ours_ce_ls and ours_focal with the step compiled
                    by XLA (tf.function(jit_compile=True)), where ours is the loss composed of
                    TensorFlow ops (tf_metal_ops.composed): what a CUDA or TPU machine runs
    floor           the memory floor: read the logits twice and write a gradient once (12 bytes
                    per element in float32, 6 in float16 and bfloat16), on the same threads as
                    our kernels (csrc/cpu/memory_floor.h), into a buffer allocated once
    tf_floor        the same traffic as TensorFlow ops (reduce_sum(z) and z * 0.5), which also
                    allocate a fresh N x C output each step as every loss here does
    tf_call         a tf.function that moves no data (a constant and the logits handed back):
                    the fixed cost of calling a step, which every case above but `floor` pays

Ours run as in training: CustomLoss's mean is a reduced loss, whose forward op also computes
the gradient (csrc/problem.h); the backward only hands it on.

The cases are timed interleaved (every repeat runs every case once, in an order shuffled anew
with a fixed seed, so a busy moment on a shared machine hits all of them alike and no case always
follows the same one: a case run right after one that allocates and frees much pays for it) and
the report gives medians and the ratios the performance issue asks for: anchor / ours (how many
times faster we are) and ours / floor (how far from what the memory system allows). With
`--memory` (on by default outside `--quick`) it also measures
the peak extra memory of one forward + backward step, ours against Keras's focal loss, each in
a fresh subprocess: peak resident memory during the step minus resident memory just before it;
and the same over 5 steps of a language model's head (`h @ W + b`, h [8192, 512], W [512, 32000],
then the loss, forward + backward with respect to h, W and b), CustomLoss() against Keras's
SparseCategoricalCrossentropy(from_logits=True): there the logits are made inside the step, so
each loss may write its gradient over them.

Usage:
    python -m tf_metal_ops bench [--quick] [--json] [--sizes 4096x1000,512x32000]
                                 [--dtype float32|float16|bfloat16] [--margin M]
                                 [--repeats R] [--threads T] [--memory | --no-memory]
                                 [--memory-size 65536x1000]
                                 [--linear-head | --linear-head-only | --metal-kernel-only]
                                 [--no-metal-kernel]

`--dtype` sets the logits' dtype of every timed case (labels, targets and the floor follow: the
floor moves the dtype's bytes, 3 x its size per element); the memory sections stay float32.
A case TensorFlow cannot run in that dtype is reported as unavailable, with the reason.
The logits are standard normal; `--margin M` raises each row's labelled logit by M, as in a
trained model's rows, whose labelled class has p near 1 (M = 8 at 10 classes and 12 at 1000 give
p_y above 0.9): the cases whose speed depends on the values (the focal terms of those classes)
then run as they do late in training.

Where the CPU's instruction counter can be read (Linux with a PMU:
tf_metal_ops/tools/bench/instructions.py), each case also runs once counted and the table gains
its instructions per element, which load does not move; elsewhere the report says why not.

`--linear-head` adds the section of tf_metal_ops/tools/bench/linear_head.py (linear_cross_entropy
against Dense(V) + CustomLoss and Dense(V) + Keras's sparse cross-entropy: memory, time and
error against float64, N = 8192, d = 512, V in {32000, 128256}; tiny sizes and one process
per case instead of three with `--quick`);
`--linear-head-only` runs that section alone.

The metal_kernel row (tf_metal_ops/tools/bench/metal_kernel.py, on unless `--no-metal-kernel` or
`--linear-head-only`): MLX's exp kernel through `tf_metal_ops.metal_kernel` on the CPU path
against tf.exp over 2^20 float32 values (2^12 with `--quick`), the ratio of the medians;
`--metal-kernel-only` runs that row alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from tf_metal_ops.tools.arguments import non_negative_int, positive_int
from tf_metal_ops.tools.bench import instructions as bench_instructions
from tf_metal_ops.tools.bench import linear_head as bench_linear_head
from tf_metal_ops.tools.bench import metal_kernel as bench_metal_kernel
from tf_metal_ops.tools.bench.process import reset_peak_rss, run_child, status_kib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SCHEMA = "tf_metal_ops.bench/1"
DEFAULT_SIZES = ((4096, 1000), (65536, 1000), (512, 32000), (65536, 10), (8, 262144))
QUICK_SIZES = ((64, 10), (16, 1000))
DEFAULT_MEMORY_SIZE = (65536, 1000)
QUICK_MEMORY_SIZE = (256, 100)
LABEL_SMOOTHING = 0.1
GAMMA = 2.0
DTYPES = ("float32", "float16", "bfloat16")

# (case, what it is). Anchors first, then ours, then the floor.
CASES = (
    ("tf_sparse_ce", "tf.nn.sparse_softmax_cross_entropy_with_logits"),
    ("keras_ce_ls", "keras CategoricalCrossentropy(from_logits, label_smoothing=0.1)"),
    ("keras_focal", "keras CategoricalFocalCrossentropy(from_logits, gamma=2, ls=0.1)"),
    ("ours_ce", "tf_metal_ops.CustomLoss()"),
    ("ours_ce_ls", "tf_metal_ops.CustomLoss(label_smoothing=0.1)"),
    ("ours_focal", "tf_metal_ops.CustomLoss(gamma=2, label_smoothing=0.1)"),
    ("keras_ce_ls_xla", "keras_ce_ls under XLA (tf.function(jit_compile=True))"),
    ("keras_focal_xla", "keras_focal under XLA"),
    ("ours_ce_ls_xla", "ours_ce_ls under XLA: our composed path (tf_metal_ops.composed)"),
    ("ours_focal_xla", "ours_focal under XLA: our composed path"),
    ("floor", "memory floor: read logits twice + write gradient once (3 x the dtype's bytes "
              "per element: 12 B in float32)"),
    ("tf_floor", "the same bytes as TensorFlow ops (reduce_sum(z), z * 0.5) under "
                 "tf.function: adds what allocating a fresh N x C output costs"),
    ("tf_call", "a tf.function call that moves no data: the fixed cost of a step"),
)
# (ratio name, numerator case, denominator case): speed-ups of ours and distances to the floor.
RATIOS = (
    ("tf_sparse_ce / ours_ce", "tf_sparse_ce", "ours_ce"),
    ("keras_ce_ls / ours_ce_ls", "keras_ce_ls", "ours_ce_ls"),
    ("keras_focal / ours_focal", "keras_focal", "ours_focal"),
    ("keras_ce_ls_xla / ours_ce_ls_xla", "keras_ce_ls_xla", "ours_ce_ls_xla"),
    ("keras_focal_xla / ours_focal_xla", "keras_focal_xla", "ours_focal_xla"),
    ("ours_ce / floor", "ours_ce", "floor"),
    ("ours_focal / floor", "ours_focal", "floor"),
    ("ours_ce / tf_floor", "ours_ce", "tf_floor"),
    ("ours_focal / tf_floor", "ours_focal", "tf_floor"),
    ("tf_call / floor", "tf_call", "floor"),
)
MEMORY_CASES = ("ours_focal", "keras_focal")
XLA_SUFFIX = "_xla"  # a case compiled with XLA: the loss of the case without the suffix
LM_HEAD_CASES = ("ours_ce", "keras_sparse_ce")
LM_HEAD_STEPS = 5
DEFAULT_LM_HEAD_SIZE = (8192, 512, 32000)  # rows, hidden width, classes
QUICK_LM_HEAD_SIZE = (64, 16, 100)


# ---------------------------------------------------------------------------------------------
# Arguments


def _size(text: str) -> Tuple[int, int]:
    try:
        rows, cols = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NxC such as 4096x1000, got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"N and C must be >= 1, got {text!r}")
    return rows, cols


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 8, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"the margin must be finite and >= 0, got {text!r}")
    return value


def _sizes(text: str) -> List[Tuple[int, int]]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected one or more NxC sizes, comma separated")
    return [_size(p.strip()) for p in parts]


def build_parser(prog: str = "tf-metal-ops bench", add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        add_help=add_help,
        description="Time CustomLoss (forward + backward, CPU) against TensorFlow's and Keras's "
        "losses and the machine's memory floor; report medians of interleaved runs and ratios.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few repeats (CI: proves the benchmark runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="comma-separated NxC sizes (default: "
                        + ",".join(f"{n}x{c}" for n, c in DEFAULT_SIZES) + ")")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the logits' dtype of the timed cases (default float32); the "
                        "floor moves that dtype's bytes")
    parser.add_argument("--margin", type=_margin, default=0.0,
                        help="raise each row's labelled logit by this much (default 0): a "
                        "trained model's confident rows")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed runs per case and size (default: by size, 5 to 15)")
    parser.add_argument("--threads", type=non_negative_int, default=None,
                        help="thread cap of our CPU kernels (tf_metal_ops.set_cpu_threads; "
                        "0: as TensorFlow's intra-op threads); default: leave as is")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory", dest="memory", action="store_true", default=None,
                        help="measure peak extra memory of one step (default: on unless --quick)")
    memory.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--memory-size", type=_size, default=None,
                        help="NxC of the memory measurement (default 65536x1000; 256x100 with "
                        "--quick)")
    linear_head = parser.add_mutually_exclusive_group()
    linear_head.add_argument("--linear-head", action="store_true",
                             help="also run the linear_cross_entropy section")
    linear_head.add_argument("--linear-head-only", action="store_true",
                             help="run only the linear_cross_entropy section")
    linear_head.add_argument("--metal-kernel-only", action="store_true",
                             help="run only the metal_kernel row")
    parser.add_argument("--no-metal-kernel", dest="metal_kernel", action="store_false",
                        help="leave out the metal_kernel row (exp kernel against tf.exp)")
    return parser


# ---------------------------------------------------------------------------------------------
# The cases


def _repeats_for(rows: int, cols: int, quick: bool) -> int:
    if quick:
        return 3
    # About 2e8 elements per case in total, between 5 and 45 runs: on a shared or virtual
    # machine a run now and then takes several times the others (the host backing fresh
    # memory), and the median must stay clear of them; small sizes, whose runs take
    # milliseconds, get more of them, since a busy spell of a second spoils several in a row
    # (15 runs at 4096 x 1000 once gave a median twice the usual).
    return max(5, min(45, int(2e8 // max(rows * cols, 1))))


def _make_inputs(rows: int, cols: int, seed: int = 0, dtype: str = "float32",
                 margin: float = 0.0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    logits_np = rng.standard_normal((rows, cols), dtype=np.float32)
    labels_np = rng.integers(0, cols, rows).astype(np.int32)
    logits_np[np.arange(rows), labels_np] += np.float32(margin)
    logits = tf.cast(tf.constant(logits_np), dtype)
    labels = tf.constant(labels_np)
    return logits_np, logits, labels


def _loss_fns(labels, cols: int, needed: Sequence[str],
              dtype: str = "float32") -> Dict[str, Callable]:
    """Per case, logits -> scalar loss (mean over the batch, as Keras reduces)."""
    import keras
    import tensorflow as tf

    import tf_metal_ops

    one_hot = None
    if any(name.startswith("keras") for name in needed):
        # Keras's categorical losses need it, in the logits' dtype.
        one_hot = tf.one_hot(labels, cols, dtype=dtype)
    fns: Dict[str, Callable] = {}
    for name in needed:
        if name.endswith(XLA_SUFFIX):  # the same loss; _step compiles it with XLA
            fns.update({name: fn for fn in _loss_fns(labels, cols, [name[:-len(XLA_SUFFIX)]],
                                                     dtype).values()})
        elif name == "tf_sparse_ce":
            fns[name] = lambda z: tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=z))
        elif name == "keras_ce_ls":
            loss = keras.losses.CategoricalCrossentropy(from_logits=True,
                                                        label_smoothing=LABEL_SMOOTHING)
            fns[name] = lambda z, loss=loss: loss(one_hot, z)
        elif name == "keras_focal":
            loss = keras.losses.CategoricalFocalCrossentropy(
                from_logits=True, gamma=GAMMA, label_smoothing=LABEL_SMOOTHING)
            fns[name] = lambda z, loss=loss: loss(one_hot, z)
        elif name in ("ours_ce", "ours_ce_ls", "ours_focal"):
            # 16-bit logits reach the op as they are only with a loss of their dtype (at its
            # default, float32, Keras's Loss.__call__ would time a float32 copy of them).
            loss = tf_metal_ops.CustomLoss(
                gamma=GAMMA if name == "ours_focal" else 0.0,
                label_smoothing=0.0 if name == "ours_ce" else LABEL_SMOOTHING,
                dtype=dtype if dtype in ("float16", "bfloat16") else None)
            fns[name] = lambda z, loss=loss: loss(labels, z)
        else:
            raise ValueError(f"unknown case {name!r}")
    return fns


def _step(loss_fn: Callable, jit_compile: bool = False) -> Callable:
    """A tf.function computing the loss and d loss / d logits: one training step's loss work."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile, reduce_retracing=False)
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = loss_fn(z)
        return loss, tape.gradient(loss, z)

    return step


def _floor_step(logits_np) -> Callable:
    """The memory floor's passes: a read (as the forward op) and a read + write (as the
    gradient op), into a gradient buffer allocated once."""
    import numpy as np

    from tf_metal_ops import _native

    runtime = _native.runtime()
    grad = np.empty_like(logits_np)

    def run() -> None:
        runtime.memory_floor_pass(logits_np)
        runtime.memory_floor_pass(logits_np, grad)

    return run


def _tf_floor_step(logits) -> Callable:
    """12 bytes per element through TensorFlow's own kernels and allocator: a reduction (the
    forward's read) and a scaled copy into a newly allocated tensor (the gradient's read and
    write). Every loss above also allocates its N x C gradient on each step, which on some
    systems (page faults on fresh memory) costs more than the traffic itself."""
    import tensorflow as tf

    @tf.function
    def step(z):
        return tf.reduce_sum(z), z * 0.5

    def run() -> None:
        total, scaled = step(logits)
        total.numpy()
        del scaled

    return run


def _tf_call_step(logits) -> Callable:
    """A step's call with no work in it, shaped as the others (the logits in, a scalar and an
    N x C tensor out, the scalar read back): what a step costs before it moves a byte. Where it
    is near the floor (few bytes per step), no step through tf.function can come near the floor."""
    import tensorflow as tf

    @tf.function
    def step(z):
        return tf.constant(0.0), z

    def run() -> None:
        total, same = step(logits)
        total.numpy()
        del same

    return run


class _Progress:
    """A one-line progress bar on stderr (a plain line per size when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.tty:
            width = 30
            filled = int(width * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total} {label:<40.40}")
            sys.stderr.flush()

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r" + " " * 80 + "\r")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


def run_orders(names: Sequence[str], repeats: int, seed: int) -> List[List[str]]:
    """The order of the cases in each repeat: every case once, shuffled anew with a fixed seed.
    A rotation would keep each case's predecessor, and a case always run right after one that
    allocates and frees much pays for it in every repeat (CustomLoss() after Keras's focal loss
    did, docs/performance.md has the figures)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(repeats):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def time_size(rows: int, cols: int, repeats: int, progress: _Progress,
              cases: Sequence[str] = tuple(name for name, _ in CASES),
              dtype: str = "float32",
              counter: Optional[bench_instructions.InstructionCounter] = None,
              margin: float = 0.0) -> Dict[str, Any]:
    """Times every case at one size, interleaved; returns medians (ms) and ratios. A case that
    fails in its warm-up (TensorFlow has no kernel for the dtype) is left out, its error kept.
    With a `counter`, each case runs once more, counted: its instructions per element. `margin`
    raises each row's labelled logit (_make_inputs)."""
    logits_np, logits, labels = _make_inputs(rows, cols, dtype=dtype, margin=margin)
    itemsize = logits.dtype.size
    fns = _loss_fns(labels, cols, [c for c in cases if c not in ("floor", "tf_floor", "tf_call")],
                    dtype)
    runners: Dict[str, Callable[[], None]] = {}
    for name, fn in fns.items():
        step = _step(fn, jit_compile=name.endswith(XLA_SUFFIX))

        def run(step=step) -> None:
            loss, grad = step(logits)
            loss.numpy()  # the step has finished; the gradient is materialized
            del grad

        runners[name] = run
    if "floor" in cases:
        # The dtype's bytes as float32 rows (the passes are about bytes, not values): half as
        # many columns for 16-bit logits.
        import numpy as np

        rows_of_bytes = logits_np[:, :-(-cols * itemsize // logits_np.itemsize)]
        runners["floor"] = _floor_step(np.ascontiguousarray(rows_of_bytes))
    if "tf_floor" in cases:
        runners["tf_floor"] = _tf_floor_step(logits)
    if "tf_call" in cases:
        runners["tf_call"] = _tf_call_step(logits)

    errors: Dict[str, str] = {}
    for name in list(runners):  # trace and warm up outside the timing
        try:
            runners[name]()
        except Exception as error:  # noqa: BLE001 - reported, the other cases go on
            errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            del runners[name]
        progress.step(f"{rows}x{cols} warm-up {name}")
    names = list(runners)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for order in run_orders(names, repeats, seed=rows * 1_000_003 + cols):
        for name in order:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
            progress.step(f"{rows}x{cols} {name}")
    medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    instructions = ({name: counter.count(runners[name]) / (rows * cols) for name in names}
                    if counter is not None else {})
    ratios = {}
    for ratio, numerator, denominator in RATIOS:
        if numerator in medians and denominator in medians and medians[denominator] > 0:
            ratios[ratio] = medians[numerator] / medians[denominator]
    floor_bytes = 3 * itemsize * rows * cols
    result = {
        "rows": rows,
        "classes": cols,
        "dtype": dtype,
        "repeats": repeats,
        "median_ms": medians,
        "min_ms": {name: 1e3 * min(values) for name, values in times.items()},
        "ratios": ratios,
        "instructions_per_element": instructions,
        "floor_bytes": floor_bytes,
        "floor_gb_per_s": (floor_bytes / (medians["floor"] * 1e-3) / 1e9
                           if medians.get("floor") else None),
        "errors": errors,
    }
    del runners, fns, logits, labels, logits_np
    gc.collect()
    return result


# ---------------------------------------------------------------------------------------------
# Peak extra memory of one step, in a subprocess per case

_MEMORY_CHILD_FLAG = "--_memory-child"
_LM_HEAD_CHILD_FLAG = "--_lm-head-memory-child"


def _memory_child(case: str, rows: int, cols: int) -> Dict[str, Any]:
    """Runs in a fresh process: one warm-up step, then measures a second step's peak."""
    import resource

    logits_np, logits, labels = _make_inputs(rows, cols)
    step = _step(_loss_fns(labels, cols, [case])[case])
    loss, grad = step(logits)  # traces, and lets allocators reach their steady state
    loss.numpy()
    del loss, grad
    gc.collect()
    if reset_peak_rss():
        method = "VmHWM after clear_refs minus VmRSS before the step"
        before = status_kib("VmRSS")
        loss, grad = step(logits)
        loss.numpy()
        peak = status_kib("VmHWM")
        # The measured step is the first to write into the buffer the warm-up step set aside
        # for it, so its faults count; from then on that buffer stays between steps.
        del loss, grad
        gc.collect()
    else:  # no /proc: ru_maxrss includes the warm-up step, so this is an upper bound
        method = "ru_maxrss minus resident size before the warm-up (upper bound)"
        before = None
        loss, grad = step(logits)
        loss.numpy()
        peak = None
    if before is None or peak is None:
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = usage // 1024 if sys.platform == "darwin" else usage  # bytes on macOS
        before = 0
    return {"case": case, "extra_bytes": 1024 * (peak - before), "method": method}


def _lm_head_memory_child(case: str, rows: int, hidden: int, cols: int) -> Dict[str, Any]:
    """Runs in a fresh process: a traced warm-up step, then the peak over LM_HEAD_STEPS steps."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_metal_ops

    rng = np.random.default_rng(0)
    h = tf.constant(rng.standard_normal((rows, hidden), dtype=np.float32))
    w = tf.Variable(rng.standard_normal((hidden, cols), dtype=np.float32) / hidden ** 0.5)
    b = tf.Variable(tf.zeros([cols]))
    labels = tf.constant(rng.integers(0, cols, rows).astype(np.int32))
    loss_fn = (tf_metal_ops.CustomLoss() if case == "ours_ce"
               else keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(h)
            loss = loss_fn(labels, h @ w + b)
        grads = tape.gradient(loss, [h, w, b])
        # Only the loss leaves the step: the gradients' sizes are the same for both losses.
        return loss + sum(tf.reduce_sum(g) for g in grads) * 0.0

    step().numpy()
    gc.collect()
    if not reset_peak_rss():
        raise RuntimeError("the LM-head memory figure needs Linux's /proc/self/clear_refs")
    before = status_kib("VmRSS")
    for _ in range(LM_HEAD_STEPS):
        step().numpy()
    peak = status_kib("VmHWM")
    return {"case": case, "extra_bytes": 1024 * (peak - before),
            "method": f"VmHWM after clear_refs minus VmRSS before {LM_HEAD_STEPS} steps"}


def _memory_children(flag: str, cases: Sequence[str], size: str, label: str,
                     progress: _Progress, result: Dict[str, Any]) -> None:
    """Runs each case's memory child (`python -m tf_metal_ops.tools.bench FLAG CASE SIZE`) in a
    fresh process and files its extra bytes, its method, or its error in `result`."""
    for case in cases:
        child, failure = run_child([flag, case, size])
        progress.step(f"{label} {case}")
        if failure:
            result["errors"][case] = failure
            continue
        result["extra_bytes"][case] = child["extra_bytes"]
        result["method"] = child["method"]


def measure_memory(rows: int, cols: int, progress: _Progress) -> Dict[str, Any]:
    """Peak extra memory of a forward + backward step, ours against Keras's focal loss."""
    result: Dict[str, Any] = {
        "rows": rows,
        "classes": cols,
        "gradient_bytes": 4 * rows * cols,
        "extra_bytes": {},
        "extra_over_gradient": {},
        "method": None,
        "errors": {},
    }
    _memory_children(_MEMORY_CHILD_FLAG, MEMORY_CASES, f"{rows}x{cols}", "memory", progress,
                     result)
    for case, extra in result["extra_bytes"].items():
        result["extra_over_gradient"][case] = extra / result["gradient_bytes"]
    return result


def measure_lm_head_memory(rows: int, hidden: int, cols: int,
                           progress: _Progress) -> Dict[str, Any]:
    """Peak extra memory of LM_HEAD_STEPS language-model-head steps, ours against Keras's."""
    result: Dict[str, Any] = {"rows": rows, "hidden": hidden, "classes": cols,
                              "steps": LM_HEAD_STEPS, "logits_bytes": 4 * rows * cols,
                              "extra_bytes": {}, "method": None, "errors": {}}
    _memory_children(_LM_HEAD_CHILD_FLAG, LM_HEAD_CASES, f"{rows}x{hidden}x{cols}",
                     "LM-head memory", progress, result)
    return result


# ---------------------------------------------------------------------------------------------
# Report


def environment() -> Dict[str, Any]:
    import tensorflow as tf

    import tf_metal_ops
    from tf_metal_ops import _native

    runtime = _native.runtime()
    return {
        "tf_metal_ops": getattr(tf_metal_ops, "__version__", "unknown"),
        "tensorflow": tf.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu_count": os.cpu_count(),
        "cpu_kernel_isa": runtime.cpu_kernel_isa(),
        "cpu_threads": int(runtime.get_cpu_threads()),
        "tf_intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "tf_inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        # Both change what a fresh N x C tensor costs, for every case: TensorFlow's caching CPU
        # allocator reuses memory (no page faults), and so does oneDNN's, which TensorFlow turns
        # on by itself on x86-64 CPUs with AVX-512 VNNI, BF16 or AMX.
        "tf_cpu_allocator": ("bfc" if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower()
                             in ("1", "true") else "default"),
        "tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"),
        "tf_onednn": _onednn_state(),
    }


def _onednn_state() -> str:
    """"on" or "off": whether TensorFlow runs with oneDNN here, which it decides by itself from
    the CPU when TF_ENABLE_ONEDNN_OPTS is unset; "unknown" where TensorFlow does not say."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return "on" if _pywrap_util_port.IsMklEnabled() else "off"
    except (ImportError, AttributeError):  # a private module of TensorFlow's
        return "unknown"


def _format_sizes(sizes) -> List[str]:
    lines = [""]
    for name, description in CASES:
        lines.append(f"  {name:<15} {description}")
    lines.append("")
    labels = [f"{size['rows']}x{size['classes']}" for size in sizes]
    lines.append(f"{'median ms':<34}" + "".join(f"{label:>14}" for label in labels))
    for name, _ in CASES:
        lines.append(f"{name:<34}" + "".join(
            f"{size['median_ms'][name]:14.2f}" if name in size["median_ms"] else f"{'-':>14}"
            for size in sizes))
    lines.append("")
    lines.append(f"{'ratio':<34}" + "".join(f"{label:>14}" for label in labels))
    for name, _, _ in RATIOS:
        lines.append(f"{name:<34}" + "".join(
            f"{size['ratios'][name]:13.2f}x" if name in size["ratios"] else f"{'-':>14}"
            for size in sizes))
    lines.append("  (anchor / ours: how many times faster ours is; ours / floor: 1.00 would be "
                 "the memory floor)")
    if any(size.get("instructions_per_element") for size in sizes):
        lines.append("")
        lines.append(f"{'instructions per element':<34}" +
                     "".join(f"{label:>14}" for label in labels))
        for name, _ in CASES:
            lines.append(f"{name:<34}" + "".join(
                f"{size['instructions_per_element'][name]:14.1f}"
                if name in size.get("instructions_per_element", {}) else f"{'-':>14}"
                for size in sizes))
    for size in sizes:
        for name, error in size.get("errors", {}).items():
            lines.append(f"  {size['rows']}x{size['classes']} {name} unavailable: {error}")
    return lines


def format_table(report: Dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"tf_metal_ops bench: TensorFlow {env['tensorflow']}, {env['machine']}, "
        f"{env['cpu_count']} CPUs, our kernels: {env['cpu_kernel_isa']} x "
        f"{env['cpu_threads']} threads; {report['settings'].get('dtype', 'float32')}, "
        "forward + backward under tf.function, "
        "medians of interleaved runs (ms)",
    ]
    if report["settings"].get("margin"):
        lines.append(f"  logits: standard normal, each row's labelled one raised by "
                     f"{report['settings']['margin']:g}")
    # Whether a fresh N x C tensor is reused memory or fresh pages: on some machines the page
    # faults of a fresh gradient cost more than the loss's kernels (docs/performance.md).
    memory_line = (f"  memory: TensorFlow's CPU allocator {env.get('tf_cpu_allocator')}, "
                   f"oneDNN {env.get('tf_onednn', 'unknown')}")
    if env.get("tf_enable_onednn_opts", "unset") != "unset":
        memory_line += f" (TF_ENABLE_ONEDNN_OPTS={env.get('tf_enable_onednn_opts')})"
    lines.append(memory_line)
    sizes = report["sizes"]
    if sizes and "instruction_counter" in env:
        lines.append(f"  instruction counts: {env['instruction_counter']}")
    if sizes:
        lines.extend(_format_sizes(sizes))
    memory = report.get("memory")
    if memory:
        lines.append("")
        lines.append(f"peak extra memory of one step at {memory['rows']}x{memory['classes']} "
                     f"(the gradient alone is {memory['gradient_bytes'] / 2**20:.1f} MiB):")
        for case in MEMORY_CASES:
            if case in memory["extra_bytes"]:
                lines.append(f"  {case:<12} {memory['extra_bytes'][case] / 2**20:10.1f} MiB "
                             f"= {memory['extra_over_gradient'][case]:.2f} x gradient")
            else:
                lines.append(f"  {case:<12} failed: {memory['errors'].get(case)}")
        if memory.get("method"):
            lines.append(f"  ({memory['method']})")
    if report.get("linear_head"):
        lines.append("")
        lines.extend(bench_linear_head.format_section(report["linear_head"]))
    if report.get("metal_kernel"):
        lines.append("")
        lines.extend(bench_metal_kernel.format_section(report["metal_kernel"]))
    lm_head = report.get("lm_head_memory")
    if lm_head:
        lines.append("")
        lines.append(f"peak extra memory of a language model's head, h @ W + b then the loss, "
                     f"h [{lm_head['rows']}, {lm_head['hidden']}], W [{lm_head['hidden']}, "
                     f"{lm_head['classes']}], {lm_head['steps']} steps (the logits alone are "
                     f"{lm_head['logits_bytes'] / 2**20:.1f} MiB):")
        for case in LM_HEAD_CASES:
            if case in lm_head["extra_bytes"]:
                extra = lm_head["extra_bytes"][case]
                lines.append(f"  {case:<16} {extra / 2**20:10.1f} MiB "
                             f"= {extra / lm_head['logits_bytes']:.2f} x logits")
            else:
                lines.append(f"  {case:<16} failed: {lm_head['errors'].get(case)}")
        if lm_head.get("method"):
            lines.append(f"  ({lm_head['method']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import tf_metal_ops

    if args.threads is not None:
        tf_metal_ops.set_cpu_threads(args.threads)
    only_linear_head = getattr(args, "linear_head_only", False)
    only_one = only_linear_head or getattr(args, "metal_kernel_only", False)
    sizes = [] if only_one else (args.sizes or list(QUICK_SIZES if args.quick
                                                            else DEFAULT_SIZES))
    do_memory = (not args.quick and not only_one) if args.memory is None else args.memory
    memory_size = args.memory_size or (QUICK_MEMORY_SIZE if args.quick else DEFAULT_MEMORY_SIZE)
    plan = [(rows, cols, args.repeats or _repeats_for(rows, cols, args.quick))
            for rows, cols in sizes]
    total = sum(len(CASES) * (repeats + 1) for _, _, repeats in plan)
    total += len(MEMORY_CASES) + len(LM_HEAD_CASES) if do_memory else 0
    if only_linear_head or getattr(args, "linear_head", False):
        _, _, classes, _, repeats = bench_linear_head.settings(args.quick)
        total += len(bench_linear_head.CASES) * repeats * len(classes)
    metal_kernel = _metal_kernel_plan(args)
    if metal_kernel is not None:
        total += len(bench_metal_kernel.CASES) * metal_kernel[1]
    progress = _Progress(total, enabled=True)
    # Every case is a new tf.function by design; TensorFlow's "retracing" warning would be noise.
    import tensorflow as tf

    logger = tf.get_logger()
    previous_level = logger.level
    logger.setLevel("ERROR")
    try:
        return _run_plan(args, plan, do_memory, memory_size, progress)
    finally:
        logger.setLevel(previous_level)


def _metal_kernel_plan(args: argparse.Namespace) -> Optional[Tuple[int, int]]:
    """(elements, repeats) of the metal_kernel row, or None when it is left out."""
    if not getattr(args, "metal_kernel", True) or getattr(args, "linear_head_only", False):
        return None
    mk = bench_metal_kernel
    return (mk.QUICK_ELEMENTS if args.quick else mk.ELEMENTS,
            args.repeats or (mk.QUICK_REPEATS if args.quick else mk.REPEATS))


def _run_plan(args: argparse.Namespace, plan, do_memory: bool, memory_size: Tuple[int, int],
              progress: _Progress) -> Dict[str, Any]:
    report: Dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "settings": {"quick": bool(args.quick), "gamma": GAMMA,
                     "dtype": getattr(args, "dtype", "float32"),
                     "margin": getattr(args, "margin", 0.0),
                     "label_smoothing": LABEL_SMOOTHING,
                     "cases": {name: description for name, description in CASES}},
        "sizes": [],
        "memory": None,
        "lm_head_memory": None,
        "linear_head": None,
        "metal_kernel": None,
    }
    counter, no_counter = bench_instructions.open_counter() if plan else (None, "")
    report["environment"]["instruction_counter"] = (
        "perf_event_open (user-space instructions of every thread)" if counter is not None
        else f"none: {no_counter}")
    for rows, cols, repeats in plan:
        result = time_size(rows, cols, repeats, progress,
                           dtype=getattr(args, "dtype", "float32"), counter=counter,
                           margin=getattr(args, "margin", 0.0))
        report["sizes"].append(result)
        progress.note(f"{rows}x{cols}: " + ", ".join(
            f"{name} {ms:.2f} ms" for name, ms in result["median_ms"].items()))
    if do_memory:
        report["memory"] = measure_memory(*memory_size, progress)
        report["lm_head_memory"] = measure_lm_head_memory(
            *(QUICK_LM_HEAD_SIZE if args.quick else DEFAULT_LM_HEAD_SIZE), progress)
    if getattr(args, "linear_head", False) or getattr(args, "linear_head_only", False):
        rows, hidden, classes, steps, repeats = bench_linear_head.settings(args.quick)
        report["linear_head"] = bench_linear_head.measure(
            rows, hidden, classes, args.repeats or steps, progress, repeats)
    metal_kernel = _metal_kernel_plan(args)
    if metal_kernel is not None:
        report["metal_kernel"] = bench_metal_kernel.measure(*metal_kernel, progress)
    progress.close()
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark; returns the exit code (0, or 2 for a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_MEMORY_CHILD_FLAG]:
        rows, cols = _size(argv[2])
        print(json.dumps(_memory_child(argv[1], rows, cols)))
        return 0
    if argv[:1] == [_LM_HEAD_CHILD_FLAG]:
        rows, hidden, cols = (int(part) for part in argv[2].split("x"))
        print(json.dumps(_lm_head_memory_child(argv[1], rows, hidden, cols)))
        return 0
    if argv[:1] == [bench_linear_head.CHILD_FLAG]:
        size = bench_linear_head.parse_child_size(argv[2])
        print(json.dumps(bench_linear_head.child(argv[1], *size,
                                                 with_errors="--no-errors" not in argv[3:])))
        return 0
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.metal_kernel_only and not args.metal_kernel:
            parser.error("argument --metal-kernel-only: not allowed with --no-metal-kernel")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return run_and_print(args)


def run_and_print(args: argparse.Namespace) -> int:
    """Runs the benchmark for parsed arguments and prints the table (or JSON)."""
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0

