"""setup.py's TF_METAL_OPS_ROW_VARIANTS: `host` leaves out the AVX-512 row kernels where this
machine's CPU lacks AVX-512 (the sanitizer build's setting), and the dispatch of such a build
then stops at AVX2 without a reference to the variant it lacks.

The sanitizer step of CI builds with it, so on a CPU without AVX-512 the tests marked native run
against a library built this way (tests/sanitizer/build_and_run.sh).
"""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "msl_host"))
import msl_build  # noqa: E402  (the tests' one choice of C++ compiler: $CXX, else g++)

REPO = HERE.parent
WITHOUT_AVX512 = ("TF_METAL_OPS_WITHOUT_AVX512", "1")


def _extension(setup_py, monkeypatch, variants, runs_avx512, machine="x86_64"):
    if variants is None:
        monkeypatch.delenv("TF_METAL_OPS_ROW_VARIANTS", raising=False)
    else:
        monkeypatch.setenv("TF_METAL_OPS_ROW_VARIANTS", variants)
    monkeypatch.setattr(setup_py, "host_runs_avx512", lambda: runs_avx512)
    monkeypatch.setattr(setup_py.platform, "machine", lambda: machine)
    return setup_py.native_extension(setup_py.LINUX)


@pytest.mark.parametrize("variants, runs_avx512, machine, left_out", [
    (None, False, "x86_64", False),       # the default builds every variant
    ("all", False, "x86_64", False),
    ("host", True, "x86_64", False),      # a CPU with AVX-512 runs all three
    ("host", False, "x86_64", True),      # the sanitizer build on a CPU without it
    ("host", False, "aarch64", False),    # the file is empty there anyway; nothing to decide
])
def test_host_leaves_out_only_the_avx512_variant_a_cpu_lacks(setup_py, monkeypatch, variants,
                                                             runs_avx512, machine, left_out):
    extension = _extension(setup_py, monkeypatch, variants, runs_avx512, machine)
    assert len(setup_py.AVX512_SOURCES) == 3
    for source in setup_py.AVX512_SOURCES:
        assert (source not in extension.sources) is left_out
    assert (WITHOUT_AVX512 in extension.define_macros) is left_out
    kept = ["csrc/cpu/simd/rows_dispatch.cc",
            *(f"csrc/cpu/simd/rows_{isa}_{dtype}.cc" for isa in ("portable", "avx2")
              for dtype in ("float32", "float16", "bfloat16"))]
    for source in kept:
        assert source in extension.sources
        assert (REPO / source).is_file()


def test_an_unknown_value_is_refused_by_name(setup_py, monkeypatch):
    with pytest.raises(SystemExit, match=r"TF_METAL_OPS_ROW_VARIANTS must be one of all, host, "
                                         r"got 'avx2'"):
        _extension(setup_py, monkeypatch, "avx2", runs_avx512=False)


@pytest.mark.parametrize("text, expected", [
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512dq avx512bw avx512vl\n",
     True),
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512dq avx512cd\n", False),
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c\n", False),
    ("processor\t: 0\n", True),  # no flags line: cannot tell, so nothing is left out
], ids=["all four", "bw and vl missing", "no avx512", "no flags line"])
def test_host_runs_avx512_reads_the_flags_linux_reports(setup_py, tmp_path, text, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert setup_py.host_runs_avx512(cpuinfo) is expected
    assert setup_py.host_runs_avx512(tmp_path / "absent") is True


def test_the_dispatch_of_a_build_without_avx512_names_no_avx512_kernel(setup_py, tmp_path):
    # Compiled to assembly (no linker or nm needed): the AVX-512 kernels' mangled names appear
    # in the dispatch built as usual and are gone with the macro, so its link needs no
    # rows_avx512_*.cc object.
    def avx512_references(*macros):
        out = tmp_path / "dispatch.s"
        subprocess.run([*msl_build.cxx(), "-std=c++17", "-O1", "-S", *macros,
                        f"-I{REPO}", f"-I{setup_py.tensorflow_dir() / 'include'}",
                        str(REPO / "csrc/cpu/simd/rows_dispatch.cc"), "-o", str(out)],
                       check=True, capture_output=True, text=True)
        return out.read_text().count("6avx512")

    if platform.machine() != "x86_64":
        pytest.skip(f"the AVX-512 variant exists on x86-64 only; this is {platform.machine()}")
    assert avx512_references() > 0
    assert avx512_references(f"-D{WITHOUT_AVX512[0]}={WITHOUT_AVX512[1]}") == 0
