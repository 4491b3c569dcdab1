"""Where a C++ compiler is: the one place that decides it, for metal_kernel's CPU path (which
compiles users' kernels with it) and for the tests' builds of the Metal sources
(tests/msl_host/msl_build.py loads this file by path, without importing the package).

A system clang is preferred ($TF_METAL_OPS_CLANG names one, or "ziglang" to take the wheel's
even where a system clang exists), then g++ for metal_kernel, then the `ziglang` wheel's clang
(`python -m ziglang c++`), which `pip install "tf_metal_ops[kernels]"` installs. Only the
standard library: no TensorFlow here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Tuple

CLANG_ENV = "TF_METAL_OPS_CLANG"


def system_clang() -> Optional[Tuple[str, str]]:
    """(path, origin) of $TF_METAL_OPS_CLANG, else of the newest versioned clang++ (Debian's
    clang-N), else of clang++ on PATH (Apple's on macOS); None when there is none, or when
    $TF_METAL_OPS_CLANG is "ziglang"."""
    explicit = os.environ.get(CLANG_ENV)
    if explicit == "ziglang":  # the wheel's even where a system clang is installed
        return None
    if explicit:
        found = shutil.which(explicit) or (explicit if Path(explicit).exists() else None)
        return (found, f"${CLANG_ENV}") if found else None
    for version in range(30, 13, -1):
        for name in (f"clang++-{version}", f"/usr/lib/llvm-{version}/bin/clang++"):
            found = shutil.which(name)
            if found:
                return found, "system"
    found = shutil.which("clang++")
    return (found, "system") if found else None


def ziglang_command() -> Optional[Tuple[str, ...]]:
    """The ziglang wheel's clang++ as a command, when the wheel is installed."""
    if importlib.util.find_spec("ziglang") is None:
        return None
    return (sys.executable, "-m", "ziglang", "c++")


def kernel_compiler() -> Tuple[Tuple[str, ...], str]:
    """(command, origin) of the compiler for metal_kernel's CPU path; command is () when there
    is none, and origin then says what to install."""
    clang = system_clang()
    if clang is not None:
        return (clang[0],), clang[1]
    if os.environ.get(CLANG_ENV) != "ziglang":
        gcc = shutil.which("g++")
        if gcc:
            return (gcc,), "system"
    zig = ziglang_command()
    if zig is not None:
        return zig, "ziglang wheel"
    return (), (
        "metal_kernel runs on the CPU by compiling the kernel with a C++ compiler, and none was "
        "found: pip install \"tf_metal_ops[kernels]\" (the ziglang wheel's clang), or install "
        f"clang or g++, or set {CLANG_ENV} to a clang++ binary")
