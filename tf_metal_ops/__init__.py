"""tf_metal_ops: a fused, numerically exact classification loss for TensorFlow and Keras.

`tf_metal_ops.CustomLoss` (Keras) and `tf_metal_ops.custom_loss` (a function) run as one native
TensorFlow op: on the CPU everywhere, and on Apple-silicon GPUs through tensorflow-metal.

TensorFlow is imported on first use of an attribute that needs it, so
`tf_metal_ops.reference` (the NumPy oracle) works without TensorFlow. The installed
TensorFlow's version is checked here, from its package metadata.
"""

from __future__ import annotations

import importlib
from typing import Any

from tf_metal_ops import _native

__version__ = "0.1.0"

_installed = _native.installed_tensorflow_version()
if _installed is not None:
    _native.check_tensorflow_version(_installed)

# Public name -> module that defines it (imported on first access).
_LAZY_ATTRIBUTES = {
    "custom_loss": "tf_metal_ops.ops",
    "CustomLoss": "tf_metal_ops.losses",
    "compare_devices": "tf_metal_ops.compare",
    "set_commit_mode": "tf_metal_ops.runtime",
    "get_commit_mode": "tf_metal_ops.runtime",
    "commit_and_wait": "tf_metal_ops.runtime",
    "metal_available": "tf_metal_ops.runtime",
    "set_cpu_threads": "tf_metal_ops.runtime",
    "get_cpu_threads": "tf_metal_ops.runtime",
    "build_info": "tf_metal_ops._native",
}
_SUBMODULES = ("reference", "debug", "ops", "losses", "compare", "runtime")

__all__ = sorted(_LAZY_ATTRIBUTES) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"tf_metal_ops.{name}")
    raise AttributeError(f"module 'tf_metal_ops' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
