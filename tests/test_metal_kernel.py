"""tf_metal_ops.metal_kernel on the CPU: users' kernels compiled for the host and run in the MSL
emulator (docs/kernels.md). The examples of docs/kernels.md run as they are written; the rest
checks dtypes against TensorFlow, the generated signature, the argument checks and the cache.

Kernels compile into a cache directory kept across sessions (pytest's cache), so a rerun loads
them from disk; the tests that count compiles compare counts before and after a call.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import _native, kernels
from child_python import run_python
from kernel_sources import EXP_SOURCE, POSITIONS_SOURCE

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "kernels.md"



@pytest.fixture(scope="module", autouse=True)
def _kernel_cache(kernel_cache):
    """Every test of this module compiles into the shared test cache (conftest.py)."""
    yield kernel_cache


def doc_examples():
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    return [b for b in blocks if "assert" in b]


@pytest.mark.parametrize("index", range(3))
def test_docs_example_runs(index):
    examples = doc_examples()
    assert len(examples) == 3, "docs/kernels.md should hold the three checked examples"
    exec(compile(examples[index], f"docs/kernels.md example {index}", "exec"), {})


def exp_kernel():
    return tf_metal_ops.metal_kernel("myexp", ["inp"], ["out"], EXP_SOURCE)


@pytest.mark.parametrize("dtype, rtol", [(tf.float32, 1e-6), (tf.float16, 1e-3),
                                         (tf.bfloat16, 1e-2)])
def test_exp_every_float_dtype(dtype, rtol):
    x = tf.cast(tf.random.stateless_normal([3, 77], seed=[1, 2]), dtype)
    (y,) = exp_kernel()(inputs=[x], output_shapes=[x.shape], output_dtypes=[dtype],
                        grid=(231, 1, 1), threadgroup=(64, 1, 1), template=[("T", dtype)])
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy(),
                               tf.cast(tf.exp(x), tf.float32).numpy(), rtol=rtol)


def test_exp_in_tf_function_with_unknown_batch():
    kernel = exp_kernel()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def run(x):
        n = tf.size(x, out_type=tf.int64)
        (y,) = kernel(inputs=[x], output_shapes=[tf.reshape(n, [1])],
                      output_dtypes=[tf.float32], grid=(n, 1, 1), threadgroup=(32, 1, 1),
                      template=[("T", tf.float32)])
        return y

    for size in (1, 45, 300):
        x = tf.linspace(-3.0, 3.0, size)
        np.testing.assert_allclose(run(x).numpy(), tf.exp(x).numpy(), rtol=1e-6)


INTEGER_SOURCE = """
    uint i = thread_position_in_grid.x;
    out[i] = T((a[i] * T(3)) ^ (a[i] >> 2)) + b;
