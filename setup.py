"""Builds tf_metal_ops's native library against the installed TensorFlow's C headers.

How the build finds TensorFlow: it locates the `tensorflow` package in the Python that runs the
build (without importing it) and uses `<tensorflow>/include` for the C headers and
`<tensorflow>/libtensorflow_framework.so.2` (`.2.dylib` on macOS) for the C API's symbols.
`pip install .` does this in an isolated build environment that pyproject.toml fills with a
recent TensorFlow; `pip install --no-build-isolation .` builds against the TensorFlow already
installed. Either way the binary uses only TensorFlow's C API, whose symbols are stable across
the supported versions, so one build serves every one of them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent
IS_MACOS = sys.platform == "darwin"

# The distributions that provide the `tensorflow` module, in the order we ask for a version.
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tf-nightly")


def tensorflow_dir() -> Path:
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "tf_metal_ops: building needs TensorFlow's C headers, but no `tensorflow` package "
            "is installed in this Python. Install tensorflow-cpu (Linux) or tensorflow (macOS) "
            "first, or build with plain `pip install .` (build isolation installs it)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def tensorflow_version() -> str:
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def native_extension() -> Pybind11Extension:
    tf_dir = tensorflow_dir()
    include_dir = tf_dir / "include"
    if not (include_dir / "tensorflow" / "c" / "kernels.h").exists():
        sys.exit(f"tf_metal_ops: {include_dir} has no tensorflow/c/kernels.h; is TensorFlow intact?")

    sources = [
        "csrc/ops.cc",
        "csrc/problem.cc",
        "csrc/runtime.cc",
        "csrc/python_module.cc",
        "csrc/cpu/custom_loss_cpu.cc",
    ]
    define_macros = [("TF_METAL_OPS_BUILT_AGAINST_TF", f'"{tensorflow_version()}"')]
    extra_compile_args = ["-O3", "-fno-strict-aliasing"]
    extra_link_args = []
    if IS_MACOS:
        framework = "libtensorflow_framework.2.dylib"
        extra_link_args += [str(tf_dir / framework), "-Wl,-rpath,@loader_path/../tensorflow"]
    else:
        framework = "libtensorflow_framework.so.2"
        extra_link_args += [
            f"-L{tf_dir}",
            f"-l:{framework}",
            # Installed next to tensorflow/ in site-packages; when TensorFlow is already loaded
            # (tf_metal_ops imports it first) the loader reuses it by its soname anyway.
            "-Wl,-rpath,$ORIGIN/../tensorflow",
        ]
    return Pybind11Extension(
        "tf_metal_ops._tf_metal_ops",
        sources=sources,
        include_dirs=[str(ROOT), str(include_dir)],
        define_macros=define_macros,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        cxx_std=17,
    )


setup(ext_modules=[native_extension()], cmdclass={"build_ext": build_ext})
