"""The case matrix of `python -m tf_metal_ops check`: CustomLoss on every device vs the reference.

Each case is run for each selected logits dtype. For every available device, the forward loss
and the gradient with respect to the logits (times a random upstream gradient, as a training
step produces it) are compared with `tf_metal_ops.reference` in float64, evaluated on exactly
the values the op saw (logits, dense targets and upstream gradient rounded to the dtype first),
so the only differences left are the op's own rounding. With a GPU, the GPU is also compared
with the CPU. The cases cover what breaks loss kernels: C = 1, odd and large C, masked (-inf)
classes, vocabulary sizes (C up to 262144), extreme logits, confident rows with gamma < 1, soft
targets, ignored rows, leading dims, an empty batch and a NaN row (which must stay NaN on that
row only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_metal_ops import reference
from tf_metal_ops._table import format_number, format_table
from tf_metal_ops.compare import REFERENCE, DeviceComparisonReport, compare_devices

DTYPES = ("float16", "bfloat16", "float32", "float64")

# (rtol, atol) against the float64 reference evaluated on the same rounded inputs. The op
# accumulates in at least float32, so what remains is the rounding of the result to the dtype
# (half an ulp: 4.9e-4 for float16, 3.9e-3 for bfloat16) plus float32 summation noise; the
# tolerances allow about three ulps. atol covers elements that are ~0 (gradients of confident
# rows, ignored rows), where a relative error means nothing.
CHECK_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-11, 1e-13),
    "float32": (1e-5, 1e-6),
    "float16": (3e-3, 1e-4),
    "bfloat16": (2e-2, 1e-3),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the op. `logits` names how the logits are drawn (see `_logits`)."""

    name: str
    batch_shape: tuple[int, ...]
    num_classes: int
    labels: str = "int32"  # "int32", "int64" (sparse) or "dense" (soft targets)
    gamma: float = 0.0
    label_smoothing: float = 0.0
    class_weights: bool = False  # random weights in [0, 2], one of them 0
    ignore_class: int | None = None
    logits: str = "normal"  # "normal", "extreme", "masked", "confident", "nan_row"
    quick: bool = False  # part of `check --quick`

    def params(self) -> dict[str, Any]:
        """JSON-serializable description."""
        out = dataclasses.asdict(self)
        out["batch_shape"] = list(self.batch_shape)
        del out["name"], out["quick"]
        return out


CASES: tuple[Case, ...] = (
    Case("C=1", (5,), 1, gamma=2.0, quick=True),
    Case("C=2, int64 labels", (9,), 2, labels="int64", label_smoothing=0.1),
    Case("odd C=31, class weights", (6,), 31, gamma=0.5, class_weights=True, quick=True),
    Case("odd C=33, focal + smoothing", (7,), 33, gamma=2.0, label_smoothing=0.1, quick=True),
    Case("C=1000", (16,), 1000, gamma=2.0, label_smoothing=0.1),
    Case("large C=50257", (3,), 50257, label_smoothing=0.1, quick=True),
    # Vocabulary sizes, where every class carries weight: the row sums' error must not grow
    # with C (tests/test_vocabulary_scale.py holds the float32 bar).
    Case("vocabulary C=32000, class weights + smoothing", (2,), 32000, label_smoothing=0.1,
         class_weights=True),
    Case("vocabulary C=131072, focal + smoothing", (2,), 131072, gamma=2.0,
         label_smoothing=0.1),
    Case("vocabulary C=262144, dense soft targets", (2,), 262144, labels="dense", gamma=1.0,
         label_smoothing=0.1),
    Case("masked classes (-inf)", (8,), 12, gamma=2.0, label_smoothing=0.0, logits="masked",
         quick=True),
    Case("extreme logits (|z| ~ 1e4)", (8,), 17, gamma=3.7, label_smoothing=0.1,
         logits="extreme", quick=True),
    Case("confident rows, gamma=0.5", (8,), 10, gamma=0.5, label_smoothing=0.05,
         logits="confident"),
    Case("dense soft targets", (6,), 13, labels="dense", gamma=1.0, label_smoothing=0.1),
    Case("ignore_class=-100", (10,), 7, gamma=2.0, ignore_class=-100),
    Case("leading dims [2, 3]", (2, 3), 11, gamma=2.0, label_smoothing=0.1, class_weights=True),
    Case("empty batch", (0,), 5, gamma=2.0),
    Case("NaN in one row", (4,), 6, gamma=2.0, logits="nan_row", quick=True),
)