"""


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.uint32, tf.uint8])
def test_integer_dtypes_bit_exact(dtype):
    info = np.iinfo(dtype.as_numpy_dtype)
    # Signed values small enough that a * 3 + 5 cannot overflow (undefined in C++); unsigned
    # ones over the whole range (they wrap, in C++ as in TensorFlow).
    low, high = (info.min // 8, info.max // 8) if info.min < 0 else (info.min, info.max)
    rng = np.random.default_rng(7)
    a_np = rng.integers(low, high, size=500, endpoint=True, dtype=dtype.as_numpy_dtype)
    a, b = tf.constant(a_np), tf.constant(5, dtype)
    kernel = tf_metal_ops.metal_kernel("mix", ["a", "b"], ["out"], INTEGER_SOURCE)
    (y,) = kernel(inputs=[a, b], output_shapes=[[500]], output_dtypes=[dtype],
                  grid=(500, 1, 1), threadgroup=(128, 1, 1), template=[("T", dtype)])
    shift = tf.bitwise.right_shift(a, tf.constant(2, dtype))
    expected = tf.bitwise.bitwise_xor(a * tf.constant(3, dtype), shift) + b
    np.testing.assert_array_equal(y.numpy(), expected.numpy())


def test_bool_and_scalar_inputs_and_init_value():
    source = """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) flags[i] = x[i] > limit;
    """
    kernel = tf_metal_ops.metal_kernel("above", ["x", "limit"], ["flags"], source)
    x = tf.range(10, dtype=tf.float32)
    (flags,) = kernel(inputs=[x, tf.constant(4.5)], output_shapes=[[10]],
                      output_dtypes=[tf.bool], grid=(10, 1, 1), threadgroup=(4, 1, 1),
                      init_value=1)
    expected = np.where(np.arange(10) % 2 == 0, np.arange(10) > 4.5, True)
    np.testing.assert_array_equal(flags.numpy(), expected)


def test_three_dimensional_grid_with_partial_threadgroups():
    """Every attribute of a 3-D dispatchThreads grid whose threadgroup does not divide it."""
    kernel = tf_metal_ops.metal_kernel("positions", [], ["out"], POSITIONS_SOURCE)
    grid, tg = (5, 3, 2), (2, 2, 2)
    (out,) = kernel(inputs=[], output_shapes=[[2, 3, 5, 4]], output_dtypes=[tf.int32],
                    grid=grid, threadgroup=tg)
    out = out.numpy()
    for z in range(2):
        for y in range(3):
            for x in range(5):
                g = (x // 2, y // 2, z // 2)
                n = tuple(min(t, d - gi * t) for t, d, gi in zip(tg, grid, g))
                assert out[z, y, x, 0] == g[0] * 100 + g[1] * 10 + g[2]
                assert out[z, y, x, 1] == n[0] * 100 + n[1] * 10 + n[2]
                assert out[z, y, x, 2] == 0
                assert out[z, y, x, 3] == 3 * 100 + 2 * 10 + 1


def test_atomic_outputs_histogram():
    source = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&counts[values[i]], 1, memory_order_relaxed);
    """
    kernel = tf_metal_ops.metal_kernel("histogram", ["values"], ["counts"], source,
                                       atomic_outputs=True)
    values = tf.constant(np.random.default_rng(3).integers(0, 8, size=1000), tf.int32)
    (counts,) = kernel(inputs=[values], output_shapes=[[8]], output_dtypes=[tf.int32],
                       grid=(1000, 1, 1), threadgroup=(256, 1, 1), init_value=0)
    np.testing.assert_array_equal(counts.numpy(), np.bincount(values.numpy(), minlength=8))


