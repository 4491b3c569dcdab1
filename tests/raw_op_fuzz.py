"""Hostile inputs for the raw native ops, run as a program of its own.

`python tests/raw_op_fuzz.py` calls `TfMetalOps>CustomLoss` and `TfMetalOps>CustomLossGrad`
directly (bypassing every check of `tf_metal_ops.custom_loss`) with wrong ranks and dtypes,
labels far outside [0, C), NaN / inf / negative attributes, C = 0, mismatched class weights and
upstream gradients, each eagerly and inside a `tf.function` with unknown shapes. It prints one
JSON object per case to stdout and, before each case, a "START <name>" line to stderr, so that
if the process dies (segfault, abort, sanitizer report) the caller knows which case did it.

It is a separate program (run by tests/test_robustness.py, and by the sanitizer build in
tests/sanitizer/) because a crash must show up as a failed test with its signal, not as a dead
pytest. Exit status: 0 when every case behaved, 1 when some did not (a readable summary on
stderr), and whatever signal killed it otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_metal_ops import _native  # noqa: E402

OPS = _native.op_module()
# Exceptions that are an orderly refusal. Anything else (or a crash) is a failure.
REFUSALS = (TypeError, ValueError, tf.errors.InvalidArgumentError)


class Case(NamedTuple):
    name: str
    inputs: Callable[[], Dict[str, object]]  # keyword arguments of the raw op
    # None: the call must succeed. Otherwise it must raise one of REFUSALS whose message
    # contains every one of these fragments (case-insensitive); a tuple of fragments means any
    # one of them. (Dtypes outside the op's type constraints are refused by TensorFlow's
    # generated wrapper, whose message names the dtype rather than the argument.)
    expect_error: Optional[Sequence[object]]
    gradient: bool = False   # call the gradient op (needs `upstream`)


def f32(values) -> tf.Tensor:
    return tf.constant(values, tf.float32)


def no_weights() -> tf.Tensor:
    return tf.zeros([0], tf.float32)


def to_numpy(tensor: tf.Tensor) -> np.ndarray:
    # An empty tensor may declare more elements per row than NumPy can address ([0, 2**62]).
    if tensor.shape.num_elements() == 0:
        return np.zeros(tensor.shape.as_list(), tensor.dtype.as_numpy_dtype) if all(
            d < 2**31 for d in tensor.shape) else np.empty((0,))
    return tensor.numpy()


def outputs_to_numpy(result) -> List[np.ndarray]:
    """Every output of an op call (the forward op has three: the loss, the row statistics and
    the scaled gradient)."""
    return [to_numpy(t) for t in (result if isinstance(result, (list, tuple)) else [result])]


def call(kwargs: Dict[str, object], gradient: bool, mode: str):
    op = OPS.tf_metal_ops_custom_loss_grad if gradient else OPS.tf_metal_ops_custom_loss
    if mode == "eager":
        return outputs_to_numpy(op(**kwargs))
    # In a tf.function whose tensor inputs have unknown dimensions (rank known), so the
    # kernel's run-time checks, not shape inference, have to catch the problem.
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, tf.Tensor)}
    attrs = {k: v for k, v in kwargs.items() if not isinstance(v, tf.Tensor)}
    names = sorted(tensors)
    signature = [tf.TensorSpec([None] * tensors[k].shape.rank, tensors[k].dtype) for k in names]

    @tf.function(input_signature=signature)
    def run(*args):
        return op(**dict(zip(names, args)), **attrs)

    return outputs_to_numpy(run(*[tensors[k] for k in names]))


def base(batch=(3,), num_classes=4, *, labels=None, weights=None, dtype=tf.float32,
         upstream=None, **attrs) -> Dict[str, object]:
    shape = tuple(batch) + (num_classes,)
    rng = np.random.default_rng(0)
    kwargs: Dict[str, object] = dict(
        logits=(tf.cast(rng.normal(size=shape), dtype) if 0 not in shape
                else tf.zeros(shape, dtype)),  # (0, 2**62) is fine for TF, not for NumPy
        labels=tf.constant(np.zeros(batch, np.int32)) if labels is None else labels,
        class_weights=no_weights() if weights is None else weights,
    )
    kwargs["row_scales"] = tf.zeros([0], tf.float32)  # none: no scaled gradient
    if upstream is not None:
        kwargs["upstream"] = upstream
    kwargs.update(attrs)
    return kwargs


def with_grad(kwargs: Dict[str, object], upstream=None) -> Dict[str, object]:
    logits = kwargs["logits"]
    kwargs = dict(kwargs)
    dtype = logits.dtype if logits.dtype.is_floating else tf.float32
    # int64 shape: a class count of 2**62 does not fit Shape's default int32.
    rows = tf.shape(logits, out_type=tf.int64)[:-1]
    kwargs["upstream"] = tf.ones(rows, dtype) if upstream is None else upstream
    kwargs.setdefault("row_stats", tf.zeros([0, 3], tf.float32))  # none: the op finds them
    kwargs.pop("row_scales", None)  # the forward op's alone
    return kwargs


def cases() -> List[Case]:
    out: List[Case] = []

    def both(name, inputs, expect_error):
        """The same inputs through the forward op and the gradient op."""
        out.append(Case(f"forward/{name}", inputs, expect_error))
        out.append(Case(f"gradient/{name}", lambda: with_grad(inputs()), expect_error, True))

    # --- the valid baseline and valid corners (must succeed) --------------------------------
    both("valid", lambda: base(), None)
    both("rank1_logits_scalar_label", lambda: base(batch=(), labels=tf.constant(2)), None)
    both("empty_batch", lambda: base(batch=(0,), labels=tf.zeros([0], tf.int32)), None)
    both("empty_inner_batch", lambda: base(batch=(2, 0), labels=tf.zeros([2, 0], tf.int64)), None)
    both("one_class", lambda: base(num_classes=1), None)
    both("ignore_class_far_outside",
         lambda: base(labels=tf.constant([2**62, 0, 2**62], tf.int64), has_ignore_class=True,
                      ignore_class=2**62), None)
    both("nan_and_inf_logits",
         lambda: dict(base(), logits=f32([[np.nan, 0, 0, 0], [np.inf, 0, 0, 0],
                                          [-np.inf] * 4])), None)
    both("wide_row", lambda: base(batch=(1,), num_classes=1 << 18), None)

    # --- wrong ranks and shapes ----------------------------------------------------------------
    both("scalar_logits", lambda: dict(base(), logits=tf.constant(1.0), labels=tf.constant(0)),
         ["logits", "rank"])
    both("zero_classes", lambda: base(num_classes=0), ["class"])
    both("zero_classes_empty_batch",
         lambda: base(batch=(0,), num_classes=0, labels=tf.zeros([0], tf.int32)), ["class"])
    both("labels_rank_too_high",
         lambda: base(labels=tf.zeros([3, 4, 5], tf.int32)), ["labels", "shape"])
    both("labels_rank_too_low",
         lambda: base(batch=(2, 3), labels=tf.zeros([2], tf.int32)), ["labels", "shape"])
    both("labels_batch_mismatch", lambda: base(labels=tf.zeros([4], tf.int32)),
         ["labels", "shape"])
    both("dense_labels_wrong_classes", lambda: base(labels=tf.zeros([3, 5], tf.float32)),
         ["labels", "shape"])
    both("dense_labels_wrong_rows", lambda: base(labels=tf.zeros([2, 4], tf.float32)),
         ["labels", "shape"])
    both("dense_labels_other_float_dtype", lambda: base(labels=tf.zeros([3, 4], tf.float64)),
         ["labels"])
    both("class_weights_too_long", lambda: base(weights=tf.ones([5])), ["class_weights"])
    both("class_weights_too_short", lambda: base(weights=tf.ones([3])), ["class_weights"])
    both("class_weights_matrix", lambda: base(weights=tf.ones([2, 4])), ["class_weights"])
    both("class_weights_scalar", lambda: base(weights=tf.constant(1.0)), ["class_weights"])
    out.append(Case("gradient/row_stats_wrong_rows",
                    lambda: dict(with_grad(base()), row_stats=tf.zeros([4, 3])),
                    ["row_stats", "shape"], True))
    out.append(Case("gradient/row_stats_wrong_width",
                    lambda: dict(with_grad(base()), row_stats=tf.zeros([3, 2])),
                    ["row_stats", "shape"], True))
    out.append(Case("gradient/row_stats_rank_1",
                    lambda: dict(with_grad(base()), row_stats=tf.zeros([9])),
                    ["row_stats", "shape"], True))
    out.append(Case("gradient/row_stats_from_the_forward_op",
                    lambda: dict(with_grad(base()),
                                 row_stats=OPS.tf_metal_ops_custom_loss(**base())[1]), None, True))
    out.append(Case("forward/row_scales_wrong_rows",
                    lambda: dict(base(), row_scales=tf.ones([4])), ["row_scales", "shape"]))
    out.append(Case("forward/row_scales_scalar",
                    lambda: dict(base(), row_scales=tf.constant(0.25)), ["row_scales", "shape"]))
    out.append(Case("forward/row_scales_matrix",
                    lambda: dict(base(), row_scales=tf.ones([3, 4])), ["row_scales", "shape"]))
    out.append(Case("forward/row_scales", lambda: dict(base(), row_scales=tf.fill([3], 0.25)),
                    None))
    out.append(Case("forward/row_scales_leading_dims",
                    lambda: dict(base(batch=(2, 3), labels=tf.zeros([2, 3], tf.int32)),
                                 row_scales=tf.ones([2, 3])), None))
    out.append(Case("forward/row_scales_empty_batch",
                    lambda: dict(base(batch=(0,), labels=tf.zeros([0], tf.int32)),
                                 row_scales=tf.zeros([0])), None))
    out.append(Case("gradient/upstream_wrong_rows",
                    lambda: with_grad(base(), tf.ones([4])), ["upstream"], True))
    out.append(Case("gradient/upstream_wrong_rank",
                    lambda: with_grad(base(), tf.ones([3, 4])), ["upstream"], True))
    out.append(Case("gradient/upstream_scalar",
                    lambda: with_grad(base(), tf.constant(1.0)), ["upstream"], True))

    # --- wrong dtypes (refused by the op's type constraints) -------------------------------------
    both("string_logits", lambda: dict(base(), logits=tf.constant([["a", "b"]])), ["logits"])
    both("complex_logits",
         lambda: dict(base(), logits=tf.complex(f32([[1.0, 2.0]]), f32([[0.0, 0.0]])),
                      labels=tf.constant([0])), ["logits"])
    both("int32_logits", lambda: dict(base(), logits=tf.zeros([3, 4], tf.int32)), ["logits"])
    both("string_labels", lambda: base(labels=tf.constant(["a", "b", "c"])), ["labels"])
    both("uint8_labels", lambda: base(labels=tf.zeros([3], tf.uint8)), ["labels"])
    both("bool_labels", lambda: base(labels=tf.zeros([3], tf.bool)), ["labels"])
    both("float64_class_weights", lambda: base(weights=tf.ones([4], tf.float64)),
         [("class_weights", "float64")])
    both("int_class_weights", lambda: base(weights=tf.ones([4], tf.int32)),
         [("class_weights", "int32")])
    out.append(Case("gradient/upstream_other_dtype",
                    lambda: with_grad(base(), tf.ones([3], tf.float64)),
                    [("upstream", "double", "float64")], True))

    # --- label values ------------------------------------------------------------------------------
    for value, dtype in ((4, tf.int32), (-1, tf.int32), (-(2**31), tf.int32), (2**31 - 1, tf.int32),
                         (2**62, tf.int64), (-(2**63), tf.int64), (2**32, tf.int64)):
        both(f"label_{value}_{dtype.name}",
             lambda value=value, dtype=dtype: base(labels=tf.constant([0, value, 1], dtype)),
             ["labels[1]", str(value)])
    both("label_out_of_range_in_leading_dims",
         lambda: base(batch=(2, 3), labels=tf.constant([[0, 1, 2], [3, 9, 0]], tf.int32)),
         ["9"])
    both("label_equal_to_c_with_other_ignore_class",
         lambda: base(labels=tf.constant([0, 4, 1], tf.int64), has_ignore_class=True,
                      ignore_class=-1), ["4"])
    both("ignore_class_beyond_int32_with_int32_labels",
         lambda: base(labels=tf.constant([0, -1, 1], tf.int32), has_ignore_class=True,
                      ignore_class=2**32 - 1), ["-1"])

    # --- attributes (the Python wrapper would have refused these) -------------------------------
    for value in (float("nan"), float("inf"), -1.0, -1e-30):
        both(f"gamma_{value}", lambda value=value: base(gamma=value), ["gamma"])
    for value in (float("nan"), float("inf"), -0.1, 1.5):
        both(f"label_smoothing_{value}", lambda value=value: base(label_smoothing=value),
             ["label_smoothing"])
    both("ignore_class_with_dense_labels",
         lambda: base(labels=tf.zeros([3, 4], tf.float32), has_ignore_class=True, ignore_class=0),
         ["ignore_class"])

    # --- class weight values -----------------------------------------------------------------------
    for value in (float("nan"), float("inf"), -1.0, -0.0):
        expect = None if value == 0 else ["class_weights[2]"]
        both(f"class_weight_{value}",
             lambda value=value: base(weights=f32([1.0, 1.0, value, 1.0])), expect)

    # --- sizes: an empty batch with an absurd class count is still O(1) work -------------------
    # (a kernel that loops over the classes before looking at the row count never finishes;
    # run these alone, under a timeout: `raw_op_fuzz.py huge_classes`).
    both("empty_batch_huge_classes",
         lambda: base(batch=(0,), num_classes=2**62, labels=tf.zeros([0], tf.int32)), None)
    return out


HANG_PRONE = "huge_classes"  # selected only when asked for by name


def run_case(case: Case, mode: str) -> Dict[str, object]:
    result: Dict[str, object] = {"case": case.name, "mode": mode}
    try:
        value = call(case.inputs(), case.gradient, mode)
    except REFUSALS as error:
        message = str(error)
        result.update(outcome="refused", error=type(error).__name__, message=message[:500])
        if case.expect_error is None:
            result["problem"] = "valid input was refused"
        else:
            missing = [f for f in case.expect_error
                       if not any(alt.lower() in message.lower()
                                  for alt in ((f,) if isinstance(f, str) else f))]
            if missing:
                result["problem"] = f"message does not name {missing}"
    except Exception as error:  # noqa: BLE001 - any other exception is a finding
        result.update(outcome="unexpected exception", error=type(error).__name__,
                      message=str(error)[:500], problem="not an orderly refusal")
    else:
        result.update(outcome="ok", shapes=[list(np.shape(v)) for v in value])
        if case.expect_error is not None:
            result["problem"] = "bad input was accepted"
    return result


def main(argv: Sequence[str]) -> int:
    only = argv[1] if len(argv) > 1 else ""
    problems = 0
    for case in cases():
        if only not in case.name or (HANG_PRONE in case.name and HANG_PRONE not in only):
            continue
        for mode in ("eager", "function"):
            print(f"START {case.name} [{mode}]", file=sys.stderr, flush=True)
            result = run_case(case, mode)
            print(json.dumps(result), flush=True)
            problems += "problem" in result
    print(f"DONE problems={problems}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
