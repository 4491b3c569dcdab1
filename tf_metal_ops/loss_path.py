"""Which implementation of the loss a call gets: the native op, or the composed TensorFlow ops.

The native op (`TfMetalOps>CustomLoss`, CPU and Metal kernels) runs wherever TensorFlow can
execute it. Two places cannot:

- an XLA compilation (`tf.function(jit_compile=True)`, Keras's `jit_compile=True`, and its
  `"auto"` on every machine with a GPU or TPU that is not an Apple GPU): XLA compiles only ops
  that have an XLA lowering, and ours has none;
- a device without a kernel of ours (a CUDA GPU, a TPU, and a GPU that a Metal plugin other
  than Apple's tensorflow-metal provides: `tf_metal_ops.gpu_plugin` registers our GPU kernels
  only for Apple's): TensorFlow would place our op on the host, copying the logits off the device
  and the gradient back on every step.

There `custom_loss` builds `tf_metal_ops.composed` instead, the same function written with
TensorFlow ops. The choice is made where the op would be made (at trace time inside
`tf.function`, at each call in eager mode) and counted, so `loss_path_info()`, the demo and
`python -m tf_metal_ops info` can say which path ran.

`tf_metal_ops.metal_kernel` takes the same decision for a user's kernel (`choose` with its
op's kernels): where the loss would be composed, the kernel runs its `fallback=` callable of
TensorFlow ops when it has one. Those choices are not counted here: they are not losses.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import tensorflow as tf

from tf_metal_ops import _native, gpu_plugin, runtime

NATIVE = "native"
COMPOSED_XLA = "composed (XLA)"
COMPOSED_DEVICE = "composed (device)"
PATHS = (NATIVE, COMPOSED_XLA, COMPOSED_DEVICE)

# Whether the graph being built is compiled by XLA: TensorFlow's own test (its XLA control-flow
# context, set by tf.function(jit_compile=True) and inherited by functions called inside it).
# Private API: where it moved or vanished, XLA_DETECTION is False and every call takes the native
# path, which then fails to compile under XLA as it did before the composed path existed; the
# tests fail on such a TensorFlow rather than let that pass unnoticed.
try:
    from tensorflow.python.framework.ops import get_default_graph as _default_graph
    from tensorflow.python.ops.control_flow_util import (
        GraphOrParentsInXlaContext as _graph_or_parents_in_xla_context,
    )

    XLA_DETECTION = True
except ImportError:  # pragma: no cover - a TensorFlow that reorganized its internals
    XLA_DETECTION = False

# The device scope of an eager call (`with tf.device(...)`); private, so guarded like the above.
try:
    from tensorflow.python.eager.context import context as _eager_context
except ImportError:  # pragma: no cover
    _eager_context = None


def in_xla_context() -> bool:
    """True while tracing a graph that XLA compiles (also a function nested inside one)."""
    if not XLA_DETECTION or tf.executing_eagerly():
        return False
    return bool(_graph_or_parents_in_xla_context(_default_graph()))


def requested_device(logits: Any) -> str:
    """The device an op made now with these logits would ask for: the device scope, else the
    logits' own device (eager tensors always have one), else '' (nothing asked)."""
    scope = ""
    if tf.executing_eagerly():
        if _eager_context is not None:
            scope = _eager_context().device_name or ""
    else:
        # The device string an op made now receives from the scope (and device functions).
        scope = tf.raw_ops.NoOp(name="device_probe").device or ""
    return scope or getattr(logits, "device", "") or ""


def target_device_type(requested: str, visible_device_types: Iterable[str]) -> str:
    """The device type an op would run on: the requested device's type, or where nothing is
    requested the one TensorFlow's placer prefers: a TPU, then a GPU, when one is visible."""
    if requested:
        device_type = tf.DeviceSpec.from_string(requested).device_type
        if device_type:
            return device_type.upper()
    visible = set(visible_device_types)
    for preferred in ("TPU", "GPU"):
        if preferred in visible:
            return preferred
    return "CPU"


def device_lacks_kernel(device_type: str, kernel_device_types: Iterable[str]) -> bool:
    """True when our library registered no kernel for the device type (e.g. a CUDA GPU or a TPU
    while only CPU kernels are registered). On a Mac with tensorflow-metal our Metal kernels are
    registered for "GPU", so the Apple GPU keeps the native op."""
    return device_type.upper() not in {t.upper() for t in kernel_device_types}


