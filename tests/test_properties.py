"""Property-based tests: `tf_metal_ops.custom_loss` and its gradient against the NumPy reference.

Hypothesis draws the structure of each case (logits dtype, leading dims including empty
batches, the class count including C = 1, the label format, gamma, label smoothing, class
weights with zeros, ignore_class, and how many extreme / -inf / +inf / NaN logits to plant);
the bulk values come from a NumPy generator seeded by a drawn integer, so shrinking works on
the structure (which is what makes a failure readable) without shrinking thousands of floats.

Oracle. `tf_metal_ops.reference` is evaluated in float64 on exactly what the op sees: logits,
dense labels and the upstream gradient rounded to the logits' dtype, class weights rounded to
float32, gamma and label_smoothing rounded to float32 (they are float attributes).

Tolerances (elementwise): |op - ref| <= ATOL * scale + RTOL * |ref|, where scale is the row's
target mass sum_c a_c q_c for the loss, and (1 + gamma) * mass * |upstream| for the gradient
(|g_c| <= (1 + gamma) a_c q_c bounds |d loss / d z_j|). RTOL = ATOL per dtype: the error of the
float32 (float64) computation plus half an ulp of the output dtype:
  float64 1e-9, float32 2e-5, float16 2e-3 (half ulp 4.9e-4), bfloat16 1.6e-2 (half ulp 3.9e-3).
Every bound has an absolute floor of the dtype's underflow level (ABS_FLOOR: float16 6e-8, where
a loss of 2e-16 is stored as 0). NaN and +-inf must appear exactly where the reference has them,
except that a finite reference
value beyond the output dtype's largest finite number may come back as inf of the same sign
(a float16 loss of 1e5 cannot be stored).

Profiles (selected with HYPOTHESIS_PROFILE, default "ci"):
  ci:   derandomized (fixed seed, the same examples on every run), a few hundred examples, no
        example database, no deadline (the machine is shared; no timing assertions).
  long: random, thousands of examples, for local runs:
        HYPOTHESIS_PROFILE=long pytest tests/test_properties.py
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import tf_metal_ops
from tf_metal_ops import reference as ref

pytestmark = pytest.mark.native

# --------------------------------------------------------------------------------------------
# Profiles. Registered under our own names and applied per test (a settings object is a
# decorator), so this module never changes the global Hypothesis settings of other modules.
# --------------------------------------------------------------------------------------------

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "tf_metal_ops_ci", max_examples=400, derandomize=True, database=None, print_blob=True,
    **_COMMON)
settings.register_profile("tf_metal_ops_long", max_examples=5000, print_blob=True, **_COMMON)

_PROFILE_NAME = os.environ.get("HYPOTHESIS_PROFILE", "ci").strip().lower()
if _PROFILE_NAME not in ("ci", "long"):
    raise ValueError(f"HYPOTHESIS_PROFILE must be 'ci' or 'long', got {_PROFILE_NAME!r}")
PROFILE = settings.get_profile(f"tf_metal_ops_{_PROFILE_NAME}")
# The tf.function property retraces for most examples (new shapes and attributes), so it gets
# a fraction of the examples.
FUNCTION_PROFILE = settings(PROFILE, max_examples=max(20, PROFILE.max_examples // 5))

# --------------------------------------------------------------------------------------------
# Dtypes and tolerances
# --------------------------------------------------------------------------------------------

DTYPES = {
    "float32": tf.float32,
    "float64": tf.float64,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
}
TOLERANCE = {"float64": 1e-9, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# An absolute floor under every bound: values this small are rounded to 0 or to a subnormal by
# the output dtype (float16's smallest subnormal is 6e-8) or by the float32 computation (a
# product below float32's smallest normal number, 1.2e-38, loses digits).
ABS_FLOOR = {"float64": 1e-300, "float32": 1e-37, "float16": 6e-8, "bfloat16": 1e-37}
# Largest finite value of each output dtype (for the overflow rule in the module doc).
LARGEST = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38,
           "float16": 65504.0, "bfloat16": 3.3895313892515355e38}
# "Extreme" logits: as large as possible while differences of two logits stay finite in the
# type the op computes in (float32 for the 16-bit types, which bfloat16's range would exceed).
EXTREME = {"float64": 1e300, "float32": 1e37, "float16": 6e4, "bfloat16": 1e37}

LABEL_FORMATS = (
    "sparse_int32",
    "sparse_int64",
    "sparse_uint8",            # any integer dtype is accepted (cast to int64)
    "sparse_float32",          # Keras hands class ids over as floats
    "sparse_int32_trailing1",  # shape logits.shape[:-1] + [1]
    "sparse_float32_trailing1",
    "dense_onehot",
    "dense_soft",
)


@dataclasses.dataclass
class Case:
    """One drawn problem; `describe()` is what Hypothesis prints for a failing example."""

    dtype: str
    shape: Tuple[int, ...]
    label_format: str
    dense_label_dtype: str
    gamma: float
    label_smoothing: float
    weights: Optional[str]          # None, "random", "with_zeros", "all_zeros"
    ignore_class: Optional[int]
    logit_scale: float
    n_extreme: int
    n_minus_inf: int
    n_plus_inf: int
    n_nan: int
    ignored_fraction: float
    seed: int

    def describe(self) -> str:
        return repr(self)


def _shape(draw) -> Tuple[int, ...]:
    leading_rank = draw(st.integers(0, 3))
    leading = tuple(draw(st.integers(0, 5)) for _ in range(leading_rank))
    num_classes = draw(st.one_of(
        st.integers(1, 40),
        st.sampled_from([1, 2, 63, 64, 65, 127, 128, 129, 1000]),
    ))
    return leading + (num_classes,)


@st.composite
def cases(draw, matrix: bool = False, plus_inf: bool = False) -> Case:
    """A drawn Case; `matrix=True` keeps to [rows >= 2, C] logits; `plus_inf=True` plants at
    least one +inf logit (a property of its own, see test_plus_inf_logit_makes_its_row_nan)."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = _shape(draw)
    if matrix:
        shape = (draw(st.integers(2, 6)), shape[-1])
    num_classes = shape[-1]
    label_format = draw(st.sampled_from(LABEL_FORMATS))
    if num_classes == 1 and label_format.endswith("trailing1"):
        # With C = 1, float labels of the logits' shape are dense targets by definition (and
        # integer ones are still class ids); keep the trailing-1 case unambiguous.
        label_format = label_format[: -len("_trailing1")]
    sparse = label_format.startswith("sparse")
    ignore_class = None
    if sparse and draw(st.booleans()):
        if label_format == "sparse_uint8":
            choices = [255]
        elif "float" in label_format:  # whole numbers a float32 holds exactly
            choices = [-1, 255, -100, 2**24]
        else:
            choices = [-1, 255, -100, 2**31 - 1]
        ignore_class = draw(st.one_of(st.sampled_from(choices), st.integers(0, num_classes - 1)))
    # Nonzero gamma and label_smoothing are not drawn below 1e-6: TensorFlow runs kernels with
    # denormals flushed to zero, so eps / C under float32's smallest normal number (1.2e-38) is
    # 0 to the op, which turns a masked (-inf) class's term from inf (eps > 0) into 0 (eps ==
    # 0); the same for a subnormal gamma at p == 1 (0^gamma). The oracle cannot know that.
    gamma = draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                           st.floats(1e-6, 5.0, allow_nan=False)))
    label_smoothing = draw(st.one_of(st.sampled_from([0.0, 0.1, 1.0]),
                                     st.floats(1e-6, 1.0, allow_nan=False)))
    return Case(
        dtype=dtype,
        shape=shape,
        label_format=label_format,
        dense_label_dtype=draw(st.sampled_from(["same", "float32", "float64"])),
        gamma=gamma,
        label_smoothing=label_smoothing,
        weights=draw(st.sampled_from([None, None, "random", "with_zeros", "all_zeros"])),
        ignore_class=ignore_class,
        logit_scale=draw(st.sampled_from([0.01, 1.0, 3.0, 30.0, 1e3])),
        n_extreme=draw(st.integers(0, 3)),
        n_minus_inf=draw(st.sampled_from([0, 0, 1, 3, 1000])),  # 1000: whole rows masked
        n_plus_inf=draw(st.integers(1, 3)) if plus_inf else 0,
        n_nan=draw(st.sampled_from([0, 0, 0, 1, 2])),
        ignored_fraction=draw(st.sampled_from([0.0, 0.3, 1.0])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@dataclasses.dataclass
class Arrays:
    logits: np.ndarray          # float64, values chosen to be exact in the op's dtype
    labels: np.ndarray          # in the format the case asks for
    upstream: np.ndarray        # float64, batch shape
    class_weights: Optional[np.ndarray]


def _quantize(x, dtype: str) -> np.ndarray:
    """x rounded to `dtype` and back to float64 (what the op actually sees)."""
    if np.size(x) == 0:
        return np.asarray(x, np.float64)
    return tf.cast(tf.cast(np.asarray(x, np.float64), DTYPES[dtype]), tf.float64).numpy()


def make_arrays(case: Case) -> Arrays:
    rng = np.random.default_rng(case.seed)
    shape = case.shape
    batch, num_classes = shape[:-1], shape[-1]
    size = int(np.prod(shape))

    logits = rng.normal(scale=case.logit_scale, size=shape)
    flat = logits.reshape(-1)
    if size:
        big = EXTREME[case.dtype]
        for value, count in ((None, case.n_extreme), (-np.inf, case.n_minus_inf),
                             (np.inf, case.n_plus_inf), (np.nan, case.n_nan)):
            at = rng.integers(0, size, size=min(count, size))
            flat[at] = rng.choice([-big, big, big / 3], size=at.size) if value is None else value
    logits = _quantize(logits, case.dtype)

    fmt = case.label_format
    if fmt.startswith("sparse"):
        ids = rng.integers(0, num_classes, size=batch)
        if case.ignore_class is not None:
            ids = np.where(rng.random(batch) < case.ignored_fraction, case.ignore_class, ids)
        dtype = {"sparse_int32": np.int32, "sparse_int64": np.int64, "sparse_uint8": np.uint8,
                 "sparse_float32": np.float32, "sparse_int32_trailing1": np.int32,
                 "sparse_float32_trailing1": np.float32}[fmt]
        labels = np.asarray(ids).astype(dtype)
        if fmt.endswith("trailing1"):
            labels = labels[..., None]
    else:
        if fmt == "dense_onehot":
            labels = np.eye(num_classes)[rng.integers(0, num_classes, size=batch)]
        else:
            labels = rng.dirichlet(np.full(num_classes, 0.5), size=batch) if num_classes > 1 \
                else rng.random(batch + (1,))
        labels = labels.reshape(shape)
        label_dtype = case.dtype if case.dense_label_dtype == "same" else case.dense_label_dtype
        if label_dtype == "bfloat16":
            labels = _quantize(labels, "bfloat16")  # exact in bfloat16; passed as float64 below
        else:
            labels = labels.astype(label_dtype)
        if case.dense_label_dtype == "same" and case.dtype == "bfloat16":
            labels = tf.cast(labels, tf.bfloat16)  # a bfloat16 tensor, as a user would pass

    upstream = rng.uniform(0.25, 2.0, size=batch) * rng.choice([-1.0, 1.0], size=batch)
    weights = None
    if case.weights == "random":
        weights = rng.uniform(0.0, 3.0, size=num_classes)
    elif case.weights == "with_zeros":
        weights = rng.choice([0.0, 0.0, 0.5, 1.0, 2.5], size=num_classes)
    elif case.weights == "all_zeros":
        weights = np.zeros(num_classes)
    return Arrays(logits, labels, upstream, weights)


# --------------------------------------------------------------------------------------------
# The oracle and the comparison
# --------------------------------------------------------------------------------------------

def _f32(x: float) -> float:
    return float(np.float32(x))


def op_kwargs(case: Case, arrays: Arrays) -> dict:
    return dict(gamma=case.gamma, label_smoothing=case.label_smoothing,
                class_weights=arrays.class_weights, ignore_class=case.ignore_class)


def expected(case: Case, arrays: Arrays):
    """(loss, grad, loss scale, grad scale) from the reference on the op's exact inputs."""
    num_classes = case.shape[-1]
    labels = arrays.labels
    dense = case.label_format.startswith("dense")
    if dense:
        labels = _quantize(np.asarray(labels, np.float64), case.dtype)
    weights = (None if arrays.class_weights is None
               else arrays.class_weights.astype(np.float32).astype(np.float64))
    kw = dict(gamma=_f32(case.gamma), label_smoothing=_f32(case.label_smoothing),
              class_weights=weights, ignore_class=case.ignore_class)
    upstream = _quantize(arrays.upstream, case.dtype)
    loss = ref.custom_loss(labels, arrays.logits, **kw)
    grad = ref.custom_loss_grad(labels, arrays.logits, upstream=upstream, **kw)

    # The row's target mass sum_c a_c q_c (0 for ignored rows, whose values are exactly 0).
    a = np.ones(num_classes) if weights is None else weights
    eps = kw["label_smoothing"]
    if dense:
        t = np.abs(labels)
    else:
        ids = np.asarray(arrays.labels).reshape(case.shape[:-1]).astype(np.int64)
        t = (ids[..., None] == np.arange(num_classes)).astype(np.float64)
    mass = np.sum(a * ((1 - eps) * t + eps / num_classes), axis=-1)
    grad_scale = ((1 + kw["gamma"]) * mass * np.abs(upstream))[..., None]
    return loss, grad, mass, grad_scale


def assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, dtype: str, what: str):
    tol = TOLERANCE[dtype]
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), (
        f"{what}: NaN positions differ; op NaN at {np.argwhere(nan_got & ~nan_want)[:4].tolist()},"
        f" reference NaN at {np.argwhere(nan_want & ~nan_got)[:4].tolist()}")
    # A finite reference value too large for the output dtype may come back as inf.
    overflow = np.isfinite(want) & (np.abs(want) >= LARGEST[dtype] * (1 - tol))
    want_inf = np.isinf(want)
    got_inf = np.isinf(got)
    assert np.array_equal(got[want_inf], want[want_inf]), (
        f"{what}: reference inf at {np.argwhere(want_inf)[:4].tolist()}, op "
        f"{got[want_inf][:4].tolist()}")
    unexpected_inf = got_inf & ~want_inf & ~(overflow & (np.sign(got) == np.sign(want)))
    assert not unexpected_inf.any(), (
        f"{what}: op inf at {np.argwhere(unexpected_inf)[:4].tolist()} where the reference "
        f"has {want[unexpected_inf][:4].tolist()}")
    check = np.isfinite(want) & ~got_inf
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - want)
        bound = tol * np.broadcast_to(scale, want.shape) + tol * np.abs(want) + ABS_FLOOR[dtype]
    bad = check & ~(err <= bound)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)),
                                 want.shape)
        raise AssertionError(
            f"{what} ({dtype}): {int(bad.sum())} of {want.size} values out of tolerance; worst "
            f"at {tuple(int(i) for i in worst)}: op {got[worst]!r}, reference {want[worst]!r}, "
            f"error {err[worst]:.3g} > bound {bound[worst]:.3g}")


