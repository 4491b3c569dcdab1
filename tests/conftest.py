"""Shared pytest fixtures for the tf_metal_ops test-suite."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
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


def pytest_configure(config) -> None:
    # The ziglang wheel's first link in a new environment builds zig's C++ runtime (libc++ and
    # its ABI library, into zig's own cache): about a minute and a half on one core, during
    # which the first test that links with it (a metal_kernel compile, the Metal sources'
    # traffic-counting build) waits, and with two pytest workers often both. Started here, once
    # (in the process that starts the workers), it runs beside the first tests. A link after it
    # finds the runtime built; one that comes first waits on zig's cache lock, as it would
    # anyway. Its failure is not the tests' business: the link that needs it reports its own.
    # A run that ends first stops it (zig's cache keeps only whole builds), so a short run does
    # not wait for it.
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller started it
        return
    sys.path.insert(0, str(REPO_ROOT / "tests" / "msl_host"))
    import msl_build

    zig = msl_build.toolchain.ziglang_command()
    if zig is None:
        return
    clang = msl_build.find_clang()
    uses_zig = ((clang is not None and clang.command == zig)
                or msl_build.toolchain.kernel_compiler()[0] == zig)
    if not uses_zig:
        return
    work = tempfile.TemporaryDirectory(prefix="tfmo_zig_runtime_")
    source = Path(work.name) / "empty.cc"
    source.write_text("int tf_metal_ops_zig_runtime() { return 0; }\n")
    process = subprocess.Popen([*zig, "-shared", "-fPIC", "-O2", str(source), "-o",
                                str(Path(work.name) / "empty.so")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)

    def stop() -> None:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # python -m ziglang and its zig child
        process.wait()
        work.cleanup()

    config.add_cleanup(stop)


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
