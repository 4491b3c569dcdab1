"""The process-wide runtime settings (commit mode, CPU threads, timings) on a machine without
the Metal kernels: the API works, says so, and leaves the CPU results unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import reference


def test_commit_mode_round_trip_and_context_manager():
    assert tf_metal_ops.get_commit_mode() == "commit"
    tf_metal_ops.set_commit_mode("commit_and_wait")
    try:
        assert tf_metal_ops.get_commit_mode() == "commit_and_wait"
    finally:
        tf_metal_ops.set_commit_mode("commit")
    with tf_metal_ops.commit_and_wait():
        assert tf_metal_ops.get_commit_mode() == "commit_and_wait"
    assert tf_metal_ops.get_commit_mode() == "commit"


def test_context_manager_restores_the_mode_after_an_error():
    with pytest.raises(RuntimeError):
        with tf_metal_ops.commit_and_wait():
            raise RuntimeError("inside")
    assert tf_metal_ops.get_commit_mode() == "commit"


def test_bad_commit_mode_is_refused():
    with pytest.raises(ValueError, match="'wait'"):
        tf_metal_ops.set_commit_mode("wait")


def test_switching_modes_changes_nothing_on_the_cpu_and_retraces_nothing():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 33)).astype(np.float32)
    labels = rng.integers(0, 33, 16)
    traces = []

    @tf.function
    def loss(z):
        traces.append(1)
        return tf_metal_ops.custom_loss(labels, z, gamma=2.0)

    first = loss(logits).numpy()
    with tf_metal_ops.commit_and_wait():
        second = loss(logits).numpy()
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, reference.custom_loss(labels, logits, gamma=2.0), rtol=1e-5)
    assert len(traces) == 1


def test_without_metal_the_build_says_so_and_records_no_timings():
    info = tf_metal_ops.build_info()
    assert info["metal_compiled_in"] is tf_metal_ops.metal_available()
    if sys.platform != "darwin":
        assert info["metal_compiled_in"] is False
        assert info["metal_kernel_library"] == "none"
    assert info["tensorflow_api"].startswith("C API only")
    assert Path(info["library_path"]).exists()
    tf_metal_ops.debug.clear_kernel_timings()
    with tf_metal_ops.commit_and_wait():
        tf_metal_ops.custom_loss([1], [[0.0, 1.0]])
    if not tf_metal_ops.metal_available():
        assert tf_metal_ops.debug.kernel_timings() == []


@pytest.mark.simd
def test_cpu_thread_cap_gives_identical_results():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((512, 1000)).astype(np.float32)  # large enough to split
    labels = rng.integers(0, 1000, 512)
    default = tf_metal_ops.get_cpu_threads()
    assert default >= 1
    try:
        tf_metal_ops.set_cpu_threads(1)
        assert tf_metal_ops.get_cpu_threads() == 1
        one = tf_metal_ops.custom_loss(labels, logits, gamma=0.5, label_smoothing=0.1).numpy()
        tf_metal_ops.set_cpu_threads(4)
        four = tf_metal_ops.custom_loss(labels, logits, gamma=0.5, label_smoothing=0.1).numpy()
    finally:
        tf_metal_ops.set_cpu_threads(0)
    np.testing.assert_array_equal(one, four)
    assert tf_metal_ops.get_cpu_threads() == default
    with pytest.raises(ValueError, match="-2"):
        tf_metal_ops.set_cpu_threads(-2)


def test_environment_variable_turns_commit_and_wait_on_at_import(tmp_path):
    package_parent = str(Path(tf_metal_ops.__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", "import tf_metal_ops; print(tf_metal_ops.get_commit_mode())"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": package_parent, "TF_METAL_OPS_COMMIT_AND_WAIT": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "commit_and_wait"


@pytest.mark.tf_abi
def test_cpu_threads_follow_tensorflow_intra_op_setting(tmp_path):
    """Without a cap of our own the CPU kernels use as many threads as TensorFlow's intra-op
    pool is given; set_cpu_threads overrides that, and 0 goes back to following it. (In a child
    process: TensorFlow's thread settings are fixed once its runtime starts.)"""
    package_parent = str(Path(tf_metal_ops.__file__).resolve().parents[1])
    script = "\n".join([
        "import os, tensorflow as tf, tf_metal_ops",
        "tf.config.threading.set_intra_op_parallelism_threads(1)",
        "tf_metal_ops.custom_loss([0], [[1.0, 2.0]])",
        "followed = tf_metal_ops.get_cpu_threads()",
        "tf_metal_ops.set_cpu_threads(3)",
        "tf_metal_ops.custom_loss([0], [[1.0, 2.0]])",
        "explicit = tf_metal_ops.get_cpu_threads()",
        "tf_metal_ops.set_cpu_threads(0)",
        "print(followed, explicit, tf_metal_ops.get_cpu_threads())",
    ])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": package_parent,
                              "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "3", "1"], out.stdout
