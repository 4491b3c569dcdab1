"""The CustomLoss op (through `tf_metal_ops.custom_loss`) against the NumPy reference.

Forward values and gradients (taken through `tf.GradientTape` with a random upstream gradient,
so the registered gradient and the gradient op are both exercised) are compared with
`tf_metal_ops.reference` evaluated in float64 on exactly the inputs the op saw: logits and
dense labels rounded to the op's dtype, class weights rounded to float32 and gamma /
label_smoothing rounded to float32 (they are float attributes).

Tolerances. Elementwise, |op - ref| <= ATOL * scale + RTOL * |ref|, where for the loss
scale = sum_c a_c |q_c| (the row's target mass: the size of the loss per unit of log p) and for
the gradient scale = (1 + gamma) * sum_c a_c |q_c| * |upstream| (a bound on |d loss / d z_j|,
since |g_c| <= (1 + gamma) a_c q_c). Per logits dtype:
* float64: computed in float64: RTOL = ATOL = 1e-9.
* float32: computed in float32: RTOL = ATOL = 2e-5 (sums over up to 50257 classes, and the
  float32 rounding of log p near 0 seen through (1 - p)^gamma).
* float16: computed in float32, stored with an 11-bit significand (half ulp 4.9e-4):
  RTOL = ATOL = 2e-3.
* bfloat16: computed in float32, stored with an 8-bit significand (half ulp 3.9e-3):
  RTOL = ATOL = 1.6e-2.
NaN and +-inf must appear exactly where the reference has them.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import reference as ref

pytestmark = pytest.mark.native

TOLERANCES = {
    tf.float64: (1e-9, 1e-9),     # (rtol, atol)
    tf.float32: (2e-5, 2e-5),
    tf.float16: (2e-3, 2e-3),
    tf.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = [tf.float32, tf.float16, tf.bfloat16, tf.float64]
GAMMAS = [0.0, 0.5, 1.0, 2.0, 3.7]
EPSILONS = [0.0, 0.1, 1.0]
CLASS_COUNTS = [1, 2, 31, 32, 33, 1000, 50257]


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _f32(x: float) -> float:
    return float(np.float32(x))


def _rows_for(num_classes: int) -> int:
    # Keep the big vocabularies to a few rows: the test is about the class loop there.
    return 2 if num_classes > 10000 else 5 if num_classes > 100 else 9


# ----------------------------------------------------------------------------------------
# Running the op and the reference on the same inputs
# ----------------------------------------------------------------------------------------

def run_op(labels, logits, *, dtype, upstream=None, mode="eager", **kw):
    """Returns the (loss, d loss / d logits) tensors of custom_loss, in `dtype`."""
    z = tf.constant(np.asarray(logits, np.float64), dtype=tf.float64)
    z = tf.cast(z, dtype)
    u = None if upstream is None else tf.cast(tf.constant(upstream, tf.float64), dtype)

    def loss_and_grad(z_in):
        with tf.GradientTape() as tape:
            tape.watch(z_in)
            loss = tf_metal_ops.custom_loss(labels, z_in, **kw)
        grad = tape.gradient(loss, z_in, output_gradients=u)
        return loss, grad

    if mode == "function":
        loss_and_grad = tf.function(loss_and_grad)
    loss, grad = loss_and_grad(z)
    return loss, grad


def quantized(x, dtype) -> np.ndarray:
    """x rounded to `dtype` and back to float64: what the op actually sees."""
    return tf.cast(tf.cast(tf.constant(np.asarray(x, np.float64)), dtype), tf.float64).numpy()


def reference_on_op_inputs(labels, logits, *, dtype, upstream=None, gamma=0.0,
                           label_smoothing=0.0, class_weights=None, ignore_class=None):
    labels = np.asarray(labels)
    dense = labels.dtype.kind == "f" and labels.shape == np.shape(logits)
    kw = dict(gamma=_f32(gamma), label_smoothing=_f32(label_smoothing),
              class_weights=None if class_weights is None
              else np.asarray(class_weights, np.float32).astype(np.float64),
              ignore_class=ignore_class)
    z = quantized(logits, dtype)
    y = quantized(labels, dtype) if dense else labels
    u = None if upstream is None else quantized(upstream, dtype)
    loss = ref.custom_loss(y, z, **kw)
    grad = ref.custom_loss_grad(y, z, upstream=u, **kw)
    # The row's target mass sum_c a_c |q_c|, for the tolerance.
    a = np.ones(z.shape[-1]) if kw["class_weights"] is None else kw["class_weights"]
    eps = kw["label_smoothing"]
    if dense:
        t = np.abs(y)
    else:
        ids = labels.reshape(z.shape[:-1]).astype(np.int64)
        valid = (ids >= 0) & (ids < z.shape[-1])
        t = np.zeros(z.shape)
        np.put_along_axis(t, np.where(valid, ids, 0)[..., None], valid[..., None] * 1.0, -1)
    mass = np.sum(a * ((1 - eps) * t + eps / z.shape[-1]), axis=-1)
    return loss, grad, mass, u


def assert_matches(got, want, *, dtype, scale, what):
    rtol, atol = TOLERANCES[dtype]
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape}"
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), (
        f"{what}: NaN at {np.argwhere(nan_got != nan_want)[:5].tolist()} differs "
        f"(op NaN: {nan_got.sum()}, reference NaN: {nan_want.sum()})")
    inf_want = np.isinf(want)
    assert np.array_equal(got[inf_want], want[inf_want]) and not np.isinf(got[~inf_want]).any(), (
        f"{what}: infinities differ: op {got[np.isinf(got) | inf_want][:5]}, "
        f"reference {want[np.isinf(got) | inf_want][:5]}")
    finite = np.isfinite(want)
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    bound = atol * np.broadcast_to(scale, want.shape) + rtol * np.abs(want)
    bad = finite & ~(err <= bound)
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        worst = np.unravel_index(np.argmax(np.where(finite, err / np.maximum(bound, 1e-300), 0)),
                                 want.shape)
        raise AssertionError(
            f"{what} ({dtype.name}): {bad.sum()} of {want.size} elements out of tolerance; "
            f"first at {idx}: op {got[idx]!r} vs reference {want[idx]!r} (bound {bound[idx]:.3g}); "
            f"worst at {worst}: op {got[worst]!r} vs reference {want[worst]!r} "
            f"(err {err[worst]:.3g}, bound {bound[worst]:.3g})")


def check_op(labels, logits, *, dtype=tf.float32, upstream=None, mode="eager", **kw):
    """Runs op and reference, compares loss and gradient; returns the op's (loss, grad)."""
    loss, grad = run_op(labels, logits, dtype=dtype, upstream=upstream, mode=mode, **kw)
    want_loss, want_grad, mass, u = reference_on_op_inputs(labels, logits, dtype=dtype,
                                                           upstream=upstream, **kw)
    assert loss.dtype == dtype and grad.dtype == dtype, (loss.dtype, grad.dtype)
    gamma = kw.get("gamma", 0.0)
    u_abs = np.ones(mass.shape) if u is None else np.abs(u)
    assert_matches(loss.numpy(), want_loss, dtype=dtype, scale=mass, what="loss")
    assert_matches(grad.numpy(), want_grad, dtype=dtype,
                   scale=((1 + gamma) * mass * u_abs)[..., None], what="grad")
    return loss.numpy(), grad.numpy()


