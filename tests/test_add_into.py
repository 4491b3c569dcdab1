"""AddInto (csrc/add_into.h), the in-place sum of linear_cross_entropy's chunk loop.

Checked: the first call makes the sum (the addend itself, or zeros with the addend at its
rows) and ignores the accumulator; later calls add at the row offset into the accumulator's
own buffer; float32 and float64; every misfit of addend and sum is an InvalidArgumentError
naming the shapes and the row; in a tf.function's while loop the sum is right on every call
(nothing carried between calls); and linear_cross_entropy's CPU loop uses the op.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import _native

pytestmark = [pytest.mark.tf_abi, pytest.mark.native]

OPS = _native.op_module()
PLACEHOLDER = tf.zeros([0, 0])


def add_into(accumulator, addend, first, shape, row_offset=0):
    return OPS.tf_metal_ops_add_into(accumulator=accumulator, addend=addend, first=first,
                                     row_offset=tf.constant(row_offset, tf.int64),
                                     shape=tf.constant(shape, tf.int64))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_first_call_takes_the_addend_and_later_calls_add_in_place(dtype):
    a = tf.constant(np.arange(6).reshape(2, 3), dtype)
    b = tf.constant(np.full((2, 3), 10.0), dtype)
    total = add_into(tf.zeros([0, 0], dtype), a, True, [2, 3])
    np.testing.assert_array_equal(total.numpy(), a.numpy())
    np.testing.assert_array_equal(a.numpy(), np.arange(6).reshape(2, 3))  # held: copied
    again = add_into(total, b, False, [2, 3])
    np.testing.assert_array_equal(again.numpy(), np.arange(6).reshape(2, 3) + 10)
    # The contract: the accumulator's own buffer holds the sum.
    np.testing.assert_array_equal(total.numpy(), again.numpy())


def test_rows_go_to_their_offset():
    part = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    total = add_into(PLACEHOLDER, part, True, [5, 2], row_offset=1)
    np.testing.assert_array_equal(total.numpy(), [[0, 0], [1, 2], [3, 4], [0, 0], [0, 0]])
    total = add_into(total, tf.constant([[5.0, 6.0]]), False, [5, 2], row_offset=4)
    total = add_into(total, tf.constant([[1.0, 1.0]]), False, [5, 2], row_offset=1)
    np.testing.assert_array_equal(total.numpy(), [[0, 0], [2, 3], [3, 4], [0, 0], [5, 6]])
    empty = add_into(PLACEHOLDER, tf.zeros([0, 2]), True, [0, 2])
    assert empty.shape == (0, 2)


@pytest.mark.parametrize("addend_shape, shape, offset, first", [
    ([2, 3], [2, 4], 0, True),      # other trailing dimension
    ([2, 3], [3, 3], 2, True),      # rows past the end
    ([2, 3], [3, 3], -1, False),    # negative offset
    ([2, 3], [2, 3, 1], 0, True),   # other rank
    ([2], [], 0, True),             # a scalar sum
    ([1, 3], [2 ** 62, 3], 0, True),  # a sum too large to allocate
])
def test_misfits_name_shapes_and_row(addend_shape, shape, offset, first):
    accumulator = tf.zeros([3, 3])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"AddInto: an addend of shape \[.*\] does not fit a sum of shape "
                             r"\[.*\] at row -?\d+"):
        add_into(accumulator, tf.ones(addend_shape), first, shape, row_offset=offset)


def test_accumulator_of_another_shape_is_an_error():
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"accumulator's shape \[2, 2\] is not the sum's \[3, 3\]"):
        add_into(tf.zeros([2, 2]), tf.ones([3, 3]), False, [3, 3])


def test_non_scalar_flags_are_an_error():
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be scalars"):
        OPS.tf_metal_ops_add_into(accumulator=PLACEHOLDER, addend=tf.ones([1, 1]),
                                  first=[True, False], row_offset=tf.constant(0, tf.int64),
                                  shape=tf.constant([1, 1], tf.int64))


def test_while_loop_sums_chunks_afresh_on_every_call():
    parts = tf.constant(np.random.default_rng(0).standard_normal((4, 3, 5)), tf.float32)

    @tf.function
    def summed(parts):
        def body(i, total):
            total = OPS.tf_metal_ops_add_into(
                accumulator=total, addend=parts[i] * 2.0, first=tf.equal(i, 0),
                row_offset=tf.constant(0, tf.int64), shape=tf.constant([3, 5], tf.int64))
            total.set_shape([None, None])
            return i + 1, total

        return tf.while_loop(lambda i, _: i < 4, body, (0, PLACEHOLDER),
                             shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, None])),
                             parallel_iterations=1)[1]

    expected = 2.0 * np.sum(parts.numpy(), axis=0)
    for _ in range(3):
        np.testing.assert_allclose(summed(parts).numpy(), expected, rtol=1e-6)


def _op_types(concrete) -> set:
    graph_def = concrete.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types |= {node.op for node in function.node_def}
    return types


@pytest.mark.parametrize("reduction", ["mean", None])
def test_linear_cross_entropy_sums_in_place_on_the_cpu(reduction):
    """float64 runs linear_cross_entropy's chunk loop of TensorFlow ops, which sums in place on
    the CPU; float32 and float16 run the native op, whose loop needs no AddInto."""
    h = tf.random.normal([10, 4], dtype=tf.float64)
    w = tf.random.normal([4, 7], dtype=tf.float64)
    y = tf.constant(np.arange(10) % 7, tf.int32)

    def step(y, h, w):
        with tf.GradientTape() as tape:
            tape.watch([h, w])
            loss = tf.reduce_sum(tf_metal_ops.linear_cross_entropy(y, h, w, reduction=reduction,
                                                                   chunk_size=3))
        return tape.gradient(loss, [h, w])

    assert "TfMetalOps>AddInto" in _op_types(tf.function(step).get_concrete_function(y, h, w))
    for dtype in (tf.float32, tf.float16):
        native = tf.function(step).get_concrete_function(y, tf.cast(h, dtype),
                                                         tf.cast(w, tf.float32))
        types = _op_types(native)
        assert "TfMetalOps>AddInto" not in types and "TfMetalOps>LinearCrossEntropy" in types
