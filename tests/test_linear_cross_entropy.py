"""linear_cross_entropy and LinearCrossEntropyHead: the loss of `custom_loss(labels, h @ W + b)`
made chunk by chunk.

Checked: the loss and its three gradients (hidden, kernel, bias) against the float64 NumPy
reference (tf_metal_ops.reference applied to h @ W + b in float64) within the
vocabulary-scale float32 bar (tests/test_vocabulary_scale.py: max(5e-7, 1.5 x the error of
TensorFlow's own composition, Dense then tf.nn.sparse_softmax_cross_entropy_with_logits, on the
plain input)), for every reduction, option set and chunk sizes that do and do not divide N;
N = 0 and N below the chunk; leading batch dimensions; bad input errors; tf.function and XLA
giving the eager values; float16 and float64; the Keras head in fit against Dense(V) +
SparseCategoricalCrossentropy (masks, ignore_class, sample weights, mixed_float16), saved and
loaded, under MirroredStrategy; and, in a child process, that the step's peak memory stays far
below the logits' size where the composition's does not.
"""

from __future__ import annotations

import functools
import importlib
import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import reference
from tf_metal_ops.linear_cross_entropy import default_chunk_size
from tf_metal_ops.tools.bench import linear_head as bench_linear_head

# The module, not the function of the same name that the package exports.
linear_module = importlib.import_module("tf_metal_ops.linear_cross_entropy")

ROWS, WIDTH, CLASSES = 37, 8, 32000
FLOOR = 5e-7
REDUCTIONS = ["mean", "sum", None]
OPTION_SETS = {
    "plain": (dict(), "sparse"),
    "focal + smoothing": (dict(gamma=2.0, label_smoothing=0.1), "sparse"),
    "class weights + smoothing": (dict(label_smoothing=0.1, class_weights=True), "sparse"),
    "ignore_class, focal": (dict(gamma=2.0, ignore_class=0), "sparse"),
    "dense soft targets, focal": (dict(gamma=2.0), "dense"),
}
CHUNKS = [10, ROWS, None]  # 10 does not divide 37; None: the default (one chunk here)


def relative_error(got, exact) -> float:
    """max over rows of max |got - exact| / (1 + max |exact| of the row)."""
    got = np.atleast_2d(np.asarray(got, np.float64))
    exact = np.atleast_2d(np.asarray(exact, np.float64))
    return float(np.max(np.max(np.abs(got - exact), axis=-1)
                        / (1.0 + np.max(np.abs(exact), axis=-1))))


@functools.lru_cache(maxsize=None)
def inputs(option: str):
    """(h, W, b, labels, op kwargs, reference kwargs, upstream of the per-row losses)."""
    params, kind = OPTION_SETS[option]
    rng = np.random.default_rng(3)
    h = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    # Logits ~ N(0, 4^2), as in the vocabulary-scale test.
    w = (rng.normal(size=(WIDTH, CLASSES)) * 4.0 / np.sqrt(WIDTH)).astype(np.float32)
    b = rng.normal(size=CLASSES).astype(np.float32)
    labels = rng.integers(1, CLASSES, ROWS)
    op = dict(params)
    if "ignore_class" in op:
        labels[::5] = op["ignore_class"]
    if op.pop("class_weights", False):
        op["class_weights"] = rng.uniform(0.5, 2.0, CLASSES).astype(np.float32)
    if kind == "dense":
        soft = rng.gamma(0.5, size=(ROWS, CLASSES))
        labels = (soft / soft.sum(axis=-1, keepdims=True)).astype(np.float32)
    ref = dict(op, gamma=float(np.float32(op.get("gamma", 0.0))),
               label_smoothing=float(np.float32(op.get("label_smoothing", 0.0))))
    if "class_weights" in ref:
        ref["class_weights"] = ref["class_weights"].astype(np.float64)
    upstream = rng.uniform(-1.0, 2.0, ROWS).astype(np.float32)
    return h, w, b, labels, op, ref, upstream


def _row_scales(option: str, reduction, upstream):
    _, _, _, labels, op, _, _ = inputs(option)
    if reduction is None:
        return upstream.astype(np.float64)
    valid = np.ones(ROWS)
    if "ignore_class" in op:
        valid = (labels != op["ignore_class"]).astype(np.float64)
    return valid / valid.sum() if reduction == "mean" else np.ones(ROWS)


@functools.lru_cache(maxsize=None)
def exact(option: str, reduction):
    """(loss, dh, dW, db) in float64; for reduction None the gradients of sum(upstream * loss)."""
    h, w, b, labels, _, ref, upstream = inputs(option)
    z = h.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
    y = labels.astype(np.float64) if labels.dtype.kind == "f" else labels
    losses = reference.custom_loss(y, z, **ref)
    grad = reference.custom_loss_grad(y, z, **ref)
    scales = _row_scales(option, reduction, upstream)
    g = grad * scales[:, None]
    loss = losses if reduction is None else np.sum(losses * scales)
    return loss, g @ w.astype(np.float64).T, h.astype(np.float64).T @ g, g.sum(axis=0)


