"""tf_metal_ops: a fused, numerically exact classification loss for TensorFlow and Keras.

`tf_metal_ops.CustomLoss` (Keras) and `tf_metal_ops.custom_loss` (a function) run as one native
TensorFlow op: on the CPU everywhere, and on Apple-silicon GPUs through tensorflow-metal.

Importing the package checks the installed TensorFlow's version, loads the native library and
registers `CustomLoss` with Keras, so
`keras.models.load_model` finds it after `import tf_metal_ops`. Without TensorFlow the package
still imports: `tf_metal_ops.reference` (the NumPy oracle) needs only NumPy, and the other names
raise an ImportError that says what to install (likewise for a TensorFlow older than 2.16).
"""

from __future__ import annotations

import importlib
from typing import Any

from tf_metal_ops import _command_line, _native

_command_line.quiet_tensorflow_log_for_command()  # before anything loads TensorFlow

__version__ = "0.1.0"

_installed = _native.installed_tensorflow_version()

# Public name -> module that defines it (imported on first access).
_LAZY_ATTRIBUTES = {
    "custom_loss": "tf_metal_ops.ops",
    "linear_cross_entropy": "tf_metal_ops.linear_loss",
    "LinearCrossEntropyHead": "tf_metal_ops.head",
    "PerTokenLoss": "tf_metal_ops.head",
    "CustomLoss": "tf_metal_ops.losses",
    "compare_devices": "tf_metal_ops.compare",
    "set_commit_mode": "tf_metal_ops.runtime",
    "get_commit_mode": "tf_metal_ops.runtime",
    "commit_and_wait": "tf_metal_ops.runtime",
    "metal_available": "tf_metal_ops.runtime",
    "set_cpu_threads": "tf_metal_ops.runtime",
    "get_cpu_threads": "tf_metal_ops.runtime",
    "loss_path_info": "tf_metal_ops.loss_path",
    "build_info": "tf_metal_ops._native",
    "value_and_gradients": "tf_metal_ops.compare",
}
_SUBMODULES = ("reference", "debug", "ops", "losses", "compare", "runtime", "composed",
               "loss_path", "linear_loss", "head")

__all__ = sorted(_LAZY_ATTRIBUTES) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        _native.load()  # without TensorFlow: an ImportError that says what to install
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"tf_metal_ops.{name}")
    raise AttributeError(f"module 'tf_metal_ops' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


if _installed is not None:
    # Eager with TensorFlow present: checks its version, loads the native library, registers the
    # gradient and the Keras serializable class. A broken environment (TensorFlow too old or
    # unimportable, the native library missing) does not fail the import, so that
    # `python -m tf_metal_ops info` can still run and explain it in one sentence; every name that
    # needs the library raises that sentence as an ImportError when it is used.
    try:
        for _name in _LAZY_ATTRIBUTES:
            __getattr__(_name)
    except ImportError:
        pass
