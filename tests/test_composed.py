"""The composed path (tf_metal_ops/composed.py) and when custom_loss takes it (loss_path.py).

Checked here, on the CPU: XLA is detected (also in nested functions) on the installed
TensorFlow and the loss then compiles; the composed path under XLA matches the float64
reference on the whole `check` matrix at every dtype, and eagerly too (the path a CUDA GPU or a
TPU takes); ties, rows of -inf and +inf logits and confident rows on both the short and the
long rows' sums; its gradient is finite at p = 1 with gamma < 1, where autodiff of the
composition is NaN; bad labels raise where TensorFlow can and give NaN rows (that row only)
under XLA; `fit` with jit_compile=True ends with the weights of jit_compile=False; the device
decision; and that the path taken is visible (loss_path_info, info; the demo's line is tested
in test_cli.py).
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import loss_path, reference
from tf_metal_ops.tools import checks
from tf_metal_ops.tools.bench import suite as bench_suite


def _grad_fn(jit_compile: bool, **params):
    @tf.function(jit_compile=jit_compile)
    def loss_and_grad(logits, labels, upstream):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf_metal_ops.custom_loss(labels, logits, **params)
        return loss, tape.gradient(loss, logits, output_gradients=upstream)

    return loss_and_grad


def _counts() -> dict:
    return tf_metal_ops.loss_path_info()["counts"]


@pytest.fixture
def device_without_our_kernel(monkeypatch):
    """Makes the placement decision see a GPU that has no kernel of ours, as on a CUDA
    machine: custom_loss then takes the composed path outside XLA (eagerly, or in a graph)."""
    monkeypatch.setattr(loss_path, "visible_device_types", lambda: ("CPU", "GPU"))
    monkeypatch.setattr(loss_path, "kernel_device_types", lambda: ("CPU",))


# ---------------------------------------------------------------------------------------------
# Detection


@pytest.mark.tf_abi
def test_xla_detection_is_available_on_the_installed_tensorflow():
    # The guarded private import: if it stops resolving, XLA goes undetected and jit_compile
    # fails again; this test says so instead.
    assert loss_path.XLA_DETECTION, f"XLA detection lost on TensorFlow {tf.__version__}"
    assert tf_metal_ops.loss_path_info()["xla_detection"] is True


@pytest.mark.tf_abi
def test_xla_context_true_inside_jit_also_nested_and_false_elsewhere():
    seen = {}

    @tf.function
    def inner(x):
        seen["nested in jit"] = loss_path.in_xla_context()
        return x

    @tf.function(jit_compile=True)
    def compiled(x):
        seen["jit"] = loss_path.in_xla_context()
        return inner(x)

    @tf.function
    def plain(x):
        seen["plain"] = loss_path.in_xla_context()
        return x

    @tf.function
    def plain_calls_jit(x):
        seen["plain outer"] = loss_path.in_xla_context()
        return compiled(x)

    compiled(tf.constant(1.0))
    plain(tf.constant(1.0))
    plain_calls_jit(tf.constant(2.0))
    assert seen == {"jit": True, "nested in jit": True, "plain": False, "plain outer": False}
    assert loss_path.in_xla_context() is False  # eager


def test_the_path_taken_is_counted():
    logits = tf.constant(np.random.default_rng(0).normal(size=(4, 3)), tf.float32)
    labels = tf.constant([0, 1, 2, 1])
    before = _counts()
    tf_metal_ops.custom_loss(labels, logits)
    tf.function(lambda z, y: tf_metal_ops.custom_loss(y, z))(logits, labels)
    after_native = _counts()
    assert after_native[loss_path.NATIVE] == before[loss_path.NATIVE] + 2
    assert after_native[loss_path.COMPOSED_XLA] == before[loss_path.COMPOSED_XLA]
    _grad_fn(True, gamma=1.0)(logits, labels, tf.ones([4]))
    after = _counts()
    assert after[loss_path.COMPOSED_XLA] == after_native[loss_path.COMPOSED_XLA] + 1
    assert after[loss_path.NATIVE] == after_native[loss_path.NATIVE]
    assert tf_metal_ops.loss_path_info()["last"]["path"] == loss_path.COMPOSED_XLA


def test_native_op_is_not_in_the_compiled_graph_under_xla():
    logits = tf.constant(np.random.default_rng(1).normal(size=(8, 5)), tf.float32)
    labels = tf.constant(np.arange(8) % 5)
    loss_fn = tf_metal_ops.CustomLoss(gamma=2.0)

    @tf.function(jit_compile=True)
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = loss_fn(labels, z)
        return loss, tape.gradient(loss, z)

    step(logits)
    graph = step.get_concrete_function(logits).graph
    op_types = {op.type for op in graph.get_operations()}
    for func in graph._functions.values():  # the tape's gradient functions
        op_types |= {node.op for node in func.definition.node_def}
    assert not any(t.startswith("TfMetalOps") for t in op_types), op_types


# ---------------------------------------------------------------------------------------------
# The device decision


@pytest.mark.parametrize("requested, visible, expected", [
    ("", ("CPU",), "CPU"),
    ("", ("CPU", "GPU"), "GPU"),
    ("", ("CPU", "GPU", "TPU"), "TPU"),
    ("/job:localhost/replica:0/task:0/device:CPU:0", ("CPU", "GPU"), "CPU"),
    ("/device:GPU:1", ("CPU", "GPU"), "GPU"),
    ("/job:worker/task:1", ("CPU", "TPU"), "TPU"),  # no device type asked: the placer's choice
    ("/TPU:0", ("CPU", "TPU"), "TPU"),
])
def test_target_device_type(requested, visible, expected):
    assert loss_path.target_device_type(requested, visible) == expected


@pytest.mark.parametrize("device_type, kernels, lacks", [
    ("CPU", ("CPU",), False),
    ("GPU", ("CPU",), True),  # a CUDA GPU: our library registered CPU kernels only
    ("GPU", ("CPU", "GPU"), False),  # an Apple GPU with tensorflow-metal: our Metal kernels
    ("TPU", ("CPU", "GPU"), True),
    ("gpu", ("CPU", "GPU"), False),
])
def test_device_lacks_kernel(device_type, kernels, lacks):
    assert loss_path.device_lacks_kernel(device_type, kernels) is lacks


def test_kernel_device_types_come_from_the_registry():
    assert loss_path.kernel_device_types() == ("CPU",) or tf_metal_ops.metal_available()
    assert "CPU" in loss_path.kernel_device_types()


def test_choose_on_a_machine_with_a_foreign_gpu(device_without_our_kernel):
    logits = tf.zeros([2, 3])
    path, reason = loss_path.choose(logits)
    # Eager tensors live on the CPU here, and the logits' device decides.
    assert path == loss_path.NATIVE, reason
    with tf.device("/GPU:0"):
        assert loss_path.requested_device(logits).endswith("GPU:0")
        path, reason = loss_path.choose(logits)
    assert path == loss_path.COMPOSED_DEVICE and "GPU has no kernel of ours" in reason

    seen = {}

    @tf.function
    def traced(z):
        seen["unscoped"] = loss_path.choose(z)[0]  # nothing asked: the placer picks the GPU
        with tf.device("/CPU:0"):
            seen["cpu scope"] = loss_path.choose(z)[0]
        return z

    traced(logits)
    assert seen == {"unscoped": loss_path.COMPOSED_DEVICE, "cpu scope": loss_path.NATIVE}


def test_choose_keeps_the_native_op_where_our_kernels_are(monkeypatch):
    monkeypatch.setattr(loss_path, "visible_device_types", lambda: ("CPU", "GPU"))
    monkeypatch.setattr(loss_path, "kernel_device_types", lambda: ("CPU", "GPU"))
    with tf.device("/GPU:0"):
        assert loss_path.choose(tf.zeros([2, 3]))[0] == loss_path.NATIVE
    assert "composed (device)" in loss_path.describe_machine(("CPU", "TPU"))
    assert loss_path.describe_machine(("CPU", "GPU")).startswith("native op on GPU")


# ---------------------------------------------------------------------------------------------
# The check matrix against the float64 reference


def _compare(case, dtype: str, got: dict, expected: dict) -> None:
    rtol, atol = checks.CHECK_TOLERANCES[dtype]
    for key in ("loss", "grad"):
        actual = np.asarray(tf.cast(got[key], tf.float64))
        np.testing.assert_allclose(actual, expected[key], rtol=rtol, atol=atol, equal_nan=True,
                                   err_msg=f"{case.name} [{dtype}] {key}")


def _run_case(case, dtype: str, jit_compile: bool) -> None:
    logits, labels, upstream, weights = checks._inputs(case, dtype, seed=7)
    _, on_reference = checks._make_functions(case, weights)
    params = dict(gamma=case.gamma, label_smoothing=case.label_smoothing,
                  class_weights=weights, ignore_class=case.ignore_class)
    loss, grad = _grad_fn(jit_compile, **params)(tf.constant(logits), tf.constant(labels),
                                                 tf.constant(upstream))
    assert loss.dtype == tf.as_dtype(dtype) and grad.dtype == tf.as_dtype(dtype)
    _compare(case, dtype, {"loss": loss, "grad": grad}, on_reference(logits, labels, upstream))


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_composed_under_xla_matches_the_reference_on_the_check_matrix(dtype):
    before = _counts()[loss_path.COMPOSED_XLA]
    for case in checks.CASES:
        _run_case(case, dtype, jit_compile=True)
    assert _counts()[loss_path.COMPOSED_XLA] == before + len(checks.CASES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_composed_long_row_sums_match_the_reference_on_the_check_matrix(monkeypatch, dtype):
    # The check matrix's rows are short, so they take the stacked reduction; with no row short
    # enough, the same cases go through the separate reductions of long rows.
    from tf_metal_ops import composed

    monkeypatch.setattr(composed, "_SHORT_ROW", 0)
    for case in checks.CASES:
        _run_case(case, dtype, jit_compile=True)


def _exponentials_per_logit(loss_kwargs: dict, shape=(64, 1000)) -> int:
    """How many exponentials of N x C values XLA's optimized program of a step (the loss and
    its gradient) computes."""
    logits = tf.zeros(shape)
    labels = tf.zeros(shape[:1], tf.int32)
    step = _grad_fn(True, **loss_kwargs)
    hlo = step.experimental_get_compiler_ir(logits, labels, tf.ones(shape[:1]))(
        stage="optimized_hlo")
    rows, cols = shape
    return sum(f"[{rows},{cols}]" in line.split("=", 1)[1].split("(", 1)[0]
               for line in hlo.splitlines()
               if " exponential(" in line or " exponential-minus-one(" in line)


@pytest.mark.parametrize("loss_kwargs", [{}, {"label_smoothing": 0.1}],
                         ids=["sparse", "smoothed"])
def test_the_gradient_under_xla_reuses_the_forward_exponentials(loss_kwargs):
    # In one XLA program the gradient takes p = e * (1 / sum) from the forward's e = exp(z - m),
    # as the native kernels do: one exponential per logit, not a second one for the gradient.
    assert _exponentials_per_logit(loss_kwargs) == 1


def _peak_live_float32_temporaries(hlo: str, rows: int, cols: int) -> int:
    """The most float32 [rows, cols] values that the entry computation of XLA's scheduled
    program keeps alive at once: each from the instruction that makes it (instructions are
    printed in schedule order) to its last user needs an N x C buffer of its own."""
    entry = hlo[hlo.index("\nENTRY"):].split("\n}\n")[0].splitlines()[1:]
    made, last_use = {}, {}
    for i, line in enumerate(entry):
        match = re.match(r"\s*(?:ROOT )?(%\S+) = (\S+) ([\w-]+)\((.*)", line)
        if not match:
            continue
        name, shape, op, rest = match.groups()
        if op != "parameter" and shape.startswith(f"f32[{rows},{cols}]"):
            made[name] = i
        for operand in re.findall(r"%[\w.-]+", rest.split("), ")[0]):
            last_use[operand] = i
    spans = [(start, last_use.get(name, len(entry))) for name, start in made.items()]
    return max((sum(start <= i < end for start, end in spans) for i in range(len(entry))),
               default=0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_under_xla_no_more_float32_temporaries_live_than_in_keras_composition(dtype):
    # Each float32 N x C temporary is fresh memory, page faults and all, on every step where
    # TensorFlow's allocator does not cache (docs/performance.md, "Under XLA"). 16-bit logits
    # add a float32 copy of them; the composed path then sums its tie count before it writes
    # its exponentials, which take the tie terms' buffer.
    # The bench's two cases of this comparison (ours_ce_ls_xla, keras_ce_ls_xla), its step.
    rows, cols = 64, 1000
    logits = tf.zeros((rows, cols), dtype)
    loss_fns = bench_suite._loss_fns(tf.zeros((rows,), tf.int32), cols,
                                     ["ours_ce_ls", "keras_ce_ls"], dtype)
    peaks = {}
    for name in ("ours", "keras"):
        step = bench_suite._step(loss_fns[f"{name}_ce_ls"], jit_compile=True)
        hlo = step.experimental_get_compiler_ir(logits)(stage="optimized_hlo")
        peaks[name] = _peak_live_float32_temporaries(hlo, rows, cols)
    assert peaks["keras"] >= 1, "the HLO parse found no temporaries"
    assert peaks["ours"] <= peaks["keras"], peaks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_composed_eager_matches_the_reference_on_the_check_matrix(dtype,
                                                                  device_without_our_kernel):
    # The path of a CUDA GPU or a TPU outside XLA: the same ops, run by TensorFlow's kernels.
    with tf.device("/GPU:0"):  # soft placement runs it on the CPU here
        before = _counts()[loss_path.COMPOSED_DEVICE]
        for case in checks.CASES:
            logits, labels, upstream, weights = checks._inputs(case, dtype, seed=7)
            _, on_reference = checks._make_functions(case, weights)
            logits = tf.constant(logits)
            with tf.GradientTape() as tape:
                tape.watch(logits)
                loss = tf_metal_ops.custom_loss(
                    labels, logits, gamma=case.gamma, label_smoothing=case.label_smoothing,
                    class_weights=weights, ignore_class=case.ignore_class)
            grad = tape.gradient(loss, logits, output_gradients=tf.constant(upstream))
            _compare(case, dtype, {"loss": loss, "grad": grad},
                     on_reference(logits.numpy(), labels, upstream))
        assert _counts()[loss_path.COMPOSED_DEVICE] == before + len(checks.CASES)


def test_float_class_ids_with_a_trailing_one_and_dense_targets_under_xla():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 4)).astype(np.float32)
    ids = rng.integers(0, 4, size=6)
    up = np.ones(6, np.float32)
    for labels in (ids.astype(np.float32)[:, None], np.eye(4, dtype=np.float32)[ids]):
        loss, grad = _grad_fn(True, gamma=2.0, label_smoothing=0.2)(
            tf.constant(logits), tf.constant(labels), tf.constant(up))
        np.testing.assert_allclose(loss, reference.custom_loss(
            ids, logits, gamma=2.0, label_smoothing=np.float32(0.2)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, reference.custom_loss_grad(
            ids, logits, gamma=2.0, label_smoothing=np.float32(0.2)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Limits


@pytest.mark.parametrize("gamma", [0.25, 0.5, 0.9])
def test_gradient_is_finite_at_p_equal_1_with_gamma_below_1(gamma):
    # Row 0 has one class (p = 1 exactly); row 1 a margin that rounds p to 1 in float32.
    logits = tf.constant([[3.0, -np.inf, -np.inf], [200.0, 0.0, -5.0]], tf.float32)
    labels = tf.constant([0, 0])
    loss, grad = _grad_fn(True, gamma=gamma)(logits, labels, tf.ones([2]))
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad)), (loss, grad)
    np.testing.assert_allclose(grad, reference.custom_loss_grad(
        labels.numpy(), logits.numpy(), gamma=gamma), atol=1e-6)

    # What the analytic gradient avoids: autodiff of the same composition is NaN there.
    with tf.GradientTape() as tape:
        tape.watch(logits)
        lp = tf.nn.log_softmax(logits)
        naive = -tf.reduce_sum(tf.one_hot(labels, 3) * (-tf.math.expm1(lp)) ** gamma * lp, -1)
    assert not np.all(np.isfinite(tape.gradient(naive, logits)))


@pytest.mark.parametrize("short_row", [8, 0], ids=["stacked sums", "long-row sums"])
@pytest.mark.parametrize("params", [dict(), dict(gamma=2.0, label_smoothing=0.1)],
                         ids=["ce", "focal+ls"])
def test_ties_and_non_finite_rows_under_xla(monkeypatch, short_row, params):
    # Short rows take their sums in one stacked reduction, long rows in one reduction each;
    # both keep the ties out of the float sum and count them. Both must give the reference's
    # loss and gradient on rows of many ties (all equal, a tie at the last class), a row of -inf
    # logits (loss inf, or NaN with smoothing; the reference says which), a +inf logit (a NaN
    # row) and a confident row whose other classes' share is tiny.
    from tf_metal_ops import composed

    monkeypatch.setattr(composed, "_SHORT_ROW", short_row)
    confident = np.full(6, -30.0, np.float32)
    confident[2] = 0.0
    logits = np.array([
        np.zeros(6),
        [1.0, 3.0, -2.0, 3.0, 3.0, 0.5],
        [0.0, -1.0, -1.0, -1.0, -1.0, 2.0],
        np.full(6, -np.inf),
        [0.0, np.inf, 1.0, 2.0, 3.0, 4.0],
        confident,
    ], np.float32)
    labels = np.array([1, 0, 5, 2, 3, 2], np.int32)
    loss, grad = _grad_fn(True, **params)(tf.constant(logits), tf.constant(labels),
                                          tf.ones([6]))
    reference_params = dict(params, label_smoothing=np.float32(params.get("label_smoothing", 0)))
    with np.errstate(all="ignore"):
        expected_loss = reference.custom_loss(labels, logits, **reference_params)
        expected_grad = reference.custom_loss_grad(labels, logits, **reference_params)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-7, equal_nan=True)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7, equal_nan=True)
    assert np.isnan(loss[4]) and np.all(np.isnan(grad[4]))
    # The confident row's loss, about 5e-13, keeps its digits (1 + share - 1 would be 0).
    np.testing.assert_allclose(loss[5], expected_loss[5], rtol=1e-5, atol=0)


def test_one_minus_p_keeps_its_digits_near_p_equal_1():
    # p of the labelled class from 1 - 1e-3 to 1 - 1e-7: 1 - exp(log p) in float32 would lose
    # up to all digits of r = 1 - p, and with gamma < 1 the gradient scales with r^gamma.
    margins = np.array([7.0, 9.0, 11.5, 14.0, 16.0], np.float32)
    logits = np.stack([margins, np.zeros(5, np.float32), np.zeros(5, np.float32)], axis=1)
    labels = np.zeros(5, np.int32)
    loss, grad = _grad_fn(True, gamma=0.5)(tf.constant(logits), tf.constant(labels),
                                           tf.ones([5]))
    np.testing.assert_allclose(loss, reference.custom_loss(labels, logits, gamma=0.5),
                               rtol=1e-5, atol=0)
    np.testing.assert_allclose(grad, reference.custom_loss_grad(labels, logits, gamma=0.5),
                               rtol=1e-5, atol=1e-12)


def test_a_confident_row_keeps_the_digits_of_its_tiny_loss():
    # log p of the labelled class is -log1p(s) with s ~ 1e-9 to 1e-16, which log(1 + s) would
    # round to 0 in float32; cross-entropy is then exactly that tiny value.
    margins = np.array([20.0, 25.0, 30.0, 37.0], np.float32)
    logits = np.stack([margins, np.zeros(4, np.float32)], axis=1)
    labels = np.zeros(4, np.int64)
    loss, _ = _grad_fn(True)(tf.constant(logits), tf.constant(labels), tf.ones([4]))
    expected = reference.custom_loss(labels, logits)
    assert np.all(expected > 0)
    np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=0)


def test_masked_row_with_smoothing_is_inf_loss_with_a_finite_gradient_under_xla():
    logits = tf.constant([[1.0, -np.inf, 0.5], [0.2, 0.1, 0.0]], tf.float32)
    labels = tf.constant([0, 2])
    loss, grad = _grad_fn(True, gamma=2.0, label_smoothing=0.1)(logits, labels, tf.ones([2]))
    expected = reference.custom_loss(labels.numpy(), logits.numpy(), gamma=2.0,
                                     label_smoothing=np.float32(0.1))
    assert np.isposinf(loss[0]) and np.isposinf(expected[0])
    assert np.all(np.isfinite(grad))


def test_second_derivative_is_autodiff_of_the_analytic_gradient_under_xla():
    # The native op raises for a second derivative; the composed one differentiates its own
    # gradient. Checked against central differences of the reference's gradient.
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 4))
    labels = np.array([0, 1, 3])

    @tf.function(jit_compile=True)
    def curvature(z):
        with tf.GradientTape() as outer:
            outer.watch(z)
            with tf.GradientTape() as inner:
                inner.watch(z)
                loss = tf.reduce_sum(tf_metal_ops.custom_loss(labels, z, gamma=2.0,
                                                              label_smoothing=0.1))
            grad = inner.gradient(loss, z)
            squared = tf.reduce_sum(grad * grad)
        return outer.gradient(squared, z)

    def squared_of(z):
        grad = reference.custom_loss_grad(labels, z, gamma=2.0, label_smoothing=np.float32(0.1))
        return float((grad * grad).sum())

    step, expected = 1e-6, np.zeros_like(logits)
    for index in np.ndindex(*logits.shape):
        bump = np.zeros_like(logits)
        bump[index] = step
        expected[index] = (squared_of(logits + bump) - squared_of(logits - bump)) / (2 * step)
    np.testing.assert_allclose(curvature(tf.constant(logits)), expected, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Bad labels


@pytest.mark.parametrize("labels, ignore_class, bad_row", [
    ([0, 1, 7, 2, 1], None, 2),  # out of range
    ([0, 1, -1, 2, 1], None, 2),  # negative
    ([0, -100, 1, 5, 1], -100, 3),  # ignore_class is fine, 5 is not
    ([0.0, 1.0, 2.5, 2.0, 1.0], None, 2),  # a float that is no class id
    ([0.0, 1.0, np.nan, 2.0, 1.0], None, 2),
])
def test_bad_labels_are_nan_rows_only_under_xla(labels, ignore_class, bad_row):
    rng = np.random.default_rng(4)
    logits = tf.constant(rng.normal(size=(5, 5)), tf.float32)
    labels = np.asarray(labels)
    fn = _grad_fn(True, gamma=2.0, label_smoothing=0.1, ignore_class=ignore_class)
    loss, grad = fn(logits, tf.constant(labels), tf.ones([5]))
    good = labels.astype(np.float64)
    good[bad_row] = 0.0
    if labels.dtype.kind in "iu":
        good = good.astype(labels.dtype)
    good_loss, good_grad = fn(logits, tf.constant(good.astype(labels.dtype)), tf.ones([5]))
    others = [i for i in range(5) if i != bad_row]
    assert np.isnan(loss[bad_row]) and np.all(np.isnan(grad[bad_row]))
    np.testing.assert_array_equal(tf.gather(loss, others), tf.gather(good_loss, others))
    np.testing.assert_array_equal(tf.gather(grad, others), tf.gather(good_grad, others))
    if ignore_class is not None:
        assert loss[1] == 0 and np.all(grad[1] == 0)


def test_bad_labels_raise_outside_xla_on_the_composed_path(device_without_our_kernel):
    logits = tf.constant(np.zeros((3, 4)), tf.float32)
    labels = tf.constant([[0, 1, 2], [3, 9, 1]])
    logits = tf.zeros([2, 3, 4])
    with tf.device("/GPU:0"):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"labels\[1, 1\] = 9 is not a class id in \[0, 4\)"):
            tf_metal_ops.custom_loss(labels, logits)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"labels\[0\] = 0.5"):
            tf_metal_ops.custom_loss(tf.constant([0.5, 1.0]), tf.zeros([2, 4]))

        @tf.function
        def graph(y, z):
            return tf_metal_ops.custom_loss(y, z, ignore_class=-1)

        before = _counts()[loss_path.COMPOSED_DEVICE]
        np.testing.assert_allclose(graph(tf.constant([-1, 2]), tf.zeros([2, 4])),
                                   [0.0, np.log(4.0)], rtol=1e-6)
        assert _counts()[loss_path.COMPOSED_DEVICE] == before + 1
        with pytest.raises(tf.errors.InvalidArgumentError, match="is not a class id"):
            graph(tf.constant([-1, 4]), tf.zeros([2, 4]))


def test_bad_run_time_class_weights_are_nan_under_xla_and_raise_elsewhere(
        device_without_our_kernel):
    logits = tf.zeros([2, 3])
    labels = tf.constant([0, 1])

    def loss(weights):
        return tf_metal_ops.custom_loss(labels, logits, class_weights=weights)

    good, bad = tf.constant([1.0, 2.0, 0.5]), tf.constant([1.0, -2.0, 0.5])
    compiled = tf.function(loss, jit_compile=True)
    np.testing.assert_allclose(compiled(good), [np.log(3.0), 2 * np.log(3.0)], rtol=1e-6)
    assert np.all(np.isnan(compiled(bad)))
    with tf.device("/GPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match="class_weights must be finite numbers >= 0"):
        tf.function(loss)(bad)


# ---------------------------------------------------------------------------------------------
# Keras


def _fit_weights(jit_compile: bool, loss: keras.losses.Loss, y: np.ndarray) -> tuple:
    """(initial, trained) weights of a small model fitted with the same seed and data."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(96, 12)).astype(np.float32)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, jit_compile=jit_compile)
    initial = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return initial, model.get_weights()