@functools.lru_cache(maxsize=None)
def registered_device_types(op_name: str) -> Optional[Tuple[str, ...]]:
    """Device types with a kernel of `op_name` in TensorFlow's registry (filled when the native
    library loaded, so it does not change afterwards); None where the registry query moved."""
    try:
        return tuple(sorted({k["device_type"] for k in _native.registered_kernels(op_name)}))
    except (ImportError, AttributeError):  # pragma: no cover - the registry query moved
        return None


def kernel_device_types() -> Tuple[str, ...]:
    """Device types with a kernel of our forward loss op."""
    found = registered_device_types(_native.FORWARD_OP)
    if found is None:  # pragma: no cover - the registry query moved
        apple_gpu = runtime.metal_available() and gpu_plugin.gpu_plugin().metal_kernels
        return ("CPU", "GPU") if apple_gpu else ("CPU",)
    return found


def visible_device_types() -> Tuple[str, ...]:
    """Device types TensorFlow may use; unlike listing logical devices this does not initialize
    the runtime, so it leaves device configuration (virtual CPUs, visible GPUs) open."""
    return tuple(sorted({d.device_type for d in tf.config.get_visible_devices()}))


def choose(logits: Any, kernels: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    """(path, reason) for an op made now with these logits (or any tensor its ops follow); see
    the module docstring. `kernels`: the device types the op has kernels for; default, those of
    our loss op (`metal_kernel`'s op passes its own, and runs its `fallback=` where this says
    composed)."""
    if in_xla_context():
        return COMPOSED_XLA, "inside an XLA compilation (jit_compile)"
    device_type = target_device_type(requested_device(logits), visible_device_types())
    kernels = kernel_device_types() if kernels is None else tuple(kernels)
    if device_lacks_kernel(device_type, kernels):
        return COMPOSED_DEVICE, (f"{device_type} has no kernel of ours (kernels registered for "
                                 f"{', '.join(kernels)}){_plugin_note(device_type)}")
    return NATIVE, f"native op on {device_type}"


def _plugin_note(device_type: str) -> str:
    """For a GPU: which plugin provides it and why our Metal kernels do or do not run there."""
    if device_type != "GPU":
        return ""
    return f"; GPU plugin: {gpu_plugin.gpu_plugin().reason}"


_lock = threading.Lock()
_counts: Dict[str, int] = dict.fromkeys(PATHS, 0)
_last: Optional[Dict[str, str]] = None


def record(path: str, reason: str) -> None:
    """Counts one loss made on `path` (a trace in tf.function, a call in eager mode)."""
    global _last
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    with _lock:
        _counts[path] += 1
        _last = {"path": path, "reason": reason}


def loss_path_info() -> Dict[str, Any]:
    """Which implementation of the loss this process has made, and how often.

    `custom_loss` and `CustomLoss` run the native op, except inside an XLA compilation
    (`jit_compile=True`) and on a device with no kernel of ours (a CUDA GPU, a TPU), where they
    run the same loss composed of TensorFlow ops (`tf_metal_ops.composed`).

    Returns:
        A dict: `counts` (losses made per path, `"native"`, `"composed (XLA)"` and
        `"composed (device)"`: one per trace inside `tf.function`, one per eager call),
        `last` (the latest choice, `{"path", "reason"}`, or None), `xla_detection` (whether this
        TensorFlow lets us detect an XLA compilation), `kernel_devices` (device types our
        library registered kernels for) and `gpu_plugin` (which TensorFlow plugin provides the
        GPU, whether our Metal kernels run there, and why: `tf_metal_ops.gpu_plugin`).
    """
    with _lock:
        counts = dict(_counts)
        last = None if _last is None else dict(_last)
    return {"counts": counts, "last": last, "xla_detection": XLA_DETECTION,
            "kernel_devices": list(kernel_device_types()),
            "gpu_plugin": gpu_plugin.gpu_plugin().as_dict()}


def describe_machine(visible: Optional[Sequence[str]] = None) -> str:
    """One line for `info`: which path runs where on this machine."""
    visible = visible_device_types() if visible is None else visible
    device_type = target_device_type("", visible)
    if device_lacks_kernel(device_type, kernel_device_types()):
        default = (f"{COMPOSED_DEVICE} on {device_type} (no kernel of ours there"
                   f"{_plugin_note(device_type)})")
    else:
        default = f"{NATIVE} op on {device_type}"
    xla = (f"{COMPOSED_XLA} inside jit_compile" if XLA_DETECTION
           else "XLA not detectable on this TensorFlow: jit_compile fails")
    return f"{default}; {xla}"
