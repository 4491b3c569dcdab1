"""Bad input never crashes, memory stays flat, and threads do not disturb each other.

* The raw ops are fuzzed in a child process (tests/raw_op_fuzz.py), so a segfault or abort is
  a failed test that names the signal and the case, not a dead pytest.
* The Python entry points (`custom_loss`, `CustomLoss`) are fuzzed in process with Hypothesis:
  any combination of good and bad arguments either gives the reference's answer or raises a
  TypeError / ValueError / InvalidArgumentError whose message names the argument at fault.
* Leaks: thousands of eager and tf.function executions, measured by the heap bytes in use
  (glibc's mallinfo2: exact, no page granularity) and by the resident set size.
* Concurrency: several Python threads calling the op at once (while another thread changes the
  kernel's thread cap) get bit-for-bit the results of sequential calls.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, List

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import tf_metal_ops
from tf_metal_ops import _native
from tf_metal_ops import reference as ref

pytestmark = pytest.mark.native

TESTS_DIR = Path(__file__).resolve().parent
FUZZ_SCRIPT = TESTS_DIR / "raw_op_fuzz.py"
# A guard against a hang, far beyond the ~20 s the fuzz program needs (TF import included):
# not a timing assertion, a bound on how long a hung child may hold CI.
FUZZ_TIMEOUT_S = 600
HANG_CASE_TIMEOUT_S = 240

# --------------------------------------------------------------------------------------------
# The raw ops, in a child process
# --------------------------------------------------------------------------------------------


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The child imports the same tf_metal_ops as this process (an in-place build or the
    # installed package).
    package_root = str(Path(tf_metal_ops.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def run_fuzz(selection: str, timeout: float) -> List[dict]:
    """Runs raw_op_fuzz.py on the cases whose names contain `selection`; returns its results,
    failing the test with the signal and the case if the child died."""
    try:
        proc = subprocess.run([sys.executable, str(FUZZ_SCRIPT), selection], env=_child_env(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode() if isinstance(error.stderr, bytes) else error.stderr or ""
        started = [line for line in stderr.splitlines() if line.startswith("START ")]
        pytest.fail(f"the raw-op fuzz hung (killed after {timeout} s) in "
                    f"{started[-1][6:] if started else 'start-up'}")
    started = [line for line in proc.stderr.splitlines() if line.startswith("START ")]
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the raw-op fuzz crashed with {name} in "
                    f"{started[-1][6:] if started else 'start-up'}; stderr tail:\n"
                    + "\n".join(proc.stderr.splitlines()[-25:]))
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, f"the fuzz program ran no case (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode in (0, 1), (
        f"the fuzz program exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return results


def test_raw_ops_refuse_hostile_inputs_in_a_child_process():
    results = run_fuzz("", FUZZ_TIMEOUT_S)
    problems = [r for r in results if "problem" in r]
    assert not problems, "\n".join(
        f"{r['case']} [{r['mode']}]: {r['problem']} ({r.get('error', '')}: "
        f"{r.get('message', '')[:200]})" for r in problems)
    # The program really exercised both refusals and successes, in both modes.
    outcomes = {(r["outcome"], r["mode"]) for r in results}
    assert {("refused", "eager"), ("ok", "eager"), ("refused", "function"),
            ("ok", "function")} <= outcomes
    assert len(results) >= 200, len(results)


def test_raw_ops_empty_batch_with_huge_class_count_does_not_hang():
    """logits of shape [0, 2**62] hold no element: the kernel must not loop over the classes
    (before the fix this took centuries; it is run alone, under a timeout, to say so)."""
    results = run_fuzz("huge_classes", HANG_CASE_TIMEOUT_S)
    problems = [r for r in results if "problem" in r]
    assert not problems, problems
    assert len(results) == 4  # forward and gradient, eager and tf.function


# --------------------------------------------------------------------------------------------
# The Python entry points, in process
# --------------------------------------------------------------------------------------------

REFUSALS = (TypeError, ValueError, tf.errors.InvalidArgumentError)

# Each argument takes a value from a pool of good and bad ones; a bad value carries the words
# its error message must contain (any one of them).
GOOD, BAD = "good", "bad"
LOGITS_POOL = {
    "f32_3x4": (GOOD, lambda: np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)),
    "f16_3x4": (GOOD, lambda: np.random.default_rng(2).normal(size=(3, 4)).astype(np.float16)),
    "f64_3x4_nan": (GOOD, lambda: np.array([[np.nan, 0, 1, 2], [0, 0, 0, 0], [-np.inf, 0, 0, 0]])),
    "int_3x4": (BAD, lambda: np.ones((3, 4), np.int32), ("logits",)),
    "tf_int_3x4": (BAD, lambda: tf.ones((3, 4), tf.int32), ("logits",)),
    "complex_3x4": (BAD, lambda: np.ones((3, 4), np.complex64), ("logits",)),
    "strings": (BAD, lambda: np.array([["a", "b"], ["c", "d"]]), ("logits",)),
    "tf_strings": (BAD, lambda: tf.constant([["a", "b"]]), ("logits",)),
    "scalar": (BAD, lambda: np.float32(1.0), ("logits", "scalar", "rank")),
    "zero_classes": (BAD, lambda: np.zeros((3, 0), np.float32), ("class", "shape")),
    "ragged_list": (BAD, lambda: [[1.0, 2.0], [3.0]], ("logits", "shape", "sequence")),
    "none": (BAD, lambda: None, ("logits",)),
}
LABELS_POOL = {
    "ids_int32": (GOOD, lambda: np.array([0, 3, 1], np.int32)),
    "ids_int64_col": (GOOD, lambda: np.array([[0], [3], [1]], np.int64)),
    "ids_float": (GOOD, lambda: np.array([0.0, 3.0, 1.0], np.float32)),
    "dense": (GOOD, lambda: np.eye(4, dtype=np.float32)[[0, 3, 1]]),
    "huge": (BAD, lambda: np.array([0, 2**40, 1], np.int64), ("1099511627776",)),
    "negative": (BAD, lambda: np.array([0, -7, 1], np.int32), ("-7",)),
    "int32_min": (BAD, lambda: np.array([0, 1, -(2**31)], np.int32), ("-2147483648",)),
    "equal_c": (BAD, lambda: np.array([4, 0, 1], np.int32), ("4",)),
    "fractional": (BAD, lambda: np.array([0.5, 1.0, 2.0], np.float32), ("whole", "labels")),
    "nan": (BAD, lambda: np.array([np.nan, 1.0, 2.0], np.float32), ("whole", "labels")),
    "wrong_rows": (BAD, lambda: np.array([0, 1], np.int32), ("shape",)),
    "wrong_rank": (BAD, lambda: np.zeros((3, 4, 2), np.int32), ("shape",)),
    "dense_wrong_classes": (BAD, lambda: np.zeros((3, 5), np.float32), ("shape",)),
    "strings": (BAD, lambda: np.array(["a", "b", "c"]), ("labels",)),
    "complex": (BAD, lambda: np.ones(3, np.complex64), ("labels",)),
    "bool": (BAD, lambda: np.array([True, False, True]), ("labels",)),
}
GAMMA_POOL = {
    "0": (GOOD, 0.0), "2": (GOOD, 2), "0.5": (GOOD, np.float32(0.5)),
    "nan": (BAD, float("nan"), ("gamma",)), "inf": (BAD, float("inf"), ("gamma",)),
    "-1": (BAD, -1.0, ("gamma",)), "str": (BAD, "2", ("gamma",)),
    "none": (BAD, None, ("gamma",)), "bool": (BAD, True, ("gamma",)),
    "complex": (BAD, 1j, ("gamma",)),
}
SMOOTHING_POOL = {
    "0": (GOOD, 0.0), "0.1": (GOOD, 0.1), "1": (GOOD, 1),
    "nan": (BAD, float("nan"), ("label_smoothing",)), "-0.1": (BAD, -0.1, ("label_smoothing",)),
    "1.5": (BAD, 1.5, ("label_smoothing",)), "inf": (BAD, float("inf"), ("label_smoothing",)),
    "str": (BAD, "0.1", ("label_smoothing",)),
}
WEIGHTS_POOL = {
    "none": (GOOD, None), "ones": (GOOD, [1.0, 1.0, 1.0, 1.0]),
    "zeros_some": (GOOD, np.array([0.0, 2.0, 0.0, 1.0])),
    "tensor": (GOOD, tf.constant([1.0, 0.5, 2.0, 0.0])),
    "too_long": (BAD, [1.0] * 5, ("class_weights",)), "too_short": (BAD, [1.0] * 3, ("class_weights",)),
    "matrix": (BAD, np.ones((2, 4)), ("class_weights",)),
    "nan": (BAD, [1.0, float("nan"), 1.0, 1.0], ("class_weights",)),
    "inf": (BAD, [1.0, 1.0, float("inf"), 1.0], ("class_weights",)),
    "negative": (BAD, [1.0, -1.0, 1.0, 1.0], ("class_weights",)),
    "strings": (BAD, ["a", "b", "c", "d"], ("class_weights",)),
    "scalar": (BAD, 1.0, ("class_weights",)),
}
IGNORE_POOL = {
    "none": (GOOD, None), "-1": (GOOD, -1), "3": (GOOD, 3), "huge": (GOOD, 2**62),
    "float": (BAD, 1.5, ("ignore_class",)), "str": (BAD, "1", ("ignore_class",)),
    "bool": (BAD, True, ("ignore_class",)),
}


def _pick(pool):
    """One value of the pool: a bad one a quarter of the time, so a fair share of the examples
    are entirely good (and checked against the reference) and most have one or two bad ones."""
    good = sorted(k for k, v in pool.items() if v[0] == GOOD)
    bad = sorted(k for k, v in pool.items() if v[0] == BAD)
    return st.integers(0, 3).flatmap(
        lambda k: st.sampled_from(bad if k == 0 else good)).map(lambda key: (key, pool[key]))


def _value(entry):
    value = entry[1]
    return value() if callable(value) else value


@settings(max_examples=int(os.environ.get("TF_METAL_OPS_FUZZ_EXAMPLES", "150")),
          derandomize=os.environ.get("HYPOTHESIS_PROFILE", "ci") != "long", database=None,
          deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=_pick(LOGITS_POOL), labels=_pick(LABELS_POOL), gamma=_pick(GAMMA_POOL),
       smoothing=_pick(SMOOTHING_POOL), weights=_pick(WEIGHTS_POOL),
       ignore=_pick(IGNORE_POOL), traced=st.booleans())
def test_custom_loss_fuzz_refuses_clearly_or_matches_reference(logits, labels, gamma, smoothing,
                                                               weights, ignore, traced):
    """Any mix of good and bad arguments: the reference's answer, or an orderly exception whose
    message names one of the bad arguments (never a crash, never a silent wrong answer)."""
    chosen = {"logits": logits, "labels": labels, "gamma": gamma, "label_smoothing": smoothing,
              "class_weights": weights, "ignore_class": ignore}
    note({k: v[0] for k, v in chosen.items()})
    bad = {k: v[1][2] for k, v in chosen.items() if v[1][0] == BAD}
    dense = labels[0] == "dense"
    if dense and ignore[1][1] is not None:
        bad["ignore_class"] = ("ignore_class",)  # class-id labels only
    # Shape and range problems only exist once logits are usable (the first check that fails
    # wins), so the message may name any of the bad arguments.
    args = {k: _value(v[1]) for k, v in chosen.items()}
    if ignore[1][1] is not None and labels[0] in ("negative", "equal_c") and \
            np.isin(args["ignore_class"], args["labels"]).any():
        bad.pop("labels")  # the out-of-range value is the ignored class: fine

    def call():
        kw = {k: args[k] for k in ("gamma", "label_smoothing", "class_weights", "ignore_class")}
        if traced:
            return tf.function(lambda: tf_metal_ops.custom_loss(args["labels"], args["logits"],
                                                                 **kw))()
        return tf_metal_ops.custom_loss(args["labels"], args["logits"], **kw)

    event("bad arguments: " + (" ".join(sorted(bad)) or "none"))
    try:
        loss = call()
    except REFUSALS as error:
        message = str(error)
        assert bad, f"good arguments refused: {type(error).__name__}: {message[:400]}"
        words = [w for words in bad.values() for w in words]
        assert any(w.lower() in message.lower() for w in words), (
            f"the message does not name the problem (expected one of {words}): "
            f"{type(error).__name__}: {message[:400]}")
        return
    assert not bad, f"bad arguments {sorted(bad)} were accepted: {loss}"
    weights_value = args["class_weights"]
    if isinstance(weights_value, tf.Tensor):
        weights_value = weights_value.numpy()
    want = ref.custom_loss(args["labels"], np.asarray(args["logits"]),
                           gamma=float(np.float32(args["gamma"])),
                           label_smoothing=float(np.float32(args["label_smoothing"])),
                           class_weights=weights_value, ignore_class=args["ignore_class"])
    np.testing.assert_allclose(loss.numpy().astype(np.float64), want, rtol=3e-3, atol=3e-3)


def test_keras_loss_constructor_refuses_bad_parameters_by_name():
    for kwargs, word in ((dict(gamma=float("nan")), "gamma"), (dict(gamma=-2.0), "gamma"),
                         (dict(label_smoothing=2.0), "label_smoothing"),
                         (dict(class_weights=[1.0, float("nan")]), "class_weights"),
                         (dict(ignore_class=0.5), "ignore_class")):
        with pytest.raises(REFUSALS) as info:
            tf_metal_ops.CustomLoss(**kwargs)
        assert word in str(info.value), (kwargs, str(info.value))


# --------------------------------------------------------------------------------------------
# Leaks
# --------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_bytes_in_use() -> int:
    """Bytes malloc has handed out and not got back (all arenas, plus mmapped blocks)."""
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_linux_glibc = pytest.mark.skipif(
    _MALLINFO2 is None or not Path("/proc/self/statm").exists(),
    reason="the leak measurement reads glibc's mallinfo2 and /proc/self/statm (Linux)")

LEAK_CALLS = 6000
WARM_UP_CALLS = 1500
# A leak of one 8-byte TF_Status per call is 32 bytes of heap (malloc's minimum chunk); one of
# the op's [64, 100] float output, 25 KB. 8 bytes per call is far below either and far above
# the measured noise (below 0.1 byte per call).
HEAP_BYTES_PER_CALL = 8
# RSS grows in whole pages and with allocator caching: generous, yet a leaked output tensor
# (25 KB x 6000 calls = 150 MB) is far beyond it.
RSS_GROWTH_BYTES = 24 << 20


def _growth(step: Callable[[], None], calls: int = LEAK_CALLS, warm_up: int = WARM_UP_CALLS):
    for _ in range(warm_up):
        step()
    gc.collect()
    heap_before, rss_before = heap_bytes_in_use(), resident_bytes()
    for _ in range(calls):
        step()
    gc.collect()
    return heap_bytes_in_use() - heap_before, resident_bytes() - rss_before


def _leak_inputs():
    rng = np.random.default_rng(5)
    logits = tf.constant(rng.normal(size=(64, 100)), tf.float32)
    labels = tf.constant(rng.integers(0, 100, size=64), tf.int32)
    weights = tf.constant(rng.uniform(0, 2, size=100), tf.float32)
    return logits, labels, weights, tf.ones([64], tf.float32)


def _assert_flat(name: str, heap_growth: int, rss_growth: int, calls: int = LEAK_CALLS):
    per_call = heap_growth / calls
    assert per_call < HEAP_BYTES_PER_CALL and rss_growth < RSS_GROWTH_BYTES, (
        f"{name}: heap grew {heap_growth} bytes ({per_call:.1f} per call) and RSS "
        f"{rss_growth / 2**20:.1f} MiB over {calls} calls")


@needs_linux_glibc
def test_memory_stays_flat_over_many_eager_calls():
    ops = _native.op_module()
    logits, labels, weights, upstream = _leak_inputs()
    attrs = dict(gamma=2.0, label_smoothing=0.1)

    def forward():
        ops.tf_metal_ops_custom_loss(logits=logits, labels=labels, class_weights=weights,
                                     row_scales=tf.zeros([0]), **attrs)

    def gradient():
        ops.tf_metal_ops_custom_loss_grad(logits=logits, labels=labels, class_weights=weights,
                                          upstream=upstream, row_stats=tf.zeros([0, 3]),
                                          **attrs)

    def through_tape():
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf_metal_ops.custom_loss(labels, logits, gamma=2.0, class_weights=weights)
        tape.gradient(loss, logits)

    _assert_flat("forward op", *_growth(forward))
    _assert_flat("gradient op", *_growth(gradient))
    _assert_flat("custom_loss + GradientTape", *_growth(through_tape, LEAK_CALLS // 3),
                 LEAK_CALLS // 3)


@needs_linux_glibc
def test_memory_stays_flat_in_tf_function():
    logits, labels, weights, _ = _leak_inputs()

    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf.reduce_sum(tf_metal_ops.custom_loss(labels, z, gamma=0.5,
                                                          class_weights=weights))
        return tape.gradient(loss, z)

    @tf.function
    def loop(z, iterations):
        # Many executions of both kernels inside one graph execution.
        def body(i, acc):
            return i + 1, acc + step(z)
        return tf.while_loop(lambda i, _: i < iterations, body, (0, tf.zeros_like(z)))[1]

    _assert_flat("tf.function called from Python", *_growth(lambda: step(logits)))
    iterations = tf.constant(1000)
    _assert_flat("tf.while_loop of 1000 steps",
                 *_growth(lambda: loop(logits, iterations), calls=8, warm_up=2), 8 * 1000)


@needs_linux_glibc
def test_error_path_leaks_no_more_than_tensorflows_own():
    """A refused call (out-of-range label) frees what it allocated. TensorFlow's eager error
    path itself keeps ~0.7 KB per raised error (measured with a built-in op), so the op's
    growth is compared with a built-in op's refusing the same bad label."""
    ops = _native.op_module()
    logits, _, _, _ = _leak_inputs()
    bad_labels = tf.fill([64], 100)

    def ours():
        try:
            ops.tf_metal_ops_custom_loss(logits=logits, labels=bad_labels,
                                         class_weights=tf.zeros([0]),
                                         row_scales=tf.zeros([0]))
        except tf.errors.InvalidArgumentError:
            pass
        else:
            raise AssertionError("the out-of-range label was accepted")

    def builtin():
        try:
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=bad_labels, logits=logits)
        except tf.errors.InvalidArgumentError:
            pass

    calls = 3000
    ours_heap, _ = _growth(ours, calls)
    builtin_heap, _ = _growth(builtin, calls)
    assert ours_heap / calls < builtin_heap / calls + 64, (
        f"refused calls: {ours_heap / calls:.0f} bytes per call kept, a built-in op's refusal "
        f"{builtin_heap / calls:.0f}")


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------


