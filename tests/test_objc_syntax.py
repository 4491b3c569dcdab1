"""Objective-C++ syntax check of the Metal host code (csrc/metal/*.mm), on Linux.

There is no Apple SDK here, so every ``.mm`` file is compiled by clang (to an object that is thrown
away: only the diagnostics matter) as Objective-C++ with ARC and blocks, against the real TensorFlow C headers (so every TF C API call
is checked against the installed TensorFlow) and against ``tests/apple_decls/``, a self-contained
set of declarations of exactly the Apple APIs the code uses, each written from Apple's
documentation. A misspelled selector, a wrong argument type, a ``void*`` turned into an ``id``
without ``__bridge``, or a TF C API misuse fails the build.

The negative tests prove the check can fail: each compiles a copy of a real ``.mm`` file with one
deliberate mistake and asserts that clang rejects it, for the expected reason.

Needs clang: a system clang, else the ziglang wheel's (the ``test`` extra), as
``tests/msl_host/msl_build.py`` finds it. Without clang the tests fail rather than skip: this
check is the only thing standing between a typo in the GPU code and a Mac user's crash.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402  (the tests' one choice of clang)

REPO_ROOT = Path(__file__).resolve().parents[1]
METAL_DIR = REPO_ROOT / "csrc" / "metal"
APPLE_DECLS = REPO_ROOT / "tests" / "apple_decls"

# The host files that must exist: a glob alone would pass vacuously if they were renamed away.
EXPECTED_MM_FILES = {"custom_loss_metal.mm", "kernel_library.mm", "metal_stream.mm",
                     "metal_kernel_metal.mm", "user_kernel_library.mm"}

OBJC_FLAGS = [
    "-x", "objective-c++",
    "-std=c++17",
    "-fblocks",
    "-fobjc-arc",
    # Any Objective-C runtime with ARC support will do for a syntax check; GNUstep's is the one
    # clang supports on Linux.
    "-fobjc-runtime=gnustep-2.0",
    "-Wall",
    "-Wextra",
    "-Werror",
]


def tensorflow_include_dir() -> Path | None:
    """TensorFlow's C headers, found without importing TensorFlow (fast, no side effects)."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    return include if (include / "tensorflow" / "c" / "kernels.h").exists() else None


@pytest.fixture(scope="module")
def objc_compiler() -> list[str]:
    clang = mb.find_clang()
    assert clang is not None, mb.missing_clang_message("the Objective-C++ syntax check")
    tf_include = tensorflow_include_dir()
    assert tf_include is not None, "TensorFlow with its C headers (tensorflow/include) is needed"
    return [
        *clang.command,
        *OBJC_FLAGS,
        # apple_decls first, so <Foundation/Foundation.h>, <Metal/Metal.h>, <dispatch/dispatch.h>
        # and <dlfcn.h> resolve to the documented declarations, not to anything on the system.
        "-I", str(APPLE_DECLS),
        "-I", str(REPO_ROOT),
        "-isystem", str(tf_include),
    ]


def compile_objc(compiler: list[str], source: Path,
                 extra_flags: tuple = ()) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as out_dir:
        return mb.compile_to_object(compiler, extra_flags, source, Path(out_dir))


def mm_files() -> list[Path]:
    return sorted(METAL_DIR.glob("*.mm"))


def test_objc_host_files_present():
    names = {p.name for p in mm_files()}
    missing = EXPECTED_MM_FILES - names
    assert not missing, f"expected Metal host files are missing from csrc/metal: {sorted(missing)}"


@pytest.mark.parametrize("source", mm_files(), ids=lambda p: p.name)
def test_objc_syntax(objc_compiler, source):
    result = compile_objc(objc_compiler, source)
    assert result.returncode == 0, (
        f"clang rejected {source.relative_to(REPO_ROOT)}:\n{result.stderr}"
    )


def mutated_copy(tmp_path: Path, name: str, original: str, replacement: str) -> Path:
    """A copy of csrc/metal/<name> with exactly one occurrence of `original` replaced.

    The copy keeps its includes working (they are relative to the repository root, which is on
    the include path). Asserting the occurrence exists keeps the negative test honest: if the code
    changes so that the mistake can no longer be introduced, the test says so instead of passing.
    """
    text = (METAL_DIR / name).read_text()
    assert original in text, f"{name} no longer contains {original!r}; update this negative test"
    path = tmp_path / name
    path.write_text(text.replace(original, replacement, 1))
    return path


def test_objc_check_rejects_misspelled_selector(objc_compiler, tmp_path):
    # One letter dropped from a Metal selector: must be an error, not a warning.
    source = mutated_copy(
        tmp_path, "custom_loss_metal.mm",
        "[encoder setComputePipelineState:pipeline]",
        "[encoder setComputePipelineStat:pipeline]",
    )
    result = compile_objc(objc_compiler, source)
    assert result.returncode != 0, "a misspelled selector compiled: the check cannot catch typos"
    assert "setComputePipelineStat:" in result.stderr, result.stderr


