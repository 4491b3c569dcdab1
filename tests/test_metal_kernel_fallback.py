"""metal_kernel's `fallback=` (under XLA and on a device without a kernel of ours) and its
generated source as public API (`generated_source`). The loss-and-gradient example of
docs/kernels.md trains under jit_compile=True through its fallbacks (tests/test_metal_kernel.py
runs it); here, each rule on its own.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import _native, kernels, loss_path
from kernel_sources import EXP_SOURCE



@pytest.fixture(scope="module", autouse=True)
def _kernel_cache(kernel_cache):
    """Every test of this module compiles into the shared test cache (conftest.py)."""
    yield kernel_cache


class CountingExp:
    """A fallback that counts its calls (one per trace in tf.function, one per eager call)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return tf.exp(x)


def exp_kernel(fallback=None):
    return tf_metal_ops.metal_kernel("myexp", ["inp"], ["out"], EXP_SOURCE, fallback=fallback)


def call(kernel, x, output_shape=None):
    return kernel(inputs=[x], output_shapes=[x.shape if output_shape is None else output_shape],
                  output_dtypes=[tf.float32], grid=(int(np.prod(x.shape)), 1, 1),
                  threadgroup=(64, 1, 1), template=[("T", tf.float32)])[0]


X = tf.random.stateless_normal([3, 50], seed=[4, 2])


def test_fallback_runs_under_xla_and_the_kernel_elsewhere():
    fallback = CountingExp()
    kernel = exp_kernel(fallback)
    np.testing.assert_allclose(call(kernel, X).numpy(), tf.exp(X).numpy(), rtol=1e-6)
    np.testing.assert_allclose(tf.function(lambda x: call(kernel, x))(X).numpy(),
                               tf.exp(X).numpy(), rtol=1e-6)
    assert fallback.calls == 0  # eager and plain tf.function run the kernel
    jitted = tf.function(lambda x: call(kernel, x), jit_compile=True)
    np.testing.assert_allclose(jitted(X).numpy(), tf.exp(X).numpy(), rtol=1e-6)
    assert fallback.calls == 1


def test_fallback_inside_a_function_nested_in_an_xla_compilation():
    fallback = CountingExp()
    kernel = exp_kernel(fallback)
    inner = tf.function(lambda x: call(kernel, x))
    outer = tf.function(lambda x: inner(x) + 1.0, jit_compile=True)
    np.testing.assert_allclose(outer(X).numpy(), tf.exp(X).numpy() + 1.0, rtol=1e-6)
    assert fallback.calls == 1


def test_xla_without_fallback_says_to_pass_one():
    jitted = tf.function(lambda x: call(exp_kernel(), x), jit_compile=True)
    with pytest.raises(ValueError, match=r"metal_kernel 'myexp' cannot run inside an XLA "
                                         r"compilation.*Pass fallback="):
        jitted(X)


def test_fallback_runs_where_the_device_has_no_kernel_of_ours(monkeypatch):
    """As the loss composes itself on a device without our kernel (a CUDA GPU, a TPU), the
    kernel runs its fallback there; without one, the op itself (TensorFlow places it)."""
    registered = loss_path.registered_device_types
    monkeypatch.setattr(loss_path, "registered_device_types",
                        lambda op: ("GPU",) if op == _native.METAL_KERNEL_OP else registered(op))
    fallback = CountingExp()
    np.testing.assert_allclose(call(exp_kernel(fallback), X).numpy(), tf.exp(X).numpy(),
                               rtol=1e-6)
    assert fallback.calls == 1
    np.testing.assert_allclose(call(exp_kernel(), X).numpy(), tf.exp(X).numpy(), rtol=1e-6)


def test_fallback_with_several_outputs_and_a_run_time_shape():
    kernel = tf_metal_ops.metal_kernel(
        "two", ["a"], ["twice", "count"],
        "twice[thread_position_in_grid.x] = 2.0f * a[thread_position_in_grid.x]; count[0] = 1;",
        fallback=lambda a: [2.0 * a, tf.ones([1], tf.int32)])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)], jit_compile=True)
    def run(a):
        n = tf.shape(a, out_type=tf.int64)
        twice, count = kernel(inputs=[a], output_shapes=[n, [1]],
                              output_dtypes=[tf.float32, tf.int32], grid=(n[0], 1, 1),
                              threadgroup=(32, 1, 1))
        assert twice.shape.as_list() == [None] and count.shape.as_list() == [1]
        return twice, count

    twice, count = run(tf.range(5, dtype=tf.float32))
    np.testing.assert_array_equal(twice.numpy(), 2.0 * np.arange(5))
    np.testing.assert_array_equal(count.numpy(), [1])


def test_fallback_must_be_callable():
    with pytest.raises(TypeError, match=r"fallback must be a callable.*got 3"):
        exp_kernel(fallback=3)


@pytest.mark.parametrize("fallback, error, match", [
    (lambda x: [tf.exp(x), tf.exp(x)], ValueError, r"returned 2 outputs; output_names \['out'\]"),
    (lambda x: tf.cast(tf.exp(x), tf.float16), TypeError,
     r"output 'out' has the dtype float16; output_dtypes says float32"),
    (lambda x: tf.exp(x)[:2], ValueError, r"output 'out' has the shape \(2, 50\); "
                                           r"output_shapes says \(3, 50\)"),
    (lambda x: "not a tensor", TypeError, r"output 'out' has the dtype string"),
])
def test_fallback_outputs_must_match_the_call(fallback, error, match):
    jitted = tf.function(lambda x: call(exp_kernel(fallback), x), jit_compile=True)
    with pytest.raises(error, match=r"fallback of metal_kernel 'myexp'.? " + match):
        jitted(X)


