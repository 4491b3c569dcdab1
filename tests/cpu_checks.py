"""Builds the stand-alone checks of tests/cpu_math/ as the library is built, per instruction set.

Each check program is compiled twice where the kernels are: the baseline (SSE2 / NEON, 4 lanes)
and, on x86-64, the AVX2 variant (-DCHECK_AVX2), with -ffp-contract=off as setup.py builds the
library (only the spelled-out Fma calls fuse).
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build  # noqa: E402  (the tests' one choice of C++ compiler: $CXX, else g++)

REPO_ROOT = Path(__file__).resolve().parents[1]

BUILDS = ["baseline"]
if platform.machine() in ("x86_64", "AMD64"):
    BUILDS.append("avx2")


def cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


def build_check(source: Path, build: str, directory: Path,
                extra_flags: Sequence[str] = ()) -> Path:
    """The check program `source` compiled for `build` ("baseline" or "avx2") into
    `directory`; skips the AVX2 build on a CPU that would never run it."""
    if build == "avx2" and not cpu_has_avx2():
        pytest.skip("this CPU lacks AVX2/FMA/F16C, so the kernels never run the AVX2 build")
    binary = directory / "check"
    flags = ["-O2", "-std=c++17", "-Wall", "-Wno-psabi", "-ffp-contract=off", f"-I{REPO_ROOT}",
             *extra_flags]
    if build == "avx2":
        flags.append("-DCHECK_AVX2")
    compiled = subprocess.run([*msl_build.cxx(), *flags, "-o", str(binary), str(source)],
                              capture_output=True, text=True, check=False)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    return binary