def test_generated_signature(capsys):
    kernel = tf_metal_ops.metal_kernel(
        "sig", ["a", "s"], ["o"], "o[0] = a[a_ndim - 1] + s + float(a_shape[0] + a_strides[0]) "
        "+ float(simdgroup_index_in_threadgroup);", header="// my helpers")
    (o,) = kernel(inputs=[tf.ones([2, 3]), tf.constant(1.0)], output_shapes=[[1]],
                  output_dtypes=[tf.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  template=[("N", 4), ("F", False)], verbose=True)
    assert o.numpy()[0] == 1.0 + 1.0 + 2.0 + 3.0
    printed = capsys.readouterr().out
    assert "// my helpers" in printed
    assert "template <int N, bool F>" in printed
    assert "const device float* a [[buffer(0)]]" in printed
    assert "constant int* a_shape [[buffer(1)]]" in printed
    assert "constant int64_t* a_strides [[buffer(2)]]" in printed
    assert "constant int& a_ndim [[buffer(3)]]" in printed
    assert "constant float& s [[buffer(4)]]" in printed
    assert "device float* o [[buffer(5)]]" in printed
    assert "uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]]" in printed
    assert "thread_position_in_grid" not in printed
    assert 'custom_kernel_sig_4_false_float_floats_float<4, false>' in printed


def test_threadgroup_declarations_become_shared():
    host = _native.runtime().kernel_host_source(
        "threadgroup float a[32];\n  threadgroup int total;\n"
        "{threadgroup metal::vec<float, 4> v[2 * N][N + 1];}\n"
        "threadgroup float* p = a;\nvoid f(threadgroup float& r);\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);\n")
    assert host.splitlines() == [
        "TFMO_THREADGROUP_STATIC float a[32];", "  TFMO_THREADGROUP_STATIC int total;",
        "{TFMO_THREADGROUP_STATIC metal::vec<float, 4> v[2 * N][N + 1];}",
        "threadgroup float* p = a;", "void f(threadgroup float& r);",
        "threadgroup_barrier(mem_flags::mem_threadgroup);"]


def test_second_call_compiles_nothing():
    kernel = tf_metal_ops.metal_kernel("again", ["inp"], ["out"], EXP_SOURCE)
    x = tf.ones([8])

    def call():
        return kernel(inputs=[x], output_shapes=[[8]], output_dtypes=[tf.float32],
                      grid=(8, 1, 1), threadgroup=(8, 1, 1), template=[("T", tf.float32)])

    before = tf_metal_ops.kernel_cache_info()
    call()
    first = tf_metal_ops.kernel_cache_info()
    assert (first["compiled"] + first["from_disk"]) == before["compiled"] + before["from_disk"] + 1
    call()
    second = tf_metal_ops.kernel_cache_info()
    assert second["compiled"] == first["compiled"]
    assert second["from_disk"] == first["from_disk"]
    assert second["in_memory"] == first["in_memory"] + 1


def test_new_process_reuses_the_disk_cache(kernel_cache):
    script = f"""
import json, tensorflow as tf, tf_metal_ops
k = tf_metal_ops.metal_kernel("myexp", ["inp"], ["out"], {EXP_SOURCE!r})
x = tf.constant([0.0, 1.0])
(y,) = k(inputs=[x], output_shapes=[[2]], output_dtypes=[tf.float32], grid=(2, 1, 1),
         threadgroup=(2, 1, 1), template=[("T", tf.float32)])
print(json.dumps([tf_metal_ops.kernel_cache_info(), y.numpy().tolist()]))
"""
    runs = [json.loads(run_python(script, env={"TF_METAL_OPS_CACHE_DIR": str(kernel_cache)})
                       .stdout.strip().splitlines()[-1]) for _ in range(2)]
    second_stats, values = runs[1]
    assert second_stats["compiled"] == 0 and second_stats["from_disk"] == 1, second_stats
    np.testing.assert_allclose(values, [1.0, np.e], rtol=1e-6)


def test_compile_error_names_the_line():
    kernel = tf_metal_ops.metal_kernel("broken", ["inp"], ["out"],
                                       "out[0] = inp[0] + not_declared_anywhere;")
    with pytest.raises(tf.errors.InvalidArgumentError, match="not_declared_anywhere") as error:
        kernel(inputs=[tf.ones([1])], output_shapes=[[1]], output_dtypes=[tf.float32],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert "metal_kernel 'custom_kernel_broken_float_float'" in str(error.value)
    assert re.search(r"\bsource:1:\d+: error", str(error.value)), str(error.value)


def test_compile_errors_name_the_users_own_lines():
    """The generated source's #line markers: the compiler names the body's and the header's own
    lines (the same text is what Metal compiles on a Mac), and the generated lines keep the
    numbering `verbose=True` prints."""
    body = "uint i = thread_position_in_grid.x;\n\nout[i] = inp[i] + not_in_body;\n"
    header = "inline float helper(float x) { return x; }\nconstant int c = not_in_header;"
    kernel = tf_metal_ops.metal_kernel("lines", ["inp"], ["out"], body, header=header)
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        kernel(inputs=[tf.ones([1])], output_shapes=[[1]], output_dtypes=[tf.float32],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    message = str(error.value)
    assert re.search(r"\bsource:3:\d+: error: .*not_in_body", message), message
    assert re.search(r"\bheader:2:\d+: error: .*not_in_header", message), message
    for template in ([], [("T", "typename", "float")]):
        _, source = kernel.generate(["float"], [1], ["float"], template)
        lines = source.splitlines()
        resumes = [(n, line) for n, line in enumerate(lines, 1) if line.startswith("#line ")
                   and line.endswith(f'"{kernels.GENERATED_FILE}"')]
        assert len(resumes) == 2, source
        for number, line in resumes:
            assert line == f'#line {number + 1} "{kernels.GENERATED_FILE}"'
        body_start = lines.index('#line 1 "source"') + 1
        assert lines[body_start:body_start + 3] == body.splitlines()


def test_broken_synchronization_fails_the_op():
    source = """
        if (thread_index_in_threadgroup == 0) return;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = 1.0f;
    """
    kernel = tf_metal_ops.metal_kernel("early_return", [], ["out"], source)
    with pytest.raises(tf.errors.InvalidArgumentError, match="returned before reaching it"):
        kernel(inputs=[], output_shapes=[[4]], output_dtypes=[tf.float32], grid=(4, 1, 1),
               threadgroup=(4, 1, 1))


def test_no_compiler_says_what_to_install(monkeypatch, kernel_cache):
    monkeypatch.setattr(kernels._toolchain, "kernel_compiler",
                        lambda: ((), "install a C++ compiler, please"))
    kernels.configure_toolchain()
    try:
        kernel = tf_metal_ops.metal_kernel("uncompiled_anywhere", [], ["out"], "out[0] = 2;")
        with pytest.raises(tf.errors.InvalidArgumentError, match="install a C\\+\\+ compiler"):
            kernel(inputs=[], output_shapes=[[1]], output_dtypes=[tf.int32], grid=(1, 1, 1),
                   threadgroup=(1, 1, 1))
    finally:
        monkeypatch.undo()
        kernels.configure_toolchain()


# ---- bad arguments, each named with its value where it enters --------------------------------

@pytest.mark.parametrize("args, error, match", [
    (("my-kernel", ["a"], ["b"]), ValueError, "name: 'my-kernel' is not an identifier"),
    (("k", ["a b"], ["b"]), ValueError, r"input_names\[0\]: 'a b' is not an identifier"),
    (("k", ["a"], ["a"]), ValueError, "output_names: 'a' is used twice"),
    (("k", ["a", "a_shape"], ["b"]), ValueError, "'a_shape' is used twice"),
    (("k", ["device"], ["b"]), ValueError, r"input_names\[0\]: 'device' is a reserved word"),
    (("k", ["a"], []), ValueError, "output_names: a kernel needs at least one output"),
    (("k", "a", ["b"]), TypeError, "input_names must be a list of names, got 'a'"),
])
def test_bad_kernel_arguments(args, error, match):
    with pytest.raises(error, match=match):
        tf_metal_ops.metal_kernel(*args, source="")


def test_unsupported_attribute_is_refused():
    with pytest.raises(ValueError, match=r"\[\[dispatch_threads_per_threadgroup\]\]"):
        tf_metal_ops.metal_kernel("k", [], ["o"], "uint3 d = dispatch_threads_per_threadgroup;")


GOOD_CALL = dict(inputs=[tf.ones([4])], output_shapes=[[4]], output_dtypes=[tf.float32],
                 grid=(4, 1, 1), threadgroup=(4, 1, 1))


@pytest.mark.parametrize("change, error, match", [
    (dict(inputs=[]), ValueError, r"inputs needs 1 tensors .*\['inp'\].*got 0"),
    (dict(inputs=[tf.ones([4], tf.float64)]), TypeError,
     "input 'inp': tf.float64 is not a supported dtype"),
    (dict(output_shapes=[[4], [4]]), ValueError, "output_shapes needs 1 entries"),
    (dict(output_dtypes=["complex64"]), TypeError,
     r"output_dtypes\[0\] \('out'\): 'complex64' is not a supported dtype"),
    (dict(output_shapes=[[4, -1]]), ValueError, r"output_shapes\[0\] \('out'\)"),
    (dict(grid=(0, 1, 1)), ValueError, r"grid.x must be in \[1, 4294967295\], got 0"),
    (dict(grid=(4, 2 ** 32, 1)), ValueError,
     r"grid.y must be in \[1, 4294967295\], got 4294967296"),
    (dict(grid=(4, 1)), ValueError, "grid must be 3 integers"),
    (dict(grid=(4.0, 1, 1)), TypeError, "grid.x must be an integer, got 4.0"),
    (dict(threadgroup=(1025, 1, 1)), ValueError, r"threadgroup.x must be in \[1, 1024\], got 1025"),
    (dict(threadgroup=(64, 4, 8)), ValueError, r"threadgroup \(64, 4, 8\) has 2048 threads"),
    (dict(template=[("T", 1.5)]), TypeError, "template 'T': 1.5 is neither a dtype"),
    (dict(template=[("T", "float")]), TypeError, "template 'T': 'float' is neither"),
    (dict(template=[("inp", 3)]), ValueError, r"template\[0\]: 'inp' is already the name"),
    (dict(template=[("2T", 3)]), ValueError, r"template\[0\]: '2T' is not an identifier"),
    (dict(template=[("T", tf.complex64)]), TypeError, "template 'T'.*not a supported dtype"),
    (dict(init_value="zero"), TypeError, "init_value must be a number or None, got 'zero'"),
])
def test_bad_call_arguments(change, error, match):
    kernel = exp_kernel()
    with pytest.raises(error, match=match):
        kernel(**{**GOOD_CALL, "template": [("T", tf.float32)], **change})


def test_bad_grid_tensor_is_checked_by_the_op():
    kernel = exp_kernel()

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def run(n):
        return kernel(**{**GOOD_CALL, "grid": (n, 1, 1), "template": [("T", tf.float32)]})

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"grid.x must be in .*got 0"):
        run(tf.constant(0, tf.int64))


def test_saved_model_carries_the_source(tmp_path, kernel_cache):
    """A SavedModel holds the source, not a path: a fresh process with an empty cache loads it
    and compiles the kernel from the graph alone, without calling metal_kernel."""
    kernel = exp_kernel()

    class Exp(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def __call__(self, x):
            n = tf.size(x, out_type=tf.int64)
            return kernel(inputs=[x], output_shapes=[tf.reshape(n, [1])],
                          output_dtypes=[tf.float32], grid=(n, 1, 1), threadgroup=(64, 1, 1),
                          template=[("T", tf.float32)])[0]

    path = tmp_path / "model"
    tf.saved_model.save(Exp(), str(path))
    graph = (path / "saved_model.pb").read_bytes()
    assert b"out[elem] = metal::exp(tmp);" in graph
    assert str(kernel_cache).encode() not in graph
    script = """
import json, sys, tensorflow as tf, tf_metal_ops
model = tf.saved_model.load(sys.argv[1])
y = model(tf.constant([0.0, 1.0, -1.0]))
print(json.dumps([tf_metal_ops.kernel_cache_info(), y.numpy().tolist()]))
"""
    out = run_python(script, str(path), env={"TF_METAL_OPS_CACHE_DIR": str(tmp_path / "cache")})
    stats, values = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["compiled"] == 1, stats
    np.testing.assert_allclose(values, np.exp([0.0, 1.0, -1.0]), rtol=1e-6)


def test_large_barrier_free_grid_runs_as_plain_calls():
    kernel = exp_kernel()
    assert not kernel.lockstep
    x = tf.random.stateless_uniform([2 ** 20], seed=[4, 5], minval=-5.0, maxval=5.0)
    (y,) = kernel(inputs=[x], output_shapes=[[2 ** 20]], output_dtypes=[tf.float32],
                  grid=(2 ** 20, 1, 1), threadgroup=(256, 1, 1), template=[("T", tf.float32)])
    np.testing.assert_allclose(y.numpy(), tf.exp(x).numpy(), rtol=1e-6)


# Every per-thread attribute the threadgroup loop steps, written per thread (6 ints).
ATTRIBUTES_SOURCE = """
    uint3 p = thread_position_in_grid;
    uint i = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
    uint3 t = thread_position_in_threadgroup;
    out[i * 6 + 0] = int(t.x + 10 * t.y + 100 * t.z);
    out[i * 6 + 1] = int(thread_index_in_threadgroup);
    out[i * 6 + 2] = int(thread_index_in_simdgroup);
    out[i * 6 + 3] = int(simdgroup_index_in_threadgroup);
    out[i * 6 + 4] = int(threadgroup_position_in_grid.x + 10 * threadgroup_position_in_grid.y);
    out[i * 6 + 5] = int(p.x + 100 * p.y + 10000 * p.z);
"""


@pytest.mark.parametrize("grid,threadgroup", [((77, 1, 1), (32, 1, 1)),
                                              ((45, 7, 3), (8, 4, 2)),
                                              ((100, 3, 1), (70, 1, 1))])
def test_threadgroup_loop_matches_the_fibers_across_partial_threadgroups(grid, threadgroup):
    """A barrier-free kernel runs each threadgroup as a loop in its own object; the same body
    with a barrier no thread reaches runs on the fibers. Every attribute agrees, edge
    threadgroups (cut by the grid) and SIMD-groups that straddle a row included."""
    plain = tf_metal_ops.metal_kernel("attributes_loop", [], ["out"], ATTRIBUTES_SOURCE)
    fibers = tf_metal_ops.metal_kernel(
        "attributes_fibers", [], ["out"],
        ATTRIBUTES_SOURCE + "if (threads_per_grid.x == 0) threadgroup_barrier("
        "mem_flags::mem_none);")
    assert not plain.lockstep and fibers.lockstep
    count = grid[0] * grid[1] * grid[2]
    outs = [k(inputs=[], output_shapes=[[count * 6]], output_dtypes=[tf.int32], grid=grid,
              threadgroup=threadgroup, init_value=-1)[0].numpy() for k in (plain, fibers)]
    assert (outs[1] >= 0).all()  # every thread wrote
    np.testing.assert_array_equal(outs[0], outs[1])
    x, y, z = np.meshgrid(*(np.arange(n) for n in grid), indexing="ij")
    np.testing.assert_array_equal(outs[0].reshape(-1, 6)[:, 5],
                                  (x + 100 * y + 10000 * z).transpose(2, 1, 0).ravel())


def test_barrier_hidden_from_the_lockstep_check_fails_the_op():
    """A barrier the source does not name (here built by a macro) cannot run as plain calls:
    the op fails with a message instead of running threads that do not wait."""
    header = "#define SYNC(space) space##_barrier(mem_flags::mem_threadgroup)"
    kernel = tf_metal_ops.metal_kernel("hidden_barrier", [], ["out"],
                                       "SYNC(threadgroup); out[0] = 1;", header=header)
    assert not kernel.lockstep
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="threadgroup_barrier called by a kernel run without lockstep"):
        kernel(inputs=[], output_shapes=[[1]], output_dtypes=[tf.int32], grid=(2, 1, 1),
               threadgroup=(2, 1, 1))


def test_float_atomics_and_max():
    source = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&stats[0], x[i], memory_order_relaxed);
        atomic_fetch_max_explicit(&stats[1], x[i], memory_order_relaxed);
    """
    kernel = tf_metal_ops.metal_kernel("float_stats", ["x"], ["stats"], source,
                                       atomic_outputs=True)
    x = tf.constant(np.random.default_rng(9).integers(-50, 50, size=300), tf.float32)
    (stats,) = kernel(inputs=[x], output_shapes=[[2]], output_dtypes=[tf.float32],
                      grid=(300, 1, 1), threadgroup=(64, 1, 1), init_value=-1000)
    # Integer-valued floats: every order of the additions gives the exact sum.
    np.testing.assert_array_equal(stats.numpy(), [np.sum(x.numpy()) - 1000, np.max(x.numpy())])


def test_simd_function_on_a_type_metal_refuses_is_a_compile_error_that_says_so():
    """Metal's SIMD-group shuffles take no bool; neither does the stand-in, with a message."""
    kernel = tf_metal_ops.metal_kernel(
        "bool_shuffle", ["x"], ["out"],
        "out[0] = simd_shuffle(x[thread_position_in_grid.x], 0);")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="simd_shuffle takes a scalar or vector of a number type"):
        kernel(inputs=[tf.ones([32], tf.bool)], output_shapes=[[1]],
               output_dtypes=[tf.bool], grid=(32, 1, 1), threadgroup=(32, 1, 1))