def random_case(rng, shape, *, scale=2.0):
    logits = rng.normal(scale=scale, size=shape)
    labels = rng.integers(0, shape[-1], size=shape[:-1]).astype(np.int32)
    upstream = rng.uniform(0.5, 1.5, size=shape[:-1]) * rng.choice([-1.0, 1.0], size=shape[:-1])
    return labels, logits, upstream


# ----------------------------------------------------------------------------------------
# The main matrix: C x gamma x eps (float32), then dtypes
# ----------------------------------------------------------------------------------------

@pytest.mark.simd
@pytest.mark.parametrize("num_classes", CLASS_COUNTS)
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("eps", EPSILONS)
def test_matches_reference_over_classes_gamma_smoothing(num_classes, gamma, eps):
    rng = _rng("matrix", num_classes, gamma, eps)
    labels, logits, upstream = random_case(rng, (_rows_for(num_classes), num_classes))
    check_op(labels, logits, upstream=upstream, gamma=gamma, label_smoothing=eps)


@pytest.mark.tf_abi
@pytest.mark.simd
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("num_classes", [1, 2, 33, 1000, 50257])
@pytest.mark.parametrize("gamma,eps", [(0.0, 0.0), (0.5, 0.1), (2.0, 0.0), (3.7, 1.0)])
def test_matches_reference_per_dtype(dtype, num_classes, gamma, eps):
    rng = _rng("dtype", dtype.name, num_classes, gamma, eps)
    labels, logits, upstream = random_case(rng, (_rows_for(num_classes), num_classes))
    weights = rng.choice([0.0, 0.5, 1.0, 2.0], size=num_classes)
    check_op(labels, logits, dtype=dtype, upstream=upstream, gamma=gamma, label_smoothing=eps,
             class_weights=weights)


