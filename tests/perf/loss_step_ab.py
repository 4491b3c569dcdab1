"""A/B of CustomLoss's training-step work between two source trees, interleaved.

Usage (from the repository root, in its virtual environment):

    python tests/perf/loss_step_ab.py TREE_A TREE_B ROWSxCLASSES[,ROWSxCLASSES...] ROUNDS

TREE_A and TREE_B are checkouts of this repository, each with its native library built in place
(`python setup.py build_ext --inplace`); the same interpreter and TensorFlow serve both. This
is how a change to the kernels or to `CustomLoss` is shown to cost nothing: e.g. the commit
before a change as A, the change as B.

Each tree gets a worker process (PYTHONPATH = the tree, so its `tf_metal_ops` is the one
imported). A worker times what `python -m tf_metal_ops bench` times for our cases: under
`tf.function`, `CustomLoss(...)(labels, z)` reduced to its mean and its gradient with respect to
the logits z, float32, for plain cross-entropy, label smoothing 0.1, and focal (gamma 2) with
smoothing 0.1. The parent alternates the workers one round at a time (A B, B A, ...), and only
one of them runs at any moment, so a busy moment on a shared machine hits both alike. A round
runs every case a few times per size. Prints, per size and case, each tree's median with its
quartiles, B / A of the medians, and the median of the rounds' own B / A ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "ours_ce": {},
    "ours_ce_ls": {"label_smoothing": 0.1},
    "ours_focal": {"gamma": 2.0, "label_smoothing": 0.1},
}


def _sizes(text: str) -> list:
    return [tuple(int(part) for part in item.split("x")) for item in text.split(",") if item]


def _runs_per_round(rows: int, classes: int) -> int:
    # About 2e7 elements per case and round, between 2 and 20 runs.
    return max(2, min(20, int(2e7 // max(rows * classes, 1))))


def worker(sizes_text: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    import tf_metal_ops

    steps = []
    for rows, classes in _sizes(sizes_text):
        rng = np.random.default_rng(0)
        z = tf.constant(rng.standard_normal((rows, classes), dtype=np.float32))
        labels = tf.constant(rng.integers(0, classes, rows).astype(np.int32))
        for case, options in CASES.items():
            loss = tf_metal_ops.CustomLoss(**options)

            @tf.function(reduce_retracing=False)
            def step(z, loss=loss, labels=labels):
                with tf.GradientTape() as tape:
                    tape.watch(z)
                    value = loss(labels, z)
                return value, tape.gradient(value, z)

            for _ in range(3):  # traces, then lets the allocator reach its steady state
                step(z)[1].numpy()
            steps.append((f"{rows}x{classes}", case, step, z, _runs_per_round(rows, classes)))
    print("ready " + tf_metal_ops.__file__, flush=True)
    for _ in sys.stdin:
        times = {}
        for size, case, step, z, runs in steps:
            samples = []
            for _ in range(runs):
                start = time.perf_counter()
                step(z)[1].numpy()
                samples.append(time.perf_counter() - start)
            times[f"{size} {case}"] = samples
        print(json.dumps(times), flush=True)


def main(argv: list) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return 0
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    trees = [os.path.abspath(tree) for tree in argv[:2]]
    sizes_text, rounds = argv[2], int(argv[3])
    _sizes(sizes_text)  # a malformed size fails here, before any worker starts
    workers = []
    for tree in trees:
        env = dict(os.environ, PYTHONPATH=tree)
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                    sizes_text], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=env, cwd=tree)
        line = process.stdout.readline().strip()
        if not line.startswith("ready ") or not line[len("ready "):].startswith(tree):
            raise RuntimeError(f"the worker for {tree} did not start from it: {line!r}")
        workers.append(process)
    samples: list = [{}, {}]
    pair_ratios: dict = {}
    for round_ in range(rounds):
        medians = [None, None]
        for index in ((0, 1) if round_ % 2 == 0 else (1, 0)):
            workers[index].stdin.write("go\n")
            workers[index].stdin.flush()
            result = json.loads(workers[index].stdout.readline())
            medians[index] = {key: statistics.median(t) for key, t in result.items()}
            for key, t in result.items():
                samples[index].setdefault(key, []).extend(t)
        for key in medians[0]:
            pair_ratios.setdefault(key, []).append(medians[1][key] / medians[0][key])
    for process in workers:
        process.stdin.close()
        process.wait()
    print(f"A = {trees[0]}\nB = {trees[1]}\n{rounds} rounds")
    for key in samples[0]:
        parts = []
        for name, runs in zip("AB", (samples[0][key], samples[1][key])):
            low, median, high = statistics.quantiles(runs, n=4)
            parts.append(f"{name} {statistics.median(runs) * 1e3:.2f} ms "
                         f"({low * 1e3:.2f}-{high * 1e3:.2f}, n={len(runs)})")
        ratio = statistics.median(samples[1][key]) / statistics.median(samples[0][key])
        rounds_ratio = statistics.median(pair_ratios[key])
        print(f"{key:24s} {parts[0]:34s} {parts[1]:34s} B/A {ratio:.2f} "
              f"(rounds' median {rounds_ratio:.2f}, range {min(pair_ratios[key]):.2f}-"
              f"{max(pair_ratios[key]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
