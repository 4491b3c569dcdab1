"""`tf_metal_ops.metal_kernel`'s generated sources on an NVIDIA GPU, checked against the CPU path.

    python user_kernels.py write DIR        # here: TensorFlow and tf_metal_ops (the CPU path)
    python user_kernels.py run DIR LIBRARY  # on the GPU machine: numpy and libtfmo_cuda.so

`write` makes one case directory per launch: the kernels of docs/kernels.md's three examples
(MLX's `exp`, the row sum with threadgroup memory and `simd_sum`, the loss and its gradient
kernel) on the examples' own shapes and a few more, and kernels of tests/test_metal_kernel.py
(every float and integer dtype, a scalar input, `init_value`, a 3-D grid with partial
threadgroups, atomic outputs, the shape / strides / ndim parameters and a template), plus
`simd_sum` / `simd_max` in a partial last SIMD-group, and the scalar kernels of
tests/test_metal_kernel_stdlib.py (threadgroup memory with both barriers, atomics, integer
functions, SIMD-group and quad-group reductions, prefixes, votes, shuffles and broadcasts, over
partial SIMD-groups and lanes that returned). Each case holds the source NVRTC compiles
(the generated MSL as the CPU path compiles it: threadgroup declarations marked by its own
rewrite, `TFMO_GENERATED_KERNEL` appended), the grid, the threadgroup, every buffer in
[[buffer(i)]] order and the outputs the CPU path (the MSL emulator) gave for the same inputs.

`run` (run_user_kernels.sh) compiles each source with NVRTC against the CUDA stand-in
(include/metal_stdlib), launches it as dispatchThreads does, and compares: integers and bools
bit-exact, floats within TOLERANCES of the emulator's. Prints one line per case and a summary;
exit 0 when every case matched.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_sources import POSITIONS_SOURCE  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Largest difference accepted from the emulator, relative and absolute, per output dtype. The
# two compute in float32 with the same operations; what differs: CUDA's expf against the C
# library's exp (each within about an ulp), the order of simd_sum's additions (a butterfly here,
# lane order there) and FMA contraction. 16-bit outputs may round to the neighbouring value.
TOLERANCES = {"float32": (1e-5, 1e-6), "float16": (2e-3, 0.0), "bfloat16": (1.6e-2, 0.0)}

# A bad value in every output byte the kernel should write (0x7B: as tfmo_cuda_main's cases).
UNWRITTEN = 0x7B

# ---- write (the CPU path) -------------------------------------------------------------------

def _docs_sources():
    return re.findall(r'source="""(.*?)"""', (REPO / "docs" / "kernels.md").read_text(), re.S)


def _cases():
    """(case name, kernel, inputs, output shapes, output dtypes, grid, threadgroup, template,
    init_value): the kernels above on fixed inputs."""
    import tensorflow as tf
    import tf_metal_ops

    exp_src, row_sum_src, mse_forward_src, mse_backward_src = _docs_sources()
    rng = np.random.default_rng(2026)
    mk = tf_metal_ops.metal_kernel
    exp_k = mk("myexp", ["inp"], ["out"], exp_src)
    row_sum = mk("row_sum", ["x"], ["total"], row_sum_src)
    mse_forward = mk("mse_forward", ["pred", "target"], ["loss"], mse_forward_src)
    mse_backward = mk("mse_backward", ["pred", "target", "upstream"], ["grad"], mse_backward_src)
    f32 = tf.float32

    def normal(*shape):
        return tf.constant(rng.normal(size=shape).astype(np.float32))

    cases = []
    x = normal(4, 1000)
    cases.append(("docs_exp", exp_k, [x], [x.shape], [f32], (4000, 1, 1), (256, 1, 1),
                  [("T", f32)], None))
    for dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(normal(3, 77), dtype)
        cases.append((f"exp_{dtype.name}", exp_k, [x], [x.shape], [dtype], (231, 1, 1),
                      (64, 1, 1), [("T", dtype)], None))
    for rows, cols, tg in ((5, 300, 256), (37, 1000, 96), (3, 20, 64)):
        x = normal(rows, cols)
        cases.append((f"docs_row_sum_{rows}x{cols}_tg{tg}", row_sum, [x], [[rows]], [f32],
                      (tg, rows, 1), (tg, 1, 1), None, None))
    for batch in (32, 96):
        pred, target = normal(batch, 3), normal(batch, 3)
        upstream = tf.constant(rng.uniform(0.5, 1.5, size=batch).astype(np.float32))
        cases.append((f"docs_mse_forward_{batch}", mse_forward, [pred, target], [[batch]],
                      [f32], (batch, 1, 1), (64, 1, 1), None, None))
        cases.append((f"docs_mse_backward_{batch}", mse_backward, [pred, target, upstream],
                      [[batch, 3]], [f32], (batch * 3, 1, 1), (256, 1, 1), None, None))

    integer = mk("mix", ["a", "b"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = T((a[i] * T(3)) ^ (a[i] >> 2)) + b;
    """)
    for dtype in (tf.int32, tf.int64, tf.uint32, tf.uint8):
        info = np.iinfo(dtype.as_numpy_dtype)
        low, high = (info.min // 8, info.max // 8) if info.min < 0 else (info.min, info.max)
        a = tf.constant(rng.integers(low, high, size=500, endpoint=True,
                                     dtype=dtype.as_numpy_dtype))
        cases.append((f"integer_{dtype.name}", integer, [a, tf.constant(5, dtype)], [[500]],
                      [dtype], (500, 1, 1), (128, 1, 1), [("T", dtype)], None))
    above = mk("above", ["x", "limit"], ["flags"], """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) flags[i] = x[i] > limit;
    """)
    cases.append(("bool_scalar_init_value", above, [tf.range(10, dtype=f32), tf.constant(4.5)],
                  [[10]], [tf.bool], (10, 1, 1), (4, 1, 1), None, 1))
    positions = mk("positions", [], ["out"], POSITIONS_SOURCE)
    cases.append(("positions_3d_partial", positions, [], [[2, 3, 5, 4]], [tf.int32], (5, 3, 2),
                  (2, 2, 2), None, None))
    histogram = mk("histogram", ["values"], ["counts"], """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&counts[values[i]], 1, memory_order_relaxed);
    """, atomic_outputs=True)
    cases.append(("atomic_histogram", histogram,
                  [tf.constant(rng.integers(0, 8, size=1000), tf.int32)], [[8]], [tf.int32],
                  (1000, 1, 1), (256, 1, 1), None, 0))
    float_stats = mk("float_stats", ["x"], ["stats"], """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&stats[0], x[i], memory_order_relaxed);
        atomic_fetch_max_explicit(&stats[1], x[i], memory_order_relaxed);
    """, atomic_outputs=True)
    cases.append(("atomic_float_add_max", float_stats,
                  [tf.constant(rng.integers(-50, 50, size=300), f32)], [[2]], [f32],
                  (300, 1, 1), (64, 1, 1), None, -1000))
    signature = mk("sig", ["a", "s"], ["o"], "o[0] = a[a_ndim - 1] + s + float(a_shape[0] + "
                   "a_strides[0]) + float(simdgroup_index_in_threadgroup) + float(N);",
                   header="// a helper header")
    cases.append(("signature_template", signature, [normal(2, 3), tf.constant(1.0)], [[1]],
                  [f32], (1, 1, 1), (1, 1, 1), [("N", 4), ("F", False)], None))
    partial_simd = mk("partial_simd", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[2 * i] = simd_sum(x[i]);
        out[2 * i + 1] = simd_max(x[i]);
    """)
    cases.append(("simd_partial_simdgroup", partial_simd, [normal(50)], [[100]], [f32],
                  (50, 1, 1), (64, 1, 1), None, None))
    cases += _stdlib_cases(mk, rng)
    return cases


def _stdlib_cases(mk, rng):
    """The kernels of tests/test_metal_kernel_stdlib.py that use scalars only: threadgroup
    memory and both barriers, atomics, integer functions, SIMD-group and quad-group functions
    (over active lanes: partial SIMD-groups and lanes that returned)."""
    import tensorflow as tf
    import kernel_sources as ks

    cases = []
    reverse = mk("reverse", ["x"], ["out"], ks.THREADGROUP_REVERSE_SOURCE)
    cases.append(("stdlib_threadgroup_reverse", reverse, [tf.range(150, dtype=tf.float32)],
                  [[150]], [tf.float32], (150, 1, 1), (64, 1, 1), None, None))
    atomics = mk("atomics", ["k"], ["n", "r"], ks.ATOMICS_SOURCE, atomic_outputs=True)
    cases.append(("stdlib_atomics", atomics,
                  [tf.constant(rng.integers(-1000, 1000, size=300), tf.int32)], [[8], [6]],
                  [tf.int32, tf.float32], (300, 1, 1), (64, 1, 1), None, 0))
    integers = mk("integers", ["a", "b"], ["out"], ks.INTEGER_FUNCTIONS_SOURCE)
    count = len(ks.INTEGER_FUNCTIONS)
    for dtype in (tf.int32, tf.uint32):
        info = np.iinfo(dtype.as_numpy_dtype)
        low = info.min + 1 if info.min < 0 else 0
        a, b = (tf.constant(rng.integers(low, info.max, size=96, endpoint=True,
                                         dtype=np.int64).astype(dtype.as_numpy_dtype))
                for _ in range(2))
        cases.append((f"stdlib_integer_functions_{dtype.name}", integers, [a, b],
                      [[96 * count]], [dtype], (96, 1, 1), (32, 1, 1), [("T", dtype)], None))
    reductions = mk("simd_reductions", ["x", "p"], ["out", "votes"], ks.SIMD_REDUCTIONS_SOURCE)
    count = len(ks.SIMD_REDUCTIONS)
    for dtype in (tf.float32, tf.int32, tf.uint32):
        np_type = dtype.as_numpy_dtype
        if dtype == tf.float32:
            x = rng.uniform(-4, 4, size=100).astype(np_type)
            p = rng.uniform(0.8, 1.25, size=100).astype(np_type)
        else:
            x = rng.integers(0 if dtype == tf.uint32 else -50, 50, size=100).astype(np_type)
            p = rng.choice([1, 1, 1, 2] if dtype == tf.uint32 else [1, -1, 1, 2],
                           size=100).astype(np_type)
        for skip in (False, True):
            cases.append((f"stdlib_simd_reductions_{dtype.name}{'_skip' if skip else ''}",
                          reductions, [tf.constant(x), tf.constant(p)], [[100 * count], [200]],
                          [dtype, tf.uint32], (100, 1, 1), (48, 1, 1),
                          [("T", dtype), ("SKIP", skip)], 0))
    shuffles = mk("simd_shuffles", ["x", "p"], ["out"], ks.SIMD_SHUFFLES_SOURCE)
    count = len(ks.SIMD_SHUFFLES)
    for dtype in (tf.float32, tf.int32, tf.uint32, tf.float16):
        x, p = (tf.constant(rng.integers(0, 1000, size=128).astype(dtype.as_numpy_dtype))
                for _ in range(2))
        cases.append((f"stdlib_simd_shuffles_{dtype.name}", shuffles, [x, p], [[128 * count]],
                      [dtype], (128, 1, 1), (64, 1, 1), [("T", dtype)], None))
    own_erf = mk("own_erf", ["x"], ["out"], ks.OWN_ERF_SOURCE, header=ks.OWN_ERF_HEADER)
    cases.append(("stdlib_own_erf", own_erf, [tf.constant(np.linspace(-3, 3, 25), tf.float32)],
                  [[25]], [tf.float32], (25, 1, 1), (32, 1, 1), None, None))
    bitwise = mk("simd_bitwise", ["x"], ["out"], ks.SIMD_BITWISE_SOURCE)
    for dtype in (tf.int32, tf.uint32):
        x = tf.constant(rng.integers(0, 2 ** 31 - 1, size=64).astype(dtype.as_numpy_dtype))
        cases.append((f"stdlib_simd_bitwise_{dtype.name}", bitwise, [x], [[64 * 6]], [dtype],
                      (64, 1, 1), (64, 1, 1), [("T", dtype)], None))
    return cases


def _dtype_name(dtype) -> str:
    return dtype.name


def _raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def cuda_source(msl_source: str) -> str:
    """The generated source as NVRTC compiles it: the CPU path's own rewrite of threadgroup
    declarations, and the CUDA entry point named like the emulator's registration."""
    from tf_metal_ops import _native

    host = _native.runtime().kernel_host_source(msl_source)
    match = re.search(r'register_generated_kernel<(tfmo_kernel(?:, ::msl_host::attr::\w+)*)>'
                      r'\("(\w+)"\)', host)
    assert match, "the generated source has no emulator registration"
    return (f"{host}\n// tests/msl_cuda: the CUDA entry point, from the registration above.\n"
            f'TFMO_GENERATED_KERNEL("{match.group(2)}", {match.group(1)})\n')


def write(directory: Path) -> None:
    import tensorflow as tf
    from tf_metal_ops.kernels import MSL_TYPES

    directory.mkdir(parents=True, exist_ok=True)
    for (name, kernel, inputs, shapes, dtypes, grid, tg, template, init) in _cases():
        outputs = kernel(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                           threadgroup=tg, template=template, init_value=init)
        kernel_name, msl = kernel.generate(
            [MSL_TYPES[x.dtype] for x in inputs], [x.shape.rank for x in inputs],
            [MSL_TYPES[d] for d in dtypes], kernel._template(template))
        buffers = []  # [[buffer(i)]] order, as the CPU op binds them
        for x_name, x, bits in zip(kernel.input_names, inputs, kernel.shape_params):
            value = x.numpy()
            buffers.append({"role": "input", "name": x_name, "dtype": _dtype_name(x.dtype),
                            "data": _raw(value)})
            dims = list(x.shape)
            if dims and bits:
                strides = [int(np.prod(dims[d + 1:])) for d in range(len(dims))]
                for suffix, bit, array in (("_shape", 1, np.array(dims, np.int32)),
                                           ("_strides", 2, np.array(strides, np.int64)),
                                           ("_ndim", 4, np.array([len(dims)], np.int32))):
                    if bits & bit:
                        buffers.append({"role": "shape", "name": x_name + suffix,
                                        "dtype": str(array.dtype), "data": _raw(array)})
        for o_name, out, dtype in zip(kernel.output_names, outputs, dtypes):
            size = int(np.prod(out.shape)) * dtype.size
            start = (b"\x7b" * size if init is None else
                     _raw(tf.fill(out.shape, tf.cast(init, dtype)).numpy()))
            buffers.append({"role": "output", "name": o_name, "dtype": _dtype_name(dtype),
                            "data": start, "expected": _raw(out.numpy())})
        case = directory / name
        case.mkdir(exist_ok=True)
        (case / "source.cu").write_text(cuda_source(msl))
        (case / "generated.metal").write_text(msl)
        for i, b in enumerate(buffers):
            (case / f"buffer{i}.bin").write_bytes(b.pop("data"))
            if "expected" in b:
                (case / f"expected{i}.bin").write_bytes(b.pop("expected"))
        (case / "case.json").write_text(json.dumps(
            {"kernel_name": kernel_name, "grid": list(grid), "threadgroup": list(tg),
             "buffers": buffers}, indent=1))
        print(f"wrote {name}: {kernel_name}, grid {grid}, threadgroup {tg}")


# ---- run (the GPU) --------------------------------------------------------------------------

def as_float64(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(
            np.float64)
    return np.frombuffer(data, np.float16 if dtype == "float16" else dtype).astype(np.float64)


def compare(got: bytes, expected: bytes, dtype: str):
    """(ok, summary) of one output against the emulator's."""
    if dtype not in TOLERANCES:
        kind = np.bool_ if dtype == "bool" else dtype
        g, e = np.frombuffer(got, kind), np.frombuffer(expected, kind)
        wrong = int(np.sum(g != e))
        return wrong == 0, f"{dtype} bit-exact: {g.size - wrong}/{g.size}"
    g, e = as_float64(got, dtype), as_float64(expected, dtype)
    rtol, atol = TOLERANCES[dtype]
    both_nan = np.isnan(g) & np.isnan(e)
    diff = np.where(both_nan, 0.0, np.abs(g - e))
    bad = ~both_nan & ~(diff <= atol + rtol * np.abs(e))
    rel = np.max(diff / np.maximum(np.abs(e), 1e-30)) if g.size else 0.0
    return not bad.any(), (f"{dtype} max |diff| {np.max(diff):.3g}, max rel {rel:.3g}, "
                           f"bit-exact {int(np.sum(g.view(np.uint64) == e.view(np.uint64)))}"
                           f"/{g.size}, rtol {rtol:g} atol {atol:g}")


class Cuda:
    """libtfmo_cuda.so (NVRTC, module load, launch) and the driver's memory calls."""

    def __init__(self, library: str):
        self.lib = ctypes.CDLL(library)
        self.driver = ctypes.CDLL("libcuda.so.1")
        u32, vp, cp = ctypes.c_uint32, ctypes.c_void_p, ctypes.c_char_p
        self.lib.tfmo_cuda_compile_generated.argtypes = [cp, cp, ctypes.c_int32, cp, cp, u32]
        self.lib.tfmo_cuda_load.argtypes = [cp, cp, u32]
        self.lib.tfmo_cuda_run_generated.argtypes = [cp, ctypes.POINTER(u32), ctypes.POINTER(u32),
                                                     ctypes.POINTER(vp), u32, vp, cp, u32]
        d = self.driver
        d.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        d.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        d.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t]
        d.cuMemcpyDtoH_v2.argtypes = [vp, ctypes.c_uint64, ctypes.c_size_t]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    def run_case(self, case: Path, arch: int, work: Path):
        meta = json.loads((case / "case.json").read_text())
        log = ctypes.create_string_buffer(1 << 16)
        cubin = str(work / f"{case.name}.cubin").encode()
        if not self.lib.tfmo_cuda_compile_generated(str(REPO).encode(),
                                                    (case / "source.cu").read_bytes(), arch,
                                                    cubin, log, len(log)):
            return False, "NVRTC: " + log.value.decode(errors="replace")[-3000:], {}
        registers = re.findall(r"Used (\d+) registers", log.value.decode(errors="replace"))
        error = ctypes.create_string_buffer(1024)
        if self.lib.tfmo_cuda_load(cubin, error, len(error)) < 0:
            return False, "load: " + error.value.decode(), {}
        pointers, sizes = [], []
        for i, b in enumerate(meta["buffers"]):
            data = (case / f"buffer{i}.bin").read_bytes()
            ptr = ctypes.c_uint64(0)
            self.check(self.driver.cuMemAlloc_v2(ctypes.byref(ptr), max(len(data), 16)), "alloc")
            if data:
                self.check(self.driver.cuMemcpyHtoD_v2(ptr.value, data, len(data)), "copy in")
            pointers.append(ptr.value)
            sizes.append(len(data))
        grid = (ctypes.c_uint32 * 3)(*meta["grid"])
        tg = (ctypes.c_uint32 * 3)(*meta["threadgroup"])
        buffers = (ctypes.c_void_p * len(pointers))(*pointers)
        try:
            if not self.lib.tfmo_cuda_run_generated(meta["kernel_name"].encode(), grid, tg,
                                                    buffers, len(pointers), None, error,
                                                    len(error)):
                return False, "launch: " + error.value.decode(), {}
            self.check(self.driver.cuCtxSynchronize(), "synchronize")
            ok, notes, detail = True, [], {}
            for i, b in enumerate(meta["buffers"]):
                if b["role"] != "output":
                    continue
                got = ctypes.create_string_buffer(max(sizes[i], 1))
                if sizes[i]:
                    self.check(self.driver.cuMemcpyDtoH_v2(got, pointers[i], sizes[i]), "copy out")
                good, note = compare(got.raw[:sizes[i]],
                                     (case / f"expected{i}.bin").read_bytes(), b["dtype"])
                ok &= good
                notes.append(f"{b['name']}: {note}")
                detail[b["name"]] = note
            detail["registers"] = registers
            return ok, "; ".join(notes), detail
        finally:
            for p in pointers:
                self.driver.cuMemFree_v2(p)


def run(directory: Path, library: str, arch: int = 90) -> int:
    cuda = Cuda(library)
    results, failed = {}, 0
    with tempfile.TemporaryDirectory() as work:
        for case in sorted(p for p in directory.iterdir() if (p / "case.json").exists()):
            meta = json.loads((case / "case.json").read_text())
            ok, summary, detail = cuda.run_case(case, arch, Path(work))
            failed += not ok
            results[case.name] = {"ok": ok, "summary": summary, "kernel": meta["kernel_name"],
                                  "grid": meta["grid"], "threadgroup": meta["threadgroup"],
                                  **detail}
            print(f"{'ok  ' if ok else 'FAIL'} {case.name} (grid {tuple(meta['grid'])}, "
                  f"threadgroup {tuple(meta['threadgroup'])}): {summary}")
    (directory / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{len(results)} cases, {len(results) - failed} matched the emulator, {failed} failed")
    return 0 if results and failed == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "run":
        sys.exit(run(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) == 5
                     else 90))
    else:
        sys.exit(__doc__)
