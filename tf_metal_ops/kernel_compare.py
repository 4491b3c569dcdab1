"""`compare_kernel`: a `metal_kernel` run on every device that has a kernel of ours, against its
fallback or a reference, in one call (`compare_devices` for a user's kernel).

    report = tf_metal_ops.compare_kernel(kernel, inputs=[x], output_shapes=[x.shape],
                                         output_dtypes=[tf.float32], grid=(n, 1, 1),
                                         threadgroup=(256, 1, 1), template=[("T", tf.float32)])
    print(report)        # max abs / rel error per output and device, PASS / FAIL by dtype

The kernel runs on every CPU and on each GPU where its op has a kernel (the Apple GPU under
tensorflow-metal once the encoder registers one). A GPU that is absent, or that has no kernel of
ours (where the call would run the fallback or land on the CPU), is not run: its row of the
report says why, so a GPU result is never claimed that was not computed there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_metal_ops import _native, compare, loss_path
from tf_metal_ops.kernels import MetalKernel

__all__ = ["compare_kernel"]


def compare_kernel(kernel: MetalKernel, inputs: Sequence[Any], output_shapes: Sequence[Any],
                   output_dtypes: Sequence[Any], grid: Sequence[Any], threadgroup: Sequence[int],
                   template: Optional[Sequence[Any]] = None, init_value: Optional[float] = None,
                   reference: Optional[Callable[..., Any]] = None,
                   devices: Optional[Sequence[str]] = None, rtol: Any = None,
                   atol: Any = None) -> compare.DeviceComparisonReport:
    """Runs `kernel` on each device with a kernel of ours and compares the outputs.

    Args:
        kernel: what `tf_metal_ops.metal_kernel` returned.
        inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value: the
            call's arguments, as for `kernel(...)`.
        reference: a callable taking the inputs as NumPy arrays and returning the outputs (a
            list, one per output name, or one array); default: the kernel's `fallback`, if it
            has one. Each device is compared with it; devices are also compared with each
            other.
        devices: the devices to run on (`"CPU:0"`, `"GPU:0"`); default every CPU, and each GPU
            with a kernel of ours.
        rtol, atol: tolerances, as for `compare_devices` (default: by dtype,
            `compare.DEFAULT_TOLERANCES`; integers and bools exactly).

    Returns:
        A `DeviceComparisonReport` whose `absent` says which GPU was not run, and why.
    """
    if not isinstance(kernel, MetalKernel):
        raise TypeError(f"kernel must be what tf_metal_ops.metal_kernel returned, got {kernel!r}")
    if reference is not None and not callable(reference):
        raise TypeError(f"reference must be callable or None, got {reference!r}")
    reference = reference if reference is not None else kernel.fallback

    def run(*tensors: Any) -> List[tf.Tensor]:
        return kernel(inputs=list(tensors), output_shapes=output_shapes,
                      output_dtypes=output_dtypes, grid=grid, threadgroup=threadgroup,
                      template=template, init_value=init_value)

    absent = {}
    if devices is None:
        devices, absent = default_devices()
    report = compare.compare_devices(
        run, *inputs, devices=devices, rtol=rtol, atol=atol,
        reference=None if reference is None else _as_list(reference))
    return dataclasses.replace(report, absent=absent)


def default_devices():
    """(devices to run on, {device type: why not run}): every CPU, and each GPU whose type has
    a kernel of our generic op; a GPU without one, or none at all, is named with the reason."""
    visible = tf.config.list_logical_devices()
    cpus = [compare._short_name(d.name) for d in visible if d.device_type == "CPU"]
    gpus = [compare._short_name(d.name) for d in visible if d.device_type == "GPU"]
    if not gpus:
        return cpus, {"GPU": "not present"}
    kernels = loss_path.registered_device_types(_native.METAL_KERNEL_OP) or ()
    if "GPU" not in kernels:
        return cpus, {"GPU": "present, no kernel of ours there (" +
                      loss_path.gpu_plugin.gpu_plugin().reason + ")"}
    return cpus + gpus, {}


def _as_list(reference: Callable[..., Any]) -> Callable[..., List[np.ndarray]]:
    """The reference's outputs as a list, as the kernel returns them."""

    def listed(*arrays: Any) -> List[Any]:
        out = reference(*arrays)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return listed
