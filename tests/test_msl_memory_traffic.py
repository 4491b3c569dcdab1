"""Device-memory bytes a training step of the Metal kernels moves, counted while they run.

The kernels are compiled (clang) with every load and store calling a hook
(tests/msl_host/memory_traffic.h says how an access is counted: once per threadgroup,
instruction and address, so a pass over the logits counts each time it runs). A step is the
forward op plus, unless the forward wrote the gradient, the gradient op, in float32, as
tf_metal_ops runs them on a Metal GPU:

* old: the forward writes nothing for the gradient, which finds the row's log-sum-exp again
  (the Metal kernels before row statistics; still what a gradient given no row_stats does);
* per-example: the forward writes row_stats, the gradient reads them (custom_loss's gradient);
* reduced: the forward, given row_scales, writes the scaled gradient; no gradient op
  (reduced_custom_loss, CustomLoss in Keras).

The figures are bytes per logits element, all device buffers counted (logits, labels, class
weights, losses, row statistics, gradients), at C = 1000 (a threadgroup per row) and C = 200
(lane groups). The per-row buffers add a few bytes per row, i.e. a few hundredths per element.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402
from msl_build import msl_cache_dir  # noqa: E402,F401  (pytest fixture)

DEVICE_ROLES = [r for r in mb.ROLES if r != "params"]  # params: setBytes, constant memory

# (label kind, gamma, label smoothing, class weights?)
OPTIONS = {
    "plain": ("int32", 0.0, 0.0, False),
    "smoothed": ("int32", 0.0, 0.1, False),
    "focal": ("int32", 2.0, 0.0, False),
    "class_weights": ("int32", 0.0, 0.0, True),
    "dense": ("dense", 0.0, 0.0, False),
}

# Bytes per logits element of one float32 step, as counted: (old, per-example, reduced).
# 16 -> 12 for plain cross-entropy: the forward reads the logits once (log-sum-exp), the gradient
# given row_stats reads them once and writes the gradient; the reduced path's forward reads them
# twice (log-sum-exp, gradient) and writes the gradient. What is above a multiple of 4 is per
# row (labels, losses, row_stats, upstream, the labelled logit): 44 bytes a row for plain
# cross-entropy per example, 0.044 per element at C = 1000. Label smoothing (gamma = 0) carries
# its sums in the log-sum-exp walk and moves what plain cross-entropy does; dense labels are
# [N, C] reads of their own, once more in a gradient given row_stats (for the row's weight).
EXPECTED = {
    1000: {
        "class_weights": (16.036, 12.056, 12.036),
        "dense": (28.008, 24.028, 20.02),
        "focal": (16.024, 12.044, 12.028),
        "plain": (16.024, 12.044, 12.028),
        "smoothed": (16.024, 12.044, 12.028),
    },
    200: {
        "class_weights": (16.18, 12.28, 12.18),
        "dense": (28.04, 24.14, 20.1),
        "focal": (16.12, 12.22, 12.14),
        "plain": (16.12, 12.22, 12.14),
        "smoothed": (16.12, 12.22, 12.14),
    },
}
PATHS = ["old", "per-example", "reduced"]


@pytest.fixture(scope="module")
def traffic_emu(msl_cache_dir) -> mb.Emulator:
    clang = mb.find_clang()
    assert clang is not None, mb.missing_clang_message(
        "the counting build (-fsanitize-coverage=trace-loads)")
    return mb.Emulator(mb.build_traffic_library(msl_cache_dir, clang))


def _case(option: str, n: int, c: int):
    label_kind, gamma, eps, weighted = OPTIONS[option]
    rng = np.random.default_rng(abs(hash((option, n, c))) % 2**32)
    logits = rng.normal(0.0, 2.0, (n, c)).astype(np.float32)
    if label_kind == "dense":
        t = rng.uniform(0.0, 1.0, (n, c)).astype(np.float32)
        labels = t / t.sum(axis=1, keepdims=True)
    else:
        labels = rng.integers(0, c, n).astype(np.int32)
    kw = dict(logits=logits, labels=labels, label_kind=label_kind, gamma=gamma,
              label_smoothing=eps,
              class_weights=rng.uniform(0.5, 2.0, c).astype(np.float32) if weighted else None)
    return kw


def _bytes(run: mb.EmuRun) -> int:
    assert run.ok, run.error
    assert run.memory_counted, "the kernels ran without access hooks"
    return sum(run.bytes_read[r] + run.bytes_written[r] for r in DEVICE_ROLES)


def step_bytes(emu: mb.Emulator, option: str, path: str, n: int, c: int) -> Tuple[float, Dict]:
    """Bytes per logits element of one training step, and the runs' per-role counts."""
    kw = _case(option, n, c)
    upstream = np.full(n, 1.0 / n, np.float32)
    runs = []
    if path == "old":
        runs.append(emu.run(direction="forward", **kw))
        runs.append(emu.run(direction="gradient", upstream=upstream, **kw))
    elif path == "per-example":
        fwd = emu.run(direction="forward", row_stats=True, **kw)
        runs.append(fwd)
        runs.append(emu.run(direction="gradient", upstream=upstream, row_stats=fwd.row_stats,
                            **kw))
    else:
        runs.append(emu.run(direction="forward", row_stats=True, row_scales=upstream, **kw))
    # Cross-entropy runs the "_plain" or "_smoothed" kernels, the other options the general ones.
    form = {"plain": "_plain", "smoothed": "_smoothed"}.get(option, "")
    for run in runs:
        assert mb.kernel_form(run.kernel_name) == form, run.kernel_name
    total = sum(_bytes(r) for r in runs)
    per_role = {r: sum(run.bytes_read[r] + run.bytes_written[r] for run in runs)
                for r in DEVICE_ROLES}
    return total / (n * c), per_role


