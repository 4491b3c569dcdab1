"""setup.py loaded as a module, for the tests of its build logic."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_setup():
    """setup.py as a module (its setup() call is guarded by __main__). Loaded when a test runs,
    not when pytest collects a file: CI's extra configurations collect every file in venvs
    without setuptools or pybind11, to run only the tests of their markers."""
    spec = importlib.util.spec_from_file_location("tf_metal_ops_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