def _as_tf_labels(labels):
    return labels if isinstance(labels, tf.Tensor) else tf.constant(labels)


def _check(case: Case, arrays: Arrays, loss, grad) -> None:
    want_loss, want_grad, loss_scale, grad_scale = expected(case, arrays)
    assert loss.dtype == DTYPES[case.dtype] and grad.dtype == DTYPES[case.dtype], (
        loss.dtype, grad.dtype)
    assert_close(loss.numpy(), want_loss, loss_scale, case.dtype, "loss")
    assert_close(grad.numpy(), want_grad, grad_scale, case.dtype, "gradient")


# --------------------------------------------------------------------------------------------
# The properties
# --------------------------------------------------------------------------------------------

@PROFILE
@given(case=cases())
def test_op_matches_reference_eagerly(case: Case):
    """Forward and gradient (through the registered gradient, with a random upstream) agree
    with the reference, in eager mode."""
    note(case.describe())
    arrays = make_arrays(case)
    logits = tf.cast(tf.constant(arrays.logits), DTYPES[case.dtype])
    upstream = tf.cast(tf.constant(arrays.upstream), DTYPES[case.dtype])
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf_metal_ops.custom_loss(_as_tf_labels(arrays.labels), logits,
                                        **op_kwargs(case, arrays))
    grad = tape.gradient(loss, logits, output_gradients=upstream)
    assert loss.shape == case.shape[:-1]
    _check(case, arrays, loss, grad)


