"""Metal address spaces, checked on Linux: the kernels compiled by clang with `device`,
`constant` and `threadgroup` as three distinct address spaces (1, 2, 3), so that using a
pointer of one where another is expected is a compile error, as it is in Metal.

The run build (test_msl_emulator.py) maps them all to ordinary memory and would accept such a
mix-up; this build exists to catch it. The negative tests prove it does, with a snippet per
kind of mistake and the corrected snippet as a control.
Needs clang++ 14 or newer: a system clang, else the ziglang wheel's (the `test` extra).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clang() -> mb.Clang:
    found = mb.find_clang()
    assert found, mb.missing_clang_message("the address-space check")
    return found


def test_msl_kernels_compile_with_distinct_address_spaces(clang, tmp_path):
    result = mb.address_space_compile(REPO / "kernels" / "custom_loss.metal", clang, tmp_path)
    # Every kernel is instantiated (the shim takes each one's address), so every template body
    # is type-checked with the address spaces, bfloat included.
    assert result.returncode == 0, result.stderr


_PRELUDE = """
#include "kernels/custom_loss.h"
using namespace metal;
inline void write_device(device float* out, float v) { out[0] = v; }
inline float read_constant(constant CustomLossParams& p) { return p.gamma; }
"""

# (what is wrong, the kernel body with the mistake, the same body done right)
_MISTAKES = [
    ("threadgroup pointer passed as device",
     "write_device(scratch, 1.0f);",
     "write_device(out, 1.0f);"),
    ("device pointer stored in a threadgroup pointer",
     "threadgroup float* t = out; t[0] = 1.0f;",
     "threadgroup float* t = scratch; t[0] = 1.0f;"),
    ("device buffer read as constant params",
     "out[0] = read_constant(*reinterpret_cast<device CustomLossParams*>(out));",
     "out[0] = read_constant(params);"),
    ("threadgroup memory handed to an atomic on device memory",
     "atomic_fetch_add_explicit(reinterpret_cast<threadgroup atomic_uint*>(scratch), 1u, "
     "memory_order_relaxed);",
     "atomic_fetch_add_explicit(record, 1u, memory_order_relaxed);"),
    ("write through constant memory",
     "params.gamma = 1.0f;",
     "out[0] = params.gamma;"),
]


def _snippet(body: str) -> str:
    return _PRELUDE + textwrap.dedent(f"""
    [[kernel]] void snippet(device float* out [[buffer(0)]],
                            constant CustomLossParams& params [[buffer(1)]],
                            device atomic_uint* record [[buffer(2)]],
                            threadgroup float* scratch TFMO_THREADGROUP_ARG(0),
                            TFMO_KERNEL_THREAD_ARGS) {{
      {body}
    }}
    """)


@pytest.mark.parametrize("what, wrong, right", _MISTAKES, ids=[m[0] for m in _MISTAKES])
def test_msl_address_space_mixups_do_not_compile(clang, tmp_path, what, wrong, right):
    good = tmp_path / "good.metal"
    good.write_text(_snippet(right))
    result = mb.address_space_compile(good, clang, tmp_path)
    assert result.returncode == 0, f"control snippet ({what}) should compile:\n{result.stderr}"

    bad = tmp_path / "bad.metal"
    bad.write_text(_snippet(wrong))
    result = mb.address_space_compile(bad, clang, tmp_path)
    assert result.returncode != 0, f"'{what}' compiled but must not"
    stderr = result.stderr.lower()
    assert any(w in stderr for w in ("address space", "device", "threadgroup", "constant",
                                     "const-qualified")), result.stderr
    # The error is at the mistake's line, not somewhere in the shim.
    assert "bad.metal" in result.stderr
