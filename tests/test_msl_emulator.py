"""The Metal kernels (kernels/custom_loss.metal), compiled as C++ and run by the emulator.

Each case is planned by csrc/metal/launch_plan.cc exactly as the macOS encoder plans it (kernel
name, grid, threadgroup size and memory, buffer bindings) and executed with threadgroup memory,
barriers and 32-lane lockstep SIMD-groups (tests/msl_host/). Results are compared with the NumPy
reference (tf_metal_ops/reference.py, float64) on the values the kernel actually read (half and
bfloat16 inputs are rounded first).

Tolerances (|kernel - reference|), per logits dtype:
* float32: loss <= 2e-5 |ref|; gradient <= 2e-5 |ref| + 5e-6 max|ref row|.
* float16: loss <= 1e-3 |ref| + 1e-7; gradient <= 1e-3 |ref| + 1e-3 max|ref row| (the outputs
  are rounded to half: 2^-11 relative, and half's subnormals below 6e-5).
* bfloat16: loss <= 8e-3 |ref|; gradient <= 8e-3 |ref| + 8e-3 max|ref row| (2^-8).
The loss is checked relative to itself: its terms w r^gamma (-lp) all have the same sign, so a
correct float kernel is accurate to a few ulps times log C even for a tiny loss (a confident
row); that is what catches a lost log1p or expm1. The gradient p_j G - g_j cancels, so its
error is measured against the row's largest entry.
NaN and +-inf must match exactly in position and sign.
"""

from __future__ import annotations

import re
import sys
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402
from msl_build import msl_cache_dir  # noqa: E402,F401  (pytest fixture)

REPO = Path(__file__).resolve().parents[1]

TOLERANCES = {
    # dtype: (loss rtol, loss atol, grad rtol, grad atol relative to the row's max |grad|)
    "float32": (2e-5, 0.0, 2e-5, 5e-6),
    "float16": (1e-3, 1e-7, 1e-3, 1e-3),
    "bfloat16": (8e-3, 0.0, 8e-3, 8e-3),
}


@pytest.fixture(scope="module")
def emu(msl_cache_dir) -> mb.Emulator:
    return mb.Emulator(mb.build_emulator_library(msl_cache_dir))


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _assert_same_nonfinite(actual: np.ndarray, expected: np.ndarray, what: str) -> np.ndarray:
    """Asserts NaN / inf agree exactly; returns the mask of finite expected values."""
    assert np.array_equal(np.isnan(actual), np.isnan(expected)), (
        f"{what}: NaN positions differ: kernel {np.argwhere(np.isnan(actual)).tolist()} vs "
        f"reference {np.argwhere(np.isnan(expected)).tolist()}")
    inf_e = np.isinf(expected)
    assert np.array_equal(np.isinf(actual), inf_e), f"{what}: inf positions differ"
    assert np.array_equal(actual[inf_e], expected[inf_e]), f"{what}: inf signs differ"
    return np.isfinite(expected)


def assert_loss_close(actual, expected, dtype, what=""):
    rtol, atol, _, _ = TOLERANCES[dtype]
    finite = _assert_same_nonfinite(actual, expected, what + " loss")
    a, e = actual[finite], expected[finite]
    bound = rtol * np.abs(e) + atol
    err = np.abs(a - e)
    assert np.all(err <= bound), (
        f"{what} loss: worst |err| {err.max():.3g} at {int(np.argmax(err - bound))}: "
        f"kernel {a[np.argmax(err - bound)]!r} vs reference {e[np.argmax(err - bound)]!r}")


def assert_grad_close(actual, expected, dtype, what=""):
    _, _, rtol, atol = TOLERANCES[dtype]
    finite = _assert_same_nonfinite(actual, expected, what + " gradient")
    with np.errstate(invalid="ignore"):
        row_scale = np.max(np.where(finite, np.abs(expected), 0.0), axis=1, keepdims=True)
    bound = rtol * np.abs(expected) + atol * np.maximum(row_scale, 1e-30)
    err = np.where(finite, np.abs(actual - expected), 0.0)
    bad = err > np.where(finite, bound, np.inf)
    assert not bad.any(), (
        f"{what} gradient: {int(bad.sum())} elements out of tolerance, first at "
        f"{np.argwhere(bad)[0].tolist()}: kernel {actual[tuple(np.argwhere(bad)[0])]!r} vs "
        f"reference {expected[tuple(np.argwhere(bad)[0])]!r}")


def _stored_inputs(logits, labels, label_kind, dtype):
    """The logits and labels as the kernels store them, and the float64 values they hold."""
    z_store = mb.storage(logits, dtype)
    if label_kind == "dense":
        y_store = mb.storage(labels, dtype)
        y_ref = mb.as_float64(y_store, dtype)
    else:
        y_store = np.ascontiguousarray(labels, np.int32 if label_kind == "int32" else np.int64)
        y_ref = y_store
    return z_store, mb.as_float64(z_store, dtype), y_store, y_ref