@pytest.mark.parametrize("shape", [(7,), (0, 5), (0, 1), (0, 50257), (2, 0, 7), (3, 4, 7),
                                   (2, 3, 33), (2, 2, 2, 5)])
@pytest.mark.tf_abi
@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_leading_dims_and_empty_batches(shape, gamma):
    rng = _rng("leading", shape, gamma)
    labels, logits, upstream = random_case(rng, shape)
    loss, grad = check_op(labels, logits, upstream=upstream, gamma=gamma, label_smoothing=0.1)
    assert loss.shape == shape[:-1] and grad.shape == shape


@pytest.mark.simd
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(4099, 37), (4, 50257), (2, 1500, 45)])
def test_many_rows_split_across_cpu_threads(dtype, shape):
    # Big enough (> 128K elements) that the CPU kernel splits the rows over threads; the
    # special rows sit near the end, in another thread's range.
    rng = _rng("threads", dtype.name, shape)
    labels, logits, upstream = random_case(rng, shape)
    flat_labels = labels.reshape(-1)
    flat_logits = logits.reshape(-1, shape[-1])
    flat_labels[-1] = -1                                    # ignored
    flat_logits[-2, 1] = np.nan                             # NaN row
    flat_logits[-3, ::2] = -np.inf                          # masked classes
    flat_logits[-3, flat_labels[-3]] = 0.0
    kw = dict(gamma=2.0, ignore_class=-1, class_weights=rng.uniform(0.5, 2.0, shape[-1]))
    previous = tf_metal_ops.get_cpu_threads()
    results = []
    try:
        for threads in (1, 3):                          # rows are independent: same bits
            tf_metal_ops.set_cpu_threads(threads)
            results.append(check_op(labels, logits, dtype=dtype, upstream=upstream, **kw))
    finally:
        tf_metal_ops.set_cpu_threads(previous)
    # (as float64: NumPy's NaN-aware comparison does not know bfloat16)
    for one, three in zip(results[0], results[1]):
        np.testing.assert_array_equal(one.astype(np.float64), three.astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_empty_batch_every_dtype_and_mode(dtype):
    for mode in ("eager", "function"):
        loss, grad = run_op(np.zeros([0], np.int64), np.zeros([0, 4]), dtype=dtype, mode=mode,
                            gamma=2.0)
        assert loss.shape == (0,) and grad.shape == (0, 4)
        assert loss.dtype == dtype and grad.dtype == dtype


# ----------------------------------------------------------------------------------------
# Class weights, ignore_class, dense targets
# ----------------------------------------------------------------------------------------

@pytest.mark.simd
@pytest.mark.parametrize("num_classes", [5, 33])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_class_weights_including_zeros(num_classes, gamma, eps):
    rng = _rng("weights", num_classes, gamma, eps)
    labels, logits, upstream = random_case(rng, (12, num_classes))
    weights = rng.uniform(0.0, 3.0, size=num_classes).astype(np.float32)
    weights[::3] = 0.0
    labels[:3] = 0                                          # some targets with weight 0
    check_op(labels, logits, upstream=upstream, gamma=gamma, label_smoothing=eps,
             class_weights=weights)
    # A tensor of weights is the same as a list.
    check_op(labels, logits, upstream=upstream, gamma=gamma, label_smoothing=eps,
             class_weights=tf.constant(weights))


@pytest.mark.tf_abi
def test_changing_class_weights_does_not_retrace():
    rng = _rng("retrace")
    labels, logits, _ = random_case(rng, (6, 4))

    @tf.function
    def f(z, w):
        return tf_metal_ops.custom_loss(labels, z, gamma=1.0, class_weights=w)

    z = tf.constant(logits, tf.float32)
    for weights in ([1.0, 2.0, 0.5, 0.0], [0.0, 1.0, 1.0, 3.0]):
        got = f(z, tf.constant(weights, tf.float32)).numpy()
        want = ref.custom_loss(labels, quantized(logits, tf.float32), gamma=1.0,
                               class_weights=weights)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert f.experimental_get_tracing_count() == 1


@pytest.mark.simd
@pytest.mark.parametrize("ignore_class", [-100, -1, 0, 6])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=lambda d: d.name)
def test_ignore_class(ignore_class, dtype):
    rng = _rng("ignore", ignore_class, dtype.name)
    labels, logits, upstream = random_case(rng, (3, 4, 7))
    labels = np.where(labels == ignore_class, (ignore_class + 1) % 7, labels)
    ignored = rng.random(labels.shape) < 0.4
    labels = np.where(ignored, ignore_class, labels).astype(np.int64)
    kw = dict(gamma=2.0, label_smoothing=0.1, class_weights=rng.uniform(0.5, 2, 7),
              ignore_class=ignore_class)
    loss, grad = check_op(labels, logits, dtype=dtype, upstream=upstream, **kw)
    assert np.all(loss[ignored] == 0) and np.all(grad[ignored] == 0)