_TRACED = {}


def _traced_loss_and_grad(case: Case, arrays: Arrays, labels: tf.Tensor):
    """A tf.function whose input signature hides every dimension except C (and a trailing 1 of
    the labels), so the op runs with shapes known only at run time. Cached per signature and
    attribute values, as a training loop would."""
    rank = len(case.shape)
    logits_spec = tf.TensorSpec([None] * (rank - 1) + [case.shape[-1]], DTYPES[case.dtype])
    label_shape = [None] * labels.shape.rank
    if case.label_format.endswith("trailing1") or case.label_format.startswith("dense"):
        label_shape[-1] = labels.shape[-1]
    labels_spec = tf.TensorSpec(label_shape, labels.dtype)
    has_weights = arrays.class_weights is not None
    key = (logits_spec, labels_spec, has_weights, case.gamma, case.label_smoothing,
           case.ignore_class)
    if key not in _TRACED:
        attrs = dict(gamma=case.gamma, label_smoothing=case.label_smoothing,
                     ignore_class=case.ignore_class)
        weight_spec = [tf.TensorSpec([None], tf.float32)] if has_weights else []

        upstream_spec = tf.TensorSpec(logits_spec.shape[:-1], logits_spec.dtype)

        @tf.function(input_signature=[logits_spec, labels_spec, upstream_spec] + weight_spec)
        def loss_and_grad(z, y, u, *weights):
            with tf.GradientTape() as tape:
                tape.watch(z)
                loss = tf_metal_ops.custom_loss(
                    y, z, class_weights=weights[0] if weights else None, **attrs)
            return loss, tape.gradient(loss, z, output_gradients=u)

        _TRACED[key] = loss_and_grad
    return _TRACED[key]