@pytest.mark.parametrize("num_classes", sorted(EXPECTED))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_msl_step_bytes_per_element(traffic_emu, option, path, num_classes):
    measured, per_role = step_bytes(traffic_emu, option, path, 8, num_classes)
    expected = EXPECTED[num_classes][option][PATHS.index(path)]
    assert abs(measured - expected) <= 0.01, (
        f"{option}, {path} path, C = {num_classes}: {measured:.3f} bytes per logits element, "
        f"stated {expected}; per role {per_role}")


@pytest.mark.parametrize("option", ["plain", "smoothed"])
@pytest.mark.parametrize("num_classes", [1000, 4096])
def test_msl_plain_cross_entropy_moves_12_bytes_per_element_and_its_rows(traffic_emu,
                                                                         num_classes, option):
    """Forward + gradient of cross-entropy, plain or label-smoothed: 12 bytes per element (one
    read in the forward, one read and one write in the gradient) and at most 48 bytes per row;
    the step without row statistics reads the logits once more."""
    c = num_classes
    for path in ("per-example", "reduced"):
        measured, per_role = step_bytes(traffic_emu, option, path, 4, c)
        assert 12.0 <= measured <= 12.0 + 48.0 / c, (path, measured, per_role)
        assert per_role["logits"] / (4 * c) <= 8.0 + 8.0 / c  # two passes (the rest: writes)
    old, _ = step_bytes(traffic_emu, option, "old", 4, c)
    assert old >= 16.0


def test_msl_traffic_counter_counts_only_what_the_kernels_touch(traffic_emu, msl_cache_dir):
    """The counter itself: a forward without row_stats writes none and with them 12 bytes a row;
    the plain build (no hooks) says it did not count rather than report zeros."""
    kw = _case("plain", 3, 300)
    fwd = traffic_emu.run(direction="forward", **kw)
    assert fwd.memory_counted and fwd.bytes_written["row_stats"] == 0
    assert fwd.bytes_written["output"] == 3 * 4 and fwd.bytes_read["logits"] >= 3 * 300 * 4
    with_stats = traffic_emu.run(direction="forward", row_stats=True, **kw)
    assert with_stats.bytes_written["row_stats"] == 3 * 12
    assert with_stats.bytes_read["logits"] == fwd.bytes_read["logits"]
    plain_build = mb.Emulator(mb.build_emulator_library(msl_cache_dir))
    assert not plain_build.run(direction="forward", **kw).memory_counted
