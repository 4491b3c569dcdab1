"""The linear-head step of two cases timed in turn in one process: what an A/B between two
builds of the native op compares.

Usage (from a checkout with its native library built in place):

    PYTHONPATH=TREE python tests/perf/linear_head_pair.py ROWSxHIDDENxCLASSESxROUNDS [A,B]

A and B are cases of `tf_metal_ops.tools.bench.linear_head` (default `fused,dense_custom`). Each
case's step (the bench's: mean loss, gradients of h, W and b, under `tf.function`) runs once to
warm up, then `ROUNDS` rounds of one step per case, each round starting one case later. Prints
each case's median and fastest step in seconds and A / B of the medians. Run it once per tree,
the trees alternated, so that a change of the machine's load falls on both: each run's ratio
has its own `dense_custom` under the same load as its `fused`.
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tf_metal_ops.tools.bench import linear_head  # noqa: E402


def main(argv) -> int:
    rows, hidden, classes, rounds = (int(part) for part in argv[0].split("x"))
    cases = argv[1].split(",") if len(argv) > 1 else ["fused", "dense_custom"]
    args = linear_head._arguments(*linear_head._inputs(rows, hidden, classes))
    steps = {case: linear_head._step(case) for case in cases}
    for case in cases:
        linear_head._run_step(steps[case], args)
    times = {case: [] for case in cases}
    for round_ in range(rounds):
        for k in range(len(cases)):
            case = cases[(round_ + k) % len(cases)]
            times[case].append(linear_head._run_step(steps[case], args))
    median = {case: statistics.median(t) for case, t in times.items()}
    for case in cases:
        print(f"{case:<13} median {median[case]:.3f} s, fastest {min(times[case]):.3f} s")
    if len(cases) == 2:
        print(f"{cases[0]} / {cases[1]}: {median[cases[0]] / median[cases[1]]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