@FUNCTION_PROFILE
@given(case=cases())
def test_op_matches_reference_in_tf_function_with_unknown_shapes(case: Case):
    """The same property inside a tf.function whose batch dimensions are unknown while
    tracing (the kernel's run-time shape handling), with class weights as a tensor input."""
    note(case.describe())
    arrays = make_arrays(case)
    dtype = DTYPES[case.dtype]
    labels = _as_tf_labels(arrays.labels)
    fn = _traced_loss_and_grad(case, arrays, labels)
    args = [tf.cast(tf.constant(arrays.logits), dtype), labels,
            tf.cast(tf.constant(arrays.upstream), dtype)]
    if arrays.class_weights is not None:
        args.append(tf.constant(arrays.class_weights, tf.float32))
    loss, grad = fn(*args)
    _check(case, arrays, loss, grad)


@FUNCTION_PROFILE
@given(case=cases(matrix=True))
def test_rows_are_independent(case: Case):
    """A row's loss and gradient do not depend on the other rows: computing the batch at once
    equals computing each row alone (catches state shared across rows or threads, and NaN or
    -inf leaking from one row into another)."""
    note(case.describe())
    arrays = make_arrays(case)
    dtype = DTYPES[case.dtype]
    labels = _as_tf_labels(arrays.labels)
    kw = op_kwargs(case, arrays)

    def loss_and_grad(y, z_values):
        z = tf.cast(tf.constant(z_values), dtype)
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf_metal_ops.custom_loss(y, z, **kw)
        return loss.numpy(), tape.gradient(loss, z).numpy()

    batch_loss, batch_grad = loss_and_grad(labels, arrays.logits)
    tol = TOLERANCE[case.dtype]
    for row in range(case.shape[0]):
        row_loss, row_grad = loss_and_grad(labels[row:row + 1], arrays.logits[row:row + 1])
        # Within the dtype's tolerance rather than bitwise: a kernel may legitimately take
        # another (vectorized or tail) code path for a row depending on where it falls in the
        # batch. NaN and inf must match exactly (assert_allclose compares them so).
        for what, alone, together in (("loss", row_loss, batch_loss[row:row + 1]),
                                      ("gradient", row_grad, batch_grad[row:row + 1])):
            np.testing.assert_allclose(alone.astype(np.float64), together.astype(np.float64),
                                       rtol=tol, atol=tol, equal_nan=True,
                                       err_msg=f"{what} of row {row}: alone vs in the batch")


