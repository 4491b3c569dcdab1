"""`python -m tf_metal_ops` as a user runs it: each command in a subprocess.

Exit codes (tf_metal_ops/tools/cli.py): 0 success, 1 check found a FAIL, 2 usage error, 3 environment
problem. Each TensorFlow start-up costs seconds on a small machine, so every slow command runs
once and the tests share its output.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

import tf_metal_ops
from tf_metal_ops import _command_line
from tf_metal_ops.tools import checks, cli, demo

# The directory holding the tf_metal_ops the tests import, so the subprocesses run the same
# package (a source checkout with the library built in place, or an installed wheel).
PACKAGE_PARENT = str(Path(tf_metal_ops.__file__).resolve().parent.parent)


def run_cli(*args: str, env: dict[str, str] | None = None,
            python_path: str | None = None) -> subprocess.CompletedProcess:
    environ = dict(os.environ if env is None else env)
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (python_path, PACKAGE_PARENT, environ.get("PYTHONPATH")) if p)
    # cwd outside the checkout: `python -m` puts the working directory first on sys.path, and
    # the bare source tree (no native library) must not shadow the package under test.
    return subprocess.run([sys.executable, "-m", "tf_metal_ops", *args], capture_output=True,
                          text=True, env=environ, timeout=600, cwd=tempfile.gettempdir())


# TensorFlow's C++ log lines (Abseil's prefix: severity, date, time, thread, file:line) and
# Abseil's banner; written here apart from the tool's own pattern, which this checks.
TENSORFLOW_LOG_LINE = re.compile(r"[IWEF]\d{4} \S+ +\d+ \S+\] "
                                 r"|WARNING: All log messages before absl::")


def start_up_log_lines(stderr: str) -> collections.Counter:
    """TensorFlow's log lines in `stderr`, counted, each with its time stamp and thread id cut
    off (they differ from run to run)."""
    return collections.Counter(re.sub(r"^([IWEF])\d{4} \S+ +\d+ ", r"\1 ", line)
                               for line in stderr.splitlines() if TENSORFLOW_LOG_LINE.match(line))


def without_tensorflow_log_level(**extra: str) -> dict:
    """This process's environment as a newcomer's: no TF_CPP_MIN_LOG_LEVEL (CI scripts and the
    project's notes set it for other runs)."""
    env = {k: v for k, v in os.environ.items() if k != _command_line.LOG_LEVEL_ENV}
    env.update(extra)
    return env


def assert_no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert "Traceback" not in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------
# Usage errors: exit 2 with the usage, before TensorFlow is imported.


@pytest.mark.parametrize("args, complaint", [
    ((), "required"),
    (("frobnicate",), "invalid choice"),
    (("check", "--dtype", "float8"), "unknown dtype 'float8'"),
    (("check", "--dtype", "float32,int32"), "unknown dtype 'int32'"),
    (("demo", "--epochs", "0"), "--epochs"),
    (("demo", "--epochs", "many"), "--epochs"),
    (("demo", "--seed", "-1"), "--seed"),
    (("demo", "--plot", "curves.jpg"), "ending in .png"),
    (("demo", "--plot", "/no/such/dir/curves.png"), "does not exist"),
    (("info", "--quick"), "unrecognized arguments: --quick"),
])
def test_usage_error_exits_2_with_usage(args, complaint, capsys):
    # In-process (argparse's SystemExit) to keep the suite fast; the subprocess test below
    # shows the same path end to end.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(args))
    assert exit_info.value.code == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert "usage: tf-metal-ops" in err
    assert complaint in err


def test_usage_error_in_a_subprocess_exits_2():
    result = run_cli("check", "--bogus")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "usage: tf-metal-ops check" in result.stderr
    assert "unrecognized arguments: --bogus" in result.stderr
    assert_no_traceback(result)


def test_help_lists_commands_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("info", "check", "demo", "exit codes", "3 environment problem",
                  "1 check found a FAIL", "2 usage error"):
        assert words in out


# ---------------------------------------------------------------------------------------------
# Environment problems: exit 3, one sentence, no traceback.


def test_missing_tensorflow_is_one_sentence_exit_3(tmp_path):
    # A `tensorflow` that fails to import, shadowing the real one.
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('simulated: no TensorFlow here')\n")
    result = run_cli("info", python_path=str(tmp_path))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert_no_traceback(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tf-metal-ops: TensorFlow cannot be imported")
    assert "pip install" in lines[0]


def test_missing_native_library_is_one_sentence_exit_3(tmp_path):
    # A copy of the Python package without its native library.
    source = Path(tf_metal_ops.__file__).resolve().parent
    shutil.copytree(source, tmp_path / "tf_metal_ops",
                    ignore=shutil.ignore_patterns("*.so", "*.dylib", "*.pyd", "*.metallib",
                                                  "__pycache__"))
    environ = without_tensorflow_log_level(PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "tf_metal_ops", "check", "--quick"],
                            capture_output=True, text=True, env=environ, timeout=600,
                            cwd=str(tmp_path))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert_no_traceback(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "native library" in lines[0] and "_tf_metal_ops" in lines[0]


def test_plot_without_matplotlib_or_with_it(tmp_path, capsys):
    out = tmp_path / "curves.png"
    if importlib.util.find_spec("matplotlib") is None:
        # Refused before any training, in-process (nothing heavy runs).
        assert cli.main(["demo", "--epochs", "1", "--plot", str(out)]) == cli.EXIT_ENVIRONMENT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install matplotlib" in err[0]
        assert not out.exists()
    else:
        result = run_cli("demo", "--epochs", "1", "--plot", str(out))
        assert_no_traceback(result)
        assert result.returncode == 0, result.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"training curves saved to {out}" in result.stdout


# ---------------------------------------------------------------------------------------------
# info


@pytest.fixture(scope="module")
def newcomer_info():
    return run_cli("info", env=without_tensorflow_log_level())


def test_info_lists_versions_kernels_and_build(newcomer_info):
    result = newcomer_info
    assert result.returncode == 0, result.stderr
    assert_no_traceback(result)
    out = result.stdout
    import tensorflow as tf

    assert re.search(rf"^TensorFlow\s+{re.escape(tf.__version__)}", out, re.M), out
    assert re.search(r"^Python\s+\d+\.\d+\.\d+", out, re.M), out
    assert re.search(r"^Keras\s+3\.", out, re.M), out
    assert re.search(r"^tensorflow-metal\s+\S", out, re.M), out
    # The kernel devices come from TensorFlow's registry: CPU at least, here and on a Mac.
    assert re.search(r"^  TfMetalOps>CustomLoss\s+.*CPU", out, re.M), out
    assert re.search(r"^  TfMetalOps>CustomLossGrad\s+.*CPU", out, re.M), out
    assert re.search(r"^Native library\s+\S*_tf_metal_ops", out, re.M), out
    assert re.search(r"^  built_against_tensorflow\s+\d", out, re.M), out
    assert re.search(r"^Commit mode\s+(commit|commit_and_wait)\b", out, re.M), out
    gpus = tf.config.list_logical_devices("GPU")
    assert ("no GPU found" in out) == (not gpus)


def test_info_json_matches_the_kernel_registry():
    from tf_metal_ops.tools import environment
    from tensorflow.python.framework import kernels

    info = json.loads(json.dumps(environment.describe()))  # JSON-serializable
    for op in environment.OP_NAMES:
        expected = sorted({k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel})
        assert sorted({k["device_type"] for k in info["kernels"][op]}) == expected
        assert "CPU" in expected
    assert info["build_info"]["built_against_tensorflow"]
    assert info["commit_mode"] in ("commit", "commit_and_wait")
    assert info["native_library"] and Path(info["native_library"]).exists()
    assert info["devices"][0] == {"name": "CPU:0", "type": "CPU"}


# ---------------------------------------------------------------------------------------------
# check


@pytest.fixture(scope="module")
def quick_check_json():
    result = run_cli("check", "--quick", "--json")
    assert_no_traceback(result)
    return result


def test_check_quick_json_schema_and_exit_code(quick_check_json):
    result = quick_check_json

    def reject(constant: str) -> None:  # NaN / Infinity are not JSON; the report spells them
        raise AssertionError(f"non-standard JSON constant {constant} in check --json")

    doc = json.loads(result.stdout, parse_constant=reject)
    assert result.returncode == (0 if doc["passed"] else 1)
    assert result.returncode == 0, json.dumps(
        [c for c in doc["cases"] if not c["passed"]], indent=1)[:3000]
    assert doc["schema_version"] == 1 and doc["verdict"] == "PASS" and doc["quick"] is True
    assert doc["dtypes"] == list(checks.DTYPES)
    assert "CPU:0" in doc["devices"]
    quick_names = [c.name for c in checks.CASES if c.quick]
    assert len(doc["cases"]) == len(quick_names) * len(checks.DTYPES)
    assert doc["summary"] == {"checks": len(doc["cases"]), "passed": len(doc["cases"]),
                              "failed": 0}
    assert set(doc["tolerances"]) == set(checks.DTYPES)
    for case in doc["cases"]:
        assert case["name"] in quick_names and case["dtype"] in checks.DTYPES
        assert {"batch_shape", "num_classes", "labels", "gamma", "label_smoothing"} <= set(
            case["params"])
        report = case["report"]
        assert report["has_reference"] is True and report["verdict"] == "PASS"
        outputs = {(c["output"], c["expected"]) for c in report["comparisons"]}
        for device in doc["devices"]:
            assert report["placements"][device]
        assert ("out['loss']", "reference") in outputs and ("out['grad']", "reference") in outputs
        for c in report["comparisons"]:
            assert {"max_abs_error", "max_rel_error", "worst_index", "nan_mismatches",
                    "inf_mismatches", "mismatches", "rtol", "atol", "passed"} <= set(c)
            assert (c["rtol"], c["atol"]) == tuple(checks.CHECK_TOLERANCES[case["dtype"]])
    if not doc["gpu_found"]:
        assert any(n.startswith("No GPU found") for n in doc["notes"])


def test_check_text_table_and_summary(capsys):
    # In-process: the subprocess path is covered by the JSON test above.
    code = cli.main(["check", "--quick", "--dtype", "float32", "--dtype", "float16"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert re.search(r"^case\s+dtype\s+compared\s+ran on", out, re.M), out
    n = sum(c.quick for c in checks.CASES)
    assert f"{2 * n} checks ({n} cases x 2 dtypes): {2 * n} PASS, 0 FAIL -> PASS" in out
    assert re.search(r"^large C=50257\s+float16\s+CPU:0 vs reference\s+CPU:0\s.*PASS$", out,
                     re.M), out
    tolerances = next(line for line in out.splitlines() if line.startswith("tolerances"))
    assert "float32" in tolerances and "float16" in tolerances and "bfloat16" not in tolerances


def test_check_failure_exits_1_and_names_the_worst_element(monkeypatch, capsys):
    # No tolerance at all: float32 rounding is enough to fail, as a real regression would.
    monkeypatch.setitem(checks.CHECK_TOLERANCES, "float32", (0.0, 0.0))
    code = cli.main(["check", "--quick", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_CHECK_FAILED == 1
    assert re.search(r"FAIL$", out, re.M)
    assert re.search(r"out\['(loss|grad)'\] CPU:0 vs reference: \d+ out of tolerance, 0 NaN and "
                     r"0 Inf mismatches; worst at \[", out), out
    assert out.rstrip().endswith("-> FAIL")


# ---------------------------------------------------------------------------------------------
# demo


@pytest.fixture(scope="module")
def default_demo():
    # As a newcomer runs it: TF_CPP_MIN_LOG_LEVEL unset (CI scripts set it for other runs).
    result = run_cli("demo", env=without_tensorflow_log_level())
    assert_no_traceback(result)
    return result


def test_demo_prints_no_tensorflow_error_lines(default_demo):
    # Keras's tf.data graph on recent TensorFlow logs "NodeDef mentions attribute
    # use_unbounded_threadpool" at error level ("E0000 ..."); the tool keeps TensorFlow's C++
    # log to fatal lines unless the user chose a level.
    errors = [line for line in default_demo.stderr.splitlines() if re.match(r"E\d{4} ", line)]
    assert not errors, errors
    assert not start_up_log_lines(default_demo.stderr), default_demo.stderr


def test_tensorflow_start_up_lines_only_when_the_user_chose_a_log_level(newcomer_info):
    """TensorFlow logs some lines while it loads whatever TF_CPP_MIN_LOG_LEVEL says (x86-64:
    "oneDNN custom operations are on" after Abseil's banner). The tool holds them back unless
    the user set the level; then they are all there, as `import tensorflow` prints them."""
    control = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                             text=True, timeout=600, cwd=tempfile.gettempdir(),
                             env=without_tensorflow_log_level(TF_CPP_MIN_LOG_LEVEL="0"))
    assert control.returncode == 0, control.stderr
    expected = start_up_log_lines(control.stderr)
    assert newcomer_info.returncode == 0, newcomer_info.stderr
    assert not start_up_log_lines(newcomer_info.stderr), newcomer_info.stderr
    chosen = run_cli("info", env=without_tensorflow_log_level(TF_CPP_MIN_LOG_LEVEL="0"))
    assert chosen.returncode == 0, chosen.stderr
    if not expected:
        pytest.skip("TensorFlow logs nothing while it loads on this machine: nothing to hold "
                    "back, and the user's level shows nothing either")
    assert not expected - start_up_log_lines(chosen.stderr), chosen.stderr


def test_held_back_lines_are_abseils_only():
    captured = (b"WARNING: All log messages before absl::InitializeLog() is called are written "
                b"to STDERR\n"
                b"I0000 00:00:1796456850.464859   21112 port.cc:153] oneDNN custom operations "
                b"are on.\n"
                b"W0000 00:00:1796456850.5   21112 cpu_feature_guard.cc:12] a notice\n"
                b"E1205 07:45:57.123456    7 graph.cc:9] an error-level line\n"
                b"F1205 07:45:57.123456    7 graph.cc:9] Check failed: a fatal line\n"
                b"/site-packages/x.py:3: RuntimeWarning: a Python warning\n"
                b"  warnings.warn(\n"
                b"Illustrating: I0000 in the middle of a line\n"
                b"no newline at the end")
    assert _command_line.without_start_up_log(captured) == (
        b"F1205 07:45:57.123456    7 graph.cc:9] Check failed: a fatal line\n"
        b"/site-packages/x.py:3: RuntimeWarning: a Python warning\n"
        b"  warnings.warn(\n"
        b"Illustrating: I0000 in the middle of a line\n"
        b"no newline at the end")


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["-m", "demo"], ["python", "-m", "tf_metal_ops", "demo"], True),
    (["-m"], ["python", "-m", "tf_metal_ops.tools.cli"], True),
    (["/venv/bin/tf-metal-ops", "info"], ["python", "/venv/bin/tf-metal-ops", "info"], True),
    (["-m"], ["python", "-m", "pytest"], False),
    (["train.py"], ["python", "train.py"], False),
    ([""], ["python", "-c", "import tf_metal_ops"], False),
])
def test_command_line_detection(monkeypatch, argv, orig_argv, expected):
    from tf_metal_ops import _command_line

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv, raising=False)
    assert _command_line.invoked_as_command() is expected
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with _command_line.quiet_tensorflow_log_for_command():
        assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == ("3" if expected else None)
    # A level the user chose stays.
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    with _command_line.quiet_tensorflow_log_for_command():
        assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"


def test_demo_defaults_reach_95_percent(default_demo):
    assert default_demo.returncode == 0, default_demo.stderr
    out = default_demo.stdout
    accuracy = float(re.search(r"^held-out accuracy: ([0-9.]+) \(\d+/450\)$", out, re.M)[1])
    assert accuracy >= 0.95, out
    epochs = re.findall(rf"^epoch\s+\d+/{demo.DEFAULT_EPOCHS} \[#+\] 43/43  loss [0-9.]+", out,
                        re.M)
    assert len(epochs) == demo.DEFAULT_EPOCHS, out
    assert "CustomLoss(gamma=2.0, label_smoothing=0.1)" in out
    device = re.search(r"^loss kernels ran on: (\S+) \(forward TfMetalOps>CustomLoss\), (\S+) "
                       r"\(gradient TfMetalOps>CustomLossGrad\)", out, re.M)
    assert device, out
    import tensorflow as tf

    if not tf.config.list_logical_devices("GPU"):
        assert device[1] == device[2] == "CPU:0"


def test_demo_is_deterministic_for_a_seed(default_demo):
    # A second process with the same seed trains the same first epoch: the figures printed for
    # it (and the data split) equal the default run's. The seed fixes everything random; the
    # total number of epochs does not change epoch 1.
    one = run_cli("demo", "--epochs", "1")
    assert one.returncode == 0, one.stderr

    def first_epoch(text: str) -> str:
        line = next(line for line in text.splitlines() if re.match(r"epoch\s+1/", line))
        return line.split("] ", 1)[1]

    def data_line(text: str) -> str:
        return next(line for line in text.splitlines() if line.startswith("data:"))

    assert first_epoch(one.stdout) == first_epoch(default_demo.stdout)
    assert data_line(one.stdout) == data_line(default_demo.stdout)
    assert "(seed 0)" in one.stdout and re.search(r"loss \d\.\d{4}", first_epoch(one.stdout))


def test_demo_under_jit_compile_says_the_composed_xla_path_ran():
    # Under XLA our op cannot run; the loss is the composed path, and the report says so
    # instead of naming an op placement that did not happen.
    result = run_cli("demo", "--epochs", "1", "--jit-compile")
    assert result.returncode == 0, result.stderr
    assert_no_traceback(result)
    line = next(l for l in result.stdout.splitlines() if l.startswith("loss kernels ran on"))
    assert line.startswith("loss kernels ran on: composed (XLA) on "), line
    assert "TfMetalOps>CustomLoss" not in line.split(";")[0], line


def test_a_fatal_line_reaches_stderr_when_loading_kills_the_tool(tmp_path):
    """TensorFlow's load can end the process (a CHECK failure: a fatal line, then abort): the
    filter process outlives it and still writes that line, while the start-up lines stay held."""
    script = tmp_path / "dies_while_loading.py"
    script.write_text(
        "import os, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tf_metal_ops import _command_line\n"  # TensorFlow is already loaded: harmless
        "with _command_line._stderr_without_start_up_log():\n"
        "    os.write(2, b'I0000 00:00:1796456850.464859   21 port.cc:153] oneDNN notice\\n')\n"
        "    print('a Python warning before the end', file=sys.stderr, flush=True)\n"
        "    os.write(2, b'F0000 00:00:1796456850.5   21 cpu_feature_guard.cc:9] Check failed\\n')\n"
        "    os.abort()\n")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(_command_line.__file__)))
    result = subprocess.run([sys.executable, str(script), package_root], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line]
    assert lines[-2:] == ["a Python warning before the end",
                          "F0000 00:00:1796456850.5   21 cpu_feature_guard.cc:9] Check failed"]
    assert "oneDNN notice" not in result.stderr
