"""tf_metal_ops: a fused, numerically exact classification loss for TensorFlow and Keras.

`tf_metal_ops.CustomLoss` (Keras) and `tf_metal_ops.custom_loss` (a function) run as one native
TensorFlow op: on the CPU everywhere, and on Apple-silicon GPUs through tensorflow-metal.

Importing the package checks the installed TensorFlow's version, loads the native library and
registers the gradients and the Keras classes, so `keras.models.load_model` finds them after
`import tf_metal_ops`. Without a usable TensorFlow or native library the package still imports:
`tf_metal_ops.reference` (the NumPy oracle) needs only NumPy, `python -m tf_metal_ops info` can
explain what is missing, and every other public name raises that explanation as an ImportError
when it is used.
"""

from __future__ import annotations

from typing import Any

from tf_metal_ops import _command_line, _native, reference

__version__ = "0.1.0"

# The public names that need TensorFlow and the native library.
_NATIVE_API = (
    "CustomLoss",
    "LinearCrossEntropyHead",
    "PerTokenLoss",
    "build_info",
    "commit_and_wait",
    "compare_devices",
    "compare_kernel",
    "custom_loss",
    "get_commit_mode",
    "get_cpu_threads",
    "kernel_cache_info",
    "linear_cross_entropy",
    "loss_path_info",
    "metal_available",
    "metal_kernel",
    "reduced_custom_loss",
    "set_commit_mode",
    "set_cpu_threads",
    "value_and_gradients",
)

__all__ = sorted(_NATIVE_API) + ["reference"]

_unavailable: "ImportError | None" = None
with _command_line.quiet_tensorflow_log_for_command():  # _native.load() imports TensorFlow
    try:
        _native.load()
    except ImportError as _error:
        _unavailable = _error
if _unavailable is None:
    from tf_metal_ops import composed, debug, loss_path
    from tf_metal_ops._native import build_info
    from tf_metal_ops.compare import compare_devices, value_and_gradients
    from tf_metal_ops.kernel_compare import compare_kernel
    from tf_metal_ops.keras import CustomLoss, LinearCrossEntropyHead, PerTokenLoss
    from tf_metal_ops.kernels import kernel_cache_info, metal_kernel
    from tf_metal_ops.linear_cross_entropy import linear_cross_entropy
    from tf_metal_ops.loss_path import loss_path_info
    from tf_metal_ops.ops import custom_loss, reduced_custom_loss
    from tf_metal_ops.runtime import (
        commit_and_wait,
        get_commit_mode,
        get_cpu_threads,
        metal_available,
        set_commit_mode,
        set_cpu_threads,
    )


def __getattr__(name: str) -> Any:
    # Reached only for names the imports above did not bind: without TensorFlow or the native
    # library, the public names raise the sentence that says what to install.
    if name in _NATIVE_API and _unavailable is not None:
        raise _native.NativeLibraryError(str(_unavailable)) from _unavailable
    raise AttributeError(f"module 'tf_metal_ops' has no attribute {name!r}")
