"""CustomLoss under tf.distribute: the same training as one device, on several devices and
processes, and under mixed precision.

Each run is a child process (tests/distribute_worker.py): the logical-device split and the
multi-worker runtime must be set up before TensorFlow initializes its devices, which has long
happened in the pytest process. Every run starts from the same explicit initial weights and
trains on the same global batches with Keras's `sum_over_batch_size` reduction; under a strategy
Keras scales each replica's loss by 1 / replicas, so the summed gradient equals the
single-device one and so do the weights after training (up to float32 summation order).

Ports for MultiWorkerMirroredStrategy are chosen free at run time on 127.0.0.1; both workers are
killed in a `finally`, and every child runs under a timeout (a guard against a hung collective,
not a timing assertion).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

import tf_metal_ops

WORKER = Path(__file__).resolve().parent / "distribute_worker.py"
CHILD_TIMEOUT_S = 420
# Two runs that sum the same float32 gradients in a different order: after 8 SGD steps the
# weights (of size ~1) agree to ~1e-7; 2e-5 leaves room and is still far below how much
# one wrong step would move them (the weights move by > 0.05).
WEIGHT_ATOL = 2e-5


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # The children import the same tf_metal_ops as this process (in-place build or installed).
    package_parent = str(Path(tf_metal_ops.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def _start(mode: str, out: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(out)], env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """Kills the child's whole process group (it may have started helper threads/processes)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _finish(proc: subprocess.Popen, name: str, timeout: float = CHILD_TIMEOUT_S) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        output, _ = proc.communicate()
        pytest.fail(f"{name} did not finish within {timeout} s; output tail:\n{output[-3000:]}")
    if proc.returncode != 0:
        how = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        pytest.fail(f"{name} failed with {how}; output tail:\n{output[-4000:]}")
    return output


def _run(mode: str, out: Path) -> None:
    proc = _start(mode, out)
    try:
        _finish(proc, mode)
    finally:
        _stop(proc)


def _load(path: Path):
    data = np.load(path)
    facts = json.loads(str(data["facts"]))
    weights = [data[f"arr_{i}"] for i in range(len(data.files) - 1)]
    return weights, facts


def _worker_module():
    sys.path.insert(0, str(WORKER.parent))
    try:
        import distribute_worker
    finally:
        sys.path.pop(0)
    return distribute_worker


def _initial_weights() -> List[np.ndarray]:
    return _worker_module().initial_weights()


def _load_forms(path: Path):
    """The weights of each loop form (distribute_worker.train_every_form), and the facts."""
    data = np.load(path)
    facts = json.loads(str(data["facts"]))
    weights = {form: [data[f"{form}_{i}"] for i in range(len(_initial_weights()))]
               for form in _worker_module().LOOP_FORMS}
    return weights, facts


def _assert_same_training(got: List[np.ndarray], want: List[np.ndarray], what: str) -> None:
    assert len(got) == len(want)
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(want, _initial_weights()))
    assert moved > 100 * WEIGHT_ATOL, f"the reference run barely trained (moved {moved})"
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=WEIGHT_ATOL,
                                   err_msg=f"{what}: weight {i} differs from single-device training")


def _free_loopback_ports(count: int) -> List[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def single_device_run(tmp_path_factory):
    """model.fit on one device (the reference for MirroredStrategy)."""
    out = tmp_path_factory.mktemp("single") / "single.npz"
    _run("single", out)
    return _load(out)


@pytest.fixture(scope="module")
def single_device_loop_run(tmp_path_factory):
    """The custom training loop, in each form, on one device (the reference for the
    multi-worker run)."""
    out = tmp_path_factory.mktemp("loop") / "loop.npz"
    _run("loop", out)
    return _load_forms(out)


def test_mirrored_strategy_on_two_cpus_trains_like_one_device(tmp_path, single_device_run):
    out = tmp_path / "mirrored.npz"
    _run("mirrored", out)
    weights, facts = _load(out)
    assert facts["replicas"] == 2 and len(facts["devices"]) == 2, facts
    want_weights, want_facts = single_device_run
    _assert_same_training(weights, want_weights, "MirroredStrategy")
    np.testing.assert_allclose(facts["losses"], want_facts["losses"], rtol=1e-5)


def test_multi_worker_mirrored_strategy_two_processes_train_like_one(tmp_path,
                                                                    single_device_loop_run):
    """Two workers on 127.0.0.1 run the custom loops of distribute_worker.py (Keras 3's
    model.fit does not support MultiWorkerMirroredStrategy), one per form of docs/loss.md's
    recipe: `custom_loss` + `tf.nn.compute_average_loss`, `reduced_custom_loss` and
    `CustomLoss(reduction="sum")`. After 8 steps of each, both workers hold the same weights,
    equal to the same loop's single-process run on the same global batches."""
    ports = _free_loopback_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    outs = [tmp_path / f"worker{i}.npz" for i in range(2)]
    procs: List[subprocess.Popen] = []
    try:
        for i in range(2):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
            procs.append(_start("worker", outs[i], TF_CONFIG=tf_config))
        for i, proc in enumerate(procs):
            _finish(proc, f"worker {i} (cluster {cluster})")
    finally:
        for proc in procs:
            _stop(proc)
    (w0, f0), (w1, f1) = _load_forms(outs[0]), _load_forms(outs[1])
    assert f0["replicas"] == 2 and f1["replicas"] == 2, (f0, f1)
    assert {f0["task"]["index"], f1["task"]["index"]} == {0, 1}
    want_weights, want_facts = single_device_loop_run
    assert want_facts["replicas"] == 1, want_facts
    for form in ("reduced", "keras_sum"):  # the recipe's forms compute one loss
        _assert_same_training(want_weights[form], want_weights["average"], f"one process, {form} vs average")
    for form in w0:
        # The workers apply the same all-reduced gradients: identical weights, bit for bit.
        for i, (a, b) in enumerate(zip(w0[form], w1[form])):
            np.testing.assert_array_equal(a, b, err_msg=f"{form}: weight {i} differs between "
                                                        "the workers")
        _assert_same_training(w0[form], want_weights[form],
                              f"MultiWorkerMirroredStrategy, {form}")
        np.testing.assert_allclose(f0["losses"][form], want_facts["losses"][form], rtol=1e-5,
                                   err_msg=form)
    # The reduced forms make the gradient in the forward op; the average runs the gradient op.
    for facts in (want_facts, f0, f1):
        assert facts["gradient_ops"] == {"average": 1, "reduced": 0, "keras_sum": 0}, facts


def test_mixed_float16_model_trains_with_custom_loss(tmp_path):
    out = tmp_path / "mixed.npz"
    _run("mixed", out)
    data = np.load(out)
    facts = json.loads(str(data["facts"]))
    for variant, op_dtype in (("float32_loss", "float32"), ("float16_loss", "float16")):
        f = facts[variant]
        assert f["compute_dtype"] == "float16" and f["variable_dtype"] == "float32", f
        assert f["logits_dtype"] == "float16", f
        assert f["optimizer"] == "LossScaleOptimizer", f
        # float32_loss: Keras casts the float16 logits to the loss's float32 (its default);
        # float16_loss: CustomLoss(dtype="mixed_float16") runs the op itself in float16.
        assert f["loss_input_dtypes"] == [op_dtype], f
        losses = f["losses"]
        assert all(np.isfinite(losses)), f
        assert losses[-1] < 0.5 * losses[0], f"{variant}: the loss did not fall: {losses}"
        weights = [data[k] for k in data.files if k.startswith(variant)]
        assert weights and all(np.isfinite(w).all() for w in weights), variant
