"""`tf_metal_ops.compare_devices`: the report's fields on planted differences.

Most tests run on the devices this process sees, against a NumPy reference that differs from
the truth in one planted element. The device-pair tests need two devices; a machine without a
GPU gets them by splitting the CPU into two logical devices, which must happen before
TensorFlow initializes, so they run in a fresh subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops.compare import (
    DEFAULT_TOLERANCES,
    OutputStructureError,
    compare_devices,
    value_and_gradients,
)

PACKAGE_PARENT = str(Path(tf_metal_ops.__file__).resolve().parent.parent)
X = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)


def np_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def only(report, output="out", expected="reference", actual="CPU:0"):
    found = [c for c in report.comparisons
             if (c.output, c.expected, c.actual) == (output, expected, actual)]
    assert len(found) == 1, report
    return found[0]


def test_agreement_passes_with_small_errors():
    report = compare_devices(tf.nn.softmax, X, devices=["CPU:0"], reference=np_softmax)
    assert report.verdict == "PASS" and report.passed and not report.failures
    c = only(report)
    assert c.passed and c.shape == (4, 6) and c.dtype == "float32"
    assert c.expected_dtype == "float64"
    assert 0 <= c.max_abs_error < 1e-6 and c.max_rel_error < 1e-5
    assert (c.rtol, c.atol) == DEFAULT_TOLERANCES["float32"]  # judged as the coarser dtype
    assert c.mismatches == c.nan_mismatches == c.inf_mismatches == 0


def test_planted_difference_is_located_and_measured():
    def wrong_reference(x):
        out = np_softmax(x)
        out[2, 3] += 1e-3
        return out

    report = compare_devices(tf.nn.softmax, X, devices=["CPU:0"], reference=wrong_reference)
    assert report.verdict == "FAIL" and not report.passed
    c = only(report)
    assert report.failures == (c,)
    assert c.worst_index == (2, 3)
    assert c.max_abs_error == pytest.approx(1e-3, rel=1e-3)
    assert c.max_rel_error == pytest.approx(1e-3 / wrong_reference(X)[2, 3], rel=1e-3)
    assert c.mismatches == 1 and c.nan_mismatches == 0 and c.inf_mismatches == 0
    assert c.worst_expected == pytest.approx(wrong_reference(X)[2, 3])
    assert c.worst_actual == pytest.approx(float(tf.nn.softmax(X)[2, 3]))

    text = str(report)
    assert text.splitlines()[0].endswith("-> FAIL")
    assert "CPU:0 vs reference" in text and "(2,3)" in text and "1/24" in text

    d = json.loads(json.dumps(report.to_dict()))
    assert d["verdict"] == "FAIL" and d["passed"] is False and d["has_reference"] is True
    assert d["devices"] == ["CPU:0"]
    (row,) = d["comparisons"]
    assert row["worst_index"] == [2, 3] and row["mismatches"] == 1 and row["passed"] is False
    assert row["shape"] == [4, 6]


def test_nan_and_inf_mismatches_are_counted_not_excused():
    def reference(x):
        out = np.array(x, dtype=np.float64)
        out[0, 0] = np.nan   # device finite: NaN mismatch
        out[1, 1] = np.inf   # device finite: Inf mismatch
        out[3, 5] = -np.inf  # device +inf: Inf mismatch (sign)
        out[2, 2] = np.nan   # device NaN too: agreement
        return out

    def fn(x):
        x = tf.tensor_scatter_nd_update(x, [[2, 2], [3, 5]], [np.nan, np.inf])
        return tf.identity(x)

    report = compare_devices(fn, X, devices=["CPU:0"], reference=reference, rtol=1.0, atol=1.0)
    c = only(report)
    assert c.nan_mismatches == 1 and c.inf_mismatches == 2 and c.mismatches == 0
    assert not c.passed and c.worst_index == (0, 0)  # the first non-finite mismatch
    assert c.max_abs_error == 0.0  # finite elements agree exactly
    d = c.to_dict()
    assert d["worst_expected"] == "nan" and json.dumps(d)


def test_nested_outputs_are_compared_leaf_by_leaf():
    def fn(x):
        return {"b": (x * 2.0, [x + 1.0]), "a": tf.reduce_sum(x)}

    def reference(x):
        out = {"a": x.astype(np.float64).sum(), "b": (x * 2.0, [x + 1.0])}
        out["b"][1][0][1, 2] += 0.5
        return out

    report = compare_devices(fn, X, devices=["CPU:0"], reference=reference)
    paths = [c.output for c in report.comparisons]
    assert paths == ["out['a']", "out['b'][0]", "out['b'][1][0]"]
    assert [c.passed for c in report.comparisons] == [True, True, False]
    assert report.comparisons[2].worst_index == (1, 2)
    assert report.comparisons[0].shape == ()


def test_structure_difference_with_reference_is_a_clear_error():
    with pytest.raises(OutputStructureError, match=r"only reference has out\[1\]"):
        compare_devices(lambda x: (x,), X, devices=["CPU:0"], reference=lambda x: (x, x))
    with pytest.raises(OutputStructureError, match=r"out\['g'\] is None on CPU:0"):
        compare_devices(lambda x: {"g": None}, X, devices=["CPU:0"],
                        reference=lambda x: {"g": x})


def test_gradients_via_value_and_gradients():
    fn = value_and_gradients(lambda x, w: tf.reduce_sum(tf.square(x) * w), wrt=(0, 1))
    w = np.full((4, 6), 3.0, np.float32)

    def reference(x, w, planted=0.0):
        grad_x = 2 * x * w
        grad_x[0, 1] += planted
        return {"value": np.sum(x.astype(np.float64) ** 2 * w), "gradients": (grad_x, x ** 2)}

    good = compare_devices(fn, X, w, devices=["CPU:0"], reference=reference)
    assert good.passed, good
    assert [c.output for c in good.comparisons] == [
        "out['gradients'][0]", "out['gradients'][1]", "out['value']"]
    bad = compare_devices(fn, X, w, devices=["CPU:0"],
                          reference=lambda x, w: reference(x, w, planted=0.01))
    (failure,) = bad.failures
    assert failure.output == "out['gradients'][0]" and failure.worst_index == (0, 1)


def test_shape_difference_fails_with_a_note():
    report = compare_devices(lambda x: x, X, devices=["CPU:0"], reference=lambda x: x[:, :5])
    c = only(report)
    assert not c.passed and c.actual_shape == (4, 6) and c.shape == (4, 5)
    assert "shape (4,6) differs from the expected (4,5)" in c.note
    assert "shape (4,6) differs" in str(report)


def test_tolerances_follow_the_coarser_dtype_and_accept_overrides():
    x16 = X.astype(np.float16)

    def reference(x):
        return np.asarray(x, np.float64) * (1 + 5e-4)  # 0.05 %: fine for float16 only

    assert compare_devices(tf.identity, tf.constant(x16), devices=["CPU:0"],
                           reference=reference).passed
    assert not compare_devices(tf.identity, tf.constant(X), devices=["CPU:0"],
                               reference=reference).passed
    assert not compare_devices(tf.identity, tf.constant(x16), devices=["CPU:0"],
                               reference=reference, rtol={"float16": 1e-5},
                               atol={"float16": 0.0}).passed
    assert compare_devices(tf.identity, tf.constant(X), devices=["CPU:0"],
                           reference=reference, rtol=1e-3).passed


def test_integer_outputs_must_match_exactly():
    report = compare_devices(lambda x: tf.argmax(x, axis=-1), X, devices=["CPU:0"],
                             reference=lambda x: np.argmax(x, axis=-1) + np.array([0, 0, 1, 0]))
    c = only(report)
    assert (c.rtol, c.atol) == (0.0, 0.0) and c.mismatches == 1 and c.worst_index == (2,)


def test_no_gpu_is_said_plainly_and_the_reference_still_compared():
    report = compare_devices(tf.nn.softmax, X, reference=np_softmax)
    gpus = tf.config.list_logical_devices("GPU")
    assert report.gpu_found == bool(gpus)
    assert report.devices[0] == "CPU:0"
    if gpus:
        assert any(d.startswith("GPU") for d in report.devices)
        assert not any("No GPU found" in n for n in report.notes)
    else:
        assert any(n.startswith("No GPU found: TensorFlow sees only CPU") for n in report.notes)
        assert "No GPU found" in str(report)
        assert report.passed  # the CPU was compared with the reference
        assert {c.actual for c in report.comparisons} == {"CPU:0"}


def test_single_device_without_reference_compares_nothing():
    report = compare_devices(tf.nn.softmax, X, devices=["CPU:0"])
    assert report.verdict == "NOTHING COMPARED" and not report.passed
    assert any("Nothing compared" in n for n in report.notes)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"device 'TPU:3' in `devices` is not available"):
        compare_devices(tf.nn.softmax, X, devices=["TPU:3"])
    with pytest.raises(ValueError, match=r"`rtol` must be a finite number >= 0"):
        compare_devices(tf.nn.softmax, X, devices=["CPU:0"], reference=np_softmax, rtol=-1)
    with pytest.raises(ValueError, match=r"`atol`"):
        compare_devices(tf.nn.softmax, X, devices=["CPU:0"], reference=np_softmax,
                        atol={"float32": float("nan")})
    with pytest.raises(TypeError, match=r"`fn` must be callable"):
        compare_devices("softmax", X)
    with pytest.raises(ValueError, match=r"nothing to run"):
        compare_devices(tf.nn.softmax, X, devices=[])


def test_an_error_on_every_device_is_raised_as_is():
    def fn(x):
        raise tf.errors.InvalidArgumentError(None, None, "planted failure")

    with pytest.raises(tf.errors.InvalidArgumentError, match="planted failure"):
        compare_devices(fn, X, devices=["CPU:0"], reference=np_softmax)


def test_custom_loss_agrees_with_the_reference_on_this_machine():
    from tf_metal_ops import reference

    labels = np.array([1, 0, 5, 2])

    def loss_and_grad(logits, labels):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf_metal_ops.custom_loss(labels, logits, gamma=2.0, label_smoothing=0.25)
        return loss, tape.gradient(loss, logits)

    def ref(logits, labels):
        kw = dict(gamma=2.0, label_smoothing=0.25)
        return (reference.custom_loss(labels, logits, **kw),
                reference.custom_loss_grad(labels, logits, **kw))

    report = compare_devices(loss_and_grad, tf.constant(X), labels, reference=ref)
    assert report.passed, report
    assert len(report.comparisons) >= 2


# ---------------------------------------------------------------------------------------------
# Two devices (two logical CPUs in a fresh process)

TWO_DEVICE_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    from tf_metal_ops.compare import OutputStructureError, compare_devices

    x = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32)

    def on(name):  # the device this call runs on, as TensorFlow placed it
        return tf.identity(0.0).device.endswith(name)

    def perturbed(x):
        y = tf.nn.softmax(x)
        if on("CPU:1"):
            y = tf.tensor_scatter_nd_add(y, [[1, 4]], [2e-3])
        return {"p": y}

    def np_softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return {"p": e / e.sum(-1, keepdims=True)}

    def raises_on_one(x):
        if on("CPU:1"):
            raise ValueError("planted: CPU:1 has no kernel")
        return tf.nn.softmax(x)

    def structure(x):
        return (x, x) if on("CPU:1") else (x,)

    out = {}
    out["planted"] = compare_devices(perturbed, x, reference=np_softmax).to_dict()
    out["planted_text"] = str(compare_devices(perturbed, x))
    out["error_on_one"] = compare_devices(raises_on_one, x).to_dict()
    try:
        compare_devices(structure, x)
        out["structure"] = None
    except OutputStructureError as e:
        out["structure"] = str(e)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def two_device_results():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_PARENT,
                                                      os.environ.get("PYTHONPATH")) if p))
    # cwd outside the checkout, so the bare source tree cannot shadow the package under test.
    result = subprocess.run([sys.executable, "-c", TWO_DEVICE_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=600, cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_device_pair_planted_difference(two_device_results):
    d = two_device_results["planted"]
    assert d["devices"] == ["CPU:0", "CPU:1"] and d["verdict"] == "FAIL"
    assert d["placements"] == {"CPU:0": ["CPU:0"], "CPU:1": ["CPU:1"]}
    by_pair = {(c["actual"], c["expected"]): c for c in d["comparisons"]}
    assert set(by_pair) == {("CPU:0", "reference"), ("CPU:1", "reference"), ("CPU:1", "CPU:0")}
    assert by_pair["CPU:0", "reference"]["passed"]
    for pair in (("CPU:1", "reference"), ("CPU:1", "CPU:0")):
        c = by_pair[pair]
        assert not c["passed"] and c["output"] == "out['p']"
        assert c["worst_index"] == [1, 4] and c["mismatches"] == 1
        assert c["max_abs_error"] == pytest.approx(2e-3, rel=1e-3)
    text = two_device_results["planted_text"]
    assert "CPU:1 vs CPU:0" in text and "(1,4)" in text and text.splitlines()[0].endswith("FAIL")


def test_device_error_on_one_device_is_reported(two_device_results):
    d = two_device_results["error_on_one"]
    assert d["verdict"] == "FAIL"
    assert d["errors"] == {"CPU:1": "ValueError: planted: CPU:1 has no kernel"}
    assert d["comparisons"] == []


def test_device_structure_difference_raises(two_device_results):
    message = two_device_results["structure"]
    assert message is not None
    assert "CPU:0 and CPU:1 are nested differently" in message
    assert "only CPU:1 has out[1]" in message
