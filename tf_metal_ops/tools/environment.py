"""What this installation is made of: versions, devices, registered kernels, native build.

`python -m tf_metal_ops info` prints it (it is what a user pastes into a bug report), `check
--json` embeds it, and the command-line tool uses `load_tensorflow` / `load_package` to turn a
broken environment into one actionable sentence (`EnvironmentProblem`) instead of a traceback.

Nothing here is imported by `import tf_metal_ops`; TensorFlow is imported only inside the
functions, so the command-line tool can report a missing TensorFlow itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
from types import ModuleType
from typing import Any

from tf_metal_ops._native import LOSS_OPS as OP_NAMES
from tf_metal_ops._native import installed_tensorflow_distribution, registered_kernels


class EnvironmentProblem(Exception):
    """The environment cannot run the command; the message is one actionable sentence."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def load_tensorflow() -> ModuleType:
    """Imports TensorFlow, or raises `EnvironmentProblem` saying what to install."""
    try:
        import tensorflow as tf  # noqa: PLC0415 - imported on demand on purpose
    except ImportError as e:
        raise EnvironmentProblem(
            f"TensorFlow cannot be imported by {sys.executable} ({_first_line(e)}); install "
            f"TensorFlow 2.16 or newer into this Python (pip install tensorflow-cpu on Linux, "
            f"pip install tensorflow tensorflow-metal on a Mac).") from e
    return tf


def load_package() -> ModuleType:
    """Imports tf_metal_ops and loads its native library, or raises `EnvironmentProblem`."""
    load_tensorflow()
    try:
        package = importlib.import_module("tf_metal_ops")
        native = importlib.import_module("tf_metal_ops._native")
        load = getattr(native, "load", None)
        if callable(load):
            load()  # the native library loads lazily; make its problems surface here
        getattr(package, "custom_loss")
    except ImportError as e:
        if type(e).__name__ == "NativeLibraryError":
            # Already one actionable sentence, written where the problem is detected.
            raise EnvironmentProblem(_first_line(e)) from e
        raise EnvironmentProblem(
            f"tf_metal_ops cannot be imported ({_first_line(e)}); reinstall the package with "
            f"pip against the TensorFlow installed here, or in a source checkout run: "
            f"python setup.py build_ext --inplace") from e
    except Exception as e:  # noqa: BLE001 - e.g. a TF error raised while loading the library
        raise EnvironmentProblem(
            f"The tf_metal_ops native library failed to load into TensorFlow "
            f"({type(e).__name__}: {_first_line(e)}); it was probably built against another "
            f"TensorFlow version: rebuild or reinstall it here.") from e
    return package


def distribution_version(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tensorflow_distribution() -> str | None:
    found = installed_tensorflow_distribution()
    return None if found is None else f"{found[0]} {found[1]}"


def kernel_devices(op_name: str) -> list[str]:
    """Device types with at least one registered kernel for `op_name`, sorted."""
    return sorted({k["device_type"] for k in registered_kernels(op_name)})


def native_library_path(package: ModuleType) -> str | None:
    """Path of the native library (op library and pybind11 module are the same file)."""
    native = getattr(package, "_native", None)
    for attr in ("library_path", "LIBRARY_PATH"):
        value = getattr(native, attr, None)
        if callable(value):
            try:
                value = value()
            except Exception:  # noqa: BLE001 - a missing library is reported as None
                value = None
        if isinstance(value, (str, os.PathLike)) and os.fspath(value):
            return os.fspath(value)
    try:
        module = importlib.import_module("tf_metal_ops._tf_metal_ops")
    except ImportError:
        return None
    return getattr(module, "__file__", None)


def build_info(package: ModuleType) -> dict[str, Any] | str:
    """`tf_metal_ops._native.build_info()`, or a sentence saying why it is not available."""
    native = getattr(package, "_native", None)
    func = getattr(native, "build_info", None)
    if func is None:
        return "not available (tf_metal_ops._native.build_info() is missing in this build)"
    try:
        return dict(func())
    except Exception as e:  # noqa: BLE001 - reported, not fatal for `info`
        return f"not available ({type(e).__name__}: {_first_line(e)})"


def commit_mode(package: ModuleType) -> str:
    """The Metal commit mode, `commit` or `commit_and_wait`, or why it cannot be read."""
    get = getattr(package, "get_commit_mode", None)
    if get is None:
        return "not available (tf_metal_ops.get_commit_mode() is missing in this build)"
    try:
        return str(get())
    except Exception as e:  # noqa: BLE001
        return f"not available ({type(e).__name__}: {_first_line(e)})"


def loss_paths() -> dict[str, Any] | str:
    """Which implementation of the loss runs where here (`tf_metal_ops.loss_path`): `where`
    (one line), plus `loss_path_info()`'s counts of what this process made."""
    try:
        from tf_metal_ops import loss_path  # noqa: PLC0415

        return {"where": loss_path.describe_machine(), **loss_path.loss_path_info()}
    except Exception as e:  # noqa: BLE001 - reported, not fatal for `info`
        return f"not available ({type(e).__name__}: {_first_line(e)})"


def devices() -> list[dict[str, str]]:
    """The logical devices TensorFlow sees, short names and types (CPU first)."""
    tf = load_tensorflow()
    found = [{"name": d.name.rsplit("device:", 1)[-1], "type": d.device_type}
             for d in tf.config.list_logical_devices()]
    return sorted(found, key=lambda d: (d["type"] != "CPU", d["name"]))


def describe() -> dict[str, Any]:
    """Everything `info` prints, as a JSON-serializable dict.

    Needs TensorFlow (raises `EnvironmentProblem` without it). A native library that does not
    load is recorded under `"problem"` instead of raising, because that is exactly when a user
    needs the rest of this report for a bug report.
    """
    tf = load_tensorflow()
    problem = None
    try:
        package = load_package()
    except EnvironmentProblem as e:
        problem = str(e)
        package = sys.modules.get("tf_metal_ops") or importlib.import_module("tf_metal_ops")
    try:
        import keras  # noqa: PLC0415

        keras_version = keras.__version__
        keras_backend = keras.backend.backend()
    except Exception as e:  # noqa: BLE001 - reported as is
        keras_version, keras_backend = f"not importable ({_first_line(e)})", None
    kernels: dict[str, Any] = {}
    for op in OP_NAMES:
        try:
            kernels[op] = registered_kernels(op)
        except Exception as e:  # noqa: BLE001 - a registry that cannot be read is reported
            kernels[op] = f"registry query failed ({type(e).__name__}: {_first_line(e)})"
    not_loaded = "not available (the native library is not loaded)"
    return {
        "tf_metal_ops": {
            "version": getattr(package, "__version__", None)
            or distribution_version("tf-metal-ops") or "unknown",
            "location": os.path.dirname(os.path.abspath(package.__file__)),
        },
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": platform.platform(),
        "machine": platform.machine(),
        "tensorflow": {"version": tf.__version__, "distribution": _tensorflow_distribution()},
        "keras": {"version": keras_version, "backend": keras_backend},
        "tensorflow_metal": distribution_version("tensorflow-metal"),
        "devices": devices(),
        "kernels": kernels,
        "native_library": native_library_path(package) if problem is None else None,
        "build_info": build_info(package) if problem is None else not_loaded,
        "commit_mode": commit_mode(package) if problem is None else not_loaded,
        "loss_path": loss_paths() if problem is None else not_loaded,
        "problem": problem,
    }
