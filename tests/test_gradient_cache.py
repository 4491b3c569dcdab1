"""The CPU gradient cache (csrc/cpu/gradient_cache.h): a large gradient that cannot take over
its logits' buffer sets one aside, and the next step writes into it instead of fresh memory.

Checked in child processes (the switch is read once per process): which steps reuse a kept
buffer, that every gradient is right although its buffer holds the previous step's values
(ignored rows included, which the kernel zeroes rather than computes), that a live gradient's
buffer is never handed out again, that a much smaller gradient does not take a large buffer,
that release frees what is idle, that TF_METAL_OPS_CPU_GRADIENT_CACHE=0 turns it off, and that
Keras's fit() with metrics reuses the buffer from its second step on.
"""

from __future__ import annotations

import textwrap

import pytest

from child_python import last_json_line, run_python


# 16640 x 1024 float32 = 65 MiB, above the 32 MiB from which gradients are cached.
STEPS = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf
    import tf_metal_ops
    from tf_metal_ops import reference as ref

    rows, classes = 16640, 1024
    labels = tf.random.stateless_uniform([rows], [3, 4], 0, classes, dtype=tf.int32)
    labels = tf.where(tf.range(rows) % 7 == 0, -1, labels)  # ignored rows: zeroed, not computed

    def step(seed, n=rows):
        z = tf.random.stateless_normal([n, classes], seed=[seed, 2]) * 3.0
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf_metal_ops.custom_loss(labels[:n], z, gamma=2.0, label_smoothing=0.1,
                                            ignore_class=-1)
        return z, tape.gradient(loss, z)

    def error(z, grad, n=rows):
        # every row the kernel writes in its own way: ignored (row 0), the rest sampled
        picked = np.r_[0:16, n - 16:n]
        want = ref.custom_loss_grad(labels.numpy()[picked], z.numpy()[picked].astype(np.float64),
                                    gamma=2.0, label_smoothing=float(np.float32(0.1)),
                                    ignore_class=-1)
        return float(np.abs(grad.numpy()[picked] - want).max())

    info = tf_metal_ops.cpu_gradient_cache_info
    out = {"start": info()}
    z1, g1 = step(1)
    out["after_step_1"] = info()
    out["error_1"] = error(z1, g1)
    del z1, g1
    z2, g2 = step(2)
    out["after_step_2"] = info()
    out["error_2"] = error(z2, g2)
    kept = g2.numpy()
    z3, g3 = step(3)  # g2 is alive: its buffer must not be written
    out["after_step_3"] = info()
    out["error_3"] = error(z3, g3)
    out["live_gradient_unchanged"] = bool(np.array_equal(kept, g2.numpy()))
    out["distinct_buffers"] = bool(not np.shares_memory(g2.numpy(), g3.numpy()))
    del z2, g2, z3, g3
    z4, g4 = step(4, n=rows // 2 + 64)  # 32.6 MiB: less than half a kept 66 MiB buffer
    out["after_small_step"] = info()
    out["error_small"] = error(z4, g4, n=rows // 2 + 64)
    del z4, g4
    out["idle_before_release"] = info()["idle_bytes"]
    out["released"] = tf_metal_ops.release_cpu_gradient_cache()
    out["after_release"] = info()
    print(json.dumps(out))
""")

FIT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    import tf_metal_ops

    rows, classes = 16640, 1024
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8)).astype(np.float32)
    y = rng.integers(0, classes, rows)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(classes)])
    model.compile(optimizer="sgd", loss=tf_metal_ops.CustomLoss(),
                  metrics=["accuracy"] if sys.argv[1] == "accuracy" else [])
    history = model.fit(x, y, batch_size=rows, epochs=4, verbose=0)
    print(json.dumps({"info": tf_metal_ops.cpu_gradient_cache_info(),
                      "losses": history.history["loss"]}))
""")

GRADIENT_BYTES = 16640 * 1024 * 4


def _run(script: str, *args: str, **settings: str) -> dict:
    completed = run_python(script, *args, env=settings,
                           unset=("TF_METAL_OPS_CPU_GRADIENT_CACHE", "TF_CPU_ALLOCATOR_USE_BFC"))
    return last_json_line(completed)


def _assert_gradients_right(out: dict) -> None:
    for key in ("error_1", "error_2", "error_3", "error_small"):
        assert out[key] < 2e-5, (key, out)


@pytest.fixture(scope="module")
def steps() -> dict:
    """One child process serves the tests that read the default settings' steps."""
    return _run(STEPS)


def test_second_step_reuses_the_buffer_the_first_set_aside(steps):
    out = steps
    _assert_gradients_right(out)
    assert out["start"] == {"enabled": True, "idle_buffers": 0, "idle_bytes": 0, "reuses": 0,
                            "reservations": 0}
    # Step 1: fresh memory from TensorFlow, and a buffer set aside for step 2.
    assert out["after_step_1"]["reuses"] == 0
    assert out["after_step_1"]["reservations"] == 1
    assert out["after_step_1"]["idle_bytes"] >= GRADIENT_BYTES
    # Step 2 writes into it (and step 1's memory went back to TensorFlow).
    assert out["after_step_2"]["reuses"] == 1
    assert out["after_step_2"]["idle_buffers"] == 0
    # Step 3 runs while step 2's gradient lives: it cannot reuse, and sets a second one aside.
    assert out["after_step_3"]["reuses"] == 1
    assert out["after_step_3"]["reservations"] == 2
    assert out["live_gradient_unchanged"] and out["distinct_buffers"]


def test_a_much_smaller_gradient_does_not_take_a_large_buffer(steps):
    out = steps
    before, after = out["after_step_3"], out["after_small_step"]
    assert after["reuses"] == before["reuses"]
    assert after["reservations"] == before["reservations"] + 1


def test_release_frees_the_idle_buffers(steps):
    out = steps
    assert out["idle_before_release"] >= GRADIENT_BYTES
    assert out["released"] == out["idle_before_release"]
    assert out["after_release"]["idle_buffers"] == 0
    assert out["after_release"]["idle_bytes"] == 0


def test_the_cache_can_be_turned_off():
    out = _run(STEPS, TF_METAL_OPS_CPU_GRADIENT_CACHE="0")
    _assert_gradients_right(out)
    for key in ("after_step_1", "after_step_2", "after_step_3", "after_small_step"):
        assert out[key]["enabled"] is False
        assert out[key]["reuses"] == 0 and out[key]["reservations"] == 0, out[key]
    assert out["released"] == 0


def test_keras_fit_with_metrics_reuses_the_gradient_buffer():
    """With metrics, fit() reads y_pred again after the gradient, so the gradient cannot take
    over the logits' buffer: every step after the first writes into the buffer the one before
    set aside."""
    out = _run(FIT, "accuracy")
    assert out["info"]["reuses"] == 3, out
    assert out["info"]["reservations"] == 1, out
    losses = out["losses"]
    assert all(l == l for l in losses) and losses[-1] < losses[0], losses


def test_keras_fit_without_metrics_needs_no_fresh_gradient_after_the_first_step():
    """Without metrics the gradient op is the logits' last reader and TensorFlow (2.21) lets it
    take over their buffer, so nothing is set aside; should TensorFlow not, the cache serves."""
    out = _run(FIT, "none")
    info = out["info"]
    assert info["reservations"] == 0 or (info["reservations"] == 1 and info["reuses"] == 3), out
