"""Debugging aids for the GPU path."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from tf_metal_ops import _native


def kernel_timings() -> List[Dict[str, Any]]:
    """GPU times of the kernels run in commit-and-wait mode, oldest first.

    Each entry has `op`, `kernel` (the Metal function), `shape` (the logits' shape) and
    `gpu_seconds` (GPUEndTime - GPUStartTime of the command buffer). Empty on machines without
    the Metal kernels, and in "commit" mode, where completion is not awaited.
    """
    return list(_native.runtime().kernel_timings())


def clear_kernel_timings() -> None:
    """Forgets the recorded kernel timings."""
    _native.runtime().clear_kernel_timings()


def has_pending_error() -> bool:
    """Whether the GPU has reported an error that nothing has raised yet.

    In the default "commit" mode a Metal kernel runs after its op has returned, so a sparse
    label outside `[0, num_classes)` is found later, when the GPU finishes the command buffer.
    The error is kept until the next CustomLoss / CustomLossGrad op (on any device) raises it,
    or `check_errors()` does. Always False on machines without the Metal kernels, unless a test
    reported a record itself.
    """
    return bool(_native.runtime().has_pending_error())


def check_errors(timeout: Optional[float] = None) -> None:
    """Waits for the GPU work that may still find a bad label, then raises the pending GPU
    error, if any, and clears it.

    The error is the one the CPU kernel raises for the same batch: an
    `tf.errors.InvalidArgumentError` naming the op (with its node name), the label's index and
    its value. Only the first error is kept until it is raised; the message counts the ones
    dropped after it. Call it after `model.fit` / a training step: every sparse-label Metal
    kernel of ours encoded before the call has reported when it returns, including one that
    tensorflow-metal had not committed to the GPU yet (it batches commits). For that the call
    commits and waits for the current command buffer of each GPU stream our ops ran on
    (tensorflow-metal's `commitAndWait`, on the stream's own queue), then waits until each of
    those kernels' completion handlers has read its error record. So a training step's bad
    label is raised here, not at some later op. Kernels encoded while it waits (other threads)
    are not waited for. On the CPU, and on machines without the Metal kernels, nothing is ever
    outstanding and it waits for nothing.

    Args:
        timeout: the most seconds to wait; None (the default) waits until the GPU has finished
            those command buffers, which it always does, completing or failing them.

    Raises:
        tf.errors.InvalidArgumentError: a bad label was found.
        tf.errors.InternalError: a kernel's error record could not be read, or a stream could
            not be committed.
        tf.errors.DeadlineExceededError: `timeout` passed before every kernel had reported
            (and no error was pending).
        ValueError: `timeout` is not None nor a number >= 0.
    """
    if timeout is None:
        limit = -1.0
    else:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(
                f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
        limit = float(timeout)
    runtime = _native.runtime()
    waited = runtime.wait_for_outstanding_launches(limit)
    taken = runtime.take_pending_error()
    if taken is None:
        taken = waited
    if taken is None:
        return
    code, message = taken
    import tensorflow as tf  # loaded already by _native.runtime()

    # TF_Code values of tensorflow/c/tf_status.h: the codes the native side reports.
    exception = {3: tf.errors.InvalidArgumentError, 4: tf.errors.DeadlineExceededError,
                 13: tf.errors.InternalError}.get(code, tf.errors.UnknownError)
    raise exception(None, None, message)
