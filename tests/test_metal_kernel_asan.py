"""A user's kernel that reads out of bounds on the CPU path is reported by AddressSanitizer,
not left to corrupt the process silently.

$TF_METAL_OPS_KERNEL_SANITIZE=address makes the kernel compiler build the kernel and the
emulator with -fsanitize=address; the process must run under the same compiler's ASan runtime.
The test runs a child Python under g++'s runtime (preloaded, as tests/sanitizer/build_and_run.sh
preloads it for the whole native step) with g++ as the kernel compiler: an in-bounds kernel runs
cleanly, the same kernel reading one element past its input is stopped with ASan's report.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from child_python import run_python

pytestmark = pytest.mark.native

SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
import tf_metal_ops

offset = int(sys.argv[1])
kernel = tf_metal_ops.metal_kernel("shifted_copy", ["x"], ["out"], '''
    const uint i = thread_position_in_grid.x;
    out[i] = x[i + OFFSET];
''')
n = 1000
x = tf.range(n, dtype=tf.float32)
(y,) = kernel(inputs=[x], output_shapes=[[n - 1 + offset]], output_dtypes=[tf.float32],
              grid=(n - 1 + offset, 1, 1), threadgroup=(64, 1, 1), template=[("OFFSET", offset)])
print("sum", float(tf.reduce_sum(y)))
"""


def asan_runtime(compiler: str) -> str:
    """The path of `compiler`'s ASan runtime, or "" when it has none."""
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True,
                           text=True, check=False).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else ""


def test_out_of_bounds_read_in_a_kernel_is_reported_by_address_sanitizer(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    runtime = asan_runtime(compiler) if compiler else ""
    if not runtime:
        pytest.skip("needs g++ with its AddressSanitizer runtime (libasan), which the kernel "
                    "must be built against")
    stdcxx = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True,
                            text=True, check=False).stdout.strip()
    env = {
        "TF_METAL_OPS_KERNEL_SANITIZE": "address",
        "TF_METAL_OPS_CLANG": compiler,
        "TF_METAL_OPS_CACHE_DIR": str(tmp_path / "cache"),
        # libstdc++ too: Python is a C program, and ASan's __cxa_throw interceptor needs it.
        "LD_PRELOAD": f"{runtime} {stdcxx}",
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:print_summary=1",
    }
    # The control: in bounds (the last thread reads the last element), under the same runtime.
    clean = run_python(SCRIPT, "0", env=env)
    assert "sum 498501.0" in clean.stdout, clean.stdout + clean.stderr[-2000:]
    assert "AddressSanitizer" not in clean.stderr

    # One element past the end of x: ASan stops the process with its report, naming the kernel.
    broken = run_python(SCRIPT, "1", env=env, must_succeed=False)
    assert broken.returncode != 0, broken.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in broken.stderr, broken.stderr[-3000:]
    assert "READ of size 4" in broken.stderr
    assert "custom_kernel_shifted_copy" in broken.stderr, broken.stderr[-3000:]
    assert "sum" not in broken.stdout
