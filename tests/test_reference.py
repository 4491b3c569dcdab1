"""Proves the NumPy reference (tf_metal_ops/reference.py) right, independently of the op.

Three independent witnesses:
* central finite differences of `custom_loss` (float64) check `custom_loss_grad` wherever the
  derivative is finite;
* TensorFlow's own float64 cross-entropy ops check the gamma = 0 cases;
* a hand-written float64 focal formula (TF autodiff for its gradient) and Keras's
  `categorical_focal_crossentropy` check the focal cases away from Keras's clip.
Plus the special cases of the definition (masks, C = 1, empty batch, ignore_class, NaN rows,
bad input) and a check that loading the module does not import TensorFlow.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

REFERENCE_PATH = Path(__file__).resolve().parents[1] / "tf_metal_ops" / "reference.py"

GAMMAS = [0.0, 0.5, 1.0, 2.0, 3.7]
EPSILONS = [0.0, 0.1, 1.0]


def _rng(*key: object) -> np.random.Generator:
    # A fixed seed per test case (crc32, not hash(): str hashing is randomized per process).
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _fd_grad(ref, labels, logits, upstream, h=1e-6, **kw):
    """Central finite differences of sum(upstream * loss) with respect to every logit."""
    z = np.array(logits, dtype=np.float64)
    out = np.zeros_like(z)
    flat = z.reshape(-1)
    gflat = out.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        hi, lo = keep + h, keep - h
        flat[i] = hi
        plus = np.sum(upstream * ref.custom_loss(labels, z, **kw))
        flat[i] = lo
        minus = np.sum(upstream * ref.custom_loss(labels, z, **kw))
        flat[i] = keep
        # Divide by the step actually taken (hi - lo is exact), not the rounded-away 2h.
        gflat[i] = (plus - minus) / (hi - lo)
    return out


# ----------------------------------------------------------------------------------------
# Finite differences
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("kind", ["sparse", "dense_soft", "weighted_sparse", "ignore"])
def test_grad_matches_finite_differences(ref, gamma, eps, kind):
    rng = _rng("fd", gamma, eps, kind)
    shape = (2, 3, 5)                                   # leading dims [B, T, C]
    z = rng.normal(scale=1.5, size=shape)
    kw = dict(gamma=gamma, label_smoothing=eps)
    if kind == "dense_soft":
        labels = rng.dirichlet(np.ones(5), size=shape[:-1])
    else:
        labels = rng.integers(0, 5, size=shape[:-1]).astype(np.int64)
    if kind == "weighted_sparse":
        kw["class_weights"] = np.array([0.0, 0.5, 1.0, 2.5, 0.0])
    if kind == "ignore":
        labels[0, 1] = -100
        labels[1, 2] = -100
        kw["ignore_class"] = -100
    upstream = rng.normal(size=shape[:-1])
    got = ref.custom_loss_grad(labels, z, upstream=upstream, **kw)
    want = _fd_grad(ref, labels, z, upstream, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    if kind == "ignore":
        assert np.all(got[0, 1] == 0) and np.all(got[1, 2] == 0)


@pytest.mark.parametrize("gamma", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("margin", [6.0, 12.0, 20.0])
def test_gamma_below_one_near_p_one_matches_finite_differences(ref, gamma, margin):
    # p_target = 1 - r with r ~ e^-margin: r^(gamma-1) is huge, yet as a function of z the loss
    # ~ r^(1+gamma) is smooth on an O(1) scale, so an ordinary step works; what must be exact
    # is lp near 0 (the reference's log1p) or the differences would be rounding noise.
    z = np.array([[margin, 0.0, -1.0, 0.5], [0.0, margin, 0.3, -0.2]])
    labels = np.array([0, 1])
    got = ref.custom_loss_grad(labels, z, gamma=gamma)
    want = _fd_grad(ref, labels, z, np.ones(2), h=2.0**-17, gamma=gamma)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("gamma", [0.0, 0.3, 0.5, 1.0, 2.0])
def test_p_exactly_one_is_finite_and_is_the_limit(ref, gamma):
    # exp(-800) underflows: p_target == 1 exactly in float64, r == 0, lp == 0.
    z = np.array([[800.0, 0.0, 0.0]])
    g = ref.custom_loss_grad([0], z, gamma=gamma)
    loss = ref.custom_loss([0], z, gamma=gamma)
    assert np.all(np.isfinite(g)) and np.isfinite(loss).all()
    np.testing.assert_array_equal(loss, [0.0])
    # The true gradient is (p_j G - g_j) -> 0 on every class as the margin grows.
    np.testing.assert_allclose(g, 0.0, atol=1e-300)
    # Continuity: at a large finite margin it is already tiny.
    g_near = ref.custom_loss_grad([0], np.array([[40.0, 0.0, 0.0]]), gamma=gamma)
    assert np.max(np.abs(g_near)) < 1e-5


# ----------------------------------------------------------------------------------------
# Against TensorFlow's float64 cross-entropy (gamma = 0)
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 1), (7, 2), (5, 33), (2, 3, 11), (0, 4)])
def test_plain_ce_equals_tf_sparse_softmax_ce(ref, shape):
    import tensorflow as tf
    rng = _rng("ce", shape)
    z = rng.normal(scale=3.0, size=shape)
    labels = rng.integers(0, shape[-1], size=shape[:-1])
    upstream = rng.normal(size=shape[:-1])
    zt = tf.constant(z, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(zt)
        want = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=zt)
    want_grad = tape.gradient(want, zt, output_gradients=tf.constant(upstream))
    np.testing.assert_allclose(ref.custom_loss(labels, z), want.numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ref.custom_loss_grad(labels, z, upstream=upstream),
                               want_grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("eps", EPSILONS)
def test_dense_soft_targets_with_smoothing_equal_tf_softmax_ce(ref, eps):
    import tensorflow as tf
    rng = _rng("dense", eps)
    c = 9
    z = rng.normal(scale=2.0, size=(6, c))
    t = rng.dirichlet(np.ones(c), size=6)
    q = (1 - eps) * t + eps / c
    zt = tf.constant(z)
    with tf.GradientTape() as tape:
        tape.watch(zt)
        want = tf.nn.softmax_cross_entropy_with_logits(labels=tf.constant(q), logits=zt)
    want_grad = tape.gradient(want, zt)
    np.testing.assert_allclose(ref.custom_loss(t, z, label_smoothing=eps), want.numpy(),
                               rtol=1e-13)
    np.testing.assert_allclose(ref.custom_loss_grad(t, z, label_smoothing=eps),
                               want_grad.numpy(), rtol=1e-11, atol=1e-14)


def _hand_focal_tf(q, z, alpha, gamma):
    """-sum_c alpha_c q_c (1 - p_c)^gamma log p_c, composed from float64 TF ops."""
    import tensorflow as tf
    lp = tf.nn.log_softmax(z, axis=-1)
    p = tf.exp(lp)
    return -tf.reduce_sum(alpha * q * tf.pow(1.0 - p, gamma) * lp, axis=-1)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_focal_with_alpha_vector_equals_hand_formula_and_keras(ref, gamma, eps):
    import keras
    import tensorflow as tf
    rng = _rng("focal", gamma, eps)
    c = 6
    z = rng.normal(scale=1.0, size=(8, c))              # p well inside [1e-7, 1 - 1e-7]
    labels = rng.integers(0, c, size=8)
    alpha = np.array([0.25, 1.0, 0.0, 2.0, 0.5, 1.5])
    q = (1 - eps) * np.eye(c)[labels] + eps / c
    zt = tf.constant(z)
    with tf.GradientTape() as tape:
        tape.watch(zt)
        want = _hand_focal_tf(tf.constant(q), zt, tf.constant(alpha), gamma)
    want_grad = tape.gradient(want, zt)
    kw = dict(gamma=gamma, label_smoothing=eps, class_weights=alpha)
    np.testing.assert_allclose(ref.custom_loss(labels, z, **kw), want.numpy(), rtol=1e-12)
    np.testing.assert_allclose(ref.custom_loss_grad(labels, z, **kw), want_grad.numpy(),
                               rtol=1e-10, atol=1e-13)
    keras_loss = keras.losses.categorical_focal_crossentropy(
        tf.constant(np.eye(c)[labels]), zt, alpha=tf.constant(alpha), gamma=gamma,
        from_logits=True, label_smoothing=eps)
    # Keras clips p to [1e-7, 1 - 1e-7]; far from the clip it agrees to ~1e-7 relative.
    np.testing.assert_allclose(ref.custom_loss(labels, z, **kw), keras_loss.numpy(),
                               rtol=1e-5)


def test_no_clip_unlike_keras_on_confident_model_with_smoothing(ref):
    import keras
    import tensorflow as tf
    # A confident model: the non-target probabilities are far below Keras's 1e-7 clip.
    z = np.array([[30.0, 0.0, 0.0, 0.0], [0.0, 25.0, 0.0, 0.0]])
    labels = np.array([0, 1])
    eps, gamma = 0.1, 2.0
    q = (1 - eps) * np.eye(4)[labels] + eps / 4
    ours = ref.custom_loss(labels, z, gamma=gamma, label_smoothing=eps)
    hand = _hand_focal_tf(tf.constant(q), tf.constant(z), tf.constant(np.ones(4)), gamma)
    np.testing.assert_allclose(ours, hand.numpy(), rtol=1e-12)
    keras_loss = keras.losses.categorical_focal_crossentropy(
        tf.constant(np.eye(4)[labels]), tf.constant(z), alpha=1.0, gamma=gamma,
        from_logits=True, label_smoothing=eps).numpy()
    assert np.all(np.abs(keras_loss - ours) / ours > 0.01)   # Keras is off by percents


# ----------------------------------------------------------------------------------------
# Special cases of the definition
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_masked_minus_inf_classes_equal_the_problem_without_them(ref, gamma, eps):
    rng = _rng("mask", gamma, eps)
    c = 12
    z = rng.normal(size=(5, c))
    mask = np.zeros((5, c), dtype=bool)
    if eps == 0.0:
        # Without smoothing a masked non-target class has w_c = 0: any per-row mask works.
        labels = np.array([3, 11, 7, 3, 9])
        mask[0, :3] = True                              # an all--inf prefix
        mask[1, :11] = True                             # everything but the target
        mask[2, [0, 5, 6, 10]] = True
        mask[4, 10:] = True                             # an all--inf suffix
        a = np.ones(c)
    else:
        # With smoothing every class has q_c > 0, so the masked classes (the same in every
        # row) get class weight 0; otherwise their -inf log p would make the loss infinite.
        labels = np.array([3, 4, 7, 5, 9])
        mask[:, [0, 1, 2, 6, 10, 11]] = True
        a = np.where(mask[0], 0.0, 1.0)
    z_masked = np.where(mask, -np.inf, z)
    kw = dict(gamma=gamma, label_smoothing=eps, class_weights=a)
    loss = ref.custom_loss(labels, z_masked, **kw)
    grad = ref.custom_loss_grad(labels, z_masked, **kw)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    assert np.all(grad[mask] == 0.0)
    # Row by row: drop the -inf columns and pass the smoothed, weighted targets a*q as dense
    # targets with no smoothing; that is the same loss over the surviving classes.
    for i in range(5):
        keep = ~mask[i]
        q = (1 - eps) * np.eye(c)[labels[i]] + eps / c
        w_dense = (a * q)[keep][None, :]
        want = ref.custom_loss(w_dense, z[i:i + 1, keep], gamma=gamma)
        want_g = ref.custom_loss_grad(w_dense, z[i:i + 1, keep], gamma=gamma)
        np.testing.assert_allclose(loss[i:i + 1], want, rtol=1e-13)
        np.testing.assert_allclose(grad[i, keep], want_g[0], rtol=1e-12, atol=1e-15)


def test_masked_class_with_positive_smoothing_weight_has_inf_loss_finite_grad(ref):
    # w_c > 0 on a -inf logit: the loss is +inf by the definition, and the gradient formula
    # (p*lp term taken as 0 at p == 0) stays finite: g_c = w_c, dz_c = 0 * G - w_c.
    z = np.array([[-np.inf, 1.0, 2.0]])
    loss = ref.custom_loss([1], z, gamma=2.0, label_smoothing=0.3)
    grad = ref.custom_loss_grad([1], z, gamma=2.0, label_smoothing=0.3)
    assert np.isposinf(loss[0])
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad[0, 0], -0.3 / 3, rtol=1e-15)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("eps", EPSILONS)
def test_single_class_is_zero_loss_zero_grad(ref, gamma, eps):
    z = np.array([[3.0], [-50.0], [0.0]])
    labels = np.zeros(3, np.int32)
    np.testing.assert_array_equal(ref.custom_loss(labels, z, gamma=gamma, label_smoothing=eps),
                                  np.zeros(3))
    np.testing.assert_array_equal(
        ref.custom_loss_grad(labels, z, gamma=gamma, label_smoothing=eps), np.zeros((3, 1)))


@pytest.mark.parametrize("shape", [(0, 5), (0, 1), (2, 0, 7), (0,  3, 4)])
def test_empty_batch(ref, shape):
    z = np.zeros(shape)
    labels = np.zeros(shape[:-1], np.int64)
    loss = ref.custom_loss(labels, z, gamma=2.0, label_smoothing=0.1)
    grad = ref.custom_loss_grad(labels, z, gamma=2.0, label_smoothing=0.1)
    assert loss.shape == shape[:-1] and loss.dtype == np.float64
    assert grad.shape == shape and grad.dtype == np.float64


@pytest.mark.parametrize("ignore_class", [-100, -1, 0, 4])
def test_ignore_class_rows_are_zero_and_others_unchanged(ref, ignore_class):
    rng = _rng("ignore", ignore_class)
    z = rng.normal(size=(6, 5))
    labels = np.array([1, 2, 3, 1, 3, 2])                 # no kept row holds ignore_class
    ignored = np.array([False, True, False, False, True, False])
    labels = np.where(ignored, ignore_class, labels)
    z[4] = np.nan                                        # ignored rows are 0 even if NaN
    kw = dict(gamma=1.5, label_smoothing=0.1, class_weights=[1.0, 2.0, 0.5, 1.0, 3.0])
    loss = ref.custom_loss(labels, z, ignore_class=ignore_class, **kw)
    grad = ref.custom_loss_grad(labels, z, ignore_class=ignore_class, **kw)
    assert np.all(loss[ignored] == 0) and np.all(grad[ignored] == 0)
    kept = ~ignored
    np.testing.assert_array_equal(loss[kept], ref.custom_loss(labels[kept], z[kept], **kw))
    np.testing.assert_array_equal(grad[kept], ref.custom_loss_grad(labels[kept], z[kept], **kw))


def test_nan_row_is_isolated(ref):
    rng = _rng("nan")
    z = rng.normal(size=(4, 6))
    labels = np.array([0, 1, 2, 3])
    z_nan = z.copy()
    z_nan[2, 4] = np.nan
    kw = dict(gamma=2.0, label_smoothing=0.1)
    loss = ref.custom_loss(labels, z_nan, **kw)
    grad = ref.custom_loss_grad(labels, z_nan, **kw)
    assert np.isnan(loss[2]) and np.all(np.isnan(grad[2]))
    others = [0, 1, 3]
    np.testing.assert_array_equal(loss[others], ref.custom_loss(labels, z, **kw)[others])
    np.testing.assert_array_equal(grad[others], ref.custom_loss_grad(labels, z, **kw)[others])


@pytest.mark.parametrize("shift", [1e3, -1e5, 1e12])
def test_shift_invariance_and_extreme_logits(ref, shift):
    rng = _rng("shift", shift)
    z = rng.normal(scale=2.0, size=(5, 7))
    labels = rng.integers(0, 7, size=5)
    kw = dict(gamma=2.0, label_smoothing=0.1)
    # Adding a constant to a row does not change softmax; compare to a tolerance that
    # reflects the rounding of z + shift itself (|shift| * 2^-52).
    tol = abs(shift) * 2.0 ** -50
    np.testing.assert_allclose(ref.custom_loss(labels, z + shift, **kw),
                               ref.custom_loss(labels, z, **kw), atol=50 * tol, rtol=0)
    np.testing.assert_allclose(ref.custom_loss_grad(labels, z + shift, **kw),
                               ref.custom_loss_grad(labels, z, **kw), atol=10 * tol, rtol=0)
    # Huge finite logits: p is exactly one-hot; no overflow, no NaN.
    big = np.array([[1e300, -1e300, 0.0], [-1e300, 0.0, 1e300]])
    loss = ref.custom_loss([0, 0], big, gamma=2.0)
    grad = ref.custom_loss_grad([0, 0], big, gamma=2.0)
    np.testing.assert_array_equal(loss, [0.0, 2e300])
    np.testing.assert_array_equal(grad, [[0.0, 0.0, 0.0], [-1.0, 0.0, 1.0]])


def test_label_formats_agree(ref):
    rng = _rng("formats")
    z = rng.normal(size=(2, 3, 4))
    ids = rng.integers(0, 4, size=(2, 3))
    kw = dict(gamma=0.5, label_smoothing=0.1)
    want = ref.custom_loss(ids, z, **kw)
    want_g = ref.custom_loss_grad(ids, z, **kw)
    for labels in (ids.astype(np.int32), ids.astype(np.uint8), ids.astype(np.float32),
                   ids.astype(np.float64), ids[..., None], ids[..., None].astype(np.float32),
                   np.eye(4)[ids].astype(np.float32)):
        np.testing.assert_array_equal(ref.custom_loss(labels, z, **kw), want)
        np.testing.assert_array_equal(ref.custom_loss_grad(labels, z, **kw), want_g)


def test_float_labels_shaped_like_logits_are_dense_even_for_one_class(ref):
    # With C == 1 a float [B, 1] label is "shape == logits.shape": dense by the rule.
    z = np.array([[0.3], [2.0]])
    np.testing.assert_array_equal(ref.custom_loss(np.array([[2.0], [0.5]]), z), [0.0, 0.0])
    # Integer [B, 1] labels are sparse with a trailing 1; label 2 is out of range for C = 1.
    with pytest.raises(ValueError, match=r"2"):
        ref.custom_loss(np.array([[0], [2]]), z)


def test_upstream_scales_each_row(ref):
    rng = _rng("upstream")
    z = rng.normal(size=(3, 2, 5))
    labels = rng.integers(0, 5, size=(3, 2))
    u = rng.normal(size=(3, 2))
    base = ref.custom_loss_grad(labels, z, gamma=1.0)
    np.testing.assert_allclose(ref.custom_loss_grad(labels, z, gamma=1.0, upstream=u),
                               base * u[..., None], rtol=1e-15)
    np.testing.assert_allclose(ref.custom_loss_grad(labels, z, gamma=1.0, upstream=2.0),
                               2.0 * base, rtol=1e-15)


def test_accepts_bfloat16_and_float16_inputs(ref):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    z = np.array([[0.5, -1.0, 2.0]], dtype=np.float32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        zq = z.astype(dt)
        np.testing.assert_array_equal(ref.custom_loss([2], zq),
                                      ref.custom_loss([2], zq.astype(np.float64)))


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("labels,index,value", [
    (np.array([0, 1, 2, 3, 4, 5, 1234, 0, 1]), 6, "1234"),
    (np.array([0, 1, -3, 0, 1, 2, 3, 0, 1], np.int32), 2, "-3"),
    (np.array([0, 1, 2, 3, 4, 5, 6, 7, 8.0]), 8, "8"),
])
def test_out_of_range_label_names_index_and_value(ref, labels, index, value):
    z = np.zeros((9, 8))
    with pytest.raises(ValueError) as info:
        ref.custom_loss(labels, z)
    msg = str(info.value)
    assert f"example {index}" in msg and f"= {value} " in msg, msg
    with pytest.raises(ValueError):
        ref.custom_loss_grad(labels, z)


def test_out_of_range_is_allowed_only_for_ignore_class(ref):
    z = np.zeros((3, 4))
    ref.custom_loss([0, -1, 3], z, ignore_class=-1)
    with pytest.raises(ValueError, match=r"example 1"):
        ref.custom_loss([0, -2, 3], z, ignore_class=-1)


@pytest.mark.parametrize("labels,match", [
    (np.array([0.0, 1.5, 2.0]), r"whole.*1\.5"),
    (np.array([0.0, np.nan, 2.0]), r"whole.*nan"),
    (np.array([0, 1]), r"\(2,\).*\(3, 4\)"),
    (np.zeros((3, 2)), r"\(3, 2\).*\(3, 4\)"),
])
def test_bad_label_values_and_shapes(ref, labels, match):
    with pytest.raises(ValueError, match=match):
        ref.custom_loss(labels, np.zeros((3, 4)))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(gamma=-0.5), ValueError, "gamma"),
    (dict(gamma=float("nan")), ValueError, "gamma"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    (dict(class_weights=[1.0, -1.0, 1.0, 1.0]), ValueError, r"class_weights\[1\]"),
    (dict(class_weights=[1.0, 1.0, float("nan"), 1.0]), ValueError, r"class_weights\[2\]"),
    (dict(class_weights=[1.0, 1.0, 1.0]), ValueError, r"\(3,\)"),
])
def test_bad_parameters(ref, kw, exc, match):
    with pytest.raises(exc, match=match):
        ref.custom_loss([0, 1, 2], np.zeros((3, 4)), **kw)
    with pytest.raises(exc, match=match):
        ref.custom_loss_grad([0, 1, 2], np.zeros((3, 4)), **kw)


def test_bad_logits(ref):
    with pytest.raises(TypeError, match="floating"):
        ref.custom_loss([0, 1], np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="rank"):
        ref.custom_loss(0, np.float64(1.0))
    with pytest.raises(ValueError, match="C >= 1"):
        ref.custom_loss(np.zeros(3, np.int64), np.zeros((3, 0)))
    with pytest.raises(TypeError, match="labels"):
        ref.custom_loss(np.array([True, False]), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="sparse"):
        ref.custom_loss(np.eye(3)[:2], np.zeros((2, 3)), ignore_class=-1)


# ----------------------------------------------------------------------------------------
# Loading the reference does not import TensorFlow
# ----------------------------------------------------------------------------------------

def test_loading_reference_does_not_import_tensorflow():
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("ref", {str(REFERENCE_PATH)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.custom_loss_grad([1], [[0.0, 1.0]], gamma=2.0)
        bad = sorted(m for m in sys.modules
                     if m.split(".")[0] in ("tensorflow", "keras", "tf_metal_ops"))
        print("IMPORTED:", bad)
        sys.exit(1 if bad else 0)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