def _thread_problems():
    """Problems of every kind, one of them big enough to be split across the kernel's threads."""
    rng = np.random.default_rng(11)
    problems = []
    for dtype, shape, dense, kw in (
            (tf.float32, (4099, 37), False, dict(gamma=2.0, label_smoothing=0.1)),
            (tf.bfloat16, (33, 1000), False, dict(gamma=0.5)),
            (tf.float16, (7, 5, 9), True, dict(label_smoothing=0.2)),
            (tf.float64, (64, 128), False, dict(class_weights=rng.uniform(0, 2, 128),
                                               ignore_class=-1)),
            (tf.float32, (0, 10), False, {}),
    ):
        logits = tf.cast(rng.normal(scale=3, size=shape), dtype)
        if dense:
            labels = tf.constant(rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]), tf.float32)
        else:
            ids = rng.integers(0, shape[-1], size=shape[:-1])
            if kw.get("ignore_class") == -1:
                ids[::5] = -1
            labels = tf.constant(ids, tf.int64)
        problems.append((labels, logits, kw))
    return problems


def _loss_and_grad(labels, logits, kw):
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf_metal_ops.custom_loss(labels, logits, **kw)
    return loss.numpy(), tape.gradient(loss, logits).numpy()


def test_concurrent_calls_equal_sequential_results():
    problems = _thread_problems()
    sequential = [_loss_and_grad(*p) for p in problems]
    threads_count, rounds = 4, 6
    barrier = threading.Barrier(threads_count + 1)
    errors: List[str] = []
    stop = threading.Event()

    def worker(index: int):
        barrier.wait()
        try:
            for r in range(rounds):
                for k in range(len(problems)):
                    k = (k + index + r) % len(problems)  # threads run different problems at once
                    loss, grad = _loss_and_grad(*problems[k])
                    for what, got, want in (("loss", loss, sequential[k][0]),
                                            ("grad", grad, sequential[k][1])):
                        if not np.array_equal(got, want, equal_nan=True):
                            errors.append(f"thread {index} round {r} problem {k}: {what} differs")
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(f"thread {index}: {type(error).__name__}: {error}")

    def change_thread_cap():
        # The thread cap is read by every kernel execution: changing it mid-flight must not
        # change any result (each row is computed by exactly one thread, the same way).
        barrier.wait()
        caps = [1, 2, 0, 3]
        i = 0
        while not stop.is_set():
            tf_metal_ops.set_cpu_threads(caps[i % len(caps)])
            i += 1
            stop.wait(0.002)

    original_cap = tf_metal_ops.get_cpu_threads()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_count)]
    changer = threading.Thread(target=change_thread_cap)
    try:
        for t in workers + [changer]:
            t.start()
        for t in workers:
            t.join()
    finally:
        stop.set()
        changer.join()
        tf_metal_ops.set_cpu_threads(original_cap)
    assert not errors, "\n".join(errors[:10])
