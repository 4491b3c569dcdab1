"""GFLOP/s of linear_cross_entropy's three products: chunked as the native op runs them, whole
on the same BLAS, and whole on TensorFlow's MatMul.

    python tests/perf/gemm_rate.py [--rows 8192] [--hidden 512] [--classes 32000]
                                   [--chunk 256] [--repeats 3]

For h [N, d], W [d, V] and a gradient g [N, V] (float32), the products of a training step:

    logits   z   = h W        (N x V, inner d)
    d hidden dh  = g W^T      (N x d, inner V)
    d kernel dW  = h^T g      (d x V, inner N)

chunk loop: the native op's loop (csrc/cpu/linear_cross_entropy_cpu.cc): per chunk of `chunk`
rows, z_c = h_c W into one reused chunk x V buffer (beta 0), dh_c = g_c W^T into its rows of
dh, dW += h_c^T g_c (beta 0 on the first chunk, 1 after), on tf_metal_ops's BLAS
(`_native.runtime().sgemm`, csrc/cpu/gemm.h). whole: each product as one call of the same
BLAS. tf: each product as one tf.matmul under tf.function (oneDNN's where TensorFlow uses it),
waited for by reading one element (not the whole product, whose copy to NumPy would be timed).
Each figure is the median of `repeats` runs, the three variants in turn per repeat. Prints one
line per product and variant, and the machine, BLAS and oneDNN setting first.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--classes", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import tensorflow as tf

    from tf_metal_ops import _native
    from tf_metal_ops.tools.bench.linear_head import backends

    n, d, v, chunk = args.rows, args.hidden, args.classes, args.chunk
    sgemm = _native.runtime().sgemm
    rng = np.random.default_rng(0)
    h = rng.standard_normal((n, d), dtype=np.float32)
    w = rng.standard_normal((d, v), dtype=np.float32) / np.float32(d ** 0.5)
    g = rng.standard_normal((n, v), dtype=np.float32) / np.float32(v)
    z_chunk = np.empty((chunk, v), np.float32)
    dh = np.empty((n, d), np.float32)
    dw = np.empty((d, v), np.float32)

    def chunk_logits():
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            sgemm(h[start:start + rows], w, z_chunk[:rows])

    def chunk_d_hidden():
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            sgemm(g[start:start + rows], w, dh[start:start + rows], trans_b=True)

    def chunk_d_kernel():
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            sgemm(h[start:start + rows], g[start:start + rows], dw, trans_a=True,
                  beta=0.0 if start == 0 else 1.0)

    z_whole = np.empty((n, v), np.float32)
    whole = {"logits": lambda: sgemm(h, w, z_whole),
             "d_hidden": lambda: sgemm(g, w, dh, trans_b=True),
             "d_kernel": lambda: sgemm(h, g, dw, trans_a=True)}
    th, tw, tg = tf.constant(h), tf.constant(w), tf.constant(g)
    tf_products = {
        "logits": tf.function(lambda: tf.matmul(th, tw)),
        "d_hidden": tf.function(lambda: tf.matmul(tg, tw, transpose_b=True)),
        "d_kernel": tf.function(lambda: tf.matmul(th, tg, transpose_a=True)),
    }
    variants = {
        "logits": {"chunk loop": chunk_logits, "whole": whole["logits"],
                   "tf": lambda: tf_products["logits"]()[0, 0].numpy()},
        "d_hidden": {"chunk loop": chunk_d_hidden, "whole": whole["d_hidden"],
                     "tf": lambda: tf_products["d_hidden"]()[0, 0].numpy()},
        "d_kernel": {"chunk loop": chunk_d_kernel, "whole": whole["d_kernel"],
                     "tf": lambda: tf_products["d_kernel"]()[0, 0].numpy()},
    }
    flops = 2.0 * n * d * v
    info = backends()
    print(f"{time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} cores; "
          f"N={n} d={d} V={v} chunk={chunk}; blas: {info['blas']} ({info['blas_config']}); "
          f"TF {info['tensorflow']}, TF_ENABLE_ONEDNN_OPTS={info['TF_ENABLE_ONEDNN_OPTS']}, "
          f"oneDNN on: {info['onednn_on']}; "
          f"threads {info['cpu_threads']}")
    for product, runs in variants.items():
        for run in runs.values():  # warm-up: first-touch page faults, tracing
            run()
        seconds = {name: [] for name in runs}
        for repeat in range(args.repeats):
            names = list(runs)
            for k in range(len(names)):
                name = names[(repeat + k) % len(names)]
                start = time.perf_counter()
                runs[name]()
                seconds[name].append(time.perf_counter() - start)
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"  {product:<9} {name:<11} {median * 1e3:9.1f} ms  "
                  f"{flops / median / 1e9:7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
