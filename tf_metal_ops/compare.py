"""Run one TensorFlow computation on several devices and compare the results.

Users of tensorflow-metal regularly find that the GPU and the CPU disagree. `compare_devices`
answers "do they, and by how much, and where?" for any TensorFlow callable, not only this
package's op: it runs the callable once per device, optionally runs a NumPy reference, and
compares every output element by element.

    report = tf_metal_ops.compare_devices(model, x, rtol=1e-4, atol=1e-5)
    print(report)            # a table; report.passed, report.to_dict() for JSON

How two results are compared (`actual` against `expected`; the expected side is the
reference when there is one, otherwise the earlier device in the list):

- Elements that are NaN on both sides, or the same infinity on both sides, agree.
- A NaN on one side only is a NaN mismatch; an infinity on one side only (or of the other
  sign) is an Inf mismatch. Either fails the comparison.
- Finite elements agree when |actual - expected| <= atol + rtol * |expected| (numpy.isclose's
  rule). `max_abs_error` is the largest |actual - expected|; `max_rel_error` the largest
  |actual - expected| / |expected| over elements whose expected value is not 0 (where it is 0
  only the absolute error says anything).
- The *worst element* is the first non-finite mismatch if there is one, otherwise the element
  that uses up the largest fraction of its tolerance, i.e. the one nearest to failing, or
  furthest past it.
- Tolerances default per dtype (`DEFAULT_TOLERANCES`), using the less precise of the two
  sides: a float16 GPU result compared with a float64 reference is judged as float16.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tf_metal_ops._table import format_number, format_table

__all__ = [
    "DEFAULT_TOLERANCES",
    "REFERENCE",
    "DeviceComparisonReport",
    "OutputComparison",
    "OutputStructureError",
    "compare_devices",
    "value_and_gradients",
]

# The name the reference takes in reports, in the place of a device name.
REFERENCE = "reference"

# (rtol, atol) per dtype for device-vs-device and device-vs-reference comparisons. They allow
# a few units in the last place of the dtype, plus the rounding that different but equally
# valid summation orders (a GPU reduction tree against a CPU loop) produce on moderate sizes.
# Integer and boolean outputs must match exactly.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-12),
    "float32": (1e-5, 1e-6),
    "float16": (4e-3, 1e-3),
    "bfloat16": (3e-2, 1e-2),
}

# Less precise first: the pair is judged by the first of these that either side has.
_PRECISION_ORDER = ("bfloat16", "float16", "float32", "float64")


class OutputStructureError(ValueError):
    """The callable returned differently nested outputs on two devices (or vs the reference)."""


@dataclasses.dataclass(frozen=True)
class OutputComparison:
    """One output of the callable, compared between two runs.

    Attributes:
        output: Where the output sits in the returned structure: `out`, `out[1]`,
            `out['loss']`, `out.grads[0]`.
        actual: The device (`CPU:0`, `GPU:0`) whose result is judged.
        expected: The device, or `"reference"`, it is judged against.
        shape: The expected side's shape.
        actual_shape: The actual side's shape (differs from `shape` only on a shape mismatch).
        dtype: The actual side's dtype name.
        expected_dtype: The expected side's dtype name.
        rtol: Relative tolerance applied.
        atol: Absolute tolerance applied.
        size: Number of elements.
        max_abs_error: Largest |actual - expected| over elements finite on both sides.
        max_rel_error: Largest |actual - expected| / |expected| over those with expected != 0.
        worst_index: Index (a tuple, `()` for a scalar) of the worst element; None when the
            output is empty, the shapes differ, or the two results are identical.
        worst_actual: The actual value at `worst_index`.
        worst_expected: The expected value at `worst_index`.
        mismatches: Finite elements outside the tolerance.
        nan_mismatches: Elements NaN on exactly one side.
        inf_mismatches: Elements infinite on one side and not equal on the other (not counting
            those already counted as NaN mismatches).
        passed: No mismatch of any kind and equal shapes.
        note: Why the comparison failed when that is not obvious from the numbers.
    """

    output: str
    actual: str
    expected: str
    shape: tuple[int, ...]
    actual_shape: tuple[int, ...]
    dtype: str
    expected_dtype: str
    rtol: float
    atol: float
    size: int
    max_abs_error: float
    max_rel_error: float
    worst_index: tuple[int, ...] | None
    worst_actual: float | None
    worst_expected: float | None
    mismatches: int
    nan_mismatches: int
    inf_mismatches: int
    passed: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict. Non-finite numbers become the strings "nan", "inf", "-inf"."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        out["actual_shape"] = list(self.actual_shape)
        out["worst_index"] = None if self.worst_index is None else list(self.worst_index)
        for key in ("max_abs_error", "max_rel_error", "worst_actual", "worst_expected"):
            out[key] = _json_number(out[key])
        return out


@dataclasses.dataclass(frozen=True)
class DeviceComparisonReport:
    """What `compare_devices` found.

    Attributes:
        devices: The devices the callable ran on, short names (`CPU:0`, `GPU:0`).
        has_reference: Whether a reference callable was compared too.
        gpu_found: Whether TensorFlow sees any GPU at all (even one not in `devices`).
        placements: For each device, the devices on which its output tensors were actually
            produced. TensorFlow silently runs an op on the CPU when the requested device has
            no kernel for it, so `{"GPU:0": ["CPU:0"]}` means the GPU was not really tested.
        errors: Devices on which the callable raised, with the error (the other devices are
            still compared).
        comparisons: One entry per output and per pair of runs.
        notes: Plain-language remarks (no GPU found, unexpected placements, nothing compared).
        absent: Devices that were not run, each with why (`{"GPU": "not present"}`); shown as
            rows of the table (`compare_kernel` fills it).
    """

    devices: tuple[str, ...]
    has_reference: bool
    gpu_found: bool
    placements: Mapping[str, tuple[str, ...]]
    errors: Mapping[str, str]
    comparisons: tuple[OutputComparison, ...]
    notes: tuple[str, ...]
    absent: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """`"PASS"`, `"FAIL"`, or `"NOTHING COMPARED"` (one device and no reference)."""
        if self.errors or any(not c.passed for c in self.comparisons):
            return "FAIL"
        if not self.comparisons:
            return "NOTHING COMPARED"
        return "PASS"

    @property
    def passed(self) -> bool:
        """True when something was compared and everything agreed within tolerance."""
        return self.verdict == "PASS"

    @property
    def failures(self) -> tuple[OutputComparison, ...]:
        """The comparisons that failed."""
        return tuple(c for c in self.comparisons if not c.passed)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict with every field, plus `verdict` and `passed`."""
        return {
            "verdict": self.verdict,
            "passed": self.passed,
            "devices": list(self.devices),
            "has_reference": self.has_reference,
            "gpu_found": self.gpu_found,
            "placements": {k: list(v) for k, v in self.placements.items()},
            "errors": dict(self.errors),
            "comparisons": [c.to_dict() for c in self.comparisons],
            "notes": list(self.notes),
            "absent": dict(self.absent),
        }

    def table_rows(self) -> list[list[str]]:
        """The rows of `str(report)`'s table (without the header), for embedding elsewhere."""
        rows = []
        for c in self.comparisons:
            rows.append([
                c.output,
                f"{c.actual} vs {c.expected}",
                _shape_text(c.shape) if c.shape == c.actual_shape
                else f"{_shape_text(c.actual_shape)}!={_shape_text(c.shape)}",
                c.dtype,
                format_number(c.max_abs_error),
                format_number(c.max_rel_error),
                "-" if c.worst_index is None else _shape_text(c.worst_index),
                f"{c.nan_mismatches}/{c.inf_mismatches}",
                f"{c.mismatches}/{c.size}",
                f"{format_number(c.rtol, 0)}/{format_number(c.atol, 0)}",
                "PASS" if c.passed else "FAIL",
            ])
        for device, why in self.absent.items():
            rows.append(["*", device] + ["-"] * (len(self.TABLE_HEADERS) - 3) + [why])
        return rows

    TABLE_HEADERS = ("output", "compared", "shape", "dtype", "max abs err", "max rel err",
                     "worst at", "NaN/Inf mism", "out of tol", "rtol/atol", "verdict")

    def __str__(self) -> str:
        runs = ", ".join(self.devices) if self.devices else "no device"
        if self.has_reference:
            runs += " + reference"
        lines = [f"compare_devices: {runs} -> {self.verdict}"]
        if self.comparisons or self.absent:
            lines.append(format_table(self.TABLE_HEADERS, self.table_rows(), indent="  "))
        for c in self.failures:
            if c.worst_index is not None:
                lines.append(
                    f"  worst {c.output}, {c.actual} vs {c.expected}: at "
                    f"{_shape_text(c.worst_index)} got {format_number(c.worst_actual, 6)}, "
                    f"expected {format_number(c.worst_expected, 6)}")
            if c.note:
                lines.append(f"  {c.output} on {c.actual}: {c.note}")
        for device, error in self.errors.items():
            lines.append(f"  error on {device}: {error}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def compare_devices(
    fn: Callable[..., Any],
    *args: Any,
    devices: Sequence[str | tf.config.LogicalDevice] | None = None,
    reference: Callable[..., Any] | None = None,
    rtol: float | Mapping[str, float] | None = None,
    atol: float | Mapping[str, float] | None = None,
) -> DeviceComparisonReport:
    """Runs `fn(*args)` on each device (and `reference` on NumPy copies of `args`) and compares.

    Example:

    ```python
    model = keras.Sequential([...])
    x = np.random.default_rng(0).normal(size=(32, 28, 28, 1)).astype("float32")
    report = tf_metal_ops.compare_devices(lambda x: model(x, training=False), x)
    print(report)
    assert report.passed, report.failures
    ```

    Gradients are outputs like any other: pass a callable that computes them, for example
    `value_and_gradients(fn)`.

    Args:
        fn: Any TensorFlow callable (eager function, `tf.function`, Keras model). It may return
            a tensor, a NumPy array, a Python number, or any nesting of dicts, lists, tuples and
            namedtuples of those. It is called under `tf.device(d)` for each device `d`;
            tensors among `args` are first copied to `d`.
        *args: Positional arguments for `fn` (and, converted to NumPy, for `reference`).
        devices: Devices to run on: names such as `"CPU:0"`, `"GPU"`, `"/device:GPU:0"`, or
            `tf.config.LogicalDevice`s. Default: every CPU and GPU TensorFlow sees, CPUs first.
        reference: Optional callable taking NumPy arrays (tensors in `args` are converted with
            `.numpy()`) and returning the same structure as `fn`; it is the expected side of
            every device's comparison.
        rtol: Relative tolerance: a number for every output, or a dict from dtype name
            (`"float16"`, `"float32"`, ...) to a number, with `DEFAULT_TOLERANCES` for the
            dtypes it lacks. Default: `DEFAULT_TOLERANCES`.
        atol: Absolute tolerance, same forms as `rtol`.

    Returns:
        A `DeviceComparisonReport`.

    Raises:
        ValueError: A device that TensorFlow does not see, an empty device list with no
            reference, or a negative/NaN tolerance.
        OutputStructureError: `fn` returned differently nested outputs on two devices, or a
            structure different from `reference`'s.
        Exception: Whatever `fn` raised, when it raised on every device; whatever `reference`
            raised.
    """
    if not callable(fn):
        raise TypeError(f"compare_devices: `fn` must be callable, got {fn!r}")
    if reference is not None and not callable(reference):
        raise TypeError(f"compare_devices: `reference` must be callable or None, got {reference!r}")
    _check_tolerance("rtol", rtol)
    _check_tolerance("atol", atol)

    available = tf.config.list_logical_devices()
    gpu_found = any(d.device_type == "GPU" for d in available)
    if devices is None:
        chosen = [d for d in available if d.device_type == "CPU"]
        chosen += [d for d in available if d.device_type == "GPU"]
        device_names = [_short_name(d.name) for d in chosen]
    else:
        if isinstance(devices, (str, tf.config.LogicalDevice)):
            devices = [devices]
        device_names = _resolve_devices(devices, available)
    if not device_names and reference is None:
        raise ValueError("compare_devices: `devices` is empty and there is no `reference`: "
                         "nothing to run")

    # Run every device first, so one failing device does not hide the others' results.
    results: dict[str, list[tuple[str, Any]]] = {}
    placements: dict[str, tuple[str, ...]] = {}
    errors: dict[str, str] = {}
    first_error: BaseException | None = None
    for name in device_names:
        try:
            with tf.device("/device:" + name):
                device_args = _map_leaves(_copy_tensor_to_current_device, args)
                out = fn(*device_args)
            leaves = _flatten(out)
            placements[name] = tuple(sorted({p for p in map(_placement, (v for _, v in leaves))
                                             if p is not None}))
            results[name] = [(path, _to_numpy(value, path, name)) for path, value in leaves]
        except OutputStructureError:
            raise
        except Exception as e:  # noqa: BLE001 - reported per device, re-raised if on all
            errors[name] = f"{type(e).__name__}: {_one_line(str(e))}"
            first_error = first_error or e
    if device_names and len(errors) == len(device_names):
        assert first_error is not None
        raise first_error

    expected_runs: list[tuple[str, list[tuple[str, Any]]]] = []
    if reference is not None:
        numpy_args = _map_leaves(_tensor_to_numpy, args)
        ref_out = reference(*numpy_args)
        expected_runs.append(
            (REFERENCE, [(p, _to_numpy(v, p, REFERENCE)) for p, v in _flatten(ref_out)]))

    # Structure must agree everywhere before any number is compared.
    ran = [(n, results[n]) for n in device_names if n in results]
    all_runs = expected_runs + ran
    for name, leaves in all_runs[1:]:
        _check_same_structure(all_runs[0][0], all_runs[0][1], name, leaves)

    comparisons: list[OutputComparison] = []
    if reference is not None:
        for name, leaves in ran:
            comparisons += _compare_runs(name, leaves, REFERENCE, expected_runs[0][1], rtol, atol)
    for j in range(len(ran)):
        for i in range(j):
            comparisons += _compare_runs(ran[j][0], ran[j][1], ran[i][0], ran[i][1], rtol, atol)

    notes = _notes(device_names, available, gpu_found, reference is not None, placements,
                   comparisons)
    return DeviceComparisonReport(
        devices=tuple(device_names), has_reference=reference is not None, gpu_found=gpu_found,
        placements=placements, errors=errors, comparisons=tuple(comparisons), notes=tuple(notes))