def run_and_compare(emu, ref, *, logits, labels, label_kind="int32", dtype="float32",
                    gamma=0.0, label_smoothing=0.0, class_weights=None, ignore_class=None,
                    upstream=None, variant="auto", max_threads=1024, simd_width=32,
                    executor="fibers", what=""):
    """Forward and gradient through the emulator vs the reference; returns the two runs."""
    n, c = logits.shape
    z_store, z, y_store, y_ref = _stored_inputs(logits, labels, label_kind, dtype)
    if upstream is None:
        upstream = _rng("upstream", n).uniform(-2.0, 2.0, n)
    u_store = mb.storage(upstream, dtype)
    u = mb.as_float64(u_store, dtype)
    kw = dict(gamma=gamma, label_smoothing=label_smoothing, class_weights=class_weights,
              ignore_class=ignore_class)
    common = dict(logits=z_store, labels=y_store, dtype=dtype, label_kind=label_kind,
                  variant=variant, max_threads=max_threads, simd_width=simd_width,
                  executor=executor, **kw)
    fwd = emu.run(direction="forward", **common)
    assert fwd.ok, fwd.error
    grad = emu.run(direction="gradient", upstream=u_store, **common)
    assert grad.ok, grad.error
    assert fwd.error_record[0] == 0 and grad.error_record[0] == 0, "unexpected bad-label report"
    tag = f"{what} [{fwd.kernel_name} grid {fwd.threadgroups_per_grid} x {fwd.threads_per_threadgroup}]"
    expected_loss = ref.custom_loss(y_ref, z, **kw)
    expected_grad = ref.custom_loss_grad(y_ref, z, upstream=u, **kw)
    assert_loss_close(fwd.output, expected_loss, dtype, tag)
    assert_grad_close(grad.output, expected_grad, dtype, tag)
    return fwd, grad


def _labels(kind, rng, n, c):
    if kind == "dense":
        t = rng.uniform(0.0, 1.0, (n, c)) ** 3  # soft targets, some near 0
        return t / t.sum(axis=1, keepdims=True)
    return rng.integers(0, c, n)


# ------------------------------------------------------------------------------------------
# The case matrix
# ------------------------------------------------------------------------------------------

ODD_CLASSES = [1, 31, 33, 1000, 50257]
# Per label kind, a different corner of the parameters (the fast single-class path for int32).
KIND_PARAMS = {
    "int32": dict(gamma=0.0, label_smoothing=0.0),
    "int64": dict(gamma=2.0, label_smoothing=0.1),
    "dense": dict(gamma=0.5, label_smoothing=0.2),
}


@pytest.mark.parametrize("num_classes", ODD_CLASSES)
@pytest.mark.parametrize("variant", ["auto", "other"])
@pytest.mark.parametrize("label_kind", ["int32", "int64", "dense"])
def test_emulated_kernels_match_reference_on_odd_num_classes(emu, ref, num_classes, variant,
                                                             label_kind):
    # Rows: enough for several threadgroups and a partial last one (rowsimd), fewer for big C.
    n = 3 if num_classes > 10000 else 37
    rng = _rng("odd", num_classes, variant, label_kind)
    logits = rng.normal(0.0, 3.0, (n, num_classes))
    labels = _labels(label_kind, rng, n, num_classes)
    weights = rng.uniform(0.0, 2.0, num_classes) if label_kind == "int64" else None
    auto = "rowsimd" if num_classes <= 256 else "rowtg"
    chosen = auto if variant == "auto" else {"rowsimd": "rowtg", "rowtg": "rowsimd"}[auto]
    fwd, grad = run_and_compare(emu, ref, logits=logits, labels=labels, label_kind=label_kind,
                                class_weights=weights, variant=chosen,
                                **KIND_PARAMS[label_kind])
    assert fwd.variant == grad.variant == chosen
    # int32's corner is plain cross-entropy: the "_plain" kernels run it.
    plain = "_plain" if label_kind == "int32" else ""
    assert fwd.kernel_name == (f"tfmo_custom_loss_forward_{chosen}_f32_"
                               f"{ {'int32': 'i32', 'int64': 'i64', 'dense': 'dense'}[label_kind] }"
                               f"{plain}")
    assert grad.kernel_name == fwd.kernel_name.replace("_forward_", "_gradient_")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("label_kind", ["int32", "int64"])
@pytest.mark.parametrize("variant, num_classes", [("rowsimd", 45), ("rowtg", 1000),
                                                   ("rowtg", 301)])
