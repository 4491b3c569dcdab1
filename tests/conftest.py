"""Shared pytest fixtures for the tf_metal_ops test-suite."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PATH = REPO_ROOT / "tf_metal_ops" / "reference.py"


def pytest_report_header(config) -> str:
    # Which clang compiles the Metal sources for the address-space, byte-count and
    # Objective-C++ checks: a system clang, or the ziglang wheel's on a machine without one.
    sys.path.insert(0, str(REPO_ROOT / "tests" / "msl_host"))
    import msl_build

    clang = msl_build.find_clang()
    return f"clang for the Metal-source checks: {clang.describe() if clang else 'none found'}"


def _load_by_path(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ref() -> types.ModuleType:
    """The NumPy reference module (tf_metal_ops/reference.py), loaded standalone: by file path,
    not through the package, so the reference tests run (and prove the oracle) even when the
    native library is not built and without importing the package's TensorFlow-importing
    __init__."""
    return _load_by_path("tf_metal_ops_reference_standalone", REFERENCE_PATH)


@pytest.fixture(scope="module")
def setup_py() -> types.ModuleType:
    """setup.py as a module (its setup() call is guarded by __main__), for the tests of its build
    logic. Loaded when a test asks for it, not when pytest collects: CI's extra configurations
    collect every file in venvs without setuptools or pybind11, to run only their markers."""
    return _load_by_path("tf_metal_ops_setup", REPO_ROOT / "setup.py")


@pytest.fixture(scope="module")
def kernel_cache(request, tmp_path_factory):
    """metal_kernel's disk cache for a test module: the pytest cache's directory, shared by the
    modules that compile kernels so each compiles once, then the setting before it."""
    from tf_metal_ops import kernels

    cache = getattr(request.config, "cache", None)
    directory = (Path(cache.mkdir("tfmo_kernel_cache")) if cache is not None
                 else tmp_path_factory.mktemp("tfmo_kernel_cache"))
    mp = pytest.MonkeyPatch()
    mp.setenv("TF_METAL_OPS_CACHE_DIR", str(directory))
    kernels.configure_toolchain()
    yield directory
    mp.undo()
    kernels.configure_toolchain()