# ---- the generated source, without running -------------------------------------------------


def test_generated_source_is_what_verbose_prints(capsys):
    kernel = exp_kernel()
    source = kernel.generated_source([X], [tf.float32], template=[("T", tf.float32)])
    kernel(inputs=[X], output_shapes=[X.shape], output_dtypes=[tf.float32], grid=(150, 1, 1),
           threadgroup=(64, 1, 1), template=[("T", tf.float32)], verbose=True)
    printed = capsys.readouterr().out
    assert printed.endswith(source + "\n")
    assert source.startswith("#include <metal_stdlib>\nusing namespace metal;")
    assert "template <typename T>" in source
    assert "const device float* inp [[buffer(0)]]" in source
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in source
    assert EXP_SOURCE in source


def test_generated_source_from_specs_follows_dtype_and_rank():
    kernel = tf_metal_ops.metal_kernel("scale", ["a", "s"], ["o"],
                                       "o[thread_position_in_grid.x] = a[0] * s + a_ndim;")
    source = kernel.generated_source(
        [tf.TensorSpec([None, 4], tf.float16), tf.TensorSpec([], tf.float16)], [tf.int32])
    assert "const device half* a [[buffer(0)]]" in source
    assert "constant int& a_ndim [[buffer(1)]]" in source
    assert "constant half& s [[buffer(2)]]" in source
    assert "device int* o [[buffer(3)]]" in source
    assert "template" not in source.split("[[kernel]]")[0]  # no template: none declared
    assert re.search(r"\[\[kernel\]\] void custom_kernel_scale_half_halfs_int\(", source)


@pytest.mark.parametrize("inputs, output_dtypes, template, error, match", [
    ([], [tf.float32], None, ValueError, r"inputs needs 1 tensors"),
    ([tf.TensorSpec(None, tf.float32)], [tf.float32], None, ValueError,
     r"input 'inp' has an unknown rank"),
    ([tf.TensorSpec([2], tf.float64)], [tf.float32], None, TypeError,
     r"input 'inp': tf.float64 is not a supported dtype"),
    ([X], [tf.float32, tf.float32], None, ValueError, r"output_dtypes needs 1 entries"),
    ([X], [tf.float32], [("T", 1.5)], TypeError, r"template 'T': 1.5 is neither"),
])
def test_generated_source_checks_its_arguments(inputs, output_dtypes, template, error, match):
    with pytest.raises(error, match=match):
        exp_kernel().generated_source(inputs, output_dtypes, template=template)


# ---- compare_kernel ------------------------------------------------------------------------


def compare_exp(kernel, x, **kwargs):
    return tf_metal_ops.compare_kernel(
        kernel, inputs=[x], output_shapes=[x.shape], output_dtypes=[tf.float32],
        grid=(int(np.prod(x.shape)), 1, 1), threadgroup=(64, 1, 1),
        template=[("T", tf.float32)], **kwargs)


def test_compare_kernel_against_its_fallback_passes_and_names_the_absent_gpu():
    report = compare_exp(exp_kernel(CountingExp()), X)
    assert report.passed and report.has_reference
    assert report.devices == ("CPU:0",)
    (row,) = report.comparisons
    assert (row.actual, row.expected, row.dtype) == ("CPU:0", "reference", "float32")
    assert (row.rtol, row.atol) == tf_metal_ops.compare.DEFAULT_TOLERANCES["float32"]
    assert 0 <= row.max_rel_error < 1e-6
    assert report.absent == {"GPU": "not present"}  # this machine has no GPU
    text = str(report)
    assert "CPU:0 vs reference" in text and "not present" in text
    assert report.to_dict()["absent"] == {"GPU": "not present"}


def test_compare_kernel_finds_a_wrong_kernel():
    wrong = tf_metal_ops.metal_kernel(
        "wrong_exp", ["inp"], ["out"],
        EXP_SOURCE.replace("metal::exp(tmp)", "metal::exp(tmp) * 1.001f"),
        fallback=tf.exp)
    report = compare_exp(wrong, X)
    assert not report.passed
    (row,) = report.failures
    assert row.max_rel_error == pytest.approx(1e-3, rel=1e-2)
    assert "FAIL" in str(report)


def test_compare_kernel_takes_a_numpy_reference_and_exact_integers():
    kernel = tf_metal_ops.metal_kernel(
        "add_one", ["a"], ["b"], "b[thread_position_in_grid.x] = a[thread_position_in_grid.x] + 1;")
    a = tf.range(10, dtype=tf.int32)
    common = dict(inputs=[a], output_shapes=[[10]], output_dtypes=[tf.int32], grid=(10, 1, 1),
                  threadgroup=(4, 1, 1))
    assert tf_metal_ops.compare_kernel(kernel, reference=lambda a: a + 1, **common).passed
    off = tf_metal_ops.compare_kernel(kernel, reference=lambda a: a + (a == 3), **common)
    assert not off.passed and off.failures[0].mismatches == 9
    assert (off.failures[0].rtol, off.failures[0].atol) == (0.0, 0.0)


def test_compare_kernel_without_reference_or_fallback_says_nothing_was_compared():
    report = compare_exp(exp_kernel(), X)
    assert report.verdict == "NOTHING COMPARED"


def test_compare_kernel_checks_its_arguments():
    with pytest.raises(TypeError, match="kernel must be what tf_metal_ops.metal_kernel"):
        tf_metal_ops.compare_kernel(tf.exp, inputs=[X], output_shapes=[X.shape],
                                    output_dtypes=[tf.float32], grid=(1, 1, 1),
                                    threadgroup=(1, 1, 1))
    with pytest.raises(TypeError, match="reference must be callable"):
        compare_exp(exp_kernel(), X, reference=3)
