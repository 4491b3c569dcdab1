"""Finds and loads the native library once, after checking the installed TensorFlow.

The library `_tf_metal_ops.<ext>` is both TensorFlow's op library (ops and kernels registered
through the C API) and a pybind11 module (runtime settings). Order matters: TensorFlow collects
the ops a library registers while `tf.load_op_library` loads it, so the op library is loaded
before Python imports the same file as a module (which then reuses the loaded image, so both
see one set of process-wide settings).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.metadata
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

MIN_TENSORFLOW = (2, 16)  # the first TensorFlow with Keras 3
NEWEST_TESTED_TENSORFLOW = (2, 22)  # the newest that tests/cross_version.sh runs
LIBRARY_STEM = "_tf_metal_ops"
COMMIT_AND_WAIT_ENV = "TF_METAL_OPS_COMMIT_AND_WAIT"
# The ops the library registers (csrc/ops.cc), namespaced in TensorFlow's registry.
FORWARD_OP = "TfMetalOps>CustomLoss"
GRADIENT_OP = "TfMetalOps>CustomLossGrad"
LINEAR_OP = "TfMetalOps>LinearCrossEntropy"
LINEAR_GRADIENT_OP = "TfMetalOps>LinearCrossEntropyGrad"
LOSS_OPS = (FORWARD_OP, GRADIENT_OP)
METAL_KERNEL_OP = "TfMetalOps>MetalKernel"  # tf_metal_ops.metal_kernel's generic op
# TensorFlow's short names for the DataType enum values our attrs use.
_DTYPE_NAMES = {1: "float", 2: "double", 3: "int32", 9: "int64", 14: "bfloat16", 19: "half"}


class NativeLibraryError(ImportError):
    """The native library or a compatible TensorFlow is missing: one actionable sentence."""


def parse_version(version: str) -> Tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_tensorflow_version(version: str) -> None:
    """Raises NativeLibraryError for a TensorFlow older than 2.16; warns past the newest tested."""
    found = parse_version(version)
    if found < MIN_TENSORFLOW:
        raise NativeLibraryError(
            f"tf_metal_ops needs TensorFlow >= {MIN_TENSORFLOW[0]}.{MIN_TENSORFLOW[1]} "
            f"(Keras 3), but TensorFlow {version} is installed: "
            "run `pip install -U tensorflow-cpu` (Linux) or `pip install -U tensorflow` (macOS)."
        )
    if found > NEWEST_TESTED_TENSORFLOW:
        warnings.warn(
            f"tf_metal_ops was tested with TensorFlow up to {NEWEST_TESTED_TENSORFLOW[0]}."
            f"{NEWEST_TESTED_TENSORFLOW[1]}; TensorFlow {version} is newer and untested.",
            RuntimeWarning,
            stacklevel=3,
        )


def library_path() -> Path:
    """Path of the native library inside the installed package."""
    package_dir = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = package_dir / f"{LIBRARY_STEM}{suffix}"
        if candidate.exists():
            return candidate
    if (package_dir.parent / "setup.py").exists():
        # A source checkout on sys.path (the working directory comes first under `python -m`)
        # shadows any installed copy.
        raise NativeLibraryError(
            f"tf_metal_ops was imported from the source checkout {package_dir}, which has no "
            "built native library: run `pip install -e .` there (or `python setup.py build_ext "
            "--inplace`), or run from another directory to use the installed package."
        )
    raise NativeLibraryError(
        f"tf_metal_ops's native library ({LIBRARY_STEM}*.so) is missing from {package_dir}: "
        "reinstall the package with `pip install .` from a source checkout."
    )


def preload_openblas() -> None:
    """Linux: loads the scipy-openblas32 wheel's OpenBLAS, which the native library links
    against (csrc/cpu/gemm.h), so that the loader finds it by its soname already loaded whatever
    the layout (the library's run path names the wheel's place beside it in site-packages, which
    an in-place build or a copied package does not have). macOS links Accelerate instead."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import scipy_openblas32
    except ImportError as error:
        raise NativeLibraryError(
            "tf_metal_ops's native library needs OpenBLAS from the scipy-openblas32 package, "
            "which is not installed: run `pip install scipy-openblas32` (a dependency of "
            "tf_metal_ops on Linux)."
        ) from error
    path = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    try:
        ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeLibraryError(f"could not load OpenBLAS from {path}: {error}") from error


