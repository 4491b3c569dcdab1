"""Data races between GPU threads, found by ThreadSanitizer on Linux.

The kernels, the emulator and the driver are built once with -fsanitize=thread as a stand-alone
program (a sanitized library cannot be loaded into an unsanitized Python) and run with the
OS-thread executor: one OS thread per GPU thread, several threadgroups at once, barriers and
SIMD-group functions through a mutex. TSan therefore sees GPU threads as threads, and any
unsynchronized access to threadgroup or device memory between two of them is a report.

* The CustomLoss kernels run clean on both variants, forward and gradient, including rows that
  report bad labels through the atomic error record, and their results match the reference.
* A kernel with the unsynchronized `+=` of Apple's sample IS reported (the check can fail),
  and the same sum done right is not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402
from msl_build import msl_cache_dir  # noqa: E402,F401  (pytest fixture)

TSAN_ENV = {**os.environ, "TSAN_OPTIONS": "exitcode=66 halt_on_error=0 second_deadlock_stack=1"}


@pytest.fixture(scope="module")
def tsan_program(msl_cache_dir) -> Path:
    return mb.build_tsan_program(msl_cache_dir)


def _run(program: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(program), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=TSAN_ENV, timeout=300,
                            check=False)
    if "unexpected memory mapping" in result.stderr and shutil.which("setarch"):
        # Older TSan runtimes cannot handle a kernel's high mmap randomization: run the same
        # program without address-space randomization, as TSan's own docs advise.
        result = subprocess.run(["setarch", os.uname().machine, "-R", *cmd], capture_output=True,
                                text=True, env=TSAN_ENV, timeout=300, check=False)
    return result


# (variant, direction, label kind, N, C, max threads per threadgroup)
_CASES = [
    ("rowtg", "gradient", "int32", 4, 300, 64),    # 4 threadgroups of 64 threads, 2 SIMD-groups
    ("rowtg", "forward", "dense", 3, 100, 96),     # 3 SIMD-groups, C not a multiple of anything
    ("rowsimd", "gradient", "int64", 45, 10, 64),  # lane groups of 2, partial last threadgroup
    ("rowsimd", "forward", "int32", 20, 33, 64),   # lane groups of 8
]


@pytest.mark.parametrize("variant, direction, label_kind, n, c, max_threads", _CASES)
def test_msl_tsan_custom_loss_kernels_have_no_race(tsan_program, ref, tmp_path, variant,
                                                   direction, label_kind, n, c, max_threads):
    rng = np.random.default_rng(n * 1000 + c)
    logits = rng.normal(0.0, 2.0, (n, c)).astype(np.float32)
    logits[0, :c // 2] = -np.inf                      # masked classes
    if label_kind == "dense":
        labels = rng.uniform(0.0, 1.0, (n, c)).astype(np.float32)
        labels /= labels.sum(axis=1, keepdims=True)
        ref_labels = labels.astype(np.float64)
    else:
        labels = rng.integers(c // 2, c, n).astype(np.int32 if label_kind == "int32" else np.int64)
        ref_labels = labels.copy()
        labels[1] = c + 7                             # two bad labels: concurrent atomics
        labels[n - 1] = -2
        ref_labels[1] = ref_labels[n - 1] = c - 1
    upstream = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    case = tmp_path / "case"
    mb.write_case_dir(case, dict(
        num_rows=n, num_classes=c, dtype=0, label_kind=mb.LABEL_KINDS[label_kind],
        direction=mb.DIRECTIONS[direction], variant=mb.VARIANTS[variant], gamma=1.5,
        label_smoothing=0.1, max_threads=max_threads, simd_width=32, executor=1,
        max_concurrent_threadgroups=4), dict(logits=logits, labels=labels, upstream=upstream))
    result = _run(tsan_program, "case", str(case))
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-6000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"_{variant}_f32_" in result.stdout

    out = np.fromfile(case / "output.bin", dtype=np.float32).astype(np.float64)
    record = np.fromfile(case / "error_record.bin", dtype=np.uint32)
    kw = dict(gamma=1.5, label_smoothing=0.1)
    z = logits.astype(np.float64)
    if direction == "forward":
        expected = ref.custom_loss(ref_labels, z, **kw)
    else:
        expected = ref.custom_loss_grad(ref_labels, z, upstream=upstream.astype(np.float64), **kw)
        out = out.reshape(n, c)
    good = np.ones(n, dtype=bool)
    if label_kind != "dense":
        good[[1, n - 1]] = False
        assert record[0] == 2 and record[1] == 1 and record[2] == 1   # count, min row, claimed
        assert np.isnan(out[~good]).all()
    assert np.allclose(out[good], expected[good], rtol=2e-5, atol=1e-6, equal_nan=True)


def test_msl_tsan_reports_unsynchronized_threadgroup_accumulation(tsan_program):
    # Apple's sample's backward kernel: every thread does `acc[0] += 1` on threadgroup memory.
    result = _run(tsan_program, "raw", "example_racy_threadgroup_sum", "64", "2", "16", "2")
    assert "WARNING: ThreadSanitizer: data race" in result.stderr, result.stderr[-3000:]
    assert "racy_threadgroup_sum" in result.stderr  # the report points at the kernel
    assert result.returncode == 66


def test_msl_tsan_accepts_the_synchronized_version(tsan_program):
    result = _run(tsan_program, "raw", "example_reduced_threadgroup_sum", "64", "2", "256", "2")
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0
    assert [float(v) for v in result.stdout.split()] == [64.0, 64.0]


@pytest.mark.parametrize("variant, label_kind, max_threads", [("rowtg", "int32", 96),
                                                              ("rowsimd", "int64", 64)])
def test_msl_tsan_forward_writing_the_gradient_has_no_race(tsan_program, ref, tmp_path, variant,
                                                           label_kind, max_threads):
    """The forward that also writes row_stats and the scaled gradient (two sums behind one
    barrier in rowtg), under ThreadSanitizer, with a bad label among the rows."""
    n, c = 5, 300 if variant == "rowtg" else 40
    rng = np.random.default_rng(n * 7 + c)
    logits = rng.normal(0.0, 2.0, (n, c)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32 if label_kind == "int32" else np.int64)
    ref_labels = labels.copy()
    labels[2] = c + 3
    ref_labels[2] = 0
    scales = rng.uniform(0.5, 2.0, n).astype(np.float32)
    case = tmp_path / "case"
    mb.write_case_dir(case, dict(
        num_rows=n, num_classes=c, dtype=0, label_kind=mb.LABEL_KINDS[label_kind], direction=0,
        variant=mb.VARIANTS[variant], gamma=1.5, label_smoothing=0.1, max_threads=max_threads,
        simd_width=32, executor=1, max_concurrent_threadgroups=4, has_row_stats=1,
        has_row_scales=1), dict(logits=logits, labels=labels, row_scales=scales))
    result = _run(tsan_program, "case", str(case))
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-6000:]
    assert result.returncode == 0, result.stderr[-3000:]
    loss = np.fromfile(case / "output.bin", dtype=np.float32).astype(np.float64)
    grad = np.fromfile(case / "scaled_gradient.bin", dtype=np.float32).reshape(n, c)
    stats = np.fromfile(case / "row_stats_out.bin", dtype=np.float32).reshape(n, 3)
    kw = dict(gamma=1.5, label_smoothing=0.1)
    z = logits.astype(np.float64)
    good = np.arange(n) != 2
    assert np.allclose(loss[good], ref.custom_loss(ref_labels, z, **kw)[good], rtol=2e-5)
    expected = ref.custom_loss_grad(ref_labels, z, upstream=scales.astype(np.float64), **kw)
    assert np.allclose(grad[good], expected[good], rtol=2e-5, atol=1e-6)
    assert np.isnan(loss[2]) and np.isnan(grad[2]).all() and (stats[2] == 0).all()
    assert np.allclose(stats[good, 0], z[good].max(axis=1))


# (variant, direction, label kind, gamma, label smoothing, class weights?, N, C, max threads per
# threadgroup)
_ALIAS_CASES = [
    ("rowtg", "forward", "int32", 0.0, 0.0, False, 4, 300, 64),  # one weighted class, 2 SIMD-groups
    ("rowtg", "forward", "int64", 1.5, 0.0, False, 3, 300, 96),  # focal, one weighted class
    ("rowtg", "forward", "int32", 0.0, 0.1, False, 3, 300, 64),  # cross-entropy sums from the walk
    ("rowtg", "forward", "int64", 0.0, 0.1, True, 3, 300, 64),   # the same, class-weighted
    ("rowtg", "gradient", "int32", 0.0, 0.0, False, 3, 300, 64),
    ("rowsimd", "forward", "int32", 0.0, 0.0, False, 20, 33, 64),  # lane groups of 8
    ("rowsimd", "forward", "int64", 1.5, 0.0, False, 9, 200, 64),  # lane groups of 32
    ("rowsimd", "forward", "int64", 0.0, 0.1, False, 20, 33, 64),
    ("rowsimd", "forward", "int32", 0.0, 0.1, True, 20, 33, 64),
    ("rowsimd", "gradient", "int64", 0.0, 0.0, False, 20, 33, 64),
]


@pytest.mark.parametrize(
    "variant, direction, label_kind, gamma, eps, weighted, n, c, max_threads", _ALIAS_CASES)
def test_msl_tsan_gradient_written_over_the_logits_has_no_race(
        tsan_program, ref, tmp_path, variant, direction, label_kind, gamma, eps, weighted, n, c,
        max_threads):
    """The gradient bound over the logits' memory (alias_gradient: a reduced forward's scaled
    gradient, or the gradient op's output, where TensorFlow forwarded the logits' buffer): the
    label's logit, which every thread of a sparse row reads, and each thread's own classes must
    be read before any thread of the row writes there. ThreadSanitizer reports a read that no
    barrier orders before another GPU thread's write of the same logit."""
    rng = np.random.default_rng(n * 31 + c)
    logits = rng.normal(0.0, 2.0, (n, c)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32 if label_kind == "int32" else np.int64)
    ref_labels = labels.copy()
    labels[1] = c + 5  # a bad row: written (NaN) without reading
    ref_labels[1] = 0
    scales = rng.uniform(0.5, 2.0, n).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, c).astype(np.float32) if weighted else None
    forward = direction == "forward"
    case = tmp_path / "case"
    fields = dict(
        num_rows=n, num_classes=c, dtype=0, label_kind=mb.LABEL_KINDS[label_kind],
        direction=mb.DIRECTIONS[direction], variant=mb.VARIANTS[variant], gamma=gamma,
        label_smoothing=eps, has_class_weights=int(weighted), max_threads=max_threads,
        simd_width=32, executor=1, max_concurrent_threadgroups=4, alias_gradient=1)
    arrays = dict(logits=logits, labels=labels, class_weights=weights)
    if forward:
        fields.update(has_row_stats=1, has_row_scales=1)
        arrays["row_scales"] = scales
    else:
        arrays["upstream"] = scales
    mb.write_case_dir(case, fields, arrays)
    result = _run(tsan_program, "case", str(case))
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-6000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"_{variant}_f32_" in result.stdout
    # Cross-entropy runs the "_plain" kernels, or with smoothing the "_smoothed" ones; focal
    # loss and class weights the general ones.
    kernel = result.stdout.split("kernel ", 1)[1].split()[0]
    ce = gamma == 0.0 and not weighted
    assert kernel.endswith("_plain") == (ce and eps == 0.0), kernel
    assert kernel.endswith("_smoothed") == (ce and eps != 0.0), kernel

    grad_file = "scaled_gradient.bin" if forward else "output.bin"
    grad = np.fromfile(case / grad_file, dtype=np.float32).reshape(n, c)
    kw = dict(gamma=gamma, label_smoothing=eps,
              class_weights=None if weights is None else weights.astype(np.float64))
    z = logits.astype(np.float64)
    good = np.arange(n) != 1
    expected = ref.custom_loss_grad(ref_labels, z, upstream=scales.astype(np.float64), **kw)
    assert np.allclose(grad[good], expected[good], rtol=2e-5, atol=1e-6)
    assert np.isnan(grad[1]).all()
    if forward:
        loss = np.fromfile(case / "output.bin", dtype=np.float32).astype(np.float64)
        assert np.allclose(loss[good], ref.custom_loss(ref_labels, z, **kw)[good], rtol=2e-5)
