"""Builds the stand-alone checks of tests/cpu_math/ as the library is built, per instruction set.

Each check program is compiled as the kernels are: the baseline (SSE2 / NEON, 4 lanes) and, on
x86-64, the AVX2 variant (-DCHECK_AVX2, 8 lanes) and the AVX-512 variant (-DCHECK_AVX512, 16
lanes), with -ffp-contract=off as setup.py builds the library (only the spelled-out Fma calls
fuse). A variant the CPU cannot run is skipped, saying so: the library never selects it there.
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
    BUILDS += ["avx2", "avx512"]

# /proc/cpuinfo's flags for each build beyond the baseline. Linux lists the AVX and AVX-512
# flags only where it also saves their registers, as rows_dispatch.cc requires.
BUILD_FLAGS = {"avx2": ("avx2", "fma", "f16c"),
               "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")}
BUILD_DEFINES = {"avx2": "-DCHECK_AVX2", "avx512": "-DCHECK_AVX512"}


def cpu_runs(build: str) -> bool:
    """Whether this CPU has what `build` needs (the baseline: always)."""
    if build == "baseline":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in BUILD_FLAGS[build])


def build_check(source: Path, build: str, directory: Path,
                extra_flags: Sequence[str] = ()) -> Path:
    """The check program `source` compiled for `build` ("baseline", "avx2" or "avx512") into
    `directory`; skips a build the CPU would never run."""
    if not cpu_runs(build):
        pytest.skip(f"this CPU lacks one of {', '.join(BUILD_FLAGS[build])}, so the kernels "
                    f"never run the {build} build")
    binary = directory / "check"
    flags = ["-O2", "-std=c++17", "-Wall", "-Wno-psabi", "-ffp-contract=off", f"-I{REPO_ROOT}",
             *extra_flags]
    if build in BUILD_DEFINES:
        flags.append(BUILD_DEFINES[build])
    compiled = subprocess.run([*msl_build.cxx(), *flags, "-o", str(binary), str(source)],
                              capture_output=True, text=True, check=False)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    return binary
