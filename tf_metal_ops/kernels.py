"""`metal_kernel`: a user's own Metal kernel as a TensorFlow op, in the shape of MLX's
`mx.fast.metal_kernel` (its "Custom Metal Kernels" page has the rules this follows).

The user writes the body; the signature is generated from the names and the call's dtypes, the
whole source goes into one generic op (`TfMetalOps>MetalKernel`, csrc/metal_kernel.h), and the
op runs it. On the CPU the source is compiled for the host against the MSL emulator's stand-in
<metal_stdlib> and run over the grid's threadgroups (csrc/kernel_compiler.h); docs/kernels.md
says what runs where today.
"""

from __future__ import annotations

import keyword
import operator
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_metal_ops import _native, _toolchain, loss_path

# TensorFlow dtype -> the MSL type the generated signature uses.
MSL_TYPES = {
    tf.float32: "float",
    tf.float16: "half",
    tf.bfloat16: "bfloat",
    tf.int32: "int",
    tf.int64: "long",
    tf.uint32: "uint",
    tf.uint8: "uchar",
    tf.bool: "bool",
}

# Metal's thread attributes a body may name, and their types (uint3 for positions and sizes).
# The generator adds each one the body uses, in this order.
THREAD_ATTRIBUTES = (
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# Attributes Metal has that the emulator does not provide yet: a body naming one is refused.
UNSUPPORTED_ATTRIBUTES = ("dispatch_quadgroups_per_threadgroup",
                          "dispatch_simdgroups_per_threadgroup",
                          "dispatch_threads_per_threadgroup")

# Words a name may not be: C++ and MSL keywords, MSL's address spaces and types.
RESERVED = frozenset("""
alignas alignof and asm auto bool break case catch char class const constexpr const_cast
continue decltype default delete do double dynamic_cast else enum explicit export extern false
float for friend goto if inline int long mutable namespace new noexcept not nullptr operator or
private protected public register reinterpret_cast return short signed sizeof static
static_assert static_cast struct switch template this thread_local throw true try typedef
typeid typename union unsigned using virtual void volatile while xor
device constant threadgroup thread kernel vertex fragment half bfloat uint uchar ushort ulong
metal
""".split()) | frozenset(name for name, _ in THREAD_ATTRIBUTES) | frozenset(
    UNSUPPORTED_ATTRIBUTES)

# Calls that make threads wait for each other (barriers, SIMD-group and quad-group functions).
LOCKSTEP_CALLS = r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|quad_\w+)\s*\("

MAX_GRID = 2 ** 32 - 1
MAX_THREADGROUP_THREADS = 1024
SHAPE_PARAMS = (("_shape", 1), ("_strides", 2), ("_ndim", 4))  # csrc/metal_kernel.h's bits


def _check_name(argument: str, name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise ValueError(f"{argument}: {name!r} is not an identifier (letters, digits, _)")
    if name in RESERVED or keyword.iskeyword(name) or name.startswith("tfmo_"):
        raise ValueError(f"{argument}: {name!r} is a reserved word in MSL or in the generated "
                         "kernel; choose another name")
    return name


def _check_names(argument: str, names: Any) -> List[str]:
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise TypeError(f"{argument} must be a list of names, got {names!r}")
    return [_check_name(f"{argument}[{i}]", n) for i, n in enumerate(names)]


def _as_dtype(argument: str, value: Any) -> tf.DType:
    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype not in MSL_TYPES:
        supported = ", ".join(d.name for d in MSL_TYPES)
        raise TypeError(f"{argument}: {value!r} is not a supported dtype ({supported})")
    return dtype


def _dims3(argument: str, value: Any, most: int) -> Tuple[int, int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{argument} must be 3 integers (x, y, z), got {value!r}")
    dims = []
    for axis, v in zip("xyz", value):
        if isinstance(v, bool):
            raise TypeError(f"{argument}.{axis} must be an integer, got {v!r}")
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"{argument}.{axis} must be an integer, got {v!r}") from None
        if not 1 <= v <= most:
            raise ValueError(f"{argument}.{axis} must be in [1, {most}], got {v}")
        dims.append(v)
    return tuple(dims)


def _grid(value: Any) -> tf.Tensor:
    """The grid as an int64 [3] tensor: ints are checked here, tensors (a size known only at
    run time) where they are known, else by the op."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        if not value.dtype.is_integer or value.shape.rank != 1 or value.shape[0] != 3:
            raise ValueError(f"grid must be 3 integers (x, y, z) or an int tensor of shape [3], "
                             f"got {value!r}")
        parts = [value[i] for i in range(3)]
    elif isinstance(value, (list, tuple)) and len(value) == 3:
        parts = list(value)
    else:
        raise ValueError(f"grid must be 3 integers (x, y, z), got {value!r}")
    out = []
    for axis, v in zip("xyz", parts):
        if isinstance(v, (tf.Tensor, tf.Variable)):
            if not v.dtype.is_integer or v.shape.rank != 0:
                raise TypeError(f"grid.{axis} must be an integer, got {v!r}")
            static = tf.get_static_value(v)
            if static is not None:
                _dims3("grid", [int(static) if a == axis else 1 for a in "xyz"], MAX_GRID)
            out.append(tf.cast(v, tf.int64))
        else:
            out.append(tf.constant(_dims3("grid", [v if a == axis else 1 for a in "xyz"],
                                          MAX_GRID)["xyz".index(axis)], tf.int64))
    return tf.stack(out)


def _template_value(name: str, value: Any) -> Tuple[str, str]:
    """(C++ parameter kind, MSL spelling) of one template value."""
    if isinstance(value, bool):
        return "bool", "true" if value else "false"
    if isinstance(value, int):
        if not -2 ** 31 <= value < 2 ** 31:
            raise ValueError(f"template {name!r}: {value} does not fit an MSL int")
        return "int", str(value)
    if isinstance(value, tf.DType):
        return "typename", MSL_TYPES[_as_dtype(f"template {name!r}", value)]
    raise TypeError(f"template {name!r}: {value!r} is neither a dtype, an int nor a bool")


# The file name compiler messages give the generated lines (the verbose printout's numbering).
GENERATED_FILE = "generated"


def _from_user(argument: str, text: str) -> List[str]:
    """`text` (the body or the header) between `#line` markers, so that a compiler's messages
    about it, the host compiler's and Metal's alike, name the argument and the user's own line
    ("source:3:12: error: ..."). The placeholder after it becomes the marker that returns to the
    generated source's own numbering (`_number_resumes`)."""
    return [f'#line 1 "{argument}"', text, _RESUME]


# The namespace the CPU path compiles a kernel's header and body in (see `generate`).
_HOST_NAMESPACE = "tfmo_kernel_source"

_RESUME = "\0tfmo-resume-line\0"  # replaced by _number_resumes once the lines are known


def _number_resumes(lines: List[str]) -> List[str]:
    """Replaces each resume placeholder by `#line N "generated"`, N the physical number of the
    line after it in the final source (entries may span several lines)."""
    out, physical = [], 0
    for entry in lines:
        if entry == _RESUME:
            entry = f'#line {physical + 2} "{GENERATED_FILE}"'
        out.append(entry)
        physical += entry.count("\n") + 1
    return out


def _used(name: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


class MetalKernel:
    """A kernel made by `metal_kernel`; call it to run it (see `__call__`)."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, fallback: Optional[Callable[..., Any]] = None):
        self.name = _check_name("name", name)
        if fallback is not None and not callable(fallback):
            raise TypeError(f"fallback must be a callable of TensorFlow ops (taking the inputs, "
                            f"returning the outputs) or None, got {fallback!r}")
        self.fallback = fallback
        self.input_names = _check_names("input_names", input_names)
        self.output_names = _check_names("output_names", output_names)
        if not self.output_names:
            raise ValueError("output_names: a kernel needs at least one output")
        for argument, text in (("source", source), ("header", header)):
            if not isinstance(text, str):
                raise TypeError(f"{argument} must be a string, got {type(text).__name__}")
        for argument, flag in (("ensure_row_contiguous", ensure_row_contiguous),
                               ("atomic_outputs", atomic_outputs)):
            if not isinstance(flag, bool):
                raise TypeError(f"{argument} must be True or False, got {flag!r}")
        for attribute in UNSUPPORTED_ATTRIBUTES:
            if _used(attribute, source):
                raise ValueError(f"source: [[{attribute}]] is not provided by the CPU emulator "
                                 "yet (docs/kernels.md lists what is)")
        self.source = source
        self.header = header
        # TensorFlow's tensors are always row-contiguous: nothing to copy either way.
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        # Per input: which of name_shape / name_strides / name_ndim the body uses.
        self.shape_params = [sum(bit for suffix, bit in SHAPE_PARAMS if _used(n + suffix, source))
                             for n in self.input_names]
        self.attributes = [(a, t) for a, t in THREAD_ATTRIBUTES if _used(a, source)]
        # Whether the threads wait for each other; if not, the CPU runs each threadgroup as a
        # loop over its threads.
        self.lockstep = re.search(LOCKSTEP_CALLS, header + "\n" + source) is not None
        generated = {n + suffix for n in self.input_names for suffix, _ in SHAPE_PARAMS}
        seen = set()
        for argument, n in ([("input_names", n) for n in self.input_names]
                            + [("output_names", n) for n in self.output_names]):
            if n in seen or n in generated:
                raise ValueError(f"{argument}: {n!r} is used twice (names of inputs, outputs "
                                 "and their _shape / _strides / _ndim must all differ)")
            seen.add(n)

    # ---- source generation -----------------------------------------------------------------

    def kernel_name(self, input_types: Sequence[str], input_ranks: Sequence[int],
                    output_types: Sequence[str], template_values: Sequence[str]) -> str:
        parts = ["custom_kernel", self.name]
        parts += [re.sub(r"\W", "", v.replace("-", "n")) for v in template_values]
        parts += [t + ("s" if r == 0 else "") for t, r in zip(input_types, input_ranks)]
        parts += list(output_types)
        return "_".join(parts)

    def generate(self, input_types: Sequence[str], input_ranks: Sequence[int],
                 output_types: Sequence[str], template: Sequence[Tuple[str, str, str]]) -> Tuple[
                     str, str]:
        """(kernel name, full MSL source) for inputs of these MSL types and ranks."""
        kernel_name = self.kernel_name(input_types, input_ranks, output_types,
                                       [v for _, _, v in template])
        params, index = [], 0
        for name, msl_type, rank, bits in zip(self.input_names, input_types, input_ranks,
                                              self.shape_params):
            if rank == 0:
                params.append(f"constant {msl_type}& {name} [[buffer({index})]]")
            else:
                params.append(f"const device {msl_type}* {name} [[buffer({index})]]")
            index += 1
            if rank > 0:
                for suffix, bit in SHAPE_PARAMS:
                    if bits & bit:
                        spelling = {"_shape": "constant int* ", "_strides": "constant int64_t* ",
                                    "_ndim": "constant int& "}[suffix]
                        params.append(f"{spelling}{name}{suffix} [[buffer({index})]]")
                        index += 1
        for name, msl_type in zip(self.output_names, output_types):
            element = f"atomic<{msl_type}>" if self.atomic_outputs else msl_type
            params.append(f"device {element}* {name} [[buffer({index})]]")
            index += 1
        params += [f"{t} {a} [[{a}]]" for a, t in self.attributes]
        lines = ["#include <metal_stdlib>", "using namespace metal;", "",
                 "// tf_metal_ops's CPU path compiles the kernel in a namespace of its own, so",
                 "// that a function the header names like a C library one (erf) is the kernel's",
                 "// own there too; a Metal compiler skips it.",
                 "#if defined(TFMO_MSL_HOST)", f"namespace {_HOST_NAMESPACE} {{", "#endif", ""]
        if self.header:
            lines += _from_user("header", self.header) + [""]
        instance = kernel_name
        if template:
            lines.append("template <" + ", ".join(f"{kind} {name}" for name, kind, _ in template)
                         + ">")
            instance += "<" + ", ".join(v for _, _, v in template) + ">"
        lines.append(f"[[kernel]] void {kernel_name}(")
        lines.append(",\n".join("    " + p for p in params) + ") {")
        lines += _from_user("source", self.source) + ["}", ""]
        attributes = "".join(f", ::msl_host::attr::{a}" for a, _ in self.attributes)
        lines += [
            "// The emulator's registration (tf_metal_ops's CPU path); a Metal compiler skips it.",
            "#if defined(TFMO_MSL_HOST)",
            f"}}  // namespace {_HOST_NAMESPACE}",
            f"static constexpr auto tfmo_kernel = &{_HOST_NAMESPACE}::{instance};",
            "static const bool tfmo_kernel_registered = ::msl_host::register_generated_kernel<"
            f"tfmo_kernel{attributes}>(\"{kernel_name}\");",
        ]
        if template:
            lines += ["#else", f"template [[host_name(\"{kernel_name}\")]] [[kernel]] "
                      f"decltype({instance}) {instance};"]
        lines += ["#endif", ""]
        return kernel_name, "\n".join(_number_resumes(lines))

    # ---- the call ------------------------------------------------------------------------

    def __call__(self, inputs: Sequence[Any], output_shapes: Sequence[Any],
                 output_dtypes: Sequence[Any], grid: Sequence[int], threadgroup: Sequence[int],
                 template: Optional[Sequence[Tuple[str, Any]]] = None,
                 init_value: Optional[float] = None, verbose: bool = False) -> List[tf.Tensor]:
        """Runs the kernel; returns one tensor per output name.

        Args:
            inputs: one tensor (or array) per input name, of a supported dtype.
            output_shapes: one shape per output name: a list of ints, or a 1-D int tensor
                (so that a batch size known only at run time works inside `tf.function`).
            output_dtypes: one dtype per output name.
            grid: threads per grid (x, y, z), as Metal's dispatchThreads counts them: ints,
                int scalar tensors, or an int tensor of shape [3].
            threadgroup: threads per threadgroup (x, y, z), at most 1024 in all.
            template: (name, value) pairs, each value a dtype, an int or a bool.
            init_value: a number every output holds before the kernel runs; None: undefined.
            verbose: print the generated source.
        """
        inputs = self._inputs(inputs)
        dtypes = self._output_dtypes(output_dtypes)
        if not isinstance(output_shapes, (list, tuple)) or len(output_shapes) != len(dtypes):
            raise ValueError(f"output_shapes needs {len(dtypes)} entries (one per output name "
                             f"{self.output_names}), got {output_shapes!r}")
        shapes, ranks, static_shapes = self._output_shapes(output_shapes)
        grid = _grid(grid)
        threadgroup = _dims3("threadgroup", threadgroup, MAX_THREADGROUP_THREADS)
        threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if threads > MAX_THREADGROUP_THREADS:
            raise ValueError(f"threadgroup {threadgroup} has {threads} threads; at most "
                             f"{MAX_THREADGROUP_THREADS}")
        template = self._template(template)
        if init_value is not None and (isinstance(init_value, bool)
                                       or not isinstance(init_value, (int, float))):
            raise TypeError(f"init_value must be a number or None, got {init_value!r}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be True or False, got {verbose!r}")
        if self._runs_fallback(inputs):
            return self._run_fallback(inputs, dtypes, output_shapes, static_shapes)
        kernel_name, source = self.generate(
            [MSL_TYPES[x.dtype] for x in inputs], [x.shape.rank for x in inputs],
            [MSL_TYPES[d] for d in dtypes], template)
        if verbose:
            print(f"Generated source of metal_kernel {self.name!r}:\n{source}")
        outputs = _native.op_module().tf_metal_ops_metal_kernel(
            inputs=inputs, output_shapes=shapes, grid=grid, Tout=dtypes, source=source,
            kernel_name=kernel_name, threadgroup=list(threadgroup),
            output_ranks=ranks, shape_params=self.shape_params,
            init_value=0.0 if init_value is None else float(init_value),
            has_init_value=init_value is not None, lockstep=self.lockstep)
        for out, static in zip(outputs, static_shapes):
            out.set_shape(static)
        return list(outputs)

    def generated_source(self, inputs: Sequence[Any], output_dtypes: Sequence[Any],
                         template: Optional[Sequence[Tuple[str, Any]]] = None) -> str:
        """The full MSL source that a call with these inputs, output dtypes and template
        compiles, without running anything: what `verbose=True` prints. (`source` is the body
        the kernel was made with.)

        Args:
            inputs: one entry per input name: a tensor, an array or a `tf.TensorSpec`; only
                the dtype and the rank matter (a rank-0 input is a `constant T&`).
            output_dtypes: one dtype per output name.
            template: (name, value) pairs, as in the call.
        """
        specs = self._inputs(inputs, specs_allowed=True)
        dtypes = self._output_dtypes(output_dtypes)
        return self.generate([MSL_TYPES[x.dtype] for x in specs], [x.shape.rank for x in specs],
                             [MSL_TYPES[d] for d in dtypes], self._template(template))[1]

    # ---- the fallback ----------------------------------------------------------------------

    def _runs_fallback(self, inputs: Sequence[tf.Tensor]) -> bool:
        """Where the op cannot run (an XLA compilation) or has no kernel for the device, the
        same decision as the loss's (loss_path.choose): the fallback runs there if given. Under
        XLA without one, an error that says what to do; on a device without a kernel of ours,
        the op itself, which TensorFlow places on the CPU."""
        kernels = loss_path.registered_device_types(_native.METAL_KERNEL_OP)
        path, _ = loss_path.choose(inputs[0] if inputs else None,
                                   kernels=("CPU",) if kernels is None else kernels)
        if path == loss_path.NATIVE:
            return False
        if self.fallback is not None:
            return True
        if path == loss_path.COMPOSED_XLA:
            raise ValueError(
                f"metal_kernel {self.name!r} cannot run inside an XLA compilation "
                f"(jit_compile=True): its op has no XLA kernel. Pass fallback= to "
                f"metal_kernel(...), a function of TensorFlow ops that takes the inputs and "
                f"returns the outputs, or compile without XLA (jit_compile=False)")
        return False

    def _run_fallback(self, inputs: Sequence[tf.Tensor], dtypes: Sequence[tf.DType],
                      output_shapes: Sequence[Any], static_shapes: Sequence[tf.TensorShape]
                      ) -> List[tf.Tensor]:
        """The fallback's outputs, checked against output_dtypes and output_shapes."""
        results = self.fallback(*inputs)
        if isinstance(results, (list, tuple)):
            results = list(results)
        else:
            results = [results]
        if len(results) != len(self.output_names):
            raise ValueError(f"fallback of metal_kernel {self.name!r} returned {len(results)} "
                             f"outputs; output_names {self.output_names} needs "
                             f"{len(self.output_names)}")
        outputs = []
        for name, value, dtype, shape, static in zip(self.output_names, results, dtypes,
                                                     output_shapes, static_shapes):
            try:
                out = tf.convert_to_tensor(value)
            except (TypeError, ValueError) as error:
                raise TypeError(f"fallback of metal_kernel {self.name!r}: output {name!r} is "
                                f"not a tensor ({error})") from None
            if out.dtype != dtype:
                raise TypeError(f"fallback of metal_kernel {self.name!r}: output {name!r} has "
                                f"the dtype {out.dtype.name}; output_dtypes says {dtype.name}")
            if not out.shape.is_compatible_with(static):
                raise ValueError(f"fallback of metal_kernel {self.name!r}: output {name!r} has "
                                 f"the shape {out.shape}; output_shapes says {static}")
            if isinstance(shape, (tf.Tensor, tf.Variable)) and not static.is_fully_defined():
                # Known only at run time: checked there (XLA compiles the check away).
                with tf.control_dependencies([tf.debugging.assert_equal(
                        tf.shape(out, out_type=tf.int64), tf.cast(shape, tf.int64),
                        message=f"fallback of metal_kernel {self.name!r}: output {name!r} "
                                "does not have the shape output_shapes says")]):
                    out = tf.identity(out)
            out = tf.ensure_shape(out, static) if static.rank is not None else out
            outputs.append(out)
        return outputs

    def _inputs(self, inputs: Any, specs_allowed: bool = False) -> List[Any]:
        """One tensor per input name (or its `tf.TensorSpec`, where `specs_allowed`), checked."""
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(self.input_names):
            raise ValueError(f"inputs needs {len(self.input_names)} tensors (one per input name "
                             f"{self.input_names}), got "
                             f"{len(inputs) if isinstance(inputs, (list, tuple)) else inputs!r}")
        checked = []
        for name, value in zip(self.input_names, inputs):
            if not (specs_allowed and isinstance(value, tf.TensorSpec)):
                value = tf.convert_to_tensor(value)
            if value.dtype not in MSL_TYPES:
                _as_dtype(f"input {name!r}", value.dtype)
            if value.shape.rank is None:
                raise ValueError(f"input {name!r} has an unknown rank; the signature depends on "
                                 "it (a pointer, or a reference for a scalar)")
            checked.append(value)
        return checked

    def _output_dtypes(self, output_dtypes: Any) -> List[tf.DType]:
        count = len(self.output_names)
        if not isinstance(output_dtypes, (list, tuple)) or len(output_dtypes) != count:
            raise ValueError(f"output_dtypes needs {count} entries (one per output name "
                             f"{self.output_names}), got {output_dtypes!r}")
        return [_as_dtype(f"output_dtypes[{i}] ({n!r})", d)
                for i, (n, d) in enumerate(zip(self.output_names, output_dtypes))]

    def _output_shapes(self, output_shapes: Sequence[Any]):
        """The dims of every output as one int64 vector, the ranks, and the static shapes."""
        parts, ranks, statics = [], [], []
        for i, (name, shape) in enumerate(zip(self.output_names, output_shapes)):
            argument = f"output_shapes[{i}] ({name!r})"
            if isinstance(shape, (tf.Tensor, tf.Variable)):
                if shape.dtype not in (tf.int32, tf.int64) or shape.shape.rank != 1 or \
                        shape.shape[0] is None:
                    raise ValueError(f"{argument} must be a 1-D int tensor of known length, got "
                                     f"{shape!r}")
                vector = tf.cast(shape, tf.int64)
                static = tf.get_static_value(vector)
                rank = int(shape.shape[0])
                statics.append(tf.TensorShape([None] * rank if static is None
                                              else [int(d) for d in static]))
                ranks.append(rank)
            else:
                if not isinstance(shape, (list, tuple, tf.TensorShape)):
                    raise TypeError(f"{argument} must be a list of ints or an int tensor, got "
                                    f"{shape!r}")
                dims = list(shape)
                for d in dims:
                    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                        raise ValueError(f"{argument}: {shape!r} must hold integers >= 0")
                vector = tf.constant(dims, dtype=tf.int64, shape=[len(dims)])
                statics.append(tf.TensorShape(dims))
                ranks.append(len(dims))
            parts.append(vector)
        return tf.concat(parts, axis=0), ranks, statics

    def _template(self, template: Any) -> List[Tuple[str, str, str]]:
        """[(name, C++ parameter kind, MSL value)] from the user's (name, value) pairs."""
        if template is None:
            return []
        if not isinstance(template, (list, tuple)):
            raise TypeError(f"template must be a list of (name, value) pairs, got {template!r}")
        out, seen = [], set(self.input_names) | set(self.output_names)
        for i, pair in enumerate(template):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"template[{i}] must be a (name, value) pair, got {pair!r}")
            name = _check_name(f"template[{i}]", pair[0])
            if name in seen:
                raise ValueError(f"template[{i}]: {name!r} is already the name of an input, an "
                                 "output or another template argument")
            seen.add(name)
            kind, value = _template_value(name, pair[1])
            out.append((name, kind, value))
        return out


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False,
                 fallback: Optional[Callable[..., Any]] = None) -> MetalKernel:
    """A Metal kernel from its body, as a callable that runs it as a TensorFlow op.

    As MLX's `mx.fast.metal_kernel`: `source` is the body; the signature is generated (inputs
    `const device T* name`, a scalar input `constant T& name`, outputs `device T* name` or
    `device atomic<T>* name` with `atomic_outputs`, `name_shape` / `name_strides` /
    `name_ndim` for an input the body names that way, and the thread attributes the body
    names). `header` goes before the kernel. Runs on the CPU through the MSL emulator
    (docs/kernels.md); on Apple's GPU (tensorflow-metal) the op has a Metal kernel, built but
    never run on a Mac.

    `fallback`: a callable of TensorFlow ops, called with the inputs (tensors, in the order of
    `input_names`) and returning the outputs (one tensor, or a list of one per output name, of
    the call's `output_dtypes` and `output_shapes`). It runs instead of the kernel where the op
    cannot: inside an XLA compilation (`jit_compile=True`), and on a device without a kernel of
    ours (a CUDA GPU, a TPU), as the package's loss composes itself there
    (`tf_metal_ops.loss_path`). Without one, the kernel raises under XLA.
    """
    return MetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                       atomic_outputs, fallback)


