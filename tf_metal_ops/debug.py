"""Debugging aids for the GPU path."""

from __future__ import annotations

from typing import Any, Dict, List

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


def check_errors() -> None:
    """Raises the pending GPU error, if any, and clears it.

    The error is the one the CPU kernel raises for the same batch: an
    `tf.errors.InvalidArgumentError` naming the op (with its node name), the label's index and
    its value. Only the first error is kept until it is raised; the message counts the ones
    dropped after it. Call it after `model.fit` / a training step to learn about a bad label
    without waiting for the next op; it waits for nothing itself, so a command buffer the GPU has
    not finished yet reports later.

    Raises:
        tf.errors.InvalidArgumentError: a bad label was found.
        tf.errors.InternalError: a kernel's error record could not be read.
    """
    taken = _native.runtime().take_pending_error()
    if taken is None:
        return
    code, message = taken
    import tensorflow as tf  # loaded already by _native.runtime()

    # TF_Code values of tensorflow/c/tf_status.h: the only two codes the native side records.
    exception = {3: tf.errors.InvalidArgumentError, 13: tf.errors.InternalError}.get(
        code, tf.errors.UnknownError)
    raise exception(None, None, message)
