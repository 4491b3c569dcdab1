"""What metal_kernel's CPU path costs: compiling, loading, and running against TensorFlow.

Usage (from the repository root, in its virtual environment):

    python tests/perf/metal_kernel_costs.py [--repeats 15]

Uses a fresh cache directory, so it measures, in this order: the first call of a kernel (the
emulator's objects and the kernel compiled by the compiler tf_metal_ops/_toolchain.py picks:
$TF_METAL_OPS_CLANG=ziglang for the wheel's), the first call of a second kernel (its compile
alone), and a new process loading the first from the disk cache. Then MLX's elementwise exp over
2^20 float32 values (a barrier-free kernel: each threadgroup a loop over its threads,
threadgroups over the thread pool) against tf.exp, the two interleaved, and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

EXP = "uint i = thread_position_in_grid.x; out[i] = metal::exp(inp[i]);"
LOAD_IN_NEW_PROCESS = f"""
import time, tensorflow as tf, tf_metal_ops
k = tf_metal_ops.metal_kernel("cost_exp", ["inp"], ["out"], {EXP!r})
x = tf.ones([4])
start = time.perf_counter()
k(inputs=[x], output_shapes=[[4]], output_dtypes=[tf.float32], grid=(4, 1, 1),
  threadgroup=(4, 1, 1))
print(time.perf_counter() - start, tf_metal_ops.kernel_cache_info()["from_disk"])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="tfmo_kernel_costs_")
    os.environ["TF_METAL_OPS_CACHE_DIR"] = cache
    import tensorflow as tf

    import tf_metal_ops

    def timed_first_call(name: str, source: str) -> float:
        kernel = tf_metal_ops.metal_kernel(name, ["inp"], ["out"], source)
        x = tf.ones([4])
        start = time.perf_counter()
        kernel(inputs=[x], output_shapes=[[4]], output_dtypes=[tf.float32], grid=(4, 1, 1),
               threadgroup=(4, 1, 1))
        return time.perf_counter() - start

    first = timed_first_call("cost_exp", EXP)
    second = timed_first_call("cost_log", EXP.replace("exp", "log"))
    child = subprocess.run([sys.executable, "-c", LOAD_IN_NEW_PROCESS], capture_output=True,
                           text=True, check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    load_seconds, from_disk = child.stdout.split()
    print(f"compiler: {tf_metal_ops.kernel_cache_info()['compiler']}")
    print(f"first kernel, emulator included: {first:.2f} s")
    print(f"second kernel: {second:.2f} s")
    print(f"new process, from the disk cache ({from_disk} load): {float(load_seconds):.3f} s")

    n = 2 ** 20
    kernel = tf_metal_ops.metal_kernel("cost_exp", ["inp"], ["out"], EXP)
    x = tf.random.uniform([n], -5.0, 5.0)

    def ours():
        return kernel(inputs=[x], output_shapes=[[n]], output_dtypes=[tf.float32],
                      grid=(n, 1, 1), threadgroup=(256, 1, 1))[0].numpy()

    def theirs():
        return tf.exp(x).numpy()

    ours(), theirs()
    times = {"metal_kernel": [], "tf.exp": []}
    for _ in range(args.repeats):
        for label, fn in (("metal_kernel", ours), ("tf.exp", theirs)):
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    medians = {label: statistics.median(t) for label, t in times.items()}
    print(f"exp over 2^20 float32, medians of {args.repeats}: metal_kernel "
          f"{medians['metal_kernel'] * 1e3:.2f} ms, tf.exp {medians['tf.exp'] * 1e3:.2f} ms, "
          f"ratio {medians['metal_kernel'] / medians['tf.exp']:.1f}x")


if __name__ == "__main__":
    main()
