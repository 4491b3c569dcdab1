"""The platform-neutral parts of metal_kernel's Metal encoder, run on Linux.

The encoder itself (csrc/metal/metal_kernel_metal.mm) only runs on a Mac; what it binds, checks
and fills comes from csrc/metal_kernel_args.cc, which the CPU kernel shares. A small C++ driver
runs those functions here:

- the buffer order must be the [[buffer(i)]] order tf_metal_ops/kernels.py generates (both
  kernels bind from it, so the generated signature and the bindings cannot drift apart);
- grid, threadgroup and output-shape checks, the threadgroup cut to the grid, the bytes of
  init_value in every dtype, the shape parameters and the fill kernel's grid;
- the fill kernels' MSL (csrc/metal/fill_kernel_source.h) passes the address-space check, as the
  generated sources do.
"""

from __future__ import annotations

import importlib.util
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

DRIVER = r"""
// Test driver over csrc/metal_kernel_args.h: one command per run, its answer on stdout.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "csrc/metal_kernel_args.h"

using namespace tf_metal_ops;

static std::vector<int64_t> Ints(const char* text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(std::strtoll(item.c_str(), nullptr, 10));
  }
  return out;
}

static int Report(const Error& e) {
  if (e.ok()) return 0;
  std::printf("error: %s\n", e.message.c_str());
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string command = argv[1];
  if (command == "bindings" && argc == 5) {
    std::vector<int> ranks;
    for (int64_t r : Ints(argv[2])) ranks.push_back(static_cast<int>(r));
    static const char* kNames[] = {"input", "shape", "strides", "ndim", "output"};
    for (const Binding& b : BufferBindings(ranks, Ints(argv[3]), std::atoi(argv[4]))) {
      std::printf("%s %d\n", kNames[static_cast<int>(b.kind)], b.index);
    }
    return 0;
  }
  if (command == "grid") {
    const std::vector<int64_t> values = Ints(argv[2]);
    uint32_t grid[3] = {0, 0, 0};
    Error e = CheckGrid("k", values.data(), static_cast<int64_t>(values.size()), grid);
    if (e.ok()) std::printf("ok %u %u %u\n", grid[0], grid[1], grid[2]);
    return Report(e);
  }
  if (command == "threadgroup") {
    Error e = CheckThreadgroup(Ints(argv[2]));
    if (e.ok()) std::printf("ok\n");
    return Report(e);
  }
  if (command == "clamp") {
    const std::vector<int64_t> grid64 = Ints(argv[3]);
    const uint32_t grid[3] = {static_cast<uint32_t>(grid64[0]), static_cast<uint32_t>(grid64[1]),
                              static_cast<uint32_t>(grid64[2])};
    uint32_t out[3];
    ClampThreadgroup(Ints(argv[2]), grid, out);
    std::printf("%u %u %u\n", out[0], out[1], out[2]);
    return 0;
  }
  if (command == "outputs" && argc == 5) {
    MetalKernelAttrs attrs;
    attrs.kernel_name = "k";
    attrs.output_ranks = Ints(argv[2]);
    for (int64_t t : Ints(argv[3])) attrs.output_types.push_back(static_cast<TF_DataType>(t));
    const std::vector<int64_t> dims = Ints(argv[4]);
    std::vector<OutputSpec> specs;
    Error e = OutputSpecs(attrs, dims.data(), static_cast<int64_t>(dims.size()), &specs);
    if (!e.ok()) return Report(e);
    for (const OutputSpec& s : specs) {
      std::printf("%lld %zu\n", static_cast<long long>(s.elements), s.bytes);
    }
    return 0;
  }
  if (command == "init" && argc == 4) {
    std::vector<uint8_t> bytes;
    Error e = InitValueBytes(static_cast<TF_DataType>(std::atoi(argv[2])),
                             std::strtof(argv[3], nullptr), &bytes);
    if (!e.ok()) return Report(e);
    for (uint8_t b : bytes) std::printf("%02x", b);
    std::printf("\n");
    return 0;
  }
  if (command == "shape") {
    const ShapeParams p = MakeShapeParams(Ints(argv[2]));
    std::printf("ndim %d\nshape", p.ndim);
    for (int32_t d : p.shape) std::printf(" %d", d);
    std::printf("\nstrides");
    for (int64_t s : p.strides) std::printf(" %lld", static_cast<long long>(s));
    std::printf("\n");
    // The bytes a shape binding passes are these values, in this order.
    const std::vector<ShapeParams> all = {p};
    const InlineBytes shape = InlineBytesOf({BindingKind::kInputShape, 0}, all);
    const InlineBytes strides = InlineBytesOf({BindingKind::kInputStrides, 0}, all);
    const InlineBytes ndim = InlineBytesOf({BindingKind::kInputNdim, 0}, all);
    const InlineBytes tensor = InlineBytesOf({BindingKind::kInput, 0}, all);
    std::printf("inline %zu %zu %zu %d\n", shape.length, strides.length, ndim.length,
                tensor.data == nullptr && tensor.length == 0 ? 1 : 0);
    return 0;
  }
  if (command == "fill" && argc == 3) {
    uint32_t grid[2] = {0, 0};
    if (FillGrid(std::strtoll(argv[2], nullptr, 10), grid)) {
      std::printf("%u %u\n", grid[0], grid[1]);
    } else {
      std::printf("none\n");
    }
    return 0;
  }
  return 2;
}
"""