@pytest.mark.parametrize("label_smoothing, form", [(0.0, "_plain"), (0.1, "_smoothed")])
def test_cross_entropy_kernels_match_the_general_kernels_bitwise(emu, variant, num_classes,
                                                                 label_kind, dtype,
                                                                 label_smoothing, form):
    # Cross-entropy (gamma 0, no class weights) runs the "_plain" kernels, or with label
    # smoothing the "_smoothed" ones; class weights of exactly 1 give the same loss through the
    # general kernels, whose outputs these must reproduce bit for bit: every launch (forward with
    # row_stats and the scaled gradient, gradient reading row_stats, gradient without) and every
    # output. Rows: ignored, bad labels, a NaN, an all -inf row and a masked vocabulary besides
    # normal ones.
    rng = _rng("plain", variant, num_classes, label_kind, dtype)
    n, c = 21, num_classes
    logits = rng.normal(0.0, 3.0, (n, c))
    logits[2, :] = -np.inf
    logits[3, 5] = np.nan
    logits[4, rng.choice(c, c // 2, replace=False)] = -np.inf
    labels = rng.integers(0, c, n)
    labels[4] = int(np.flatnonzero(np.isfinite(logits[4]))[0])
    labels[6] = 7                      # ignore_class
    labels[9] = c                      # out of range: NaN row, error record
    z = mb.storage(logits, dtype)
    y = labels.astype(np.int32 if label_kind == "int32" else np.int64)
    scales = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    upstream = mb.storage(rng.uniform(-2.0, 2.0, n), dtype)
    common = dict(logits=z, labels=y, dtype=dtype, label_kind=label_kind, ignore_class=7,
                  variant=variant, label_smoothing=label_smoothing)
    runs = {}
    for name, weights in (("plain", None), ("general", np.ones(c, np.float32))):
        fwd = emu.run(direction="forward", class_weights=weights, row_stats=True,
                      row_scales=scales, **common)
        grad_stats = emu.run(direction="gradient", class_weights=weights, upstream=upstream,
                             row_stats=fwd.row_stats, **common)
        grad = emu.run(direction="gradient", class_weights=weights, upstream=upstream, **common)
        for run in (fwd, grad_stats, grad):
            assert run.ok, run.error
            assert run.kernel_name.endswith(form) == (name == "plain"), run.kernel_name
        runs[name] = (fwd, grad_stats, grad)
    for plain, general in zip(runs["plain"], runs["general"]):
        assert plain.kernel_name == general.kernel_name + form
        for field in ("raw_output", "row_stats", "scaled_gradient", "error_record"):
            a, b = getattr(plain, field), getattr(general, field)
            if a is None or b is None:
                assert a is None and b is None, field
                continue
            a, b = np.asarray(a), np.asarray(b)
            assert a.tobytes() == b.tobytes(), f"{plain.kernel_name}: {field} differs"
    fwd = runs["plain"][0]
    assert fwd.bad_label_count == 1
    assert np.isnan(fwd.output[[2, 3, 9]]).all() and fwd.output[6] == 0.0
    # Smoothing weighs the masked classes of row 4 too: their -inf logits make its loss +inf.
    if label_smoothing:
        assert fwd.output[4] == np.inf
    else:
        assert np.isfinite(fwd.output[4])
    assert np.isfinite(np.delete(fwd.output, [2, 3, 4, 9])).all()


@pytest.mark.parametrize("variant, num_classes", [("rowsimd", 45), ("rowtg", 1000)])
def test_smoothing_that_rounds_away_runs_the_plain_kernels(emu, variant, num_classes):
    # eps / C below float's smallest subnormal is 0 in the params: nothing is smoothed, the
    # general kernels take their one-class path, and the plan runs the plain kernels, which
    # give the same bits (a smoothed kernel would turn the masked row's 0 * -inf into NaN).
    rng = _rng("tiny eps", variant, num_classes)
    n, c = 9, num_classes
    logits = rng.normal(0.0, 3.0, (n, c)).astype(np.float32)
    logits[4, rng.choice(c, c // 2, replace=False)] = -np.inf
    labels = rng.integers(0, c, n).astype(np.int64)
    labels[4] = int(np.flatnonzero(np.isfinite(logits[4]))[0])
    common = dict(logits=logits, labels=labels, label_kind="int64", variant=variant,
                  label_smoothing=1e-45, row_stats=True,
                  row_scales=np.full(n, 1.0 / n, np.float32))
    plain = emu.run(direction="forward", **common)
    general = emu.run(direction="forward", class_weights=np.ones(c, np.float32), **common)
    assert plain.ok and general.ok, (plain.error, general.error)
    assert plain.kernel_name.endswith("_i64_plain"), plain.kernel_name
    assert general.kernel_name.endswith("_i64"), general.kernel_name
    for field in ("raw_output", "row_stats", "scaled_gradient"):
        a, b = np.asarray(getattr(plain, field)), np.asarray(getattr(general, field))
        assert a.tobytes() == b.tobytes(), field
    assert np.isfinite(plain.output).all()


@pytest.mark.parametrize("variant", ["rowtg", "rowsimd"])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0, 3.7])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
def test_emulated_focal_smoothing_weights_and_ignore_class(emu, ref, variant, gamma,
                                                           label_smoothing):
    rng = _rng("focal", variant, gamma, label_smoothing)
    n, c = 41, 45
    logits = rng.normal(0.0, 2.0, (n, c))
    labels = rng.integers(0, c, n)
    labels[::5] = 7                   # ignore_class inside [0, C)
    weights = rng.uniform(0.0, 3.0, c)
    weights[::4] = 0.0                # zero weights, including on some labels
    run_and_compare(emu, ref, logits=logits, labels=labels, label_kind="int64", gamma=gamma,
                    label_smoothing=label_smoothing, class_weights=weights, ignore_class=7,
                    variant=variant)
    # ignore_class outside [0, C) (the Keras convention -1): such rows are ignored, not errors.
    labels[::3] = -1
    run_and_compare(emu, ref, logits=logits, labels=labels, label_kind="int32", gamma=gamma,
                    label_smoothing=label_smoothing, ignore_class=-1, variant=variant)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the reference's log(0)
@pytest.mark.parametrize("variant", ["rowtg", "rowsimd"])
@pytest.mark.parametrize("label_kind", ["int32", "dense"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_emulated_masks_nan_and_infinite_rows(emu, ref, variant, label_kind, label_smoothing):
    rng = _rng("masks", variant, label_kind, label_smoothing)
    n, c = 12, 300
    logits = rng.normal(0.0, 2.0, (n, c))
    labels = rng.integers(0, c, n)
    logits[0, :200] = -np.inf                         # an all--inf prefix (threads see only -inf)
    labels[0] = 250
    logits[1, rng.choice(c, 150, replace=False)] = -np.inf   # a masked vocabulary
    labels[1] = int(np.flatnonzero(np.isfinite(logits[1]))[0])
    logits[2, :] = -np.inf                            # no finite logit: undefined softmax (NaN)
    logits[3, 17] = np.nan                            # NaN: this row only
    logits[4, 5] = np.inf                             # +inf: undefined softmax (NaN)
    logits[5, :] = -np.inf                            # only the target is finite: p_y = 1
    logits[5, labels[5]] = 3.0
    logits[6, :] = 0.0                                # all ties
    logits[7] *= 1e4                                  # extreme logits (float32 range)
    if label_kind == "dense":
        t = np.zeros((n, c))
        t[np.arange(n), labels] = 1.0
        labels = t
    fwd, grad = run_and_compare(emu, ref, logits=logits, labels=labels, label_kind=label_kind,
                                gamma=1.5, label_smoothing=label_smoothing, variant=variant)
    nan_rows = {2, 3, 4}
    for row in range(n):
        assert np.isnan(fwd.output[row]) == (row in nan_rows), row
        assert np.isnan(grad.output[row]).all() == (row in nan_rows), row
    # Masked classes get a finite gradient even when their loss term is +inf (smoothing).
    assert np.isfinite(grad.output[[0, 1, 5]]).all()


@pytest.mark.parametrize("variant", ["rowtg", "rowsimd"])
@pytest.mark.parametrize("gamma", [0.25, 0.5, 0.9])
def test_emulated_confident_rows_with_gamma_below_one(emu, ref, variant, gamma):
    # p_y within 1e-9 of 1 (and exactly 1 for C = 1): the gamma < 1 term has its finite limit.
    rng = _rng("confident", variant, gamma)
    n, c = 9, 260
    logits = rng.normal(0.0, 1.0, (n, c))
    labels = rng.integers(0, c, n)
    logits[np.arange(n), labels] = 30.0 + np.arange(n)
    fwd, grad = run_and_compare(emu, ref, logits=logits, labels=labels, gamma=gamma,
                                label_smoothing=0.05, variant=variant)
    assert np.isfinite(grad.output).all() and np.isfinite(fwd.output).all()
    one = run_and_compare(emu, ref, logits=rng.normal(0.0, 1.0, (5, 1)),
                          labels=np.zeros(5, np.int64), gamma=gamma, variant=variant)
    assert np.array_equal(one[0].output, np.zeros(5))  # lp = 0, r = 0: loss 0 ...
    assert np.array_equal(one[1].output, np.zeros((5, 1)))  # ... and gradient 0, not NaN


@pytest.mark.parametrize("variant", ["rowtg", "rowsimd"])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_emulated_precision_near_p_equal_one(emu, ref, variant, gamma):
    # 1 - p_y from 1e-2 down to 1e-10: lp_y = -log1p(others) and r_y = -expm1(lp_y) must keep
    # their digits, where log(1 + others) and 1 - exp(lp) in float would lose all of them.
    # (Not below 1e-10: the float64 reference forms p G - g = g (p - 1) directly, which keeps
    # only ~16 + log10(r) digits of the target's gradient.)
    n, c = 11, 300
    rng = _rng("near-one", variant, gamma)
    logits = rng.normal(0.0, 0.1, (n, c))
    labels = rng.integers(0, c, n)
    others = np.log(np.exp(logits).sum(axis=1) - np.exp(logits[np.arange(n), labels]))
    target_r = 10.0 ** -np.linspace(2, 10, n)          # 1 - p_y per row
    logits[np.arange(n), labels] = others - np.log(target_r)
    fwd, grad = run_and_compare(emu, ref, logits=logits, labels=labels, gamma=gamma,
                                variant=variant)
    assert (fwd.output > 0).all()                      # no loss rounded to 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_classes", [33, 1000])
@pytest.mark.parametrize("label_kind", ["int32", "dense"])
def test_emulated_half_and_bfloat_logits(emu, ref, dtype, num_classes, label_kind):
    rng = _rng("16bit", dtype, num_classes, label_kind)
    n = 19
    logits = rng.normal(0.0, 2.0, (n, num_classes))
    labels = _labels(label_kind, rng, n, num_classes)
    for variant in ("rowtg", "rowsimd"):
        fwd, _ = run_and_compare(emu, ref, logits=logits, labels=labels, label_kind=label_kind,
                                 dtype=dtype, gamma=2.0, label_smoothing=0.1, variant=variant)
        assert fwd.kernel_name.split("_")[-2] == {"float16": "f16", "bfloat16": "bf16"}[dtype]


@pytest.mark.parametrize("variant", ["rowtg", "rowsimd"])
@pytest.mark.parametrize("label_kind", ["int32", "int64"])
def test_emulated_bad_labels_give_nan_rows_and_an_error_record(emu, ref, variant, label_kind):
    rng = _rng("bad", variant, label_kind)
    n, c = 23, 70
    logits = rng.normal(0.0, 2.0, (n, c))
    labels = rng.integers(0, c, n)
    bad = {4: -3, 9: c, 17: c + 1000}
    if label_kind == "int64":
        bad[20] = 2**40 + 5                   # only representable in int64
    good_labels = labels.copy()
    for row, value in bad.items():
        labels[row] = value
    y = labels.astype(np.int32 if label_kind == "int32" else np.int64)
    kw = dict(labels=y, dtype="float32", label_kind=label_kind, gamma=1.0, label_smoothing=0.1,
              ignore_class=-1, variant=variant)
    fwd = emu.run(direction="forward", logits=mb.storage(logits, "float32"), **kw)
    grad = emu.run(direction="gradient", logits=mb.storage(logits, "float32"),
                   upstream=np.ones(n, np.float32), **kw)
    for run in (fwd, grad):
        assert run.ok, run.error
        assert run.bad_label_count == len(bad)
        assert run.min_bad_row == min(bad)
        row, value = run.claimed
        assert bad.get(row) == value, (row, value)  # a consistent (row, label) pair
    good = np.array([r not in bad for r in range(n)])
    assert np.isnan(fwd.output[~good]).all() and np.isnan(grad.output[~good]).all()
    z = logits.astype(np.float32).astype(np.float64)
    exp_loss = ref.custom_loss(good_labels, z, gamma=1.0, label_smoothing=0.1)
    exp_grad = ref.custom_loss_grad(good_labels, z, gamma=1.0, label_smoothing=0.1)
    assert_loss_close(fwd.output[good], exp_loss[good], "float32", "good rows")
    assert_grad_close(grad.output[good], exp_grad[good], "float32", "good rows")
    # The ignore_class value itself is not an error, and a clean batch reports nothing.
    clean = emu.run(direction="forward", logits=mb.storage(logits, "float32"),
                    **{**kw, "labels": good_labels.astype(y.dtype)})
    assert clean.ok and clean.bad_label_count == 0 and clean.claimed is None
    assert clean.min_bad_row == 0xFFFFFFFF


def test_emulated_empty_batch_is_not_dispatched(emu):
    for direction in ("forward", "gradient"):
        for variant in ("auto", "rowtg", "rowsimd"):
            run = emu.run(direction=direction, logits=np.zeros((0, 10), np.float32),
                          labels=np.zeros(0, np.int32), upstream=np.zeros(0, np.float32),
                          variant=variant)
            assert run.ok, run.error
            assert not run.dispatched
            assert run.threadgroups_per_grid == (0, 0, 0)
            assert run.output.shape in ((0,), (0, 10))


@pytest.mark.parametrize("max_threads, simd_width", [(1024, 32), (96, 32), (64, 32),
                                                     (32, 32), (256, 16), (1024, 64)])
def test_emulated_partial_threadgroups_and_pipeline_limits(emu, ref, max_threads, simd_width):
    rng = _rng("limits", max_threads, simd_width)
    # rowsimd: 300 rows of 10 classes -> 2 lanes a row; the last threadgroup is partial.
    logits = rng.normal(0.0, 2.0, (300, 10))
    labels = rng.integers(0, 10, 300)
    fwd, _ = run_and_compare(emu, ref, logits=logits, labels=labels, gamma=2.0,
                             label_smoothing=0.1, max_threads=max_threads,
                             simd_width=simd_width)
    tg = fwd.threads_per_threadgroup[0]
    assert fwd.variant == "rowsimd" and tg % simd_width == 0 and tg <= max_threads
    assert fwd.threads_per_row == 2 and fwd.rows_per_threadgroup == tg // 2
    grid = fwd.threadgroups_per_grid[0] * fwd.threadgroups_per_grid[1]
    assert grid * fwd.rows_per_threadgroup >= 300 > (grid - 1) * fwd.rows_per_threadgroup
    # rowtg: 1000 classes over a threadgroup that does not divide it.
    logits = rng.normal(0.0, 2.0, (5, 1000))
    labels = rng.integers(0, 1000, 5)
    fwd, _ = run_and_compare(emu, ref, logits=logits, labels=labels, gamma=0.5,
                             label_smoothing=0.2, variant="rowtg", max_threads=max_threads,
                             simd_width=simd_width)
    tg = fwd.threads_per_threadgroup[0]
    assert tg % simd_width == 0 and tg <= max_threads and tg // simd_width <= simd_width
    assert fwd.threadgroup_memory_length % 16 == 0
    assert fwd.threadgroup_memory_length >= 4 * 4 * (tg // simd_width)


def test_emulated_fibers_and_os_threads_agree_bitwise(emu, ref):
    rng = _rng("executors")
    for variant, (n, c) in (("rowtg", (3, 700)), ("rowsimd", (50, 20))):
        logits = rng.normal(0.0, 2.0, (n, c))
        labels = rng.integers(0, c, n)
        runs = [run_and_compare(emu, ref, logits=logits, labels=labels, gamma=2.0,
                                label_smoothing=0.1, variant=variant, max_threads=128,
                                executor=ex) for ex in ("fibers", "threads")]
        assert np.array_equal(runs[0][0].raw_output, runs[1][0].raw_output)
        assert np.array_equal(runs[0][1].raw_output, runs[1][1].raw_output)


# ------------------------------------------------------------------------------------------
# Row statistics from the forward, and the forward that writes a reduced loss's gradient
# ------------------------------------------------------------------------------------------

# (label kind, gamma, label smoothing, class weights?, ignore_class?)
FUSED_OPTIONS = {
    "plain": ("int32", 0.0, 0.0, False, False),
    "smoothed": ("int32", 0.0, 0.1, False, False),
    "focal": ("int64", 2.0, 0.0, False, True),
    "weighted": ("int32", 0.0, 0.0, True, False),
    "focal_smoothed_weighted": ("int64", 0.5, 0.2, True, True),
    "dense": ("dense", 1.0, 0.1, False, False),
    # cross-entropy whose W and S come from the log-sum-exp walk
    "smoothed_weighted": ("int64", 0.0, 0.2, True, True),
    "dense_cross_entropy": ("dense", 0.0, 0.1, True, False),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("variant, num_classes", [("rowtg", 1000), ("rowsimd", 33),
                                                  ("rowtg", 5), ("rowsimd", 1)])
@pytest.mark.parametrize("options", sorted(FUSED_OPTIONS))
def test_emulated_row_stats_and_scaled_gradient(emu, ref, dtype, variant, num_classes, options):
    """The forward's row_stats hold (max, log_sum, 1/sum) as the CPU's do; the gradient given
    them is bitwise the gradient that found them itself; the forward given row_scales writes
    row_scales * d loss / d z beside a loss bitwise equal to the plain forward's."""
    label_kind, gamma, eps, weighted, ignored = FUSED_OPTIONS[options]
    n, c = 12, num_classes
    rng = _rng("fused", dtype, variant, c, options)
    logits = rng.normal(0.0, 3.0, (n, c))
    logits[1, 0] = 12.0  # a confident row (the reference still resolves 1 - p)
    labels = _labels(label_kind, rng, n, c)
    ignore_class = None
    if ignored:
        ignore_class = int(labels[3])
    weights = rng.uniform(0.2, 2.0, c).astype(np.float32) if weighted else None
    z_store, z, y_store, y_ref = _stored_inputs(logits, labels, label_kind, dtype)
    kw = dict(gamma=gamma, label_smoothing=eps, class_weights=weights, ignore_class=ignore_class)
    common = dict(logits=z_store, labels=y_store, dtype=dtype, label_kind=label_kind,
                  variant=variant, **kw)
    scales = rng.uniform(0.1, 2.0, n).astype(np.float32)
    upstream = mb.storage(scales, dtype)

    plain = emu.run(direction="forward", **common)
    fused = emu.run(direction="forward", row_stats=True, row_scales=scales, **common)
    assert plain.ok and fused.ok, plain.error + fused.error
    assert np.array_equal(plain.raw_output, fused.raw_output)  # the loss does not change
    stats = fused.row_stats
    valid = np.ones(n, bool) if ignore_class is None else labels != ignore_class
    assert (stats[~valid] == 0).all()
    shifted = np.exp(z[valid] - z[valid].max(axis=1, keepdims=True)).sum(axis=1)
    assert np.array_equal(stats[valid, 0], z[valid].max(axis=1).astype(np.float32))
    assert np.allclose(stats[valid, 1], np.log(shifted), rtol=1e-6, atol=1e-7)
    assert np.allclose(stats[valid, 2], 1.0 / shifted, rtol=1e-6)

    found = emu.run(direction="gradient", upstream=upstream, **common)
    given = emu.run(direction="gradient", upstream=upstream, row_stats=stats, **common)
    assert found.ok and given.ok, found.error + given.error
    assert np.array_equal(found.raw_output, given.raw_output, equal_nan=True)
    tag = f"{options} [{fused.kernel_name}]"
    expected = ref.custom_loss_grad(y_ref, z, upstream=scales.astype(np.float64), **kw)
    assert_grad_close(fused.scaled_gradient, expected, dtype, tag + " scaled gradient")
    if dtype == "float32":  # the same scale in both: the same bits
        assert np.array_equal(fused.scaled_gradient, found.output)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("variant, num_classes, max_threads", [
    ("rowtg", 3000, 128),  # 4 SIMD-groups per row, 23-24 classes a thread
    ("rowtg", 40, 1024),   # 1 SIMD-group, 1-2 classes a thread
    ("rowsimd", 200, 1024),  # lane groups of 32
    ("rowsimd", 33, 1024),   # lane groups of 8, four rows per SIMD-group
    ("rowsimd", 7, 1024),    # one lane a row: nothing shared
])
@pytest.mark.parametrize("options", sorted(FUSED_OPTIONS))
def test_emulated_gradient_written_over_the_logits_equals_the_separate_one(
        emu, dtype, variant, num_classes, max_threads, options):
    """On a Mac TensorFlow may forward the logits' buffer to the gradient the kernel writes (the
    reduced forward's scaled gradient, as the CPU does), so the kernel then writes a row's
    gradient over its own logits. Every thread of a row must have read each logit it needs
    (its own classes in every pass, and the label's logit, which all threads of a sparse row
    read) before any thread of the row writes there. The emulator's fibers run a thread from one
    synchronization point to the next before the next thread starts, so a read that is not
    ordered before another thread's write sees the gradient instead of the logit: the aliased
    run then differs from the run with a separate gradient buffer, which it must equal bit for
    bit (loss, row_stats and gradient), bad and ignored rows included."""
    label_kind, gamma, eps, weighted, ignored = FUSED_OPTIONS[options]
    n, c = 12, num_classes
    rng = _rng("alias", dtype, variant, c, options)
    logits = rng.normal(0.0, 3.0, (n, c))
    logits[1, 0] = 12.0
    labels = _labels(label_kind, rng, n, c)
    ignore_class = None
    if ignored:
        ignore_class = int(labels[3])
    if label_kind != "dense":
        labels[5] = c + 2  # a bad row: NaN, written without reading
    weights = rng.uniform(0.2, 2.0, c).astype(np.float32) if weighted else None
    z_store, _, y_store, _ = _stored_inputs(logits, labels, label_kind, dtype)
    scales = rng.uniform(0.1, 2.0, n).astype(np.float32)
    common = dict(logits=z_store, labels=y_store, dtype=dtype, label_kind=label_kind,
                  variant=variant, max_threads=max_threads, gamma=gamma, label_smoothing=eps,
                  class_weights=weights, ignore_class=ignore_class)

    separate = emu.run(direction="forward", row_stats=True, row_scales=scales, **common)
    aliased = emu.run(direction="forward", row_stats=True, row_scales=scales, alias=True,
                      **common)
    assert separate.ok and aliased.ok, separate.error + aliased.error
    assert aliased.variant == variant and "scaled_gradient" in aliased.bindings
    tag = f"{options} [{aliased.kernel_name}, C={c}]"
    assert np.array_equal(aliased.raw_output, separate.raw_output, equal_nan=True), tag + " loss"
    assert np.array_equal(aliased.row_stats, separate.row_stats, equal_nan=True), tag
    assert np.array_equal(aliased.scaled_gradient, separate.scaled_gradient, equal_nan=True), (
        tag + " scaled gradient: rows " +
        str(np.unique(np.argwhere(aliased.scaled_gradient != separate.scaled_gradient)[:, 0])))
    assert np.array_equal(mb.as_float64(z_store, dtype), mb.as_float64(
        np.asarray(z_store), dtype))  # the caller's logits were not written

    # The gradient op over the logits' memory too (with and without the forward's row_stats).
    upstream = mb.storage(scales, dtype)
    for stats in (None, separate.row_stats):
        own = emu.run(direction="gradient", upstream=upstream, row_stats=stats, **common)
        over = emu.run(direction="gradient", upstream=upstream, row_stats=stats, alias=True,
                       **common)
        assert own.ok and over.ok, own.error + over.error
        assert np.array_equal(over.output, own.output, equal_nan=True), (
            f"{tag} gradient op (row_stats given: {stats is not None})")


def test_emulated_alias_needs_a_gradient_to_write(emu):
    z = mb.storage(np.zeros((2, 3)), "float32")
    with pytest.raises(ValueError, match="alias needs a gradient to write"):
        emu.run(direction="forward", logits=z, labels=np.zeros(2, np.int32), alias=True)


def test_emulated_row_stats_make_the_gradient_skip_the_logits_it_does_not_need(emu):
    """Given row_stats, a plain cross-entropy gradient never needs the row's maximum: a
    logits buffer whose entries all changed by a constant gives the same gradient only if the
    kernel took max and log_sum from the stats (the log-sum-exp pass would shift them)."""
    rng = _rng("skip")
    n, c = 4, 300
    logits = rng.normal(0.0, 1.0, (n, c)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32)
    fwd = emu.run(direction="forward", logits=logits, labels=labels, row_stats=True)
    stats = fwd.row_stats.copy()
    up = np.ones(n, np.float32)
    base = emu.run(direction="gradient", logits=logits, labels=labels, upstream=up,
                   row_stats=stats)
    stats[:, 0] += 1.0  # as if every logit had been 1 larger in the forward
    moved = emu.run(direction="gradient", logits=logits, labels=labels, upstream=up,
                    row_stats=stats)
    # p_j = exp(z_j - max - log_sum): one less in the exponent, e times smaller
    ratio = moved.output / base.output
    off_label = np.ones((n, c), bool)
    off_label[np.arange(n), labels] = False
    assert np.allclose(ratio[off_label], np.exp(-1.0), rtol=1e-5)


@pytest.mark.parametrize("num_classes", [300, 40])
@pytest.mark.parametrize("options", ["plain", "smoothed", "focal", "dense"])
def test_emulated_row_stats_and_the_cpu_kernels_take_each_others(emu, options, num_classes):
    """The Metal forward's row_stats are the CPU forward's (same definition), so either
    backend's gradient can take the other's: each gradient given the other backend's stats
    agrees with itself given its own."""
    import tensorflow as tf  # noqa: PLC0415 (the CPU op; the rest of this file needs no TF)
    from raw_ops import NO_WEIGHTS, forward, gradient  # noqa: PLC0415

    label_kind, gamma, eps, _, _ = FUSED_OPTIONS[options]
    n, c = 16, num_classes
    rng = _rng("cpu-stats", options, c)
    logits = rng.normal(0.0, 3.0, (n, c)).astype(np.float32)
    labels = _labels(label_kind, rng, n, c)
    labels = (labels.astype(np.float32) if label_kind == "dense"
              else labels.astype(np.int32 if label_kind == "int32" else np.int64))
    upstream = rng.uniform(0.5, 2.0, n).astype(np.float32)
    common = dict(logits=logits, labels=labels, label_kind=label_kind, gamma=gamma,
                  label_smoothing=eps)
    metal = emu.run(direction="forward", row_stats=True, **common)
    assert metal.ok, metal.error
    attrs = dict(gamma=gamma, label_smoothing=eps, has_ignore_class=False, ignore_class=0)
    _, cpu_stats, _ = forward(tf.constant(logits), tf.constant(labels), **attrs)
    cpu_stats = cpu_stats.numpy()
    assert cpu_stats.shape == metal.row_stats.shape
    assert np.array_equal(cpu_stats[:, 0], metal.row_stats[:, 0])
    np.testing.assert_allclose(metal.row_stats[:, 1:], cpu_stats[:, 1:], rtol=2e-6, atol=1e-7)

    def cpu_gradient(stats):
        return gradient(tf.constant(logits), tf.constant(labels), NO_WEIGHTS,
                        tf.constant(upstream), tf.constant(stats), **attrs).numpy()

    def metal_gradient(stats):
        run = emu.run(direction="gradient", upstream=upstream, row_stats=stats, **common)
        assert run.ok, run.error
        return run.output

    scale = np.abs(cpu_gradient(cpu_stats)).max()
    for own, other in ((cpu_gradient(cpu_stats), cpu_gradient(metal.row_stats)),
                       (metal_gradient(metal.row_stats), metal_gradient(cpu_stats))):
        np.testing.assert_allclose(other, own, rtol=2e-5, atol=5e-6 * scale)


# ------------------------------------------------------------------------------------------
# Every kernel the plan can name exists, and plan <-> kernel signatures agree
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("label_kind", ["int32", "int64", "dense"])
def test_emulated_every_planned_kernel_is_instantiated(emu, ref, dtype, label_kind):
    rng = _rng("all", dtype, label_kind)
    logits = rng.normal(0.0, 1.0, (6, 5))
    labels = _labels(label_kind, rng, 6, 5)
    for variant in ("rowtg", "rowsimd"):
        run_and_compare(emu, ref, logits=logits, labels=labels, label_kind=label_kind,
                        dtype=dtype, gamma=1.0, label_smoothing=0.1, variant=variant)


def test_msl_launch_plan_geometry_and_bindings(emu):
    def plan(n, c, direction="forward", **kw):
        run = emu.run(direction=direction, logits=np.zeros((0, 0), np.float32), labels=None,
                      plan_only=True, num_rows=n, num_classes=c, **kw)
        assert run.ok, run.error
        return run

    common = ["logits", "labels", "class_weights", "params", "error_record", "output"]
    fwd = plan(10, 50)
    assert fwd.bindings == common + ["row_scales", "row_stats", "scaled_gradient"]
    grad = plan(10, 50, "gradient")
    assert grad.bindings == common + ["upstream", "row_stats"]
    # A threadgroup per row: 5 floats of scratch per SIMD-group (the loss and G side by side).
    # (1000 classes: 16 per thread -> 64 threads, 2 SIMD-groups; rounded up to 16 bytes.)
    assert plan(10, 1000).threads_per_threadgroup == (64, 1, 1)
    assert plan(10, 1000).threadgroup_memory_length == 48
    # C <= 256: lane groups; above: a threadgroup per row.
    assert plan(10, 256).variant == "rowsimd" and plan(10, 257).variant == "rowtg"
    assert plan(10, 256).threadgroup_memory_length == 0
    # A huge batch folds its threadgroups into x and y, never past 65535 in x.
    big = plan(200_000, 1000)
    gx, gy, gz = big.threadgroups_per_grid
    assert gx <= 65535 and gz == 1 and gx * gy >= 200_000 > gx * (gy - 1)
    big = plan(20_000_000, 3)
    gx, gy, _ = big.threadgroups_per_grid
    assert gx <= 65535 and gx * gy * big.rows_per_threadgroup >= 20_000_000
    # A large C gets 512 threads a row, or fewer when the pipeline allows fewer.
    assert plan(8, 262144).threads_per_threadgroup == (512, 1, 1)
    assert plan(8, 262144, max_threads=384).threads_per_threadgroup == (384, 1, 1)
    assert plan(8, 262144, simd_width=64).threads_per_threadgroup == (512, 1, 1)
    # N = 0: a valid plan with nothing to dispatch.
    empty = plan(0, 7)
    assert not empty.dispatched and empty.threadgroups_per_grid == (0, 0, 0)


@pytest.mark.parametrize("bad, message", [
    (dict(num_classes=0), "num_classes"),
    (dict(num_rows=-1), "num_rows"),
    (dict(num_rows=2**31), "num_rows"),
    (dict(simd_width=0), "threadExecutionWidth"),
    (dict(simd_width=24), "threadExecutionWidth"),
    (dict(max_threads=16), "maxTotalThreadsPerThreadgroup"),
    (dict(gamma=-1.0), "gamma"),
    (dict(gamma=float("inf")), "gamma"),
    (dict(label_smoothing=1.5), "label_smoothing"),
])
def test_msl_launch_plan_rejects_what_cannot_launch(emu, bad, message):
    kw = dict(num_rows=4, num_classes=10)
    kw.update(bad)
    run = emu.run(direction="forward", logits=np.zeros((0, 0), np.float32), labels=None,
                  plan_only=True, **kw)
    assert not run.ok and message in run.error, run.error


def _macro_values(path: Path, prefix: str) -> dict:
    return {m.group(1): int(m.group(2)) for m in
            re.finditer(rf"#define ({prefix}\w+) (\d+)", path.read_text())}


def test_msl_kernel_signatures_bind_buffers_by_position():
    """The emulator binds [[buffer(i)]] to the i-th argument and the thread attributes in
    TFMO_KERNEL_THREAD_ARGS order: check the kernels and the emulator's ThreadIds say so."""
    header = (REPO / "kernels" / "custom_loss.h").read_text()
    indices = _macro_values(REPO / "kernels" / "custom_loss_params.h", "TFMO_BUFFER_")
    kernels = re.findall(r"\[\[kernel\]\] void (\w+)\((.*?)\)\s*\{", header, re.S)
    assert {k for k, _ in kernels} == {f"custom_loss_{d}_{v}" for d in ("forward", "gradient")
                                       for v in ("rowtg", "rowsimd")}
    for name, params in kernels:
        buffers = re.findall(r"\[\[buffer\((\w+)\)\]\]", params)
        assert [indices[b] for b in buffers] == list(range(len(buffers))), name
        assert params.rstrip().endswith("TFMO_KERNEL_THREAD_ARGS"), name
        has_scratch = "TFMO_THREADGROUP_ARG" in params
        assert has_scratch == name.endswith("rowtg"), name
        if has_scratch:  # right after the buffers
            assert params.index("TFMO_THREADGROUP_ARG") > params.rindex("[[buffer(")
    macro = re.search(r"#define TFMO_KERNEL_THREAD_ARGS(.*?)\n\n", header, re.S).group(1)
    kernel_order = re.findall(r"\[\[(\w+)\]\]", macro)
    runtime = (REPO / "csrc" / "emulator" / "msl_host_runtime.h").read_text()
    ids = re.search(r"struct ThreadIds \{(.*?)\};", runtime, re.S).group(1)
    emulator_order = re.findall(r"// \[\[(\w+)\]\]", ids)
    assert kernel_order == emulator_order and len(kernel_order) == 8


def test_msl_params_layout_matches_host_static_asserts():
    """The MSL struct and the host's static_asserts describe the same offsets."""
    text = (REPO / "kernels" / "custom_loss_params.h").read_text()
    body = re.search(r"struct CustomLossParams \{(.*?)\};", text, re.S).group(1)
    sizes = {"tfmo_u32": 4, "tfmo_i32": 4, "float": 4, "tfmo_i64": 8}
    offset = 0
    expected = {}
    for type_name, field in re.findall(r"^\s*(tfmo_u32|tfmo_i32|tfmo_i64|float) (\w+);", body,
                                       re.M):
        size = sizes[type_name]
        assert offset % size == 0, f"{field} is misaligned"
        expected[field] = offset
        offset += size
    asserted = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"offsetof\(CustomLossParams, (\w+)\) == (\d+)", text)}
    assert asserted == expected
    assert f"sizeof(CustomLossParams) == {offset}" in text and offset % 8 == 0


# ------------------------------------------------------------------------------------------
# The emulator refuses kernels that break Metal's synchronization rules
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("executor", ["fibers", "threads"])
def test_emulator_rejects_broken_synchronization(emu, executor):
    error, out = emu.run_raw("example_reduced_threadgroup_sum", threads=64, groups=2,
                             threadgroup_bytes=256, executor=executor)
    assert error == "" and list(out) == [64.0, 64.0]
    error, _ = emu.run_raw("example_early_return_before_barrier", threads=64, groups=1,
                           threadgroup_bytes=256, executor=executor)
    assert "returned before reaching it" in error
    error, _ = emu.run_raw("example_divergent_simd_sum", threads=32, groups=1,
                           threadgroup_bytes=16, executor=executor)
    assert "deadlock" in error or "divergent" in error
    error, _ = emu.run_raw("tfmo_custom_loss_forward_rowtg_f32_i32", threads=32, groups=1,
                           threadgroup_bytes=16, executor=executor)
    assert "buffer/threadgroup arguments" in error  # signature / binding mismatch is caught
