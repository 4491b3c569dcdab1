"""Runs checks of a test module again on a narrower variant of the CPU kernels.

The CPU kernels pick their instruction-set variant once per process, so another variant is
tested in a child process started with TF_METAL_OPS_CPU_ISA set to it (portable: the SSE2 / NEON
baseline; avx2: the AVX2 one where the CPU's default is AVX-512), which imports the test module
and runs the given body (with the module as `t`).
"""

from __future__ import annotations

import os
import textwrap

from child_python import run_python


def run_on_portable_isa(module: str, body: str, timeout: int = 900) -> None:
    """Runs `body` (Python, with `tf` and the test module `t` imported) where the portable
    variant is selected; fails with the child's stderr if it raises."""
    run_on_isa("portable", module, body, timeout)


def run_on_isa(isa: str, module: str, body: str, timeout: int = 900) -> None:
    """Runs `body` as run_on_portable_isa does, where the variant `isa` is selected (the child
    checks that it is: the variable only caps the choice, so `isa` must be one this CPU has)."""
    script = "\n".join([
        "import sys",
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})",
        "import tensorflow as tf",
        "from tf_metal_ops import _native",
        f"import {module} as t",
        f"assert _native.runtime().cpu_kernel_isa() == {isa!r}",
        textwrap.dedent(body),
        'print("ok")',
    ])
    completed = run_python(script, env={"TF_METAL_OPS_CPU_ISA": isa}, timeout=timeout)
    assert completed.stdout.strip().endswith("ok"), completed.stderr[-3000:]
