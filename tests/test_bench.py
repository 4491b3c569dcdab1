"""The CPU benchmark (tf_metal_ops/tools/bench/): it runs and reports the documented schema.

Nothing here asserts a timing: on a shared CI machine speed proves nothing. What is checked is
that every case, ratio and memory figure is present and sane, and that the memory floor's
native passes compute what they claim (so the floor is real traffic, not an empty loop).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import numpy as np
import pytest

import tf_metal_ops
from tf_metal_ops.tools.bench import suite as bench


@pytest.fixture(scope="module")
def quick_report() -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "tf_metal_ops.tools.bench", "--quick", "--json", "--memory"],
        capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout)


def test_bench_quick_json_schema(quick_report):
    assert quick_report["schema"] == bench.SCHEMA
    env = quick_report["environment"]
    assert env["cpu_kernel_isa"] in ("avx512", "avx2", "portable")
    assert env["cpu_threads"] >= 1
    assert env["tf_cpu_allocator"] in ("bfc", "default")
    assert isinstance(env["tf_enable_onednn_opts"], str)
    assert env["tf_onednn"] in ("on", "off", "unknown")
    assert quick_report["settings"]["quick"] is True
    case_names = [name for name, _ in bench.CASES]
    assert set(quick_report["settings"]["cases"]) == set(case_names)
    sizes = [(s["rows"], s["classes"]) for s in quick_report["sizes"]]
    assert sizes == [tuple(size) for size in bench.QUICK_SIZES]
    for size in quick_report["sizes"]:
        assert size["dtype"] == "float32"
        assert size["repeats"] >= 1
        assert set(size["median_ms"]) == set(case_names)
        for name in case_names:
            assert math.isfinite(size["median_ms"][name]) and size["median_ms"][name] > 0
            assert 0 < size["min_ms"][name] <= size["median_ms"][name]
        assert set(size["ratios"]) == {name for name, _, _ in bench.RATIOS}
        for name, numerator, denominator in bench.RATIOS:
            expected = size["median_ms"][numerator] / size["median_ms"][denominator]
            assert size["ratios"][name] == pytest.approx(expected)
        assert size["floor_bytes"] == 12 * size["rows"] * size["classes"]
        assert size["floor_gb_per_s"] > 0
        # Counted for every case where the machine has a counter, for none where it has not.
        counted = env["instruction_counter"].startswith("perf_event_open")
        assert set(size["instructions_per_element"]) == (set(case_names) if counted else set())
        for value in size["instructions_per_element"].values():
            assert value > 0


def test_bench_quick_memory_report(quick_report):
    memory = quick_report["memory"]
    rows, cols = bench.QUICK_MEMORY_SIZE
    assert (memory["rows"], memory["classes"]) == (rows, cols)
    assert memory["gradient_bytes"] == 4 * rows * cols
    assert memory["errors"] == {}
    assert set(memory["extra_bytes"]) == set(bench.MEMORY_CASES)
    for case in bench.MEMORY_CASES:
        assert memory["extra_bytes"][case] >= 0
        assert memory["extra_over_gradient"][case] == pytest.approx(
            memory["extra_bytes"][case] / memory["gradient_bytes"])
    assert isinstance(memory["method"], str) and memory["method"]


def test_bench_quick_lm_head_memory_report(quick_report):
    lm_head = quick_report["lm_head_memory"]
    rows, hidden, cols = bench.QUICK_LM_HEAD_SIZE
    assert (lm_head["rows"], lm_head["hidden"], lm_head["classes"]) == (rows, hidden, cols)
    assert lm_head["steps"] == bench.LM_HEAD_STEPS
    assert lm_head["logits_bytes"] == 4 * rows * cols
    assert lm_head["errors"] == {}
    assert set(lm_head["extra_bytes"]) == set(bench.LM_HEAD_CASES)
    assert all(extra >= 0 for extra in lm_head["extra_bytes"].values())
    assert "clear_refs" in lm_head["method"]
    table = bench.format_table(quick_report)
    assert "language model's head" in table
    for case in bench.LM_HEAD_CASES:
        assert case in table


def test_bench_table_names_every_case(quick_report):
    table = bench.format_table(quick_report)
    for name, _ in bench.CASES:
        assert name in table
    for name, _, _ in bench.RATIOS:
        assert name in table


def test_bench_table_names_the_memory_settings(quick_report):
    """TensorFlow's caching allocator and oneDNN (which TensorFlow turns on by itself on some
    CPUs) decide whether a fresh N x C tensor costs page faults, so figures of different
    settings are not comparable: the table's header names both, and the environment variable
    only where it was set."""
    env = quick_report["environment"]
    defaults = dict(quick_report, environment=dict(env, tf_cpu_allocator="default",
                                                   tf_enable_onednn_opts="unset",
                                                   tf_onednn="off"))
    table = bench.format_table(defaults)
    assert "memory: TensorFlow's CPU allocator default, oneDNN off" in table
    assert "TF_ENABLE_ONEDNN_OPTS" not in table
    report = dict(quick_report, environment=dict(env, tf_cpu_allocator="bfc", tf_onednn="on"))
    assert "TensorFlow's CPU allocator bfc, oneDNN on" in bench.format_table(report)
    report = dict(quick_report, environment=dict(env, tf_enable_onednn_opts="0"))
    assert "TF_ENABLE_ONEDNN_OPTS=0" in bench.format_table(report)


@pytest.mark.parametrize("dtype, itemsize", [("float16", 2), ("bfloat16", 2)])
def test_bench_dtype_times_every_case_with_that_dtypes_floor(dtype, itemsize):
    size = bench.time_size(16, 10, 1, bench._Progress(1, enabled=False), dtype=dtype)
    assert size["dtype"] == dtype
    assert size["floor_bytes"] == 3 * itemsize * 16 * 10
    # Every case ran in this dtype, or says why it could not.
    case_names = {name for name, _ in bench.CASES}
    assert set(size["median_ms"]) | set(size["errors"]) == case_names
    assert {"ours_ce", "ours_focal", "floor"} <= set(size["median_ms"]), size["errors"]
    report = {"environment": dict(bench.environment()), "sizes": [size],
              "settings": {"dtype": dtype}}
    assert f"threads; {dtype}," in bench.format_table(report)


@pytest.mark.parametrize("argv", [["--sizes", "10by3"], ["--sizes", "0x5"], ["--repeats", "0"],
                                  ["--threads", "-1"], ["--dtype", "int8"], ["--no-such-flag"],
                                  ["--margin", "-1"], ["--margin", "nan"], ["--margin", "eight"]])
def test_bench_usage_errors_exit_2(argv, capsys):
    assert bench.main(argv) == 2
    assert "usage" in capsys.readouterr().err


def test_bench_margin_raises_each_rows_labelled_logit():
    base, _, labels = bench._make_inputs(64, 10)
    raised, logits, same_labels = bench._make_inputs(64, 10, margin=8.0)
    np.testing.assert_array_equal(same_labels.numpy(), labels.numpy())
    rows = np.arange(64)
    np.testing.assert_allclose(raised[rows, labels.numpy()] - base[rows, labels.numpy()], 8.0,
                               rtol=1e-6)
    others = np.ones_like(base, dtype=bool)
    others[rows, labels.numpy()] = False
    np.testing.assert_array_equal(raised[others], base[others])
    np.testing.assert_array_equal(logits.numpy(), raised)
    size = bench.time_size(16, 10, 1, bench._Progress(1, enabled=False),
                           cases=("ours_focal", "floor"), margin=8.0)
    assert set(size["median_ms"]) == {"ours_focal", "floor"}, size["errors"]
    report = {"environment": dict(bench.environment()), "sizes": [size],
              "settings": {"dtype": "float32", "margin": 8.0}}
    assert "each row's labelled one raised by 8" in bench.format_table(report)
    assert bench.build_parser().parse_args(["--margin", "12"]).margin == 12.0


def test_bench_orders_run_every_case_once_and_vary_each_ones_predecessor():
    """A case always run after the same one pays for that one's freed memory in every repeat:
    the order is shuffled per repeat (reproducibly), so each case follows several others."""
    names = [name for name, _ in bench.CASES]
    orders = bench.run_orders(names, 20, seed=7)
    assert len(orders) == 20
    assert all(sorted(order) == sorted(names) for order in orders)
    assert orders == bench.run_orders(names, 20, seed=7)
    predecessors = {name: set() for name in names}
    for order in orders:
        for before, name in zip(order, order[1:]):
            predecessors[name].add(before)
    assert all(len(seen) >= 3 for seen in predecessors.values()), predecessors


def test_memory_floor_passes_do_the_traffic_they_claim():
    from tf_metal_ops import _native

    runtime = _native.runtime()
    rng = np.random.default_rng(5)
    src = rng.standard_normal((300, 257)).astype(np.float32)
    total = runtime.memory_floor_pass(src)
    assert total == pytest.approx(float(src.sum(dtype=np.float64)), rel=1e-4, abs=1e-2)
    dst = np.full_like(src, np.nan)
    runtime.memory_floor_pass(src, dst)
    np.testing.assert_array_equal(dst, 0.5 * src)
    with pytest.raises(ValueError, match="dst"):
        runtime.memory_floor_pass(src, np.zeros((300, 257), np.float64))
    with pytest.raises(ValueError, match="dst"):
        runtime.memory_floor_pass(src, np.zeros((300, 256), np.float32))


def test_bench_linear_head_section_runs_every_case():
    """`--linear-head-only --quick`: each case's children ran and reported memory, the time of
    their steps and (for fused and Dense + CustomLoss) the error against float64; the medians
    and the targets are worked out from them."""
    from tf_metal_ops.tools.bench import linear_head as lh

    completed = subprocess.run(
        [sys.executable, "-m", "tf_metal_ops.tools.bench", "--quick", "--json", "--linear-head-only"],
        capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(completed.stdout)
    assert report["sizes"] == [] and report["memory"] is None
    section = report["linear_head"]
    assert (section["rows"], section["hidden"]) == (lh.QUICK_ROWS, lh.QUICK_HIDDEN)
    assert [size["classes"] for size in section["sizes"]] == list(lh.QUICK_CLASSES)
    cases = [name for name, _ in lh.CASES]
    for size in section["sizes"]:
        assert size["failures"] == {}
        assert set(size["extra_bytes"]) == set(cases) == set(size["median_ms"])
        assert all(extra >= 0 for extra in size["extra_bytes"].values())
        assert all(ms > 0 for ms in size["median_ms"].values())
        assert set(size["times_ms"]) == set(cases)
        for case, runs in size["extra_bytes_runs"].items():  # one child per case with --quick
            assert len(runs) == section["repeats"] == lh.QUICK_MEMORY_REPEATS
            assert size["extra_bytes"][case] == int(statistics.median(runs))
        for case, times in size["times_ms"].items():  # every child's timed steps
            assert len(times) == lh.QUICK_MEMORY_REPEATS * section["steps"]
            assert size["median_ms"][case] == pytest.approx(statistics.median(times))
        assert set(size["errors"]) == {"fused", "dense_custom"}
        for errors in size["errors"].values():
            assert set(errors) == {"loss", "d_hidden", "d_kernel", "d_bias"}
            assert all(0 <= error < 1e-6 for error in errors.values()), errors
        for fused in lh.FUSED_CASES:
            assert size["targets"][f"time {fused} / dense_custom"] == pytest.approx(
                size["median_ms"][fused] / size["median_ms"]["dense_custom"])
            assert size["targets"][f"time {fused} / dense_keras"] == pytest.approx(
                size["median_ms"][fused] / size["median_ms"]["dense_keras"])
            assert f"time {fused} <= {lh.TIME_TARGET} x dense_custom" in size["targets"]
    # What the times depend on: TensorFlow's oneDNN setting and the native op's BLAS.
    assert section["backends"]["blas"] == tf_metal_ops._native.build_info()["blas"]
    assert "TF_ENABLE_ONEDNN_OPTS" in section["backends"]
    table = bench.format_table(report)
    assert "linear head" in table and all(case in table for case in cases)


def test_linear_head_children_take_turns_and_report_medians(monkeypatch):
    """The section's bookkeeping without its children: each repeat runs every case once, one
    case later each time; only the first repeat measures errors; the medians are over the
    children; a case whose child fails is not run again and has no median."""
    from tf_metal_ops.tools.bench import linear_head as lh

    calls = []

    def fake_child(argv):
        case = argv[1]
        calls.append((case, "--no-errors" not in argv))
        n = len(calls)
        if case == "dense_keras" and n > 3:
            return None, "out of memory"
        found = {"extra_bytes": 1000 * n, "times_ms": [float(n)], "backends": {"blas": "x"}}
        if "--no-errors" not in argv:
            found["errors"] = {"loss": 0.0}
        return found, None

    monkeypatch.setattr(lh, "run_child", fake_child)
    section = lh.measure(4, 2, (7,), 1, repeats=3)
    names = [name for name, _ in lh.CASES]
    # the third repeat starts at dense_keras, which failed in the second and is left out
    assert [case for case, _ in calls] == names + names[1:] + names[:1] + names[:2]
    assert [errors for _, errors in calls] == [True] * 3 + [False] * 5
    size = section["sizes"][0]
    assert section["repeats"] == 3 and "in 3 processes" in section["method"]
    assert size["failures"] == {"dense_keras": "out of memory"}
    assert set(size["median_ms"]) == {"fused", "dense_custom"}
    assert size["extra_bytes_runs"] == {"fused": [1000, 6000, 7000],
                                        "dense_custom": [2000, 4000, 8000]}
    assert size["median_ms"] == {"fused": 6.0, "dense_custom": 4.0}
    assert size["extra_bytes"] == {"fused": 6000, "dense_custom": 4000}
    assert size["errors"] == {name: {"loss": 0.0} for name in names}  # the first children's


def test_bench_metal_kernel_row_reports_both_medians_and_their_ratio():
    """The metal_kernel row: the exp kernel and tf.exp timed side by side, the ratio worked out
    from the medians and set against the target, the two results checked against each other."""
    from tf_metal_ops.tools.bench import metal_kernel as mk

    section = mk.measure(1000, 3, bench._Progress(6, enabled=False))
    assert section["elements"] == 1000 and section["repeats"] == 3
    assert set(section["median_ms"]) == {name for name, _ in mk.CASES} == set(section["min_ms"])
    assert all(0 < section["min_ms"][n] <= ms for n, ms in section["median_ms"].items())
    assert section["ratio"] == pytest.approx(
        section["median_ms"]["metal_kernel_exp"] / section["median_ms"]["tf_exp"])
    assert section["within_target"] is (section["ratio"] <= mk.TARGET)
    assert 0 <= section["max_rel_error"] < 1e-5
    report = {"environment": dict(bench.environment()), "sizes": [], "settings": {},
              "metal_kernel": section}
    table = bench.format_table(report)
    assert "metal_kernel_exp" in table and "ratio metal_kernel_exp / tf_exp" in table


def test_bench_metal_kernel_row_can_be_left_out():
    parse = bench.build_parser().parse_args
    assert bench._metal_kernel_plan(parse(["--quick", "--no-metal-kernel"])) is None
    assert bench._metal_kernel_plan(parse(["--linear-head-only"])) is None
    assert bench._metal_kernel_plan(parse(["--quick"])) == (4096, 3)
    assert bench._metal_kernel_plan(parse(["--repeats", "7"])) == (2 ** 20, 7)


def test_instruction_counter_counts_work_or_says_why_not():
    from tf_metal_ops.tools.bench import instructions

    counter, why = instructions.open_counter()
    if counter is None:
        # No counter here (this project's VMs have no PMU): the reason names what failed.
        assert why and ("perf_event_open" in why or "has no perf_event_open" in why), why
        return
    assert why == ""
    data = np.arange(1 << 20, dtype=np.float64)
    once = counter.count(lambda: float(np.sum(np.sqrt(data))))
    twice = counter.count(lambda: [float(np.sum(np.sqrt(data))) for _ in range(2)])
    assert once > 1 << 20  # at least one instruction per element
    assert 1.5 < twice / once < 2.5


def test_bench_table_prints_instructions_per_element_when_counted(quick_report):
    report = json.loads(json.dumps(quick_report))
    for size in report["sizes"]:
        size["instructions_per_element"] = {name: 12.5 for name in size["median_ms"]}
    report["environment"]["instruction_counter"] = "perf_event_open (test)"
    table = bench.format_table(report)
    assert "instruction counts: perf_event_open (test)" in table
    assert "instructions per element" in table and "12.5" in table
    for size in report["sizes"]:
        size["instructions_per_element"] = {}
    assert "instructions per element" not in bench.format_table(report)


def test_bench_metal_kernel_only_runs_that_row_alone(monkeypatch, capsys):
    """`--metal-kernel-only`: no loss sizes and no memory sections, only the metal_kernel row
    (its measure stood in for: the row itself is checked above)."""
    from tf_metal_ops.tools.bench import metal_kernel as mk

    calls = []
    monkeypatch.setattr(mk, "measure", lambda *a: calls.append(a[:2]) or None)
    report = bench.run(bench.build_parser().parse_args(["--metal-kernel-only", "--quick"]))
    assert calls == [(mk.QUICK_ELEMENTS, mk.QUICK_REPEATS)]
    assert report["sizes"] == [] and report["memory"] is None and report["linear_head"] is None
    for conflict in (["--no-metal-kernel"], ["--linear-head-only"], ["--linear-head"]):
        assert bench.main(["--metal-kernel-only", *conflict]) == 2
    assert "not allowed with" in capsys.readouterr().err