@pytest.mark.simd
def test_ignored_rows_are_zero_even_with_nan_logits():
    logits = np.array([[0.1, 0.2, 0.3], [np.nan, 1.0, 2.0], [1.0, 2.0, 3.0]])
    loss, grad = check_op(np.array([0, -1, 2]), logits, ignore_class=-1, gamma=2.0)
    assert loss[1] == 0 and np.all(grad[1] == 0)


@pytest.mark.tf_abi
@pytest.mark.simd
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
def test_dense_soft_targets(dtype, gamma, eps):
    rng = _rng("dense", dtype.name, gamma, eps)
    _, logits, upstream = random_case(rng, (2, 3, 9))
    targets = rng.dirichlet(np.ones(9), size=(2, 3))
    targets[0, 0] = np.eye(9)[4]                            # one-hot rows are dense too
    check_op(targets.astype(dtype.as_numpy_dtype), logits, dtype=dtype, upstream=upstream,
             gamma=gamma, label_smoothing=eps, class_weights=rng.uniform(0, 2, 9))


@pytest.mark.simd
def test_dense_float32_targets_with_float16_logits():
    rng = _rng("dense-mixed")
    _, logits, upstream = random_case(rng, (5, 6))
    targets = rng.dirichlet(np.ones(6), size=5).astype(np.float32)
    check_op(targets, logits, dtype=tf.float16, upstream=upstream, gamma=1.0)


# ----------------------------------------------------------------------------------------
# Label formats
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("label_dtype", [np.int32, np.int64, np.int16, np.uint8, np.float32,
                                         np.float64])