def doc_kernel_sources():
    return re.findall(r'source="""(.*?)"""', DOCS.read_text(), re.S)


@pytest.mark.parametrize("example, msl_type", [(0, "float"), (0, "half"), (0, "bfloat"),
                                               (1, "float")])
def test_generated_source_passes_the_address_space_check(example, msl_type, tmp_path):
    """The examples' generated sources, compiled by clang with device / constant / threadgroup
    as distinct address spaces (as Metal has them); a mix-up is caught (the control)."""
    clang = mb.find_clang()
    assert clang, mb.missing_clang_message("the address-space check")
    body = doc_kernel_sources()[example]
    names, template = ((["inp"], ["out"]), [("T", "typename", msl_type)]) if example == 0 else \
        ((["x"], ["total"]), [])
    cases = [(body, True)]
    if example == 1:  # the control: a device pointer where a threadgroup one is expected
        cases.append((body.replace("acc += x[row * cols + c];",
                                   "acc += x[row * cols + c]; threadgroup float* wrong = x;"),
                      False))
    for source, should_compile in cases:
        kernel = tf_metal_ops.metal_kernel("checked", *names, source)
        _, msl = kernel.generate([msl_type], [2], [msl_type], template)
        path = tmp_path / f"generated_{should_compile}.metal"
        path.write_text(_native.runtime().kernel_host_source(msl))
        result = mb.address_space_compile(path, clang, tmp_path, ["-DTFMO_MSL_HOST"])
        assert (result.returncode == 0) == should_compile, result.stderr
        if not should_compile:
            assert "threadgroup float *" in result.stderr and "device" in result.stderr


