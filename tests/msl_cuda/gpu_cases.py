"""The correctness matrix of the Metal kernels on an NVIDIA GPU (this file itself needs no GPU).

    python gpu_cases.py write DIR    # one case directory per launch, with the float64 reference
    tfmo_cuda_main cases CUBIN DIR/*  # (run_on_gpu.sh) the kernels write output.bin there
    python gpu_cases.py check DIR    # compare; prints one line per failure and a summary

The matrix follows `python -m tf_metal_ops check` (tf_metal_ops/tools/checks.py: C = 1, odd C, 50257,
masked -inf classes, |z| ~ 1e4, confident rows, ignore_class, a NaN row) and the emulator tests
(tests/test_msl_emulator.py: all -inf / +inf rows, ties, bad labels and the error record), with
C = 262144 and a grid folded into two dimensions added, for every kernel variant (rowtg,
rowsimd), logits dtype (float32, float16, bfloat16) and label kind (int32, int64, dense) the
case applies to. Reference: tf_metal_ops/reference.py in float64 on the values the kernel read
(16-bit inputs rounded first); tolerances and the NaN / inf rules are the emulator tests'.
"""

from __future__ import annotations

import json
import sys
import warnings
import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "msl_host"))
import msl_build as mb  # noqa: E402
import test_msl_emulator as emu_tests  # noqa: E402  (tolerances and comparisons)


def load_reference():
    return mb.load_package_file("reference.py", "tfmo_reference")


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------------------------------
# The cases: (name, rows, classes, logits maker, params, which label kinds and dtypes)


def _normal(scale: float) -> Callable:
    return lambda rng, n, c, y: rng.normal(0.0, scale, (n, c))


def _extreme(rng, n, c, y):
    return rng.uniform(-1e4, 1e4, (n, c))  # exp underflows for all but the row max


