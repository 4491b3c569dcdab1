"""The CPU gradient asks for transparent huge pages on large fresh outputs (csrc/cpu/huge_pages.h).

Without the advice a 262 MB gradient is faulted in 4 KiB at a time on every step, which costs
more than the kernel. What is checked here is the advice itself, which Linux records in the
mapping's flags (`hg` in /proc/self/smaps) whether or not huge pages are free at that moment,
so the test does not depend on the machine's memory state: a process computing a 65 MiB
gradient gains at least 62 MiB of advised mappings, and none with TF_METAL_OPS_CPU_HUGE_PAGES=0.
The gradient's values are checked too (first rows, against the reference). Each setting needs
its own process: the environment variable is read once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import tf_metal_ops

PACKAGE_PARENT = str(Path(tf_metal_ops.__file__).resolve().parent.parent)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP_SETTING.exists(),
    reason="transparent huge pages are a Linux feature and this kernel has none",
)

# 16640 x 1024 float32 = 65 MiB, above the 32 MiB from which the advice is given. Only whole
# 2 MiB pages are advised, and wherever the buffer starts at least 31 of them (62 MiB) lie in it.
CHILD = textwrap.dedent("""
    import json, re
    import numpy as np
    import tensorflow as tf
    import tf_metal_ops
    from tf_metal_ops import reference as ref

    def advised_kib():
        # NumPy advises its own arrays of 4 MiB and more; this process makes none.
        total = 0
        with open("/proc/self/smaps") as smaps:
            blocks = re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps.read())
        for block in blocks:
            flags = [l for l in block.splitlines() if l.startswith("VmFlags:")]
            if flags and " hg" in flags[0]:
                size = [l for l in block.splitlines() if l.startswith("Size:")][0]
                total += int(size.split()[1])
        return total

    rows, classes = 16640, 1024
    z = tf.random.stateless_normal([rows, classes], seed=[1, 2])
    labels = tf.random.stateless_uniform([rows], [3, 4], 0, classes, dtype=tf.int32)
    before = advised_kib()
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = tf_metal_ops.custom_loss(labels, z, gamma=2.0, label_smoothing=0.1)
    grad = tape.gradient(loss, z)
    after = advised_kib()
    want = ref.custom_loss_grad(labels[:8].numpy(), z[:8].numpy().astype(np.float64),
                                gamma=2.0, label_smoothing=float(np.float32(0.1)))
    error = float(np.abs(grad[:8].numpy() - want).max())
    print(json.dumps({"advised_kib": after - before, "max_error": error}))
""")


def _run(setting: str | None) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_METAL_OPS_CPU_HUGE_PAGES", None)
    if setting is not None:
        env["TF_METAL_OPS_CPU_HUGE_PAGES"] = setting
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    completed = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                               env=env, timeout=600, cwd=tempfile.gettempdir(), check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_large_fresh_gradient_is_advised():
    result = _run(None)
    assert result["advised_kib"] >= 62 * 1024, result
    assert result["max_error"] < 2e-5, result


def test_advice_can_be_turned_off():
    result = _run("0")
    assert result["advised_kib"] == 0, result
    assert result["max_error"] < 2e-5, result