def kernel_cache_info() -> dict:
    """How this process's kernel loads were served: `compiled`, `from_disk` (a cached object),
    `in_memory`, and the `compiler` (its --version line, once one compile needed it)."""
    return dict(_native.runtime().kernel_cache_stats())


def emulator_dir() -> Path:
    """The emulator's sources: shipped inside the package, or csrc/emulator/ in a checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "emulator", package.parent / "csrc" / "emulator"):
        if (candidate / "include" / "metal_stdlib").exists():
            return candidate
    return package / "emulator"  # the native side names the missing file


def cache_dir() -> Path:
    """$TF_METAL_OPS_CACHE_DIR, else the user's cache directory."""
    explicit = os.environ.get("TF_METAL_OPS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no home directory (some service accounts)
            base = Path(tempfile.gettempdir()) / f"tf_metal_ops-{os.getuid()}"
    return Path(base) / "tf_metal_ops" / "kernels"


def configure_toolchain() -> None:
    """Hands the compiler, the emulator and the cache directory to the native runtime."""
    command, origin = _toolchain.kernel_compiler()
    _native.runtime().set_kernel_toolchain(
        compiler=list(command), missing_reason="" if command else origin,
        emulator_dir=str(emulator_dir()), cache_dir=str(cache_dir()))


configure_toolchain()