def _masked(rng, n, c, y):
    z = rng.normal(0.0, 2.0, (n, c))
    mask = rng.random((n, c)) < 0.35
    mask[np.arange(n), y] = False
    mask[0, :] = True                                 # only the target finite (p_y = 1)
    mask[0, y[0]] = False
    z = np.where(mask, -np.inf, z)
    z[1, : c // 2] = -np.inf                          # an all -inf prefix
    z[1, y[1]] = 1.0
    z[2, :] = -np.inf                                 # no finite logit: NaN row
    z[3, c // 3] = np.inf                             # +inf: undefined softmax, NaN row
    z[4, :] = 0.0                                     # all ties
    return z


def _confident(rng, n, c, y):
    z = rng.normal(0.0, 1.0, (n, c))
    z[np.arange(n), y] = 30.0 + np.arange(n)          # p_y within ~1e-13 of 1
    return z


def _nan_row(rng, n, c, y):
    z = rng.normal(0.0, 2.0, (n, c))
    z[1, c // 2] = np.nan
    return z


ALL_KINDS = ("int32", "int64", "dense")
SPARSE = ("int32", "int64")
ALL_DTYPES = ("float32", "float16", "bfloat16")

CASES: List[dict] = [
    dict(name="C=1", n=5, c=1, logits=_normal(2.0), gamma=2.0),
    dict(name="odd C=31, class weights", n=37, c=31, logits=_normal(2.0), gamma=0.5,
         weights=True),
    dict(name="odd C=33, focal + smoothing", n=37, c=33, logits=_normal(2.0), gamma=2.0,
         smoothing=0.1),
    dict(name="C=1000", n=37, c=1000, logits=_normal(2.0), gamma=2.0, smoothing=0.1),
    dict(name="C=1000, plain cross-entropy", n=37, c=1000, logits=_normal(3.0)),
    dict(name="plain cross-entropy, masked -inf, NaN/inf rows, ties", n=12, c=300,
         logits=_masked, kinds=SPARSE),
    dict(name="C=50257", n=3, c=50257, logits=_normal(2.0), smoothing=0.1),
    dict(name="C=262144", n=2, c=262144, logits=_normal(2.0), gamma=1.0, smoothing=0.1),
    dict(name="masked -inf, NaN/inf rows, ties", n=12, c=300, logits=_masked, gamma=1.5,
         smoothing=0.3),
    dict(name="masked -inf, no smoothing", n=12, c=45, logits=_masked, gamma=2.0),
    dict(name="extreme logits |z|~1e4", n=8, c=17, logits=_extreme, gamma=3.7, smoothing=0.1),
    dict(name="confident rows, gamma=0.5", n=9, c=260, logits=_confident, gamma=0.5,
         smoothing=0.05),
    dict(name="NaN in one row", n=4, c=6, logits=_nan_row, gamma=2.0),
    dict(name="ignore_class=-100", n=10, c=7, logits=_normal(2.0), gamma=2.0, ignore=-100,
         kinds=SPARSE),
    dict(name="ignore_class=7 in range, weights", n=41, c=45, logits=_normal(2.0), gamma=2.0,
         smoothing=0.1, ignore=7, weights=True, kinds=SPARSE),
    dict(name="partial last threadgroup", n=1000, c=10, logits=_normal(2.0), gamma=1.0),
    # gamma = 0 with several weighted classes: W and S from the log-sum-exp walk
    dict(name="cross-entropy, masked -inf, NaN/inf rows, smoothing", n=12, c=300,
         logits=_masked, smoothing=0.3),
    dict(name="cross-entropy, |z|~1e4, smoothing, weights", n=8, c=17, logits=_extreme,
         smoothing=0.1, weights=True),
    dict(name="cross-entropy, confident rows, smoothing", n=9, c=260, logits=_confident,
         smoothing=0.05),
    dict(name="cross-entropy, C=40000, smoothing", n=3, c=40000, logits=_normal(2.0),
         smoothing=0.1, kinds=SPARSE),
    dict(name="cross-entropy, C=262144, smoothing, weights", n=2, c=262144,
         logits=_normal(2.0), smoothing=0.1, weights=True),
    dict(name="grid folded into y", n=70000, c=3, logits=_normal(2.0), kinds=("int32",),
         dtypes=("float32",)),
]

BAD_LABELS = dict(name="bad labels -> error record", n=23, c=70)


def _labels(kind: str, rng, n: int, c: int, y: np.ndarray) -> np.ndarray:
    if kind == "dense":
        t = rng.uniform(0.0, 1.0, (n, c)) ** 3
        return t / t.sum(axis=1, keepdims=True)
    return y.astype(np.int32 if kind == "int32" else np.int64)


def numpy_row_stats(z64: np.ndarray) -> np.ndarray:
    """(max, log sum exp(z - max), 1 / sum exp(z - max)) per row, float32: what a forward writes
    into row_stats (csrc/problem.h), computed here in float64 as a gradient's input."""
    with np.errstate(all="ignore"):
        m = z64.max(axis=1)
        s = np.exp(z64 - m[:, None]).sum(axis=1)
        return np.stack([m, np.log(s), 1.0 / s], axis=1).astype(np.float32)


# The launches of one case: a plain forward and gradient; the forward that also writes
# row_stats and, given row_scales, the scaled gradient ("fused"); the gradient that reads
# row_stats instead of finding the log-sum-exp itself ("stats").
LAUNCHES = (("forward", "plain"), ("gradient", "plain"), ("forward", "fused"),
            ("gradient", "stats"))


def _write(directory: Path, fields: dict, arrays: dict, meta: dict, expected) -> None:
    mb.write_case_dir(directory, fields, arrays)
    (directory / "meta.json").write_text(json.dumps(meta))
    if expected is not None:
        np.save(directory / "expected.npy", expected)


def _form(kind: str, fields: dict) -> str:
    """The suffix of the kernel the launch plan runs (csrc/metal/launch_plan.cc, KernelName):
    "_plain" for sparse labels, gamma 0, no label smoothing (eps / C is 0 in float), no class
    weights; "_smoothed" for the same with smoothing; "" (a general kernel) otherwise."""
    if kind == "dense" or fields["gamma"] != 0.0 or fields["has_class_weights"]:
        return ""
    smooth_off = np.float32(fields["label_smoothing"] / fields["num_classes"])
    return "_plain" if smooth_off == 0.0 else "_smoothed"



def write_cases(root: Path) -> int:
    ref = load_reference()
    root.mkdir(parents=True, exist_ok=True)
    count = 0
    warnings.simplefilter("ignore", RuntimeWarning)  # the reference's log(0) and inf - inf
    for ci, case in enumerate(CASES):
        for dtype in case.get("dtypes", ALL_DTYPES):
            for kind in case.get("kinds", ALL_KINDS):
                rng = _rng(case["name"], dtype, kind)
                n, c = case["n"], case["c"]
                y = rng.integers(0, c, n)
                if "ignore" in case:
                    y[::3] = case["ignore"] if 0 <= case["ignore"] < c else 0
                z = case["logits"](rng, n, c, y)
                labels = _labels(kind, rng, n, c, y)
                if "ignore" in case and not 0 <= case["ignore"] < c:
                    labels[::3] = case["ignore"]
                weights = None
                if case.get("weights"):
                    weights = rng.uniform(0.0, 2.0, c).astype(np.float32)
                    weights[::4] = 0.0
                upstream = rng.uniform(-2.0, 2.0, n)
                z_store = mb.storage(z, dtype)
                y_store = mb.storage(labels, dtype) if kind == "dense" else labels
                u_store = mb.storage(upstream, dtype)
                y_ref = mb.as_float64(y_store, dtype) if kind == "dense" else labels
                kw = dict(gamma=float(np.float32(case.get("gamma", 0.0))),
                          label_smoothing=float(np.float32(case.get("smoothing", 0.0))),
                          class_weights=None if weights is None else weights.astype(np.float64),
                          ignore_class=case.get("ignore"))
                z64 = mb.as_float64(z_store, dtype)
                scales = rng.uniform(0.1, 2.0, n).astype(np.float32)
                stats = numpy_row_stats(z64)
                expected = {
                    "forward": ref.custom_loss(y_ref, z64, **kw),
                    "gradient": ref.custom_loss_grad(y_ref, z64, upstream=mb.as_float64(
                        u_store, dtype), **kw),
                    "scaled": ref.custom_loss_grad(y_ref, z64, upstream=scales.astype(
                        np.float64), **kw),
                }
                if kind != "dense" and "ignore" in case:
                    stats_rows = labels != case["ignore"]
                else:
                    stats_rows = np.ones(n, bool)
                for variant in ("rowtg", "rowsimd"):
                    for direction, launch in LAUNCHES:
                        fields = dict(
                            num_rows=n, num_classes=c, dtype=mb.DTYPES[dtype],
                            label_kind=mb.LABEL_KINDS[kind], direction=mb.DIRECTIONS[direction],
                            variant=mb.VARIANTS[variant], gamma=case.get("gamma", 0.0),
                            label_smoothing=case.get("smoothing", 0.0),
                            has_class_weights=int(weights is not None),
                            has_ignore_class=int("ignore" in case),
                            ignore_class=case.get("ignore", 0), max_threads=1024, simd_width=32,
                            has_row_stats=int(launch != "plain"),
                            has_row_scales=int(launch == "fused"))
                        arrays = dict(logits=z_store, labels=y_store, class_weights=weights,
                                      upstream=u_store if direction == "gradient" else None,
                                      row_scales=scales if launch == "fused" else None,
                                      row_stats=stats if launch == "stats" else None)
                        meta = dict(case=case["name"], dtype=dtype, kind=kind, variant=variant,
                                    direction=direction, launch=launch, n=n, c=c, bad={},
                                    form=_form(kind, fields))
                        directory = root / f"c{ci:02d}_{dtype}_{kind}_{variant}_{direction}_{launch}"
                        _write(directory, fields, arrays, meta, expected[direction])
                        if launch == "fused":
                            np.save(directory / "expected_scaled.npy", expected["scaled"])
                            np.save(directory / "expected_stats.npy", stats)
                            np.save(directory / "stats_rows.npy", stats_rows)
                        count += 1
    # Bad labels: NaN rows, the error record (count, lowest row, a consistent (row, label) pair),
    # the good rows still right; ignore_class = -1 is not an error.
    for kind, options in [(k, o) for k in SPARSE for o in ("general", "plain", "smoothed")]:
        rng = _rng("bad", kind)
        n, c = BAD_LABELS["n"], BAD_LABELS["c"]
        z = rng.normal(0.0, 2.0, (n, c))
        y = rng.integers(0, c, n)
        good_y = y.copy()
        bad = {4: -3, 9: c, 17: c + 1000}
        if kind == "int64":
            bad[20] = 2**40 + 5
        for row, value in bad.items():
            y[row] = value
        y[1] = -1                                     # ignore_class: loss 0, not an error
        good_y[1] = 0
        labels = y.astype(np.int32 if kind == "int32" else np.int64)
        gamma, eps = {"general": (1.0, 0.1), "plain": (0.0, 0.0), "smoothed": (0.0, 0.1)}[options]
        kw = dict(gamma=gamma, label_smoothing=float(np.float32(eps)))
        z_store = mb.storage(z, "float32")
        z64 = mb.as_float64(z_store, "float32")
        upstream = np.ones(n, np.float32)
        expected = {"forward": ref.custom_loss(good_y, z64, **kw),
                    "gradient": ref.custom_loss_grad(good_y, z64, **kw)}
        expected["forward"][1] = 0.0
        expected["gradient"][1] = 0.0
        for variant in ("rowtg", "rowsimd"):
            for direction in ("forward", "gradient"):
                fields = dict(num_rows=n, num_classes=c, dtype=0, label_kind=mb.LABEL_KINDS[kind],
                              direction=mb.DIRECTIONS[direction], variant=mb.VARIANTS[variant],
                              gamma=gamma, label_smoothing=eps, has_class_weights=0,
                              has_ignore_class=1, ignore_class=-1, max_threads=1024,
                              simd_width=32)
                arrays = dict(logits=z_store, labels=labels, class_weights=None,
                              upstream=upstream if direction == "gradient" else None)
                meta = dict(case=f"{BAD_LABELS['name']}, {options}", dtype="float32", kind=kind,
                            variant=variant, direction=direction, n=n, c=c,
                            bad={str(k): v for k, v in bad.items()},
                            form=_form(kind, fields))
                _write(root / f"bad_{kind}_{options}_{variant}_{direction}", fields, arrays, meta,
                       expected[direction])
                count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Checking what the kernels wrote


def _read_output(directory: Path, meta: dict) -> np.ndarray:
    raw = (directory / "output.bin").read_bytes()
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[meta["dtype"]]
    stored = np.frombuffer(raw, dtype=np_dtype)
    shape = (meta["n"],) if meta["direction"] == "forward" else (meta["n"], meta["c"])
    return mb.as_float64(stored, meta["dtype"]).reshape(shape)


def _check_fused_extras(directory: Path, meta: dict) -> None:
    """A fused forward's row_stats and scaled gradient (AssertionError when wrong)."""
    n, c = meta["n"], meta["c"]
    for name in ("row_stats_out.bin", "scaled_gradient.bin"):
        assert (directory / name).exists(), f"no {name}"
    stats = np.frombuffer((directory / "row_stats_out.bin").read_bytes(),
                          np.float32).reshape(n, 3)
    want = np.load(directory / "expected_stats.npy")
    rows = np.load(directory / "stats_rows.npy")
    assert (stats[~rows] == 0).all(), "ignored rows' row_stats are not 0"
    finite = rows & np.isfinite(want[:, 0]) & np.isfinite(want[:, 1])
    assert np.array_equal(stats[finite, 0], want[finite, 0]), "row_stats max differs"
    assert np.allclose(stats[finite, 1:], want[finite, 1:], rtol=1e-5, atol=1e-7), (
        "row_stats log_sum or 1/sum differs")
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[meta["dtype"]]
    scaled = mb.as_float64(np.frombuffer((directory / "scaled_gradient.bin").read_bytes(),
                                         np_dtype), meta["dtype"]).reshape(n, c)
    _compare(scaled, np.load(directory / "expected_scaled.npy"), meta, "gradient", "scaled ")


def _compare(out, expected, meta, direction, what) -> None:
    if meta["dtype"] == "float16":
        # float16 outputs below 2^-14 are subnormal, spaced 2^-24: their rounding error
        # (up to 2^-25) can exceed the emulator tests' bound on a row of tiny gradients.
        close = np.abs(out - expected) <= 2.0**-25
        out = np.where(close, expected, out)
    if direction == "forward":
        emu_tests.assert_loss_close(out, expected, meta["dtype"], what)
    else:
        emu_tests.assert_grad_close(out, expected, meta["dtype"], what)


def check_case(directory: Path) -> Optional[str]:
    """None when the kernel's output matches; otherwise what is wrong."""
    meta = json.loads((directory / "meta.json").read_text())
    if not (directory / "output.bin").exists():
        return "no output (the case did not run)"
    out = _read_output(directory, meta)
    expected = np.load(directory / "expected.npy")
    record = np.frombuffer((directory / "error_record.bin").read_bytes(), dtype=np.uint32)
    bad = {int(k): v for k, v in meta["bad"].items()}
    try:
        if bad:
            assert record[0] == len(bad), f"bad_label_count {record[0]} != {len(bad)}"
            assert record[1] == min(bad), f"min_bad_row {record[1]} != {min(bad)}"
            assert record[2] == 1, "no claimed detail"
            label = int(np.array(record[4:6], dtype=np.uint32).view(np.int64)[0])
            assert bad.get(int(record[3])) == label, f"claimed ({record[3]}, {label}) inconsistent"
            rows = np.array([r in bad for r in range(meta["n"])])
            assert np.isnan(out[rows]).all(), "bad-label rows are not NaN"
            out, expected = out[~rows], expected[~rows]
        else:
            assert record[0] == 0 and record[2] == 0, f"unexpected error record {record.tolist()}"
            assert record[1] == 0xFFFFFFFF, "min_bad_row changed without a bad label"
        _compare(out, expected, meta, meta["direction"], "")
        if meta.get("launch") == "fused":
            _check_fused_extras(directory, meta)
    except AssertionError as e:
        return " ".join(str(e).split())[:300]
    return None


def check_cases(root: Path) -> int:
    warnings.simplefilter("ignore", RuntimeWarning)  # NaN - NaN in the comparisons
    dirs = sorted(p for p in root.iterdir() if (p / "meta.json").exists())
    failures = 0
    kernels = set()
    for d in dirs:
        problem = check_case(d)
        plan = (d / "plan.txt").read_text().split() if (d / "plan.txt").exists() else []
        if len(plan) > 1:
            kernels.add(plan[1])
            form = json.loads((d / "meta.json").read_text()).get("form")
            if problem is None and form is not None and mb.kernel_form(plan[1]) != form:
                problem = f"ran {plan[1]}, expected a {form.strip('_') or 'general'} kernel"
        if problem is not None:
            failures += 1
            print(f"FAIL {d.name}: {problem}")
    plain = sum(mb.kernel_form(k) == "_plain" for k in kernels)
    smoothed = sum(mb.kernel_form(k) == "_smoothed" for k in kernels)
    print(f"{len(dirs)} launches checked against the float64 reference, {failures} failed; "
          f"{len(kernels)} distinct kernels ran ({plain} of them plain, {smoothed} smoothed)")
    return 1 if failures or not dirs else 0


def main(argv: List[str]) -> int:
    if len(argv) == 3 and argv[1] == "write":
        print(f"{write_cases(Path(argv[2]))} case directories written")
        return 0
    if len(argv) == 3 and argv[1] == "check":
        return check_cases(Path(argv[2]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