def ours(option: str, reduction, chunk_size, wrap=None):
    h, w, b, labels, op, _, upstream = inputs(option)
    tensors = [tf.constant(a) for a in (h, w, b)]

    def run(h, w, b):
        with tf.GradientTape() as tape:
            tape.watch([h, w, b])
            loss = tf_metal_ops.linear_cross_entropy(labels, h, w, b, reduction=reduction,
                                                     chunk_size=chunk_size, **op)
            total = loss if reduction is not None else tf.reduce_sum(loss * upstream)
        return (loss, *tape.gradient(total, [h, w, b]))

    return [t.numpy() for t in (wrap(run) if wrap else run)(*tensors)]


@functools.lru_cache(maxsize=None)
def matmul_errors(reduction, chunk_size, jit_compile=False):
    """The errors of d_hidden and d_kernel that float32 matmuls alone make, chunked as ours:
    the exact gradient of the logits, rounded to float32, times W^T and h^T. (oneDNN's matmul
    sums K = 32000 terms differently for a few rows than for many, so this, not the loss,
    sets the error of d_hidden with small chunks.)"""
    h, w, b, labels, _, ref, upstream = inputs("plain")
    z = h.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
    g = (reference.custom_loss_grad(labels, z, **ref)
         * _row_scales("plain", reduction, upstream)[:, None]).astype(np.float32)
    step = chunk_size or ROWS
    matmul = tf.function(tf.matmul, jit_compile=True) if jit_compile else tf.matmul
    dh = np.concatenate([matmul(g[i:i + step], w, transpose_b=True).numpy()
                         for i in range(0, ROWS, step)])
    dw = sum(matmul(h[i:i + step], g[i:i + step], transpose_a=True).numpy().astype(np.float64)
             for i in range(0, ROWS, step))
    want = exact("plain", reduction)
    return relative_error(dh, want[1]), relative_error(dw, want[2])


@functools.lru_cache(maxsize=None)
def bars(reduction, chunk_size=ROWS, jit_compile=False):
    """Per quantity: the floor or 1.5 x the error of TensorFlow's composition on the plain
    input (for d_hidden and d_kernel, or of the same float32 matmuls, chunked as ours)."""
    h, w, b, labels, _, _, upstream = inputs("plain")
    tensors = [tf.constant(a) for a in (h, w, b)]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tensors[0] @ tensors[1] + tensors[2])
        scales = _row_scales("plain", reduction, upstream).astype(np.float32)
        loss = losses if reduction is None else tf.reduce_sum(losses * scales)
        total = loss if reduction is not None else tf.reduce_sum(loss * upstream)
    got = [loss.numpy(), *(g.numpy() for g in tape.gradient(total, tensors))]
    errors = [relative_error(g, e) for g, e in zip(got, exact("plain", reduction))]
    dh_matmul, dw_matmul = matmul_errors(reduction, chunk_size, jit_compile)
    errors[1] = max(errors[1], dh_matmul)
    errors[2] = max(errors[2], dw_matmul)
    return [max(FLOOR, 1.5 * error) for error in errors]


def assert_within_bars(option, reduction, got, what="", chunk_size=ROWS, jit_compile=False):
    for name, value, want, bar in zip(("loss", "d_hidden", "d_kernel", "d_bias"), got,
                                      exact(option, reduction),
                                      bars(reduction, chunk_size, jit_compile)):
        error = relative_error(value, want)
        assert error <= bar, f"{what} {option} {reduction}: {name} error {error:.3g} > {bar:.3g}"


@pytest.fixture(params=["native op", "composed loop"])
def implementation(request, monkeypatch):
    """The native op (csrc/linear_cross_entropy.h), or the chunk loop of TensorFlow ops that
    float64, XLA and devices without our kernels run."""
    monkeypatch.setattr(linear_module, "USE_NATIVE_OP", request.param == "native op")
    return request.param


def _op_types(function, *args) -> set:
    graph = function.get_concrete_function(*args).graph
    types = {op.type for op in graph.get_operations()}
    for f in graph._functions.values():  # the custom gradient's and the loops' bodies
        types |= {node.op for node in f.definition.node_def}
    return types