@pytest.mark.tf_abi
@pytest.mark.parametrize("trailing_one", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_label_dtypes_and_trailing_one(label_dtype, trailing_one, mode):
    rng = _rng("labels", np.dtype(label_dtype).name, trailing_one, mode)
    labels, logits, upstream = random_case(rng, (4, 3, 5))
    want_loss, want_grad, *_ = reference_on_op_inputs(labels, logits, dtype=tf.float32,
                                                      upstream=upstream, gamma=0.5)
    given = labels.astype(label_dtype)
    if trailing_one:
        given = given[..., None]
    loss, grad = run_op(given, logits, dtype=tf.float32, upstream=upstream, mode=mode,
                        gamma=0.5)
    assert loss.shape == (4, 3)
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=2e-5, atol=2e-5)


@pytest.mark.tf_abi
def test_tensor_labels_and_keras_style_float_column():
    # What Keras passes: float32 labels of shape [B, 1] next to [B, C] logits.
    rng = _rng("keras-labels")
    labels, logits, upstream = random_case(rng, (8, 4))
    check_op(tf.constant(labels[:, None], tf.float32), logits, upstream=upstream,
             gamma=2.0, label_smoothing=0.1)


# ----------------------------------------------------------------------------------------
# Numerics: masks, extreme logits, p -> 1, C = 1, NaN
# ----------------------------------------------------------------------------------------

