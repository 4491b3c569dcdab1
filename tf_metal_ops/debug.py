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
