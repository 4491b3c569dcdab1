"""The bench's metal_kernel row: a user's barrier-free elementwise kernel on the CPU path against
TensorFlow's own op for the same work.

MLX's elementwise `exp` kernel (docs/kernels.md's first example) over ELEMENTS float32 values,
through `tf_metal_ops.metal_kernel` (the MSL emulator's threadgroup loops over our thread pool),
against `tf.exp`; both eager, each run ending with the result copied to NumPy, interleaved, the
medians and their ratio reported. The target: the kernel within TARGET times tf.exp's time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict

CASES = (
    ("metal_kernel_exp", "tf_metal_ops.metal_kernel: MLX's exp kernel on the CPU path"),
    ("tf_exp", "tf.exp, TensorFlow's own op"),
)
ELEMENTS = 2 ** 20
QUICK_ELEMENTS = 2 ** 12
REPEATS, QUICK_REPEATS = 31, 3
TARGET = 5.0  # metal_kernel_exp / tf_exp
THREADGROUP = 256
EXP_SOURCE = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""


def measure(elements: int, repeats: int, progress=None) -> Dict[str, Any]:
    """Medians (ms) of interleaved runs of both cases, the ratio and whether it meets TARGET;
    the largest relative difference of the two results is kept as a check of the work."""
    import numpy as np
    import tensorflow as tf

    import tf_metal_ops

    kernel = tf_metal_ops.metal_kernel("bench_exp", ["inp"], ["out"], EXP_SOURCE)
    x = tf.random.stateless_normal([elements], seed=[0, 1])

    def ours():
        return kernel(inputs=[x], output_shapes=[[elements]], output_dtypes=[tf.float32],
                      grid=(elements, 1, 1), threadgroup=(THREADGROUP, 1, 1),
                      template=[("T", tf.float32)])[0].numpy()

    runners = {"metal_kernel_exp": ours, "tf_exp": lambda: tf.exp(x).numpy()}
    results = {name: run() for name, run in runners.items()}  # warm-up: compiles the kernel
    expected = results["tf_exp"]
    max_rel_error = float(np.max(np.abs(results["metal_kernel_exp"] - expected)
                                 / np.abs(expected)))
    names = list(runners)
    times: Dict[str, list] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
            if progress is not None:
                progress.step(f"metal_kernel {name}")
    medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    ratio = medians["metal_kernel_exp"] / medians["tf_exp"]
    return {"elements": elements, "dtype": "float32", "threadgroup": THREADGROUP,
            "repeats": repeats, "median_ms": medians,
            "min_ms": {name: 1e3 * min(values) for name, values in times.items()},
            "ratio": ratio, "target": TARGET, "within_target": ratio <= TARGET,
            "max_rel_error": max_rel_error}


def format_section(section: Dict[str, Any]) -> list:
    lines = [f"metal_kernel on the CPU path: MLX's exp kernel over {section['elements']} float32 "
             f"values against tf.exp, eager, medians of {section['repeats']} interleaved runs:"]
    for name, description in CASES:
        lines.append(f"  {name:<18} {section['median_ms'][name]:10.3f} ms  {description}")
    verdict = "within" if section["within_target"] else "MISSES"
    lines.append(f"  ratio metal_kernel_exp / tf_exp: {section['ratio']:.2f}x ({verdict} the "
                 f"{section['target']:g}x target); max relative difference "
                 f"{section['max_rel_error']:.1e}")
    return lines