@pytest.mark.tf_abi
@pytest.mark.native
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("option", list(OPTION_SETS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_and_gradients_match_float64(reduction, option, chunk_size, implementation):
    assert_within_bars(option, reduction, ours(option, reduction, chunk_size),
                       what=f"{implementation}, chunk {chunk_size}", chunk_size=chunk_size)


@pytest.mark.native
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_native_op_runs_the_whole_loop(reduction):
    """float32 on the CPU: one native op (and its gradient op for per-row losses), no
    tf.while_loop, no logits-sized matmul of TensorFlow's; float64: the loop of TensorFlow ops."""
    h, w, b, labels, op, _, upstream = inputs("plain")

    def step(h_t):
        with tf.GradientTape() as tape:
            tape.watch(h_t)
            loss = tf_metal_ops.linear_cross_entropy(labels, h_t, w, b, reduction=reduction,
                                                     chunk_size=10)
            total = loss if reduction is not None else tf.reduce_sum(loss * upstream)
        return tape.gradient(total, h_t)

    types = _op_types(tf.function(step), tf.constant(h))
    assert "TfMetalOps>LinearCrossEntropy" in types
    assert ("TfMetalOps>LinearCrossEntropyGrad" in types) == (reduction is None)
    assert not types & {"While", "StatelessWhile", "MatMul", "BatchMatMulV2"}, types
    types64 = _op_types(tf.function(step), tf.constant(h.astype(np.float64)))
    assert "TfMetalOps>LinearCrossEntropy" not in types64
    assert types64 & {"While", "StatelessWhile"}


@pytest.mark.native
@pytest.mark.simd
@pytest.mark.parametrize("classes", [1003, 1201])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_native_op_on_this_cpus_rows_matches_float64_small(reduction, classes):
    """A small case of the native op (BLAS products and the vector rows of this CPU's
    instruction set): what the aarch64 (NEON under qemu) and clang builds run. 1003 classes
    (a vector tail in every row) are one column block of the BLAS; 1201, on Linux, two of 608
    and 593 columns, d hidden summed from two partial products (csrc/cpu/gemm.h)."""
    rng = np.random.default_rng(5)
    rows, width = 19, 6
    h = rng.normal(size=(rows, width)).astype(np.float32)
    w = (rng.normal(size=(width, classes)) * 2).astype(np.float32)
    b = rng.normal(size=classes).astype(np.float32)
    labels = rng.integers(0, classes, rows)
    labels[3] = -1
    upstream = rng.uniform(0.5, 1.5, rows).astype(np.float32)
    kwargs = dict(gamma=1.5, label_smoothing=0.05, ignore_class=-1, reduction=reduction,
                  chunk_size=4)
    tensors = [tf.constant(a) for a in (h, w, b)]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        loss = tf_metal_ops.linear_cross_entropy(labels, *tensors, **kwargs)
        total = loss if reduction is not None else tf.reduce_sum(loss * upstream)
    got = [loss.numpy(), *(g.numpy() for g in tape.gradient(total, tensors))]
    z = h.astype(np.float64) @ w.astype(np.float64) + b
    ref = dict(gamma=1.5, label_smoothing=float(np.float32(0.05)), ignore_class=-1)
    losses = reference.custom_loss(labels, z, **ref)
    valid = (labels != -1).astype(np.float64)
    scales = {"mean": valid / valid.sum(), "sum": np.ones(rows), None: upstream}[reduction]
    g = reference.custom_loss_grad(labels, z, **ref) * scales[:, None]
    want = [losses if reduction is None else np.sum(losses * scales), g @ w.T.astype(np.float64),
            h.T.astype(np.float64) @ g, g.sum(axis=0)]
    for name, value, exact_value in zip(("loss", "d_hidden", "d_kernel", "d_bias"), got, want):
        assert relative_error(value, exact_value) < 2e-6, name


@pytest.mark.native
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", None])
def test_native_16_bit_hidden_states_compute_in_float32(dtype, reduction):
    """mixed precision: 16-bit hidden states with a float32 kernel; every product is float32,
    so the loss and gradients are those of the float32 op on the same (rounded) hidden states,
    d hidden rounded once to the hidden states' dtype."""
    h, w, b, labels, _, _, upstream = inputs("focal + smoothing")
    h16 = tf.cast(tf.constant(h / 2), dtype)
    h32 = tf.cast(h16, tf.float32)
    results = []
    for hidden in (h16, h32):
        with tf.GradientTape() as tape:
            tape.watch([hidden])
            wv, bv = tf.constant(w), tf.constant(b)
            tape.watch([wv, bv])
            loss = tf_metal_ops.linear_cross_entropy(labels, hidden, wv, bv, gamma=2.0,
                                                     label_smoothing=0.1, reduction=reduction,
                                                     chunk_size=10)
            total = loss if reduction is not None else tf.reduce_sum(loss * upstream)
        results.append([loss, *tape.gradient(total, [hidden, wv, bv])])
    got, want = results
    assert got[0].dtype == tf.float32 and got[1].dtype == dtype and got[2].dtype == tf.float32
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(got[1].numpy().astype(np.float32),
                               tf.cast(tf.cast(want[1], dtype), tf.float32).numpy(), rtol=0,
                               atol=0)
    for g, e in zip(got[2:], want[2:]):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-9)


@pytest.mark.native
def test_native_results_do_not_depend_on_the_thread_count():
    """On Linux bit for bit: each column block is one single-threaded BLAS call and the partial
    sums of d hidden are added in a fixed order, whichever thread ran which block."""
    option = "class weights + smoothing"
    previous = tf_metal_ops.get_cpu_threads()
    try:
        tf_metal_ops.set_cpu_threads(1)
        one = ours(option, "mean", 10)
        tf_metal_ops.set_cpu_threads(2)
        two = ours(option, "mean", 10)
    finally:
        tf_metal_ops.set_cpu_threads(0 if previous == tf_metal_ops.get_cpu_threads() else previous)
    for a, b in zip(one, two):
        if sys.platform == "darwin":  # Accelerate's own threads, one whole product
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        else:
            np.testing.assert_array_equal(a, b)


def test_native_default_chunk_holds_about_n_times_d_logits():
    chunk_rows = tf_metal_ops._native.runtime().linear_chunk_rows
    assert chunk_rows(0, 8192, 512, 32000) == 256  # 131 rows of logits: the 256-row floor
    assert chunk_rows(0, 8192, 512, 128256) == 256
    assert chunk_rows(0, 8192, 4096, 32000) == 1049  # ceil(8192 * 4096 / 32000)
    assert chunk_rows(0, 100, 8, 50) == 100  # never more than the rows
    assert chunk_rows(7, 100, 8, 50) == 7
    assert chunk_rows(700, 100, 8, 50) == 100


RAW_ATTRS = dict(gamma=0.0, label_smoothing=0.0, has_ignore_class=False, ignore_class=0)


def _raw(hidden, kernel, bias, labels, class_weights=(), row_scales=(), chunk_rows=0, **attrs):
    return tf_metal_ops._native.op_module().tf_metal_ops_linear_cross_entropy(
        hidden=hidden, kernel=kernel, bias=bias, labels=labels,
        class_weights=tf.constant(class_weights, tf.float32, shape=[len(class_weights)]),
        row_scales=tf.constant(row_scales, tf.float32, shape=[len(row_scales)]),
        chunk_rows=chunk_rows, **{**RAW_ATTRS, **attrs})


@pytest.mark.native
def test_raw_native_op_rejects_bad_input_naming_it():
    h, w, b = tf.ones([4, 3]), tf.ones([3, 5]), tf.zeros([5])
    y = tf.constant([0, 1, 2, 3])
    bad = tf.errors.InvalidArgumentError
    with pytest.raises(bad, match=r"LinearCrossEntropy.*kernel must have shape \[d, num_classes\]"
                                  r".*kernel shape \[2, 5\] and hidden shape \[4, 3\]"):
        _raw(h, tf.ones([2, 5]), b, y)
    with pytest.raises(bad, match=r"bias must have shape \[5\]; got \[4\]"):
        _raw(h, w, tf.zeros([4]), y)
    with pytest.raises(bad, match=r"sparse labels must have shape \[rows\].*labels shape \[3\]"):
        _raw(h, w, b, tf.constant([0, 1, 2]))
    with pytest.raises(bad, match=r"class_weights must have shape \[5\].*got \[2\]"):
        _raw(h, w, b, y, class_weights=[1.0, 1.0])
    with pytest.raises(bad, match=r"row_scales must have shape \[4\].*got \[3\]"):
        _raw(h, w, b, y, row_scales=[1.0, 1.0, 1.0])
    with pytest.raises(bad, match=r"labels\[2\] = 9 is not a class id in \[0, 5\)"):
        _raw(h, w, b, tf.constant([0, 1, 9, 3]), chunk_rows=1)
    with pytest.raises(bad, match=r"labels\[1\] = -1 is not a class id in \[0, 5\) nor "
                                  r"ignore_class \(4\)"):
        _raw(h, w, b, tf.constant([0, -1, 2, 3], tf.int64), has_ignore_class=True,
             ignore_class=4)
    with pytest.raises(bad, match=r"class_weights\[3\] = -1 must be a finite number >= 0"):
        _raw(h, w, b, y, class_weights=[1.0, 1.0, 1.0, -1.0, 1.0])
    with pytest.raises(bad, match=r"chunk_rows must be >= 0.*got -3"):
        _raw(h, w, b, y, chunk_rows=-3)
    with pytest.raises(bad, match=r"gamma must be a finite number >= 0"):
        _raw(h, w, b, y, gamma=-1.0)
    with pytest.raises((bad, ValueError), match=r"rank 2|hidden must have shape"):
        _raw(tf.ones([4]), w, b, y)
    # Errors leave the op usable: the next good call works.
    loss, stats, dh, dw, db = _raw(h, w, b, y, row_scales=[0.25] * 4)
    assert loss.shape == (4,) and stats.shape == (4, 3) and dw.shape == (3, 5)
    np.testing.assert_allclose(loss.numpy(), np.log(5.0), rtol=1e-6)


@pytest.mark.native
def test_raw_native_op_without_row_scales_makes_no_gradients():
    h, w, b = tf.ones([4, 3]), tf.ones([3, 5]), tf.zeros([5])
    loss, stats, dh, dw, db = _raw(h, w, b, tf.constant([0, 1, 2, 3]))
    assert dh.shape == (0,) and dw.shape == (0,) and db.shape == (0,)
    np.testing.assert_allclose(stats.numpy()[:, 0], 3.0)  # max z: every logit is 3
    empty = _raw(tf.ones([0, 3]), w, b, tf.zeros([0], tf.int32), row_scales=[])
    assert empty[0].shape == (0,) and empty[2].shape == (0, 3)
    assert not np.any(empty[3].numpy()) and empty[3].shape == (3, 5)


@pytest.mark.native
def test_native_second_derivative_says_it_is_missing():
    h, w, b, labels, _, _, _ = inputs("plain")
    hv = tf.constant(h)
    with pytest.raises(NotImplementedError, match="Second derivatives"):
        with tf.GradientTape() as outer:
            outer.watch(hv)
            with tf.GradientTape() as inner:
                inner.watch(hv)
                loss = tf.reduce_sum(tf_metal_ops.linear_cross_entropy(
                    labels, hv, w, b, reduction=None))
            g = inner.gradient(loss, hv)
        outer.gradient(g, hv)


@pytest.mark.parametrize("reduction", ["mean", None])
def test_kernel_gradient_in_vocabulary_blocks(reduction, monkeypatch):
    """The kernel's gradient made in blocks (as for a large d x V with chunks of fewer than d
    rows, kept transposed) gives the whole product's values: blocks of uneven size, the last
    one short. (The other tests make it whole, in the kernel's layout.)"""
    shape = tf.TensorShape([WIDTH, CLASSES])
    assert linear_module._kernel_gradient_blocks(shape, 5) == 1
    monkeypatch.setattr(linear_module, "KERNEL_BLOCK_BYTES", 4 * WIDTH * CLASSES // 3 + 1)
    assert linear_module._kernel_gradient_blocks(shape, 5) == 3
    assert linear_module._kernel_gradient_blocks(shape, WIDTH) == 1  # d rows: whole
    option = "focal + smoothing"
    assert_within_bars(option, reduction, ours(option, reduction, 5), what="3 blocks",
                       chunk_size=5)


def test_kernel_gradient_blocks_of_the_bench_sizes():
    blocks = linear_module._kernel_gradient_blocks
    assert blocks(tf.TensorShape([512, 32000]), 262) == 4  # 62.5 MiB
    assert blocks(tf.TensorShape([512, 128256]), 256) == 16
    assert blocks(tf.TensorShape([512, 32000]), 512) == 1  # d rows: whole
    assert blocks(tf.TensorShape([None, 128256]), 256) == 1


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tf_function_and_xla_give_the_eager_values(reduction):
    option = "ignore_class, focal"
    eager = ours(option, reduction, 10)
    graph = ours(option, reduction, 10, wrap=tf.function)
    for a, b in zip(eager, graph):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    before = tf_metal_ops.loss_path_info()["counts"]["composed (XLA)"]
    xla = ours(option, reduction, 10, wrap=lambda f: tf.function(f, jit_compile=True))
    assert tf_metal_ops.loss_path_info()["counts"]["composed (XLA)"] > before
    # XLA's matmuls inside the compiled loop sum K = 32000 terms in yet another order than a
    # matmul compiled alone: d_hidden and d_kernel get twice the matmul's share of the bar.
    loss_bar, dh_bar, dw_bar, db_bar = bars(reduction, 10, jit_compile=True)
    for name, value, want, bar in zip(("loss", "d_hidden", "d_kernel", "d_bias"), xla,
                                      exact(option, reduction),
                                      (loss_bar, 2 * dh_bar, 2 * dw_bar, db_bar)):
        error = relative_error(value, want)
        assert error <= bar, f"XLA {option} {reduction}: {name} error {error:.3g} > {bar:.3g}"


def _plain_step(labels, h, w, b, reduction="mean", **kwargs):
    """(loss, gradients of its sum with respect to h, w and b where b is given)."""
    sources = [h, w] if b is None else [h, w, b]
    with tf.GradientTape() as tape:
        tape.watch(sources)
        loss = tf_metal_ops.linear_cross_entropy(labels, h, w, b, reduction=reduction, **kwargs)
        total = tf.reduce_sum(loss)
    return loss, tape.gradient(total, sources)


def test_leading_dimensions_and_trailing_one_labels():
    h, w, b, labels, _, _, _ = inputs("plain")
    h3 = tf.constant(h[:36].reshape(4, 9, WIDTH))
    for y in (labels[:36].reshape(4, 9), labels[:36].reshape(4, 9, 1).astype(np.float32)):
        loss, grads = _plain_step(y, h3, tf.constant(w), tf.constant(b), reduction=None,
                                  chunk_size=5)
        assert loss.shape == (4, 9) and loss.dtype == tf.float32 and grads[0].shape == h3.shape
        flat, _ = _plain_step(labels[:36], tf.constant(h[:36]), tf.constant(w), tf.constant(b),
                              reduction=None)
        np.testing.assert_allclose(loss.numpy().reshape(-1), flat.numpy(), rtol=1e-6)


@pytest.mark.parametrize("rows", [0, 3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_and_small_batches(rows, reduction):
    rng = np.random.default_rng(0)
    h = tf.constant(rng.normal(size=(rows, 4)).astype(np.float32))
    w = tf.constant(rng.normal(size=(4, 11)).astype(np.float32))
    b = tf.constant(rng.normal(size=11).astype(np.float32))
    labels = tf.constant(rng.integers(0, 11, rows).astype(np.int32))
    loss, (dh, dw, db) = _plain_step(labels, h, w, b, reduction=reduction, chunk_size=8)
    with tf.GradientTape() as tape:
        tape.watch([h, w, b])
        per_row = tf_metal_ops.custom_loss(labels, h @ w + b)
        want_loss = (per_row if reduction is None else tf.reduce_sum(per_row)
                     / (max(rows, 1) if reduction == "mean" else 1))
        want_dh, want_dw, want_db = tape.gradient(tf.reduce_sum(want_loss), [h, w, b])
    assert dh.shape == h.shape and dw.shape == w.shape and db.shape == b.shape
    for got, want in ((loss, want_loss), (dh, want_dh), (dw, want_dw), (db, want_db)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def test_mean_of_only_ignored_rows_is_zero():
    h = tf.ones([3, 4])
    w = tf.ones([4, 5])
    loss, grads = _plain_step([2, 2, 2], h, w, None, ignore_class=2)
    assert float(loss) == 0.0
    assert not np.any(grads[0].numpy()) and not np.any(grads[1].numpy())


def test_no_bias_and_float16_and_float64():
    h, w, b, labels, _, _, _ = inputs("plain")
    # float16 hidden states with a float32 kernel (mixed_float16's Dense): logits in float16.
    h16 = tf.constant(h / 4, tf.float16)
    w32 = tf.Variable(w / 4)
    with tf.GradientTape() as tape:
        tape.watch(h16)
        loss = tf_metal_ops.linear_cross_entropy(labels, h16, w32, chunk_size=10)
    dh, dw = tape.gradient(loss, [h16, w32])
    assert loss.dtype == tf.float32 and dh.dtype == tf.float16 and dw.dtype == tf.float32
    with tf.GradientTape() as tape:
        tape.watch(h16)
        want = tf.reduce_mean(tf_metal_ops.custom_loss(labels, tf.cast(h16, tf.float32) @ w32))
    want_dh, want_dw = tape.gradient(want, [h16, w32])
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-3)
    np.testing.assert_allclose(dh.numpy(), want_dh.numpy(), atol=2e-3 * np.abs(want_dh).max())
    np.testing.assert_allclose(dw.numpy(), want_dw.numpy(), atol=2e-3 * np.abs(want_dw).max())
    # float64 all through: the float64 kernel, exact to ~1e-15.
    got = _plain_step(labels, *(tf.constant(a.astype(np.float64)) for a in (h, w, b)),
                      chunk_size=10)
    assert got[0].dtype == tf.float64
    want = exact("plain", "mean")
    assert relative_error(got[0].numpy(), want[0]) < 1e-12
    for g, e in zip(got[1], want[1:]):
        assert relative_error(g.numpy(), e) < 1e-12


@pytest.mark.native
def test_bad_inputs_name_the_argument_and_value():
    h, w, b = tf.ones([4, 3]), tf.ones([3, 5]), tf.ones([5])
    y = tf.constant([0, 1, 2, 3])
    lce = tf_metal_ops.linear_cross_entropy
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or None, got 'avg'"):
        lce(y, h, w, reduction="avg")
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        lce(y, h, w, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size must be a positive int or None, got 2.5"):
        lce(y, h, w, chunk_size=2.5)
    with pytest.raises(TypeError, match="hidden must be floating point.*int32"):
        lce(y, tf.ones([4, 3], tf.int32), w)
    with pytest.raises(ValueError, match="kernel must have shape \\[d, num_classes\\]"):
        lce(y, h, tf.ones([3, 5, 1]))
    with pytest.raises(ValueError, match="hidden's last dimension must equal kernel's first"):
        lce(y, h, tf.ones([2, 5]))
    with pytest.raises(ValueError, match="bias must have one entry per class"):
        lce(y, h, w, tf.ones([4]))
    with pytest.raises(ValueError, match="sparse labels must have shape"):
        lce(tf.constant([0, 1, 2]), h, w)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0, got -1"):
        lce(y, h, w, gamma=-1)
    with pytest.raises(ValueError, match="ignore_class=0 applies to class-id labels only"):
        lce(tf.ones([4, 5]) / 5, h, w, ignore_class=0)
    with pytest.raises(ValueError, match="class_weights must have one entry per class"):
        lce(y, h, w, class_weights=[1.0, 2.0])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"labels\[2\] = 7 is not a class id in \[0, 5\)"):
        lce(tf.constant([0, 1, 7, 3]), h, w, chunk_size=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"labels.flat\[.*2"):
        tf.function(lambda y: lce(y, h, w, chunk_size=2))(tf.constant([0, 1, -3, 3]))
    # ignore_class may lie outside [0, C): those rows are no error.
    assert float(lce(tf.constant([0, -1, 2, 3]), h, w, ignore_class=-1)) > 0


def test_default_chunk_holds_32_mib_of_logits_or_half_a_kernel():
    assert default_chunk_size(32000) == 262
    assert default_chunk_size(128256) == 65
    assert default_chunk_size(32000, width=512) == 262
    assert default_chunk_size(128256, width=512) == 256  # d / 2 rows: half of dW's size
    assert default_chunk_size(10, rows=100) == 100
    assert default_chunk_size(10 ** 9) == 1


# ---- memory: the bench's child process, small enough for CI ---------------------------------

def test_peak_memory_stays_far_below_the_logits():
    """At N = 8192, V = 40000 the logits are 1250 MiB; fused with its default chunks (32 MiB
    of logits; an allocator's pool may hold several) must stay under 30 % of that, while
    Dense(V) + CustomLoss reaches most of it (so the measurement sees what it should)."""
    rows, hidden, classes = 8192, 32, 40000
    logits_bytes = 4 * rows * classes
    extra = {}
    for case in ("fused", "dense_custom"):
        completed = subprocess.run(
            [sys.executable, "-m", "tf_metal_ops.tools.bench", bench_linear_head.CHILD_FLAG, case,
             f"{rows}x{hidden}x{classes}x1"],
            capture_output=True, text=True, timeout=300, check=False)
        assert completed.returncode == 0, completed.stderr[-3000:]
        found = json.loads([l for l in completed.stdout.splitlines() if l.startswith("{")][-1])
        extra[case] = found["extra_bytes"]
        for name, error in found["errors"].items():
            assert error < 1e-6, f"{case}: {name} error {error}"
    assert extra["dense_custom"] > 0.8 * logits_bytes, extra
    assert extra["fused"] < 0.3 * logits_bytes, extra


# ---- the Keras head --------------------------------------------------------------------------

VOCAB, D, T = 40, 8, 6


def _lm_data():
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCAB, (16, T)).astype(np.int32)
    x[:, 4:] = 0  # padding: masked by the embedding
    y = rng.integers(0, VOCAB, (16, T)).astype(np.int32)
    y[:, 0] = 2  # ignore_class
    w = np.repeat(rng.uniform(0.5, 2, (16, 1)), T, axis=1).astype(np.float32)
    return x, y, w


def _head_model(**head_kwargs):
    tokens = keras.Input((T,), dtype="int32")
    labels = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, D, mask_zero=True)(tokens)
    h = keras.layers.Dense(D)(h)
    head = tf_metal_ops.LinearCrossEntropyHead(VOCAB, ignore_class=2, chunk_size=7,
                                               **head_kwargs)
    return keras.Model([tokens, labels], head([h, labels]))


def _dense_model():
    tokens = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, D, mask_zero=True)(tokens)
    h = keras.layers.Dense(D)(h)
    return keras.Model(tokens, keras.layers.Dense(VOCAB)(h))


@pytest.fixture
def policy():
    previous = keras.mixed_precision.global_policy()
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy(previous)


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_head_in_fit_trains_as_dense_and_keras_sparse_cross_entropy(policy, precision):
    policy(precision)
    x, y, w = _lm_data()
    model = _head_model()
    model.compile(keras.optimizers.SGD(0.5), loss=tf_metal_ops.PerTokenLoss())
    reference_model = _dense_model()
    reference_model.set_weights(model.get_weights())
    reference_model.compile(keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=2))
    rtol = 1e-6 if precision == "float32" else 2e-3
    np.testing.assert_allclose(model.evaluate([x, y], y, sample_weight=w, verbose=0),
                               reference_model.evaluate(x, y, sample_weight=w, verbose=0),
                               rtol=rtol)
    start = model.get_weights()
    model.fit([x, y], y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference_model.fit(x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), start))
    assert moved > 0.01
    for got, want in zip(model.get_weights(), reference_model.get_weights()):
        np.testing.assert_allclose(got, want, atol=(1e-6 if precision == "float32" else 2e-3))


