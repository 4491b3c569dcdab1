"""The scalar math shared by the Metal kernels and the CPU (kernels/custom_loss_math.h) against
the CPU's vector versions of the same terms (csrc/cpu/simd/simd_rows.h), and against itself.

tests/cpu_math/shared_math_check.cc evaluates, on a grid of lp = log p, gamma and w with the
limits among them (p = 1, p = 0, lp = -inf, NaN, both sides of the vector kernels' p = 1/2
switch to the scalar code):
- the vector loss term and g_c against loss_term / gradient_term: the same bits where the
  kernels hand the element to the scalar code, within the vector math's error elsewhere;
- the limits the kernels rely on, one by one;
- the float instantiation (Metal, float CPU paths) against the double one (float64 kernel);
- Metal's expm1 / log1p (Kahan's correction) against the double-precision libm, every 64th
  float of their domains, with this machine's float exp / log standing in for metal::precise.
It is built as the row kernels are, for both instruction sets.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from cpu_checks import BUILDS, REPO_ROOT, build_check

SOURCE = REPO_ROOT / "tests" / "cpu_math" / "shared_math_check.cc"

# Relative difference allowed between the vector and the scalar terms where the vector formula
# runs (p <= 1/2): a few float ulps from the vector exp / log behind r^gamma. Measured: 2.8e-7.
VECTOR_REL = 2e-6
# Kahan's expm1 / log1p, in float ulps ("a few ulps" in the header). Measured: 2.05 and 2.41.
KAHAN_ULP = 3.0


def _tensorflow_include() -> str:
    # csrc/cpu/simd/rows_dispatch.h reaches TensorFlow's C API headers through csrc/problem.h.
    spec = importlib.util.find_spec("tensorflow")
    assert spec is not None and spec.submodule_search_locations, "TensorFlow is not installed"
    return str(Path(list(spec.submodule_search_locations)[0]) / "include")


@pytest.fixture(scope="module", params=BUILDS)
def results(request, tmp_path_factory) -> dict:
    binary = build_check(SOURCE, request.param,
                         tmp_path_factory.mktemp(f"shared_math_{request.param}"),
                         [f"-I{_tensorflow_include()}"])
    ran = subprocess.run([str(binary), str(VECTOR_REL), str(KAHAN_ULP)], capture_output=True,
                         text=True, timeout=600, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = {record["check"]: record for record in map(json.loads, ran.stdout.splitlines())}
    out["stderr"] = ran.stderr
    return out


CHECKS = ["vector_loss_term", "vector_gradient_term", "scalar_limits", "float_vs_double",
          "kahan_expm1", "kahan_log1p"]


@pytest.mark.parametrize("check", CHECKS)
def test_shared_math(results, check):
    record = results[check]
    assert record["points"] > 0, record
    assert record["failures"] == 0, (record, results["stderr"])
