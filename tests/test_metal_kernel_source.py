"""How the Metal host code finds and assembles the kernel source (csrc/metal/kernel_source.*).

On a Mac without the Metal toolchain, the kernels are compiled at first use from the shipped
``kernels/custom_loss.metal`` with ``newLibraryWithSource:``, which has no include path: the
loader inlines the quoted includes itself. That code is platform-neutral C++, so it is compiled
and run here, on the real kernel files:

- the assembled source must preprocess to exactly what the original preprocesses to (the Metal
  compiler would see the same program), with each header inlined once;
- ``#line`` markers must point compiler messages back at the original file and line;
- the loader must find the precompiled library and the source in the installed-package and the
  in-place-build layouts, and report what it searched otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNELS_DIR = REPO_ROOT / "kernels"

DRIVER = r"""
// Test driver: `assemble <file.metal>` prints the assembled source; `find <dir>` prints what
// FindKernelFiles found.
#include <cstdio>
#include <cstring>
#include <string>

#include "csrc/metal/kernel_source.h"

using namespace tf_metal_ops::metal;

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  if (std::strcmp(argv[1], "assemble") == 0) {
    std::string source, error;
    if (!AssembleKernelSource(argv[2], &source, &error)) {
      std::fprintf(stderr, "ERROR: %s\n", error.c_str());
      return 1;
    }
    std::fwrite(source.data(), 1, source.size(), stdout);
    return 0;
  }
  if (std::strcmp(argv[1], "find") == 0) {
    const KernelFiles files = FindKernelFiles(argv[2]);
    std::printf("metallib=%s\nsource=%s\n", files.metallib.c_str(), files.source.c_str());
    for (const std::string& path : files.searched) std::printf("searched=%s\n", path.c_str());
    return 0;
  }
  return 2;
}
"""


def cxx_compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "clang++", "clang++-16"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise AssertionError("a C++17 compiler (g++ or clang++) is needed to test kernel_source.cc")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("metal_kernel_source")
    main = build / "driver.cc"
    main.write_text(DRIVER)
    exe = build / "driver"
    result = subprocess.run(
        [cxx_compiler(), "-std=c++17", "-O0", "-Wall", "-Wextra", "-Werror", "-I", str(REPO_ROOT),
         str(main), str(REPO_ROOT / "csrc" / "metal" / "kernel_source.cc"), "-o", str(exe)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    return exe


def run_driver(driver: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(driver), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def preprocess(path: Path, stub_dir: Path) -> list[str]:
    """Tokens of `path` after the preprocessor, as the Metal compiler (__METAL__) would see them.

    <metal_stdlib> is replaced by an empty stub: both sides include it identically, and only what
    our files contribute matters. Whitespace and line markers are dropped before comparing.
    """
    result = subprocess.run(
        [cxx_compiler(), "-E", "-P", "-x", "c++", "-D__METAL__", "-D__METAL_VERSION__=310",
         "-I", str(stub_dir), str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_metal_kernel_source_assembles_real_kernels_to_the_same_program(driver, tmp_path):
    source = KERNELS_DIR / "custom_loss.metal"
    assert source.exists(), "kernels/custom_loss.metal is missing"
    result = run_driver(driver, "assemble", str(source))
    assert result.returncode == 0, result.stderr
    assembled = result.stdout

    # Nothing quoted is left to resolve (there is no include path at run time)...
    for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', assembled, flags=re.M):
        assert not (KERNELS_DIR / name).exists(), f'#include "{name}" was not inlined'
    # ...each header's contents appear once (the scalar math the CPU shares included)...
    assert assembled.count("struct CustomLossParams {") == 1
    assert assembled.count("struct GradientParts {") == 1
    # ...and the program is unchanged: the same tokens after preprocessing.
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "metal_stdlib").write_text("// stub\n")
    flat = tmp_path / "assembled.metal"
    flat.write_text(assembled)
    original_tokens = preprocess(source, stub)
    assert original_tokens, "the kernel source preprocessed to nothing"
    assert preprocess(flat, stub) == original_tokens


def test_metal_kernel_source_inlines_once_with_line_markers(driver, tmp_path):
    (tmp_path / "b.h").write_text("#ifndef B_H\n#define B_H\nint b_value;\n#endif\n")
    (tmp_path / "a.h").write_text('#include "b.h"\nint a_value;\n')
    (tmp_path / "main.metal").write_text(
        "#include <metal_stdlib>\n"          # 1: the compiler's own, kept
        '#include "a.h"\n'                   # 2: inlined, with b.h inside it
        '  #  include "b.h"  // again\n'     # 3: already inlined: a comment
        "#ifndef __METAL__\n"                # 4
        '#include "host_only.h"\n'           # 5: no such file: left for the compiler
        "#endif\n"                           # 6
        "int main_value;\n"                  # 7
    )
    result = run_driver(driver, "assemble", str(tmp_path / "main.metal"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    text = result.stdout

    assert "#include <metal_stdlib>" in lines
    assert '#include "host_only.h"' in lines
    assert text.count("int b_value;") == 1 and text.count("int a_value;") == 1
    assert not any(re.match(r'\s*#\s*include\s*"(a|b)\.h"', line) for line in lines)
    assert "// tf_metal_ops: already inlined: b.h" in lines

    # After a.h (inlined for line 2) the source resumes at line 3 of main.metal, so a compiler
    # message about `int main_value;` names main.metal:7.
    main = str(tmp_path / "main.metal")
    assert lines[0] == f'#line 1 "{main}"'
    assert f'#line 1 "{tmp_path / "a.h"}"' in lines
    assert f'#line 3 "{main}"' in lines
    resume = lines.index(f'#line 3 "{main}"')
    body_after = lines[resume + 1:]
    assert body_after.index("int main_value;") == 7 - 3


def test_metal_kernel_source_reports_unreadable_file(driver, tmp_path):
    result = run_driver(driver, "assemble", str(tmp_path / "absent.metal"))
    assert result.returncode == 1
    assert "cannot read" in result.stderr and "absent.metal" in result.stderr


def parse_find(output: str) -> dict:
    found = {"searched": []}
    for line in output.splitlines():
        key, _, value = line.partition("=")
        if key == "searched":
            found["searched"].append(value)
        else:
            found[key] = value
    return found


def test_metal_kernel_files_found_in_every_layout(driver, tmp_path):
    package = tmp_path / "site-packages" / "tf_metal_ops"
    package.mkdir(parents=True)

    # Nothing installed: both empty, and every candidate listed for the error message.
    found = parse_find(run_driver(driver, "find", str(package)).stdout)
    assert found["metallib"] == "" and found["source"] == ""
    assert found["searched"] == [
        str(package / "custom_loss.metallib"),
        str(package / "kernels" / "custom_loss.metal"),
        str(package / ".." / "kernels" / "custom_loss.metal"),
    ]

    # In-place build in a source checkout: the source next to the package directory.
    (tmp_path / "site-packages" / "kernels").mkdir()
    (tmp_path / "site-packages" / "kernels" / "custom_loss.metal").write_text("// src\n")
    found = parse_find(run_driver(driver, "find", str(package)).stdout)
    assert found["source"] == str(package / ".." / "kernels" / "custom_loss.metal")

    # Installed package: its own kernels/ wins over the checkout's, and the metallib is found.
    (package / "kernels").mkdir()
    (package / "kernels" / "custom_loss.metal").write_text("// src\n")
    (package / "custom_loss.metallib").write_bytes(b"MTLB")
    found = parse_find(run_driver(driver, "find", str(package)).stdout)
    assert found["source"] == str(package / "kernels" / "custom_loss.metal")
    assert found["metallib"] == str(package / "custom_loss.metallib")