@pytest.mark.simd
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("num_classes", [12, 1000])
def test_masked_minus_inf_classes(dtype, gamma, num_classes):
    rng = _rng("mask", dtype.name, gamma, num_classes)
    c = num_classes
    labels, logits, upstream = random_case(rng, (6, c))
    labels[:] = [c - 1, 3, c // 2, 0, 5, c - 2]
    mask = np.zeros((6, c), dtype=bool)
    mask[0, : c - 1] = True                 # everything but the target (an all--inf prefix)
    mask[1, :3] = True                      # a prefix before the target
    mask[2, rng.choice(c, c // 3)] = True   # scattered
    mask[4, 6:] = True                      # a suffix
    mask[np.arange(6), labels] = False      # targets stay finite
    logits = np.where(mask, -np.inf, logits)
    loss, grad = check_op(labels, logits, dtype=dtype, upstream=upstream, gamma=gamma)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    assert np.all(grad[mask] == 0)


@pytest.mark.simd
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_masked_classes_with_smoothing_and_zero_weight(gamma):
    # Smoothing puts q_c > 0 on every class; weight 0 on the masked classes keeps the loss
    # finite, and the w_c == 0 terms must be 0, never 0 * -inf.
    rng = _rng("mask-smooth", gamma)
    labels, logits, upstream = random_case(rng, (5, 40))
    masked = np.zeros(40, bool)
    masked[:10] = masked[30:] = True
    labels[:] = rng.integers(10, 30, size=5)
    logits[:, masked] = -np.inf
    weights = np.where(masked, 0.0, 1.0)
    loss, grad = check_op(labels, logits, upstream=upstream, gamma=gamma, label_smoothing=0.2,
                          class_weights=weights)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))


@pytest.mark.simd
def test_masked_class_with_positive_smoothed_weight_gives_inf_loss_finite_grad():
    # By the definition the loss is +inf (w_c > 0 on log p_c = -inf); the brief's numerics
    # take the p*lp term as 0 at p == 0, so the gradient is finite: exactly the reference's.
    logits = np.array([[-np.inf, 1.0, 2.0, 0.5], [0.0, 1.0, -1.0, 2.0]])
    loss, grad = check_op(np.array([1, 3]), logits, gamma=2.0, label_smoothing=0.3)
    assert np.isposinf(loss[0]) and np.isfinite(loss[1])
    assert np.all(np.isfinite(grad))


# big is chosen so that the true loss (up to 2 * big) is representable in the dtype.
@pytest.mark.parametrize("dtype,big", [(tf.float32, 1e30), (tf.float32, 1.5e38), (tf.float32, 1e4),
                                       (tf.float16, 3e4), (tf.bfloat16, 1.5e38),
                                       (tf.float64, 1e300)],
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.simd
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_extreme_logits(dtype, big, gamma):
    logits = np.array([
        [big, -big, 0.0, 1.0],          # confident and right
        [-big, big, 0.0, 1.0],          # confident and wrong: loss ~ 2 * big
        [big, big, -big, 0.0],          # a tie at the top
        [-big, -big, -big, -big],       # all equal and huge negative
        [big / 2, big / 2 - 1, 0, 0],   # finite differences at a huge offset
    ])
    labels = np.array([0, 0, 1, 2, 1])
    loss, grad = check_op(labels, logits, dtype=dtype, gamma=gamma, label_smoothing=0.0)
    assert np.all(np.isfinite(grad))


@pytest.mark.simd
@pytest.mark.parametrize("gamma", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32], ids=lambda d: d.name)
def test_gamma_below_one_near_p_one_has_finite_exact_gradient(gamma, dtype):
    margins = np.array([5.0, 10.0, 15.0, 30.0, 60.0, 200.0])
    logits = np.zeros((len(margins), 3))
    logits[:, 1] = margins
    labels = np.ones(len(margins), np.int64)
    loss, grad = check_op(labels, logits, dtype=dtype, gamma=gamma)
    assert np.all(np.isfinite(grad)) and np.all(np.isfinite(loss))
    # Smoothing puts weight on the tiny classes too; the confident class still has p -> 1.
    loss, grad = check_op(labels, logits, dtype=dtype, gamma=gamma, label_smoothing=0.1)
    assert np.all(np.isfinite(grad))


@pytest.mark.simd
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("eps", [0.0, 1.0])
def test_single_class_gives_zero_loss_and_gradient(dtype, gamma, eps):
    logits = np.array([[3.0], [-50.0], [0.0], [1e4]])
    loss, grad = run_op(np.zeros(4, np.int64), logits, dtype=dtype, gamma=gamma,
                        label_smoothing=eps)
    np.testing.assert_array_equal(loss.numpy().astype(np.float64), np.zeros(4))
    np.testing.assert_array_equal(grad.numpy().astype(np.float64), np.zeros((4, 1)))


@pytest.mark.simd
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("num_classes", [7, 1000])
def test_nan_row_is_isolated(dtype, num_classes):
    rng = _rng("nan", dtype.name, num_classes)
    labels, logits, upstream = random_case(rng, (5, num_classes))
    logits[1, 3] = np.nan
    logits[3, -1] = np.nan
    loss, grad = check_op(labels, logits, dtype=dtype, upstream=upstream, gamma=2.0,
                          label_smoothing=0.1)
    assert np.isnan(loss[[1, 3]]).all() and np.isnan(grad[[1, 3]]).all()
    assert np.isfinite(loss[[0, 2, 4]]).all() and np.isfinite(grad[[0, 2, 4]]).all()


def test_no_clip_unlike_keras_on_confident_model_with_smoothing():
    import keras
    logits = np.array([[12.0, -6.0, -6.0, -6.0], [-6.0, 14.0, -6.0, -6.0]])
    labels = np.array([0, 1])
    loss, _ = check_op(labels, logits, gamma=2.0, label_smoothing=0.1)
    keras_loss = keras.losses.CategoricalFocalCrossentropy(
        alpha=1.0, gamma=2.0, from_logits=True, label_smoothing=0.1, reduction=None)(
        tf.one_hot(labels, 4), tf.constant(logits, tf.float32)).numpy()
    # Keras's clip of p to [1e-7, 1 - 1e-7] moves its value by percents; ours is the
    # reference's to float32 precision (checked above).
    assert np.all(np.abs(keras_loss - loss) / loss > 0.01), (keras_loss, loss)


@pytest.mark.tf_abi
def test_equals_tf_sparse_softmax_cross_entropy_with_defaults():
    rng = _rng("ce")
    labels, logits, upstream = random_case(rng, (16, 10), scale=4.0)
    z = tf.constant(logits, tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(z)
        ours = tf_metal_ops.custom_loss(labels, z)
        theirs = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=z)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tape.gradient(ours, z).numpy(), tape.gradient(theirs, z).numpy(),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Gradient checks with TensorFlow's own machinery; eager vs tf.function; second order
# ----------------------------------------------------------------------------------------

@pytest.mark.tf_abi
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0, 3.7])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("kind", ["sparse", "dense", "weighted_ignore"])
def test_tf_compute_gradient(gamma, eps, kind):
    rng = _rng("compute_gradient", gamma, eps, kind)
    labels, logits, _ = random_case(rng, (2, 3, 4), scale=1.5)
    kw = dict(gamma=gamma, label_smoothing=eps)
    if kind == "dense":
        labels = rng.dirichlet(np.ones(4), size=(2, 3))
    if kind == "weighted_ignore":
        labels[0, 1] = -1
        kw.update(class_weights=[0.0, 1.0, 2.0, 0.5], ignore_class=-1)

    def f(z):
        return tf_metal_ops.custom_loss(labels, z, **kw)

    theoretical, numerical = tf.test.compute_gradient(f, [tf.constant(logits, tf.float64)],
                                                      delta=1e-6)
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-8)
    assert np.abs(theoretical[0]).max() > 1e-3          # not a vacuous all-zero Jacobian