@functools.lru_cache(maxsize=None)
def load() -> Tuple[ModuleType, ModuleType]:
    """Returns (op module, runtime module), loading them on first use."""
    try:
        import tensorflow as tf
    except ImportError as error:
        raise NativeLibraryError(
            "tf_metal_ops needs TensorFlow, which is not installed: run "
            "`pip install tensorflow-cpu` (Linux) or `pip install tensorflow` (macOS), "
            "or install this package with the [cpu] extra."
        ) from error
    check_tensorflow_version(tf.__version__)
    path = library_path()
    preload_openblas()
    try:
        ops = tf.load_op_library(str(path))
    except (tf.errors.NotFoundError, OSError) as error:
        raise NativeLibraryError(
            f"TensorFlow {tf.__version__} could not load {path}: {error}. Rebuild the package "
            "against this TensorFlow with `pip install --no-build-isolation .`."
        ) from error
    from tf_metal_ops import _tf_metal_ops as runtime  # same image, now loaded

    register_metal_kernels_if_apple(runtime)
    if os.environ.get(COMMIT_AND_WAIT_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        runtime.set_commit_mode("commit_and_wait")
    return ops, runtime


def register_metal_kernels_if_apple(runtime_module: ModuleType) -> bool:
    """Registers the GPU kernels of a Metal build only where Apple's tensorflow-metal alone
    provides the GPU (`tf_metal_ops.gpu_plugin`: another plugin's stream is not an Objective-C
    object, and messaging it crashes the process). Returns whether they are registered."""
    from tf_metal_ops import gpu_plugin  # noqa: PLC0415 - after TensorFlow loaded its plugins

    if not runtime_module.build_info()["metal_compiled_in"]:
        return False
    if not gpu_plugin.gpu_plugin().metal_kernels:
        return False
    return bool(runtime_module.register_metal_kernels())


def op_module() -> ModuleType:
    return load()[0]


def runtime() -> ModuleType:
    return load()[1]


def registered_kernels(op_name: str) -> List[Dict[str, Any]]:
    """The kernels TensorFlow's registry holds for `op_name`: device type, dtype constraints and
    host-memory arguments. Asks the registry itself (not our build flags): a GPU kernel appears
    only when the Metal kernels were compiled in and registered.

    Raises ImportError or AttributeError where this TensorFlow moved its (private) registry
    query.
    """
    from tensorflow.python.framework import kernels  # noqa: PLC0415 - private, callers guard

    out = []
    for kernel in kernels.get_registered_kernels_for_op(op_name).kernel:
        constraints = {}
        for c in kernel.constraint:
            constraints[c.name] = [_DTYPE_NAMES.get(t, str(t)) for t in c.allowed_values.list.type]
        out.append({"device_type": kernel.device_type, "constraints": constraints,
                    "host_memory_args": list(kernel.host_memory_arg)})
    return out


def build_info() -> Dict[str, Any]:
    """Build information of the native library plus where it was loaded from."""
    info = dict(runtime().build_info())
    info["library_path"] = str(library_path())
    return info


# Distributions that provide the `tensorflow` module (setup.py keeps the same list: it cannot
# import the package while building it).
TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-macos",
    "tensorflow-intel",
    "tf-nightly",
    "tf-nightly-cpu",
)


def installed_tensorflow_distribution() -> Optional[Tuple[str, str]]:
    """(distribution name, version) of the installed TensorFlow, from package metadata, without
    importing it; None when none is installed."""
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_tensorflow_version() -> Optional[str]:
    """The installed TensorFlow's version from package metadata, without importing it."""
    found = installed_tensorflow_distribution()
    return None if found is None else found[1]