def test_objc_check_covers_the_metal_kernel_encoder(objc_compiler, tmp_path):
    # metal_kernel's encoder dispatches with dispatchThreads:threadsPerThreadgroup:, declared
    # from Apple's page: a wrong selector there fails like one in the loss encoder.
    source = mutated_copy(
        tmp_path, "metal_kernel_metal.mm",
        "[encoder dispatchThreads:MTLSizeMake(launch.grid[0]",
        "[encoder dispatchThread:MTLSizeMake(launch.grid[0]",
    )
    result = compile_objc(objc_compiler, source)
    assert result.returncode != 0, "a misspelled dispatchThreads selector compiled"
    assert "dispatchThread:" in result.stderr, result.stderr


def test_objc_check_rejects_wrong_selector_argument_type(objc_compiler, tmp_path):
    # A buffer index where the buffer belongs: the declared parameter types are enforced.
    source = mutated_copy(
        tmp_path, "custom_loss_metal.mm",
        "offset:record ? outcome->record_offset : 0\n                 atIndex:binding.index];",
        "offset:binding.role\n                 atIndex:binding.index];",
    )
    result = compile_objc(objc_compiler, source)
    assert result.returncode != 0, "an enum passed as an NSUInteger offset compiled"
    assert re.search(r"error: .*(gpu::BufferRole|BufferRole)", result.stderr), result.stderr


def test_objc_check_rejects_tf_c_api_misuse(objc_compiler, tmp_path):
    # The dtype name (const char*) where TF_KernelBuilder_TypeConstraint takes a TF_DataType:
    # only the real TensorFlow headers can catch this.
    source = mutated_copy(
        tmp_path, "custom_loss_metal.mm",
        'TF_KernelBuilder_TypeConstraint(builder, "T", type.dtype, status.get());',
        'TF_KernelBuilder_TypeConstraint(builder, "T", type.name, status.get());',
    )
    result = compile_objc(objc_compiler, source)
    assert result.returncode != 0, "a TF C API call with a wrong argument type compiled"
    assert "TF_DataType" in result.stderr, result.stderr


def test_objc_check_rejects_tf_status_owner_passed_as_pointer(objc_compiler, tmp_path):
    # The RAII owner instead of the raw TF_Status* it holds.
    source = mutated_copy(
        tmp_path, "metal_stream.mm",
        "TF_GetStream(ctx, status.get())",
        "TF_GetStream(ctx, status)",
    )
    result = compile_objc(objc_compiler, source)
    assert result.returncode != 0, "TF_GetStream accepted a StatusPtr instead of a TF_Status*"
    assert "TF_GetStream" in result.stderr, result.stderr


def test_objc_check_enforces_arc_bridged_casts(objc_compiler, tmp_path):
    # Under ARC a TF_TensorData void* must become an id<MTLBuffer> through __bridge; a plain cast
    # is an error. This proves the check really compiles with ARC on, as the macOS build does.
    source = mutated_copy(
        tmp_path, "custom_loss_metal.mm",
        "(__bridge id<MTLBuffer>)TF_TensorData(tensor)",
        "(id<MTLBuffer>)TF_TensorData(tensor)",
    )
    result = compile_objc(objc_compiler, source)
    assert result.returncode != 0, "a void* to id cast without __bridge compiled: ARC is off"
    assert "bridged cast" in result.stderr, result.stderr


def test_objc_apple_decls_are_self_contained(objc_compiler, tmp_path):
    # The declarations must not depend on any system Objective-C header (there is none on a clean
    # Linux CI machine, and one that happened to exist here could mask a missing declaration).
    probe = tmp_path / "probe.mm"
    probe.write_text(
        "#import <Foundation/Foundation.h>\n"
        "#import <Metal/Metal.h>\n"
        "#include <dispatch/dispatch.h>\n"
        "#include <dlfcn.h>\n"
        "static_assert(sizeof(MTLSize) == 3 * sizeof(NSUInteger), \"MTLSize layout\");\n"
    )
    result = compile_objc(objc_compiler, probe, ("-H",))
    assert result.returncode == 0, result.stderr
    # -H lists every header opened, one per line, prefixed with dots.
    opened = [line.lstrip(". ").strip() for line in result.stderr.splitlines()
              if line.startswith(".")]
    apple_names = ("Foundation.h", "Metal.h", "dispatch.h", "dlfcn.h")
    for header in opened:
        if Path(header).name in apple_names:
            assert Path(header).resolve().is_relative_to(APPLE_DECLS.resolve()), (
                f"{header} was taken from the system instead of tests/apple_decls"
            )