@pytest.mark.tf_abi
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=lambda d: d.name)
def test_eager_and_tf_function_agree_and_match_reference(dtype):
    rng = _rng("modes", dtype.name)
    labels, logits, upstream = random_case(rng, (3, 5, 33))
    kw = dict(gamma=2.0, label_smoothing=0.1, class_weights=rng.uniform(0, 2, 33))
    eager = check_op(labels, logits, dtype=dtype, upstream=upstream, mode="eager", **kw)
    graph = check_op(labels, logits, dtype=dtype, upstream=upstream, mode="function", **kw)
    for a, b in zip(eager, graph):
        np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


@pytest.mark.tf_abi
def test_tf_function_with_unknown_shapes():
    f = tf.function(
        lambda y, z: tf_metal_ops.custom_loss(y, z, gamma=0.5, label_smoothing=0.1),
        input_signature=[tf.TensorSpec([None, None], tf.int64),
                         tf.TensorSpec([None, None, None], tf.float32)])
    rng = _rng("unknown-shapes")
    for shape in [(2, 3, 5), (1, 7, 2), (0, 4, 3)]:
        labels, logits, _ = random_case(rng, shape)
        got = f(tf.constant(labels, tf.int64), tf.constant(logits, tf.float32)).numpy()
        want = ref.custom_loss(labels, quantized(logits, tf.float32), gamma=_f32(0.5),
                               label_smoothing=_f32(0.1))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.tf_abi
def test_loss_has_the_logits_shape_and_dtype_statically():
    f = tf.function(lambda z: tf_metal_ops.custom_loss(tf.zeros([4, 3], tf.int32), z))
    concrete = f.get_concrete_function(tf.TensorSpec([4, 3, 10], tf.bfloat16))
    out = concrete.structured_outputs
    assert out.shape.as_list() == [4, 3] and out.dtype == tf.bfloat16


@pytest.mark.tf_abi
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_second_derivative_raises_a_clear_error(mode):
    z = tf.constant([[0.5, 1.0, -1.0], [2.0, 0.0, 1.0]], tf.float32)

    def second():
        with tf.GradientTape() as outer:
            outer.watch(z)
            with tf.GradientTape() as inner:
                inner.watch(z)
                loss = tf_metal_ops.custom_loss([0, 2], z, gamma=2.0)
            grad = inner.gradient(loss, z)
        return outer.gradient(grad, z)

    if mode == "function":
        second = tf.function(second)
    with pytest.raises(Exception) as info:
        result = second()
        pytest.fail(f"second derivative returned {result!r} instead of raising")
    assert re.search(r"(?i)second.deriv", str(info.value)), str(info.value)