def test_head_saves_loads_and_gives_logits(tmp_path):
    x, y, w = _lm_data()
    model = _head_model(gamma=1.0, label_smoothing=0.1)
    model.compile("sgd", loss=tf_metal_ops.PerTokenLoss())
    path = tmp_path / "head.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    head = loaded.layers[-1]
    assert isinstance(head, tf_metal_ops.LinearCrossEntropyHead)
    assert (head.gamma, head.label_smoothing, head.ignore_class, head.chunk_size) == (1.0, 0.1, 2, 7)
    np.testing.assert_allclose(loaded.predict([x, y], verbose=0),
                               model.predict([x, y], verbose=0), rtol=1e-6)
    # Logits on request: the hidden states alone, as Dense(V) would give them.
    hidden = tf.random.normal([3, 5, D])
    logits = head(hidden)
    np.testing.assert_allclose(logits.numpy(), (hidden @ head.kernel + head.bias).numpy(),
                               rtol=1e-6)
    per_token = head([hidden, tf.constant(np.full((3, 5), 4, np.int32))])
    want = tf_metal_ops.custom_loss(np.full((3, 5), 4), logits, gamma=1.0, label_smoothing=0.1)
    np.testing.assert_allclose(per_token.numpy(), want.numpy(), rtol=1e-5)