@dataclasses.dataclass
class CheckResult:
    """One case at one dtype: the device comparison, or the error that prevented it."""

    case: Case
    dtype: str
    report: DeviceComparisonReport | None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.report is not None and self.report.passed

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.case.name, "dtype": self.dtype, "params": self.case.params(),
                "passed": self.passed, "error": self.error,
                "report": None if self.report is None else self.report.to_dict()}


@dataclasses.dataclass
class CheckResults:
    """Every case of one `check` run."""

    results: list[CheckResult]
    dtypes: list[str]
    quick: bool
    devices: list[str]
    gpu_found: bool
    versions: dict[str, str]
    # tf_metal_ops.gpu_plugin's decision: which plugin provides the GPU, whether our Metal
    # kernels run there, and why.
    gpu_plugin: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def notes(self) -> list[str]:
        out = []
        if not self.gpu_found:
            out.append(f"No GPU found: TensorFlow sees only {', '.join(self.devices)}, so the "
                       f"CPU was checked against the reference; no GPU kernel was tested.")
        elif self.gpu_plugin is not None:
            where = ("our Metal kernels" if self.gpu_plugin["metal_kernels"]
                     else "the composed loss (TensorFlow ops), not our Metal kernels")
            out.append(f"GPU plugin: {self.gpu_plugin['reason']}. The GPU ran {where}.")
        moved = sorted({(device, ran) for r in self.results if r.report is not None
                        for device, ran_on in r.report.placements.items() for ran in ran_on
                        if ran != device})
        for device, ran in moved:
            dtypes = sorted({r.dtype for r in self.results if r.report is not None
                             and ran in r.report.placements.get(device, ())})
            out.append(f"Some cases requested on {device} ran on {ran} (dtypes "
                       f"{', '.join(dtypes)}): no {device} kernel for them.")
        return out

    def to_dict(self) -> dict[str, Any]:
        """The `check --json` document (schema_version 1)."""
        failed = sum(not r.passed for r in self.results)
        return {
            "schema_version": 1,
            "tool": "tf_metal_ops check",
            "verdict": "PASS" if self.passed else "FAIL",
            "passed": self.passed,
            "quick": self.quick,
            "dtypes": list(self.dtypes),
            "devices": list(self.devices),
            "gpu_found": self.gpu_found,
            "versions": dict(self.versions),
            "gpu_plugin": self.gpu_plugin,
            "tolerances": {d: {"rtol": CHECK_TOLERANCES[d][0], "atol": CHECK_TOLERANCES[d][1]}
                           for d in self.dtypes},
            "summary": {"checks": len(self.results), "passed": len(self.results) - failed,
                        "failed": failed},
            "notes": self.notes(),
            "cases": [r.to_dict() for r in self.results],
        }

    def format(self) -> str:
        """The human-readable table."""
        lines = [
            "tf_metal_ops check: CustomLoss forward + gradient vs the NumPy float64 reference",
            "versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
            f"devices: {', '.join(self.devices)}",
            "tolerances (rtol/atol): " + ", ".join(
                f"{d} {format_number(CHECK_TOLERANCES[d][0], 0)}/"
                f"{format_number(CHECK_TOLERANCES[d][1], 0)}" for d in self.dtypes),
            "",
        ]
        headers = ("case", "dtype", "compared", "ran on", "loss err abs/rel", "grad err abs/rel",
                   "NaN/Inf mism", "result")
        rows = []
        details = []
        for r in self.results:
            if r.report is None:
                rows.append([r.case.name, r.dtype, "-", "-", "-", "-", "-", "FAIL"])
                details.append(f"{r.case.name} [{r.dtype}]: {r.error}")
                continue
            pairs: dict[tuple[str, str], dict[str, Any]] = {}
            for c in r.report.comparisons:
                pairs.setdefault((c.actual, c.expected), {})[c.output] = c
            for (actual, expected), by_output in pairs.items():
                loss, grad = by_output.get("out['loss']"), by_output.get("out['grad']")
                ok = all(c.passed for c in by_output.values())
                nonfinite = sum(c.nan_mismatches + c.inf_mismatches for c in by_output.values())
                rows.append([
                    r.case.name, r.dtype, f"{actual} vs {expected}",
                    ",".join(r.report.placements.get(actual, ())) or "-",
                    _err_text(loss), _err_text(grad), str(nonfinite),
                    "PASS" if ok else "FAIL"])
                for c in by_output.values():
                    if not c.passed and c.worst_index is not None:
                        details.append(
                            f"{r.case.name} [{r.dtype}] {c.output} {actual} vs {expected}: "
                            f"{c.mismatches} out of tolerance, {c.nan_mismatches} NaN and "
                            f"{c.inf_mismatches} Inf mismatches; worst at "
                            f"{list(c.worst_index)}: got {format_number(c.worst_actual, 6)}, "
                            f"expected {format_number(c.worst_expected, 6)}")
            for device, error in r.report.errors.items():
                rows.append([r.case.name, r.dtype, f"{device} vs {REFERENCE}", "-", "-", "-",
                             "-", "FAIL"])
                details.append(f"{r.case.name} [{r.dtype}] on {device}: {error}")
        lines.append(format_table(headers, rows))
        if details:
            lines += ["", "failures:"] + [f"  {d}" for d in details]
        failed = sum(not r.passed for r in self.results)
        lines += [""] + [f"note: {n}" for n in self.notes()]
        cases = len({r.case for r in self.results})
        lines.append(f"{len(self.results)} checks ({cases} case{'s' * (cases != 1)} x "
                     f"{len(self.dtypes)} dtype{'s' * (len(self.dtypes) != 1)}): "
                     f"{len(self.results) - failed} PASS, "
                     f"{failed} FAIL -> {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(lines)


def _err_text(c: Any) -> str:
    if c is None:
        return "-"
    return f"{format_number(c.max_abs_error, 1)}/{format_number(c.max_rel_error, 1)}"


# ---------------------------------------------------------------------------------------------
# Inputs


def _logits(case: Case, rng: np.random.Generator, labels: np.ndarray | None) -> np.ndarray:
    shape = (*case.batch_shape, case.num_classes)
    z = rng.normal(0.0, 2.0, size=shape)
    if case.logits == "extreme":
        z = rng.uniform(-1e4, 1e4, size=shape)  # exp underflows for all but the row max
    elif case.logits == "masked":
        # A vocabulary mask: about a third of the classes at -inf, never the target, and one
        # row where only the target is finite (the all -inf prefix case).
        mask = rng.random(shape) < 0.35
        if labels is not None:
            np.put_along_axis(mask, labels[..., None].astype(np.int64), False, axis=-1)
            mask.reshape(-1, case.num_classes)[0, :] = True
            mask.reshape(-1, case.num_classes)[0, labels.reshape(-1)[0]] = False
        z = np.where(mask, -np.inf, z)
    elif case.logits == "confident" and labels is not None:
        np.put_along_axis(z, labels[..., None].astype(np.int64), 40.0, axis=-1)  # p ~ 1 - 1e-17
    elif case.logits == "nan_row":
        z.reshape(-1, case.num_classes)[1, 0] = np.nan
    return z


def _inputs(case: Case, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray,
                                                         np.ndarray, np.ndarray | None]:
    """(logits, labels, upstream, class_weights) as NumPy arrays in the dtypes the op gets."""
    rng = np.random.default_rng(seed)
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    c = case.num_classes
    sparse = rng.integers(0, c, size=case.batch_shape)
    if case.ignore_class is not None and sparse.size:
        sparse.reshape(-1)[::3] = case.ignore_class
    logits = _logits(case, rng, np.where(sparse == case.ignore_class, 0, sparse)
                     if case.ignore_class is not None else sparse)
    if case.labels == "dense":
        soft = rng.gamma(0.5, size=(*case.batch_shape, c))
        soft = soft / soft.sum(axis=-1, keepdims=True)
        labels = soft.astype(np_dtype)
    else:
        labels = sparse.astype(case.labels)
    upstream = rng.uniform(0.5, 1.5, size=case.batch_shape).astype(np_dtype)
    weights = None
    if case.class_weights:
        weights = rng.uniform(0.0, 2.0, size=c).astype(np.float32)
        weights[rng.integers(0, c)] = 0.0
    return logits.astype(np_dtype), labels, upstream, weights


def _make_functions(case: Case, weights: np.ndarray | None) -> tuple[Callable, Callable]:
    import tf_metal_ops  # noqa: PLC0415 - the package's public entry point, as users call it

    params = dict(gamma=case.gamma, label_smoothing=case.label_smoothing,
                  class_weights=None if weights is None else weights,
                  ignore_class=case.ignore_class)

    def on_device(logits: tf.Tensor, labels: tf.Tensor, upstream: tf.Tensor) -> dict[str, Any]:
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf_metal_ops.custom_loss(labels, logits, **params)
        grad = tape.gradient(loss, logits, output_gradients=upstream)
        return {"loss": loss, "grad": grad}

    def on_reference(logits: np.ndarray, labels: np.ndarray,
                     upstream: np.ndarray) -> dict[str, Any]:
        z = np.asarray(logits).astype(np.float64)
        y = labels if labels.dtype.kind in "iu" else np.asarray(labels).astype(np.float64)
        u = np.asarray(upstream).astype(np.float64)
        # gamma and label_smoothing reach the kernels as float32 attributes (TensorFlow's
        # "float"), so the reference gets the same rounded values; otherwise float64 results
        # would differ by ~1e-8 for parameters like 0.1 that float32 cannot hold exactly.
        ref = dict(params, gamma=float(np.float32(case.gamma)),
                   label_smoothing=float(np.float32(case.label_smoothing)),
                   class_weights=None if weights is None else weights.astype(np.float64))
        return {"loss": reference.custom_loss(y, z, **ref),
                "grad": reference.custom_loss_grad(y, z, upstream=u, **ref)}

    return on_device, on_reference


# ---------------------------------------------------------------------------------------------
# Running


def select_cases(quick: bool) -> list[Case]:
    """The whole matrix, or the `--quick` subset."""
    return [c for c in CASES if c.quick or not quick]


def run_case(case: Case, dtype: str, seed: int = 0) -> CheckResult:
    """Runs one case at one dtype on every device; errors become a failed result."""
    if dtype not in CHECK_TOLERANCES:
        raise ValueError(f"run_case: `dtype` must be one of {', '.join(DTYPES)}, got {dtype!r}")
    logits, labels, upstream, weights = _inputs(case, dtype, seed)
    on_device, on_reference = _make_functions(case, weights)
    rtol, atol = CHECK_TOLERANCES[dtype]
    try:
        # Tolerances are keyed by dtype; every output here has the logits' dtype.
        report = compare_devices(on_device, tf.constant(logits), tf.constant(labels),
                                 tf.constant(upstream), reference=on_reference,
                                 rtol={dtype: rtol}, atol={dtype: atol})
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        return CheckResult(case, dtype, None, f"{type(e).__name__}: "
                                              f"{' '.join(str(e).split())[:300]}")
    return CheckResult(case, dtype, report)


def run_checks(dtypes: Sequence[str] = DTYPES, quick: bool = False,
               progress: Callable[[int, int, str], None] | None = None) -> CheckResults:
    """Runs the case matrix for `dtypes`.

    Args:
        dtypes: Logits dtypes, a subset of `DTYPES`.
        quick: Only the cases marked quick.
        progress: Called as `progress(done, total, label)` after each case.

    Returns:
        A `CheckResults`.
    """
    unknown = [d for d in dtypes if d not in CHECK_TOLERANCES]
    if unknown or not dtypes:
        raise ValueError(f"run_checks: `dtypes` must be a non-empty subset of {DTYPES}, "
                         f"got {list(dtypes)!r}")
    import keras  # noqa: PLC0415

    import tf_metal_ops  # noqa: PLC0415

    cases = select_cases(quick)
    total = len(cases) * len(dtypes)
    results = []
    for i, case in enumerate(cases):
        for j, dtype in enumerate(dtypes):
            # A fixed seed per case: the same inputs for every dtype and every run.
            results.append(run_case(case, dtype, seed=1000 + i))
            if progress is not None:
                progress(i * len(dtypes) + j + 1, total, f"{case.name} [{dtype}]")
    devices = sorted((d.name.rsplit("device:", 1)[-1] for d in tf.config.list_logical_devices()
                      if d.device_type in ("CPU", "GPU")), key=lambda n: (n[:3] != "CPU", n))
    versions = {"tf_metal_ops": str(getattr(tf_metal_ops, "__version__", "unknown")),
                "tensorflow": tf.__version__, "keras": keras.__version__,
                "numpy": np.__version__}
    return CheckResults(results=results, dtypes=list(dtypes), quick=quick, devices=devices,
                        gpu_found=any(d.startswith("GPU") for d in devices), versions=versions,
                        gpu_plugin=tf_metal_ops.loss_path_info()["gpu_plugin"])