@FUNCTION_PROFILE
@given(case=cases(plus_inf=True))
def test_plus_inf_logit_makes_its_row_nan(case: Case):
    """A +inf logit leaves the softmax undefined (inf - inf): like a NaN logit or a row of only
    -inf, the reference makes that row's loss and whole gradient row NaN (and only that row;
    ignored rows stay 0). The op must agree, not return a finite or infinite loss with a
    gradient that is NaN in one column only."""
    note(case.describe())
    arrays = make_arrays(case)
    logits = tf.cast(tf.constant(arrays.logits), DTYPES[case.dtype])
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf_metal_ops.custom_loss(_as_tf_labels(arrays.labels), logits,
                                        **op_kwargs(case, arrays))
    grad = tape.gradient(loss, logits, output_gradients=tf.cast(arrays.upstream, logits.dtype))
    _check(case, arrays, loss, grad)


def test_generator_reaches_the_corners():
    """The strategy is not vacuous: a fixed sample of it contains every corner the properties
    are about, for every dtype (so the test fails if the generator is edited into something
    that never makes them)."""
    seen = set()

    @settings(max_examples=600, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def collect(case):
        arrays = make_arrays(case)
        z = arrays.logits
        seen.add(("dtype", case.dtype))
        seen.add(("format", case.label_format))
        if z.size == 0:
            seen.add("empty batch")
        if case.shape[-1] == 1:
            seen.add("C = 1")
        if len(case.shape) >= 3:
            seen.add("leading dims")
        if np.isneginf(z).any():
            seen.add("-inf")
        if (np.isneginf(z).all(axis=-1)).any():
            seen.add("row of only -inf")
        if np.isnan(z).any():
            seen.add("NaN")
        if np.any(np.abs(z[np.isfinite(z)]) >= EXTREME[case.dtype] / 4):
            seen.add(("extreme", case.dtype))
        if case.ignore_class is not None:
            seen.add("ignore_class")
        if arrays.class_weights is not None and (arrays.class_weights == 0).any():
            seen.add("zero weight")

    collect()
    wanted = ({"empty batch", "C = 1", "leading dims", "-inf", "row of only -inf", "NaN",
               "ignore_class", "zero weight"}
              | {("format", f) for f in LABEL_FORMATS}
              | {("dtype", d) for d in DTYPES} | {("extreme", d) for d in DTYPES})
    assert wanted <= seen, f"never generated: {sorted(map(str, wanted - seen))}"