def test_head_rejects_bad_options():
    with pytest.raises(ValueError, match="units must be a positive int"):
        tf_metal_ops.LinearCrossEntropyHead(0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got -2"):
        tf_metal_ops.LinearCrossEntropyHead(5, chunk_size=-2)
    with pytest.raises(ValueError, match="class_weights must have one entry per class"):
        tf_metal_ops.LinearCrossEntropyHead(5, class_weights=[1.0])


def test_head_under_mirrored_strategy_trains_as_one_device(tmp_path):
    out = tmp_path / "mirrored.json"
    worker = Path(__file__).resolve().parent / "linear_head_worker.py"
    package_parent = str(Path(tf_metal_ops.__file__).resolve().parents[1])
    completed = subprocess.run([sys.executable, str(worker), str(out)], capture_output=True,
                               text=True, timeout=300, check=False,
                               env={**__import__("os").environ, "PYTHONPATH": package_parent})
    assert completed.returncode == 0, completed.stderr[-3000:]
    facts = json.loads(out.read_text())
    assert facts["replicas"] == 2
    assert facts["moved"] > 0.05
    assert facts["max_difference"] < 2e-5, facts


@pytest.mark.tf_abi
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batch_of_unknown_size_under_tf_function(reduction):
    """Keras traces fit with a batch of unknown size: the chunk is then bounded at run time
    (here the default chunk would be far larger than the 37 rows)."""
    option = "ignore_class, focal"
    h, w, b, labels, op, _, upstream = inputs(option)

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH]), tf.TensorSpec([None], tf.int64)])
    def run(h_t, y):
        with tf.GradientTape() as tape:
            tape.watch(h_t)
            loss = tf_metal_ops.linear_cross_entropy(y, h_t, w, b, reduction=reduction, **op)
            total = loss if reduction is not None else tf.reduce_sum(loss * upstream)
        return loss, tape.gradient(total, h_t)

    loss, dh = run(tf.constant(h), tf.constant(labels))
    want = ours(option, reduction, None)
    np.testing.assert_allclose(loss.numpy(), want[0], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dh.numpy(), want[1], rtol=1e-5, atol=1e-9)


def test_head_under_keras_jit_compile_runs_the_composed_path():
    x, y, w = _lm_data()
    model = _head_model()
    model.compile("sgd", loss=tf_metal_ops.PerTokenLoss())
    plain = model.evaluate([x, y], y, sample_weight=w, verbose=0)
    model.compile("sgd", loss=tf_metal_ops.PerTokenLoss(), jit_compile=True)
    compiled = model.evaluate([x, y], y, sample_weight=w, verbose=0)
    assert tf_metal_ops.loss_path_info()["last"]["path"] == "composed (XLA)"
    np.testing.assert_allclose(compiled, plain, rtol=1e-5)