@pytest.mark.parametrize("change, match", [
    (dict(threadgroup=[2000, 1, 1]), "threadgroup needs 3 values >= 1, at most 1024"),
    (dict(threadgroup=[2 ** 40, 2 ** 40, 1]), "threadgroup needs 3 values"),
    (dict(output_shapes=tf.constant([-4], tf.int64)), r"output 0 has the shape \[-4\]"),
    (dict(output_shapes=tf.constant([2 ** 62], tf.int64)), "too many bytes"),
    (dict(output_shapes=tf.constant([4, 1], tf.int64)), "output_shapes holds 2 dims"),
    (dict(grid=tf.constant([4, 1], tf.int64)), "grid must hold 3 int64 values"),
])
def test_raw_op_checks_what_the_wrapper_would(change, match):
    """The op called directly (a hand-written graph) checks its own attributes and inputs."""
    kernel = exp_kernel()
    name, source = kernel.generate(["float"], [1], ["float"], [("T", "typename", "float")])
    args = dict(inputs=[tf.ones([4])], output_shapes=tf.constant([4], tf.int64),
                grid=tf.constant([4, 1, 1], tf.int64), Tout=[tf.float32], source=source,
                kernel_name=name, threadgroup=[4, 1, 1], output_ranks=[1], shape_params=[0])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=match):
        _native.op_module().tf_metal_ops_metal_kernel(**{**args, **change})