# TF_DataType values (tensorflow/c/tf_datatype.h).
TF_FLOAT, TF_INT32, TF_UINT8, TF_BOOL, TF_INT64, TF_BFLOAT16, TF_HALF, TF_UINT32, TF_DOUBLE = (
    1, 3, 4, 10, 9, 14, 19, 22, 2)


def tensorflow_dir() -> Path:
    spec = importlib.util.find_spec("tensorflow")
    assert spec is not None and spec.submodule_search_locations, "TensorFlow is needed"
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("metal_kernel_args")
    main = build / "driver.cc"
    main.write_text(DRIVER)
    exe = build / "driver"
    tf_dir = tensorflow_dir()
    framework = next(tf_dir.glob("libtensorflow_framework.so*"), None)
    assert framework is not None, f"no libtensorflow_framework in {tf_dir}"
    sources = [main] + [REPO_ROOT / "csrc" / name for name in
                        ("metal_kernel_args.cc", "problem.cc", "pending_errors.cc")]
    result = subprocess.run(
        [*mb.cxx(), "-std=c++17", "-O0", "-Wall", "-Wextra", "-Werror", "-I", str(REPO_ROOT),
         "-isystem", str(tf_dir / "include"), *map(str, sources), str(framework),
         f"-Wl,-rpath,{tf_dir}", "-lpthread", "-o", str(exe)],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    return exe


def run(driver: Path, *args) -> str:
    result = subprocess.run([str(driver), *map(str, args)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def generated_buffers(input_ranks, shape_params_used, num_outputs):
    """The [[buffer(i)]] names of kernels.py's generated signature, in index order."""
    from tf_metal_ops import kernels  # imports TensorFlow: only where the test needs it
    names = [f"in{i}" for i in range(len(input_ranks))]
    outputs = [f"out{o}" for o in range(num_outputs)]
    uses = " ".join(f"{n}{suffix}" for n, wanted in zip(names, shape_params_used)
                    for suffix in wanted)
    kernel = kernels.metal_kernel("order", names, outputs, f"// {uses}\nout0[0] = 0;")
    _, source = kernel.generate(["float"] * len(names), list(input_ranks),
                                ["float"] * num_outputs, [])
    found = re.findall(r"(\w+) \[\[buffer\((\d+)\)\]\]", source)
    assert [int(i) for _, i in found] == list(range(len(found)))
    return [name for name, _ in found], kernel.shape_params


@pytest.mark.parametrize("input_ranks, wanted, num_outputs", [
    ([1], [[]], 1),
    ([2, 0, 3], [["_shape", "_strides", "_ndim"], ["_shape"], ["_ndim", "_shape"]], 2),
    ([0, 0], [["_ndim"], []], 1),
    ([], [], 3),
    ([1, 2], [["_strides"], ["_ndim", "_strides"]], 1),
])
def test_bindings_follow_the_generated_signature(driver, input_ranks, wanted, num_outputs):
    names, shape_params = generated_buffers(input_ranks, wanted, num_outputs)
    lines = run(driver, "bindings", ",".join(map(str, input_ranks)) or ",",
                ",".join(map(str, shape_params)) or ",", num_outputs).splitlines()
    spelled = []
    for line in lines:
        kind, index = line.split()
        base = f"out{index}" if kind == "output" else f"in{index}"
        spelled.append(base if kind in ("input", "output") else f"{base}_{kind}")
    assert spelled == names


@pytest.mark.parametrize("values, expected", [
    ("4,1,1", "ok 4 1 1"),
    ("4294967295,1,2", "ok 4294967295 1 2"),
    ("0,1,1", "error: metal_kernel 'k': grid.x must be in [1, 4294967295], got 0"),
    ("1,4294967296,1", "error: metal_kernel 'k': grid.y must be in [1, 4294967295], got "
                       "4294967296"),
    ("1,1,-3", "error: metal_kernel 'k': grid.z must be in [1, 4294967295], got -3"),
    ("4,1", "error: metal_kernel 'k': grid must hold 3 int64 values, got 2"),
])
def test_grid_checks(driver, values, expected):
    assert run(driver, "grid", values).strip() == expected


@pytest.mark.parametrize("values, ok", [
    ("1024,1,1", True), ("32,32,1", True), ("1,1,1", True), ("1025,1,1", False),
    ("32,32,2", False), ("0,1,1", False), ("8,8", False), ("1099511627776,1099511627776,1", False),
])
def test_threadgroup_checks(driver, values, ok):
    out = run(driver, "threadgroup", values).strip()
    if ok:
        assert out == "ok"
    else:
        assert out.startswith("error: TfMetalOps>MetalKernel: threadgroup needs 3 values >= 1, "
                              "at most 1024 threads in all, got ["), out


def test_threadgroup_is_cut_to_the_grid(driver):
    assert run(driver, "clamp", "256,4,1", "100,8,1").split() == ["100", "4", "1"]
    assert run(driver, "clamp", "32,32,1", "4000,1,1").split() == ["32", "1", "1"]


def test_output_specs(driver):
    assert run(driver, "outputs", "2,0,1", f"{TF_FLOAT},{TF_INT64},{TF_HALF}",
               "3,5,0").splitlines() == ["15 60", "1 8", "0 0"]
    assert "output_shapes holds 2 dims, the output ranks add up to 3" in run(
        driver, "outputs", "3", str(TF_FLOAT), "2,2")
    assert "output 0 has the shape [4, -1] (a negative dimension, or too many bytes)" in run(
        driver, "outputs", "2", str(TF_FLOAT), "4,-1")
    # 2^61 float32 elements are 2^63 bytes: one past int64.
    assert "too many bytes" in run(driver, "outputs", "2", str(TF_FLOAT), f"{2 ** 31},{2 ** 30}")
    assert run(driver, "outputs", "2", str(TF_UINT8), f"{2 ** 31},{2 ** 31}").split() == [
        str(2 ** 62), str(2 ** 62)]
    assert "a dtype the op does not support" in run(driver, "outputs", "1", str(TF_DOUBLE), "2")


def bfloat16_bits(value: float) -> bytes:
    bits = int(np.array([value], np.float32).view(np.uint32)[0])
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return struct.pack("<H", bits)


@pytest.mark.parametrize("value", [0.0, 1.0, -1000.0, 2.5, 3.0e38, 0.1])
def test_init_value_bytes(driver, value):
    def got(dtype):
        return bytes.fromhex(run(driver, "init", dtype, repr(value)).strip())

    assert got(TF_FLOAT) == struct.pack("<f", value)
    with np.errstate(over="ignore"):  # 3e38 rounds to half's infinity, as the C++ cast does
        assert got(TF_HALF) == np.array([value], np.float32).astype(np.float16).tobytes()
    assert got(TF_BFLOAT16) == bfloat16_bits(value)
    assert got(TF_BOOL) == bytes([1 if value != 0 else 0])
    if -2 ** 31 <= value < 2 ** 31:
        assert got(TF_INT32) == struct.pack("<i", int(value))
        assert got(TF_INT64) == struct.pack("<q", int(value))
    if 0 <= value < 256:
        assert got(TF_UINT8) == bytes([int(value)])
        assert got(TF_UINT32) == struct.pack("<I", int(value))
    assert "error: TfMetalOps>MetalKernel: init_value for an unsupported dtype" in run(
        driver, "init", TF_DOUBLE, "1")


def test_shape_params(driver):
    lines = run(driver, "shape", "2,3,4").splitlines()
    assert lines == ["ndim 3", "shape 2 3 4", "strides 12 4 1", "inline 12 24 4 1"]


@pytest.mark.parametrize("elements, expected", [
    (1, "1 1"), (65536, "65536 1"), (65537, "65536 2"), (10 ** 9, f"65536 {-(-10 ** 9 // 65536)}"),
    (0, "none"), (65536 * (2 ** 32 - 1), f"65536 {2 ** 32 - 1}"), (65536 * 2 ** 32, "none"),
])
def test_fill_grid(driver, elements, expected):
    assert run(driver, "fill", elements).strip() == expected


def test_fill_kernels_pass_the_address_space_check(tmp_path):
    clang = mb.find_clang()
    assert clang is not None, mb.missing_clang_message("the fill kernels' address-space check")
    header = (REPO_ROOT / "csrc" / "metal" / "fill_kernel_source.h").read_text()
    match = re.search(r'R"msl\((.*?)\)msl"', header, re.DOTALL)
    assert match, "fill_kernel_source.h no longer holds its source as R\"msl(...)msl\""
    source = match.group(1)
    for bits in (8, 16, 32, 64):
        assert f"tfmo_fill_{bits}" in source
    good = tmp_path / "fill.metal"
    good.write_text(source)
    result = mb.address_space_compile(good, clang, tmp_path)
    assert result.returncode == 0, result.stderr
    # The control: a write through the constant value must fail the same check.
    bad = tmp_path / "fill_bad.metal"
    bad.write_text(source.replace("out[i] = value;", "out[i] = value; (&value)[0] = value;"))
    result = mb.address_space_compile(bad, clang, tmp_path)
    assert result.returncode != 0, "the check accepted a write to constant memory"