@pytest.mark.parametrize("loss_kwargs", [
    dict(gamma=2.0, label_smoothing=0.1),
    dict(gamma=0.5, class_weights=[1.0, 2.0, 0.5, 1.0, 1.5], ignore_class=4),
])
def test_fit_with_jit_compile_gives_the_weights_without_it(loss_kwargs):
    y = np.random.default_rng(1).integers(0, 5, size=96)
    native_before = _counts()
    initial, expected = _fit_weights(False, tf_metal_ops.CustomLoss(**loss_kwargs), y)
    after_native = _counts()
    assert after_native[loss_path.NATIVE] > native_before[loss_path.NATIVE]
    assert after_native[loss_path.COMPOSED_XLA] == native_before[loss_path.COMPOSED_XLA]
    initial_xla, got = _fit_weights(True, tf_metal_ops.CustomLoss(**loss_kwargs), y)
    assert _counts()[loss_path.COMPOSED_XLA] > after_native[loss_path.COMPOSED_XLA]
    for a, b in zip(initial_xla, initial):
        np.testing.assert_array_equal(a, b)
    # Training moved the weights far more than the tolerance, so the match means something.
    assert max(np.abs(a - b).max() for a, b in zip(expected, initial)) > 1e-2
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Visible to the user


def test_info_says_which_path_runs_where():
    from tf_metal_ops.tools import cli, environment

    _grad_fn(True)(tf.zeros([2, 3]), tf.constant([0, 1]), tf.ones([2]))
    info = environment.describe()
    assert info["loss_path"]["counts"][loss_path.COMPOSED_XLA] >= 1
    text = cli.format_info(info)
    assert "Loss path" in text and "composed (XLA) inside jit_compile" in text
    assert "made so far" in text and "composed (XLA) " in text