def value_and_gradients(fn: Callable[..., Any], wrt: int | Sequence[int] = 0,
                        ) -> Callable[..., dict[str, Any]]:
    """Wraps `fn` so that it returns its value and the gradients of the value's sum.

    `compare_devices(value_and_gradients(loss_fn, wrt=0), logits, labels)` compares the
    forward values and d(sum of every output)/d(logits) across devices.

    Args:
        fn: A differentiable TensorFlow callable.
        wrt: Position(s) in `args` of the inputs to differentiate with respect to; they are
            converted to tensors (floating point) and watched.

    Returns:
        A callable returning `{"value": fn(*args), "gradients": (d/d args[i] for i in wrt)}`.
        Unconnected inputs get zero gradients (not None), so every device has the same
        structure.
    """
    positions = (wrt,) if isinstance(wrt, int) else tuple(wrt)
    if not positions or not all(isinstance(i, int) for i in positions):
        raise ValueError(f"value_and_gradients: `wrt` must be an int or a non-empty sequence of "
                         f"ints, got {wrt!r}")

    def wrapped(*args: Any) -> dict[str, Any]:
        for i in positions:
            if not -len(args) <= i < len(args):
                raise ValueError(f"value_and_gradients: `wrt` position {i} is out of range for "
                                 f"{len(args)} arguments")
        args_list = list(args)
        with tf.GradientTape() as tape:
            for i in positions:
                args_list[i] = tf.convert_to_tensor(args_list[i])
                tape.watch(args_list[i])
            value = fn(*args_list)
        grads = tape.gradient(value, [args_list[i] for i in positions],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return {"value": value, "gradients": tuple(grads)}

    return wrapped


# ---------------------------------------------------------------------------------------------
# Devices


def _short_name(full_name: str) -> str:
    """`/job:localhost/replica:0/task:0/device:GPU:0` -> `GPU:0`."""
    return full_name.rsplit("device:", 1)[-1]


def _resolve_devices(devices: Iterable[str | tf.config.LogicalDevice],
                     available: Sequence[tf.config.LogicalDevice]) -> list[str]:
    known = {_short_name(d.name).upper(): _short_name(d.name) for d in available}
    names: list[str] = []
    for spec in devices:
        raw = spec.name if isinstance(spec, tf.config.LogicalDevice) else spec
        if not isinstance(raw, str):
            raise TypeError(f"compare_devices: `devices` entries must be device names, got "
                            f"{spec!r}")
        key = _short_name(raw.strip()).upper()
        if ":" not in key:
            key += ":0"  # "GPU" means the first GPU, as in tf.device
        if key not in known:
            raise ValueError(f"compare_devices: device {raw!r} in `devices` is not available; "
                             f"TensorFlow sees {sorted(known.values()) or 'no device'}")
        if known[key] not in names:
            names.append(known[key])
    return names


def _copy_tensor_to_current_device(leaf: Any) -> Any:
    # Copy inputs to the device under test, so an op that reads them is not placed elsewhere
    # because of where its input happens to live. NumPy arrays and other objects pass as-is.
    if isinstance(leaf, tf.Tensor):
        return tf.identity(leaf)
    return leaf


def _placement(leaf: Any) -> str | None:
    device = getattr(leaf, "device", None)
    if isinstance(leaf, (tf.Tensor, tf.Variable)) and isinstance(device, str) and device:
        return _short_name(device)
    return None


# ---------------------------------------------------------------------------------------------
# Nested outputs


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _flatten(value: Any, path: str = "out") -> list[tuple[str, Any]]:
    """(path, leaf) pairs in a stable order: dict keys sorted (as tf.nest does)."""
    if isinstance(value, Mapping):
        try:
            keys = sorted(value)
        except TypeError:
            keys = sorted(value, key=repr)
        out: list[tuple[str, Any]] = []
        for k in keys:
            out += _flatten(value[k], f"{path}[{k!r}]")
        return out
    if _is_namedtuple(value):
        out = []
        for field in value._fields:
            out += _flatten(getattr(value, field), f"{path}.{field}")
        return out
    if isinstance(value, (list, tuple)):
        out = []
        for i, item in enumerate(value):
            out += _flatten(item, f"{path}[{i}]")
        return out
    return [(path, value)]


def _map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, dict):
        return type(value)((k, _map_leaves(fn, v)) for k, v in value.items())
    if isinstance(value, Mapping):
        return {k: _map_leaves(fn, v) for k, v in value.items()}
    if _is_namedtuple(value):
        return type(value)(*(_map_leaves(fn, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(fn, v) for v in value)
    return fn(value)


def _tensor_to_numpy(leaf: Any) -> Any:
    if isinstance(leaf, (tf.Tensor, tf.Variable)):
        return leaf.numpy()
    return leaf


def _to_numpy(value: Any, path: str, run: str) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    if isinstance(value, (tf.Tensor, tf.Variable)):
        try:
            return np.asarray(value.numpy())
        except (AttributeError, NotImplementedError) as e:
            raise TypeError(f"compare_devices: {path} on {run} is a symbolic tensor; call "
                            f"compare_devices eagerly (fn itself may be a tf.function)") from e
    try:
        array = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - anything NumPy cannot take
        raise TypeError(f"compare_devices: {path} on {run} is a {type(value).__name__}, "
                        f"which cannot be compared as an array") from e
    if array.dtype == object:
        raise TypeError(f"compare_devices: {path} on {run} is a {type(value).__name__}, "
                        f"which cannot be compared as an array")
    return array


def _check_same_structure(name_a: str, leaves_a: list[tuple[str, Any]],
                          name_b: str, leaves_b: list[tuple[str, Any]]) -> None:
    paths_a = [p for p, _ in leaves_a]
    paths_b = [p for p, _ in leaves_b]
    if paths_a != paths_b:
        only_a = [p for p in paths_a if p not in paths_b]
        only_b = [p for p in paths_b if p not in paths_a]
        detail = []
        if only_a:
            detail.append(f"only {name_a} has {_preview(only_a)}")
        if only_b:
            detail.append(f"only {name_b} has {_preview(only_b)}")
        if not detail:
            detail.append(f"the order differs: {_preview(paths_a)} vs {_preview(paths_b)}")
        raise OutputStructureError(
            f"compare_devices: the outputs on {name_a} and {name_b} are nested differently ("
            + "; ".join(detail) + "). fn must return the same structure on every device"
            + (" and the reference must mirror it" if REFERENCE in (name_a, name_b) else ""))
    for (path, a), (_, b) in zip(leaves_a, leaves_b):
        if (a is None) != (b is None):
            has_none = name_a if a is None else name_b
            raise OutputStructureError(
                f"compare_devices: {path} is None on {has_none} but not on "
                f"{name_b if has_none == name_a else name_a}")


def _preview(paths: list[str], limit: int = 4) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > limit else "")


# ---------------------------------------------------------------------------------------------
# Element-wise comparison


def _check_tolerance(name: str, value: Any) -> None:
    values = value.values() if isinstance(value, Mapping) else [] if value is None else [value]
    for v in values:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not v >= 0 \
                or math.isinf(v):
            raise ValueError(f"compare_devices: `{name}` must be a finite number >= 0 (or a "
                             f"dict of them per dtype), got {value!r}")


def _dtype_name(array: np.ndarray) -> str:
    return str(array.dtype)  # ml_dtypes' bfloat16 prints as "bfloat16"


def _judging_dtype(a: np.ndarray, b: np.ndarray) -> str | None:
    names = {_dtype_name(a), _dtype_name(b)}
    for name in _PRECISION_ORDER:
        if name in names:
            return name
    return None  # neither side is a float type we know: exact comparison


def _tolerance(kind: str, given: float | Mapping[str, float] | None, dtype: str | None) -> float:
    index = 0 if kind == "rtol" else 1
    if dtype is None:
        default = 0.0
    else:
        default = DEFAULT_TOLERANCES[dtype][index]
    if given is None:
        return default
    if isinstance(given, Mapping):
        return float(given.get(dtype, default)) if dtype is not None else default
    return float(given)


def _as_comparable(array: np.ndarray) -> np.ndarray:
    if np.iscomplexobj(array):
        return array.astype(np.complex128)
    if array.dtype.kind in "iub":
        return array.astype(np.float64)  # exact for |x| < 2**53
    return array.astype(np.float64)


def _compare_runs(actual_name: str, actual: list[tuple[str, Any]], expected_name: str,
                  expected: list[tuple[str, Any]], rtol: Any, atol: Any) -> list[OutputComparison]:
    out = []
    for (path, a), (_, b) in zip(actual, expected):
        if a is None:  # None on both sides (checked): nothing to compare
            continue
        out.append(_compare_arrays(path, actual_name, a, expected_name, b, rtol, atol))
    return out


def _compare_arrays(path: str, actual_name: str, a: np.ndarray, expected_name: str,
                    b: np.ndarray, rtol_given: Any, atol_given: Any) -> OutputComparison:
    judging = _judging_dtype(a, b)
    rtol = _tolerance("rtol", rtol_given, judging)
    atol = _tolerance("atol", atol_given, judging)
    common = dict(output=path, actual=actual_name, expected=expected_name,
                  shape=tuple(int(d) for d in b.shape),
                  actual_shape=tuple(int(d) for d in a.shape), dtype=_dtype_name(a),
                  expected_dtype=_dtype_name(b), rtol=rtol, atol=atol)
    if a.shape != b.shape:
        return OutputComparison(
            **common, size=int(b.size), max_abs_error=math.nan, max_rel_error=math.nan,
            worst_index=None, worst_actual=None, worst_expected=None, mismatches=int(b.size),
            nan_mismatches=0, inf_mismatches=0, passed=False,
            note=f"shape {_shape_text(a.shape)} differs from the expected "
                 f"{_shape_text(b.shape)}")

    x = _as_comparable(a)
    y = _as_comparable(b)
    if x.size == 0:
        return OutputComparison(
            **common, size=0, max_abs_error=0.0, max_rel_error=0.0, worst_index=None,
            worst_actual=None, worst_expected=None, mismatches=0, nan_mismatches=0,
            inf_mismatches=0, passed=True)

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        nan_mismatch = nan_x != nan_y
        any_nan = nan_x | nan_y
        # Inf on either side, no NaN involved, and not the same value (same-signed infinities
        # compare equal): a mismatch the tolerance cannot excuse.
        inf_mismatch = (np.isinf(x) | np.isinf(y)) & ~any_nan & (x != y)
        finite = np.isfinite(x) & np.isfinite(y)
        diff = np.where(finite, np.abs(x - y), 0.0)
        magnitude = np.abs(y)
        rel = np.where(finite & (magnitude > 0), diff / np.where(magnitude > 0, magnitude, 1.0),
                       0.0)
        allowed = atol + rtol * magnitude
        out_of_tol = finite & (diff > allowed)
        # Fraction of its tolerance each element uses; with zero tolerance any difference is
        # infinitely far past it, and among those the largest difference is the worst.
        used = np.where(allowed > 0, diff / np.where(allowed > 0, allowed, 1.0),
                        np.where(diff > 0, np.inf, 0.0))

    nonfinite_bad = nan_mismatch | inf_mismatch
    if nonfinite_bad.any():
        flat = int(np.flatnonzero(nonfinite_bad.ravel())[0])
    elif np.isinf(used).any():
        flat = int(np.argmax(np.where(np.isinf(used), diff, -1.0)))
    else:
        flat = int(np.argmax(used))
    counts = dict(mismatches=int(out_of_tol.sum()), nan_mismatches=int(nan_mismatch.sum()),
                  inf_mismatches=int(inf_mismatch.sum()))
    if not nonfinite_bad.any() and not diff.any():
        # Identical results: no element is worse than another.
        return OutputComparison(
            **common, size=int(x.size), max_abs_error=0.0, max_rel_error=0.0, worst_index=None,
            worst_actual=None, worst_expected=None, **counts, passed=True)
    worst = tuple(int(i) for i in np.unravel_index(flat, x.shape))
    return OutputComparison(
        **common, size=int(x.size), max_abs_error=float(diff.max()),
        max_rel_error=float(rel.max()), worst_index=worst,
        worst_actual=_scalar(x.ravel()[flat]), worst_expected=_scalar(y.ravel()[flat]),
        **counts, passed=not any(counts.values()))


def _scalar(value: Any) -> float:
    if isinstance(value, complex) or np.iscomplexobj(value):
        return float(abs(value))
    return float(value)


# ---------------------------------------------------------------------------------------------
# Text


def _notes(device_names: list[str], available: Sequence[tf.config.LogicalDevice],
           gpu_found: bool, has_reference: bool, placements: Mapping[str, tuple[str, ...]],
           comparisons: list[OutputComparison]) -> list[str]:
    notes = []
    if not gpu_found:
        seen = ", ".join(_short_name(d.name) for d in available) or "no device"
        if has_reference:
            notes.append(f"No GPU found: TensorFlow sees only {seen}, so each device was "
                         f"compared with the reference; no GPU result was checked.")
        else:
            notes.append(f"No GPU found: TensorFlow sees only {seen}; no GPU result was "
                         f"checked.")
    for name in device_names:
        produced = placements.get(name)
        if produced and any(p != name for p in produced):
            notes.append(f"Outputs requested on {name} were produced on {', '.join(produced)}: "
                         f"TensorFlow ran some op elsewhere (no kernel for {name}?), so "
                         f"{name} was not fully tested.")
    if not comparisons and len(device_names) <= 1 and not has_reference:
        notes.append("Nothing compared: one device and no reference. Pass `reference=` or "
                     "more `devices=`.")
    return notes


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ",".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
