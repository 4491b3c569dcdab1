"""Accuracy of the CPU kernels' own exp, log, log1p, expm1 and 1 - exp near 0
(csrc/cpu/simd/simd_vector.h).

tests/cpu_math/simd_math_check.cc evaluates them over every 256th float32 bit pattern (16.7
million inputs, all binades) and over their special values, against the double-precision libm,
in both instruction-set builds the kernels use. The bounds are those simd_vector.h states; the
op-level tests (test_custom_loss_op.py, test_cpu_kernels.py) only see their effect through a
tolerance of 2e-5, which a much worse function would still meet.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from cpu_checks import BUILDS, REPO_ROOT, build_check

pytestmark = pytest.mark.simd

SOURCE = REPO_ROOT / "tests" / "cpu_math" / "simd_math_check.cc"

# Largest error in float32 ulps, as documented in simd_vector.h.
MAX_ULP = {"exp": 1.0, "log": 1.9, "log1p": 4.0, "expm1": 4.0, "one_minus_exp": 1.0}


@pytest.fixture(scope="module", params=BUILDS)
def results(request, tmp_path_factory) -> dict:
    binary = build_check(SOURCE, request.param, tmp_path_factory.mktemp(
        f"simd_math_{request.param}"))
    # The checker's default sample: every 256th bit pattern.
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600,
                         check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out: dict = {}
    for line in ran.stdout.splitlines():
        record = json.loads(line)
        out.setdefault(record["function"], {}).update(record)
    out["stderr"] = ran.stderr
    return out


@pytest.mark.parametrize("function", sorted(MAX_ULP))
def test_error_within_documented_ulps(results, function):
    record = results[function]
    assert record["max_ulp"] <= MAX_ULP[function], record


@pytest.mark.parametrize("function", sorted(MAX_ULP))
def test_special_values(results, function):
    assert results[function]["special_failures"] == 0, results["stderr"]


def test_plain_exp_is_exp(results):
    """Exp<false>, which the kernels call where a row's logits span less than its plain range,
    gives Exp's bits there (and for NaN)."""
    record = results["exp"]
    assert record["plain_checked"] > 100_000, record
    assert record["plain_mismatches"] == 0, record
