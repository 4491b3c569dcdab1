"""The CPU gradient asks for transparent huge pages on large fresh outputs (csrc/cpu/huge_pages.h).

Without the advice a 262 MB gradient is faulted in 4 KiB at a time on every step, which costs
more than the kernel. What is checked here is the advice itself, which Linux records in the
mapping's flags (`hg` in /proc/self/smaps) whether or not huge pages are free at that moment,
so the test does not depend on the machine's memory state: a process computing a 65 MiB
gradient gains at least 62 MiB of advised mappings, none with TF_METAL_OPS_CPU_HUGE_PAGES=0, and
none when the memory was in use before (TensorFlow's caching allocator). The gradient's values
are checked too (first rows, against the reference). Each setting needs its own process: the
environment variables are read once.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from child_python import last_json_line, run_python

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
    want = ref.custom_loss_grad(labels[:8].numpy(), z[:8].numpy().astype(np.float64),
                                gamma=2.0, label_smoothing=float(np.float32(0.1)))
    scratch = z * 2.0  # as large as a gradient, written (resident), then freed
    del scratch
    steps = []
    for step in range(2):
        before = advised_kib()
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf_metal_ops.custom_loss(labels, z, gamma=2.0, label_smoothing=0.1)
        grad = tape.gradient(loss, z)
        steps.append({"advised_kib": advised_kib() - before,
                      "max_error": float(np.abs(grad[:8].numpy() - want).max())})
        del grad, tape
    print(json.dumps(steps))
""")


def _run(**settings: str) -> list:
    # Our gradient cache would serve the second step from the first step's memory (and advise
    # its own buffer): off here, so each step's fresh TensorFlow output is what is checked.
    # tests/test_gradient_cache.py covers the cache. oneDNN off too: where TensorFlow turns it
    # on by itself (x86-64 CPUs with AVX-512 VNNI, BF16 or AMX), its CPU allocator is the
    # caching one, whose reused memory is never advised (the last test here).
    env = dict(TF_METAL_OPS_CPU_GRADIENT_CACHE="0", TF_ENABLE_ONEDNN_OPTS="0", **settings)
    completed = run_python(CHILD, env=env,
                           unset=("TF_METAL_OPS_CPU_HUGE_PAGES", "TF_CPU_ALLOCATOR_USE_BFC"))
    steps = last_json_line(completed)
    for step in steps:
        assert step["max_error"] < 2e-5, steps
    return steps


def test_large_fresh_gradients_are_advised():
    for step in _run():
        assert step["advised_kib"] >= 62 * 1024, step


def test_advice_can_be_turned_off():
    for step in _run(TF_METAL_OPS_CPU_HUGE_PAGES="0"):
        assert step["advised_kib"] == 0, step


def test_reused_memory_is_not_advised():
    """TensorFlow's caching (BFC) CPU allocator keeps freed memory and hands it out again: the
    gradients land where the scratch tensor was, already faulted in. Nothing to gain there, and
    the advice would split the allocator's mapping."""
    for step in _run(TF_CPU_ALLOCATOR_USE_BFC="true"):
        assert step["advised_kib"] == 0, step
