"""Runs checks of a test module again on the baseline (SSE2 / NEON) kernels.

The CPU kernels pick their instruction-set variant once per process, so the other variant is
tested in a child process started with TF_METAL_OPS_CPU_ISA=portable, which imports the test
module and runs the given body (with the module as `t`).
"""

from __future__ import annotations

import os
import textwrap

from child_python import run_python


def run_on_portable_isa(module: str, body: str, timeout: int = 900) -> None:
    """Runs `body` (Python, with `tf` and the test module `t` imported) where the portable
    variant is selected; fails with the child's stderr if it raises."""
    script = "\n".join([
        "import sys",
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})",
        "import tensorflow as tf",
        "from tf_metal_ops import _native",
        f"import {module} as t",
        'assert _native.runtime().cpu_kernel_isa() == "portable"',
        textwrap.dedent(body),
        'print("ok")',
    ])
    completed = run_python(script, env={"TF_METAL_OPS_CPU_ISA": "portable"}, timeout=timeout)
    assert completed.stdout.strip().endswith("ok"), completed.stderr[-3000:]
