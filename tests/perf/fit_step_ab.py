"""A/B of one Keras `fit()` step between two environment settings, interleaved.

Usage (from the repository root, in its virtual environment):

    python tests/perf/fit_step_ab.py ROWS CLASSES FEATURES BATCHES ROUNDS "A" "B"

A and B are comma-separated NAME=VALUE environment settings ("" for none), e.g.
`python tests/perf/fit_step_ab.py 65536 1000 32 4 6 "" "TF_CPU_ALLOCATOR_USE_BFC=true"`.

Settings such as the CPU allocator are read once per process, so each gets a worker process of
its own, both building the same model (Dense(CLASSES) over FEATURES inputs, CustomLoss(),
metrics=["accuracy"], float32, SGD). The parent then alternates the workers one fit() call at a
time (A B, B A, ...), so a busy moment on a shared machine hits both alike. A call runs BATCHES
batches of ROWS rows; the times between consecutive batch ends are its step times. Prints each
setting's median with its quartiles, and B / A.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def worker(rows: int, classes: int, features: int, batches: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import tf_metal_ops

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows * batches, features), dtype=np.float32)
    y = rng.integers(0, classes, rows * batches).astype(np.int32)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(classes)])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=tf_metal_ops.CustomLoss(),
                  metrics=["accuracy"])
    batch_ends: list = []

    class BatchEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batch_ends.append(time.perf_counter())

    def one_call() -> list:
        batch_ends.clear()
        model.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0,
                  callbacks=[BatchEnds()])
        return [end - start for start, end in zip(batch_ends, batch_ends[1:])]

    one_call()  # traces; the second call lets the allocators reach their steady state
    one_call()
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(one_call()), flush=True)


def _settings(text: str) -> dict:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def main(argv: list) -> int:
    if argv[:1] == ["--worker"]:
        worker(*map(int, argv[1:5]))
        return 0
    if len(argv) != 7:
        print(__doc__, file=sys.stderr)
        return 2
    rows, classes, features, batches, rounds = map(int, argv[:5])
    names = argv[5:7]
    workers = []
    for name in names:
        process = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rows), str(classes), str(features),
             str(batches)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, **_settings(name)))
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker for {name!r} did not start")
        workers.append(process)
    times: list = [[], []]
    for round_ in range(rounds):
        for index in ((0, 1) if round_ % 2 == 0 else (1, 0)):
            workers[index].stdin.write("go\n")
            workers[index].stdin.flush()
            times[index] += json.loads(workers[index].stdout.readline())
    for process in workers:
        process.stdin.close()
        process.wait()
    medians = [statistics.median(t) * 1e3 for t in times]
    for name, median, t in zip(names, medians, times):
        low, _, high = statistics.quantiles(t, n=4)
        print(f"{rows}x{classes} [{name or 'as is'}]: median {median:.1f} ms "
              f"(quartiles {low * 1e3:.1f}-{high * 1e3:.1f}, n={len(t)})")
    print(f"{rows}x{classes}: B / A = {medians[1] / medians[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
