"""Builds and drives the Linux verification of the Metal kernels (test helper, not shipped).

* :func:`build_emulator_library`: ``kernels/custom_loss.metal`` compiled as C++ through the shim
  (``include/metal_stdlib``), the emulator, ``csrc/metal/launch_plan.cc`` and the driver, as one
  shared library that :class:`Emulator` calls with ctypes.
* :func:`build_tsan_program`: the same sources as a stand-alone program built with
  ``-fsanitize=thread``.
Both also hold ``sync_examples.metal``: kernels that break the synchronization rules on purpose.
* :func:`address_space_compile`: a clang compile (diagnostics only) with ``device`` /
  ``constant`` / ``threadgroup`` as distinct address spaces.

Builds are cached under a directory keyed by a hash of every input file, the compiler's version
and the flags, so a test session compiles each artifact once and later sessions reuse it.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EMULATOR = REPO / "csrc" / "emulator"
SHIM_INCLUDE = EMULATOR / "include"
KERNEL_SOURCE = REPO / "kernels" / "custom_loss.metal"
SYNC_EXAMPLES = HERE / "sync_examples.metal"
KERNEL_INPUTS = [
    REPO / "kernels" / "custom_loss.metal",
    REPO / "kernels" / "custom_loss.h",
    REPO / "kernels" / "custom_loss_math.h",
    REPO / "kernels" / "custom_loss_params.h",
    REPO / "csrc" / "loss_kinds.h",
    REPO / "csrc" / "metal" / "launch_plan.h",
    REPO / "csrc" / "metal" / "launch_plan.cc",
    EMULATOR / "include" / "metal_stdlib",
    EMULATOR / "msl_host_runtime.h",
    EMULATOR / "emulator.h",
    EMULATOR / "emulator.cc",
    HERE / "memory_traffic.h",
    HERE / "memory_traffic.cc",
    HERE / "custom_loss_case.h",
    HERE / "custom_loss_driver.h",
    HERE / "custom_loss_driver.cc",
    HERE / "custom_loss_driver_main.cc",
    HERE / "sync_examples.metal",
    Path(__file__).resolve(),
]

COMMON_FLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter", "-I", str(REPO),
                "-I", str(HERE), "-I", str(EMULATOR)]
# How the shim compiles a .metal file: as C++, with __METAL__ (custom_loss_params.h's Metal
# branch) and the shim's <metal_stdlib> first on the include path. MSL attributes such as
# [[buffer(0)]] are unknown to a C++ compiler, which ignores them (warning silenced).
METAL_AS_CXX = ["-D__METAL__", "-I", str(SHIM_INCLUDE), "-x", "c++"]

# Enum values shared with csrc/loss_kinds.h and csrc/metal/launch_plan.h.
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
LABEL_KINDS = {"int32": 0, "int64": 1, "dense": 2}
DIRECTIONS = {"forward": 0, "gradient": 1}
VARIANTS = {"auto": -1, "rowtg": 0, "rowsimd": 1}
ROLES = ["logits", "labels", "class_weights", "params", "error_record", "output", "upstream",
         "row_scales", "row_stats", "scaled_gradient"]
MAX_BINDINGS = 12  # TFMO_EMU_MAX_BINDINGS
# The host-name suffixes of the cross-entropy kernels (kernels/custom_loss.h, KernelForm).
KERNEL_FORMS = ("_plain", "_smoothed")


def kernel_form(kernel_name: str) -> str:
    """The KernelForm suffix of a kernel's host name: "_plain", "_smoothed", or "" (general)."""
    return next((f for f in KERNEL_FORMS if kernel_name.endswith(f)), "")


# --------------------------------------------------------------------------------------------
# Toolchains and the cache
# --------------------------------------------------------------------------------------------

def cxx() -> List[str]:
    """The C++ compiler for run builds: $CXX, else g++ (>= 12 has _Float16 on x86-64)."""
    return [os.environ.get("CXX") or shutil.which("g++") or "c++"]


@dataclass(frozen=True)
class Clang:
    """A clang++ for the checks that need clang itself (address spaces, coverage hooks,
    Objective-C++): a system binary, or the `ziglang` wheel's clang (`python -m ziglang c++`,
    installed by the `test` extra), so that the checks run on a machine with Python alone."""

    command: tuple
    origin: str   # where it was found, for the test report
    version: str  # the first line of --version

    def describe(self) -> str:
        return f"{self.version} ({self.origin}: {' '.join(self.command)})"


def load_package_file(filename: str, module_name: str):
    """A module of tf_metal_ops/ that needs no TensorFlow (_toolchain.py, reference.py), loaded
    by its path: importing the package would load TensorFlow and the native library."""
    spec = importlib.util.spec_from_file_location(module_name, REPO / "tf_metal_ops" / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolchain = load_package_file("_toolchain.py", "tfmo_toolchain")


@functools.lru_cache(maxsize=None)
def find_clang() -> Optional[Clang]:
    """The clang++ the checks use: a system one where there is one, the ziglang wheel's
    otherwise (or where $TF_METAL_OPS_CLANG is "ziglang"); None when neither is installed."""
    system = toolchain.system_clang()
    zig = toolchain.ziglang_command()
    if system is not None:
        command, origin = (system[0],), system[1]
    elif zig is not None:
        command, origin = zig, "ziglang wheel"
    else:
        return None
    return Clang(command, origin, _compiler_id(command))


def missing_clang_message(check: str) -> str:
    return (f"{check} needs clang++: install the test extra (pip install -e \".[test]\", which "
            "brings the ziglang wheel's clang), install a system clang, or set "
            "TF_METAL_OPS_CLANG to a clang++ binary")


def compile_to_object(command: Sequence[str], flags: Sequence[str], source: Path,
                      out_dir: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Compiles `source` to an object in `out_dir`: a check that needs only the diagnostics.
    Not -fsyntax-only, which zig's driver cannot run (it renames an output it never wrote)."""
    obj = Path(out_dir) / (Path(source).name + ".o")
    return subprocess.run([*command, *flags, "-c", "-o", str(obj), str(source)],
                          capture_output=True, text=True, check=False, cwd=cwd, timeout=600)


def _compiler_id(command: Sequence[str]) -> str:
    out = subprocess.run([*command, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else " ".join(command)


def _digest(paths: Iterable[Path], *extra: str) -> str:
    h = hashlib.sha256()
    for p in sorted(set(paths)):
        h.update(str(p).encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:20]


class BuildError(RuntimeError):
    pass


def _run(cmd: Sequence[str], cwd: Path) -> None:
    proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stdout}\n{proc.stderr}")


def _cached_build(cache_dir: Path, key: str, artifact: str, build) -> Path:
    """Builds `artifact` into cache_dir/key/ once (file-locked), returns its path."""
    out_dir = cache_dir / key
    target = out_dir / artifact
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            build(out_dir, target)
    return target


def _compile_objects(compiler: Sequence[str], jobs: List[List[str]], out_dir: Path) -> None:
    # Two at a time: the machine (and CI) has two cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for f in [pool.submit(_run, [*compiler, *job], out_dir) for job in jobs]:
            f.result()


def _object_jobs(flags: List[str], out_dir: Path, with_main: bool) -> List[List[str]]:
    jobs = [
        flags + ["-Wno-attributes"] + METAL_AS_CXX + [str(KERNEL_SOURCE), "-x", "none",
                                                    "-c", "-o", str(out_dir / "kernels.o")],
        flags + ["-Wno-attributes"] + METAL_AS_CXX + [str(SYNC_EXAMPLES), "-x", "none",
                                                    "-c", "-o", str(out_dir / "examples.o")],
        flags + ["-c", str(EMULATOR / "emulator.cc"), "-o", str(out_dir / "emulator.o")],
        flags + ["-c", str(HERE / "memory_traffic.cc"), "-o", str(out_dir / "traffic.o")],
        flags + ["-c", str(HERE / "custom_loss_driver.cc"), "-o", str(out_dir / "driver.o")],
        flags + ["-c", str(REPO / "csrc" / "metal" / "launch_plan.cc"),
                 "-o", str(out_dir / "plan.o")],
    ]
    if with_main:
        jobs.append(flags + ["-c", str(HERE / "custom_loss_driver_main.cc"),
                             "-o", str(out_dir / "main.o")])
    return jobs


def _link_emulator_library(compiler: Sequence[str], jobs: list, out_dir: Path,
                           target: Path) -> None:
    """Compiles `jobs` (_object_jobs's list) and links the emulator's shared library."""
    _compile_objects(compiler, jobs, out_dir)
    objs = [str(out_dir / n) for n in ("kernels.o", "examples.o", "emulator.o", "traffic.o",
                                       "driver.o", "plan.o")]
    tmp = out_dir / (target.name + ".tmp")
    _run([*compiler, "-shared", "-o", str(tmp)] + objs + ["-lpthread"], out_dir)
    tmp.rename(target)


def build_emulator_library(cache_dir: Path) -> Path:
    """The shared library with every kernel, the emulator and the ctypes driver."""
    compiler = cxx()
    flags = COMMON_FLAGS + ["-O2", "-fPIC", "-g0"]
    key = "emu-" + _digest(KERNEL_INPUTS, *compiler, _compiler_id(compiler), *flags)

    def build(out_dir: Path, target: Path) -> None:
        _link_emulator_library(compiler, _object_jobs(flags, out_dir, False), out_dir, target)

    return _cached_build(cache_dir, key, "libtfmo_msl_emulator.so", build)


# The kernels of the traffic-counting build: every load and store calls a hook
# (memory_traffic.h). -O1 without vectorization, so each access is one scalar load or store of
# the kernel's own (the hooks exist for 1 to 16 bytes, not for wider vectors).
TRAFFIC_KERNEL_FLAGS = ["-O1", "-fno-vectorize", "-fno-slp-vectorize",
                        "-fsanitize-coverage=func,trace-loads,trace-stores"]


def build_traffic_library(cache_dir: Path, clang: Clang) -> Path:
    """The emulator library with the kernels compiled by clang with access hooks."""
    flags = COMMON_FLAGS + ["-O2", "-fPIC", "-g0"]
    kernel_flags = COMMON_FLAGS + ["-fPIC", "-g0"] + TRAFFIC_KERNEL_FLAGS
    key = "traffic-" + _digest(KERNEL_INPUTS, *clang.command, clang.version, *flags, *kernel_flags)

    def build(out_dir: Path, target: Path) -> None:
        jobs = _object_jobs(flags, out_dir, False)
        jobs[0] = (kernel_flags + ["-Wno-attributes", "-Wno-unknown-attributes"] + METAL_AS_CXX
                   + [str(KERNEL_SOURCE), "-x", "none", "-c", "-o", str(out_dir / "kernels.o")])
        _link_emulator_library(clang.command, jobs, out_dir, target)

    return _cached_build(cache_dir, key, "libtfmo_msl_traffic.so", build)


def build_tsan_program(cache_dir: Path) -> Path:
    """The stand-alone driver under -fsanitize=thread (g++'s libtsan, or $CXX)."""
    compiler = cxx()
    flags = COMMON_FLAGS + ["-O1", "-g", "-fsanitize=thread", "-fno-omit-frame-pointer"]
    key = "tsan-" + _digest(KERNEL_INPUTS, *compiler, _compiler_id(compiler), *flags)

    def build(out_dir: Path, target: Path) -> None:
        _compile_objects(compiler, _object_jobs(flags, out_dir, True), out_dir)
        objs = [str(out_dir / n) for n in ("kernels.o", "examples.o", "emulator.o", "traffic.o",
                                           "driver.o", "plan.o", "main.o")]
        tmp = out_dir / (target.name + ".tmp")
        _run([*compiler, "-fsanitize=thread", "-o", str(tmp)] + objs + ["-lpthread"], out_dir)
        tmp.rename(target)

    return _cached_build(cache_dir, key, "custom_loss_driver_tsan", build)


def address_space_compile(source: Path, clang: Clang, out_dir: Path,
                          extra_flags: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """clang of a .metal file with distinct address spaces (not cached: ~2 s)."""
    flags = (COMMON_FLAGS + ["-Wno-unknown-attributes", "-DTFMO_MSL_ADDRESS_SPACES"]
             + list(extra_flags) + METAL_AS_CXX)
    return compile_to_object(clang.command, flags, source, out_dir)


@pytest.fixture(scope="session")
def msl_cache_dir(request, tmp_path_factory) -> Path:
    """Where builds are cached: pytest's cache dir (kept across sessions), else a tmp dir."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("tfmo_msl_build"))
    return tmp_path_factory.mktemp("tfmo_msl_build")


# --------------------------------------------------------------------------------------------
# 16-bit floats: the bit patterns the kernels read, and what they mean
# --------------------------------------------------------------------------------------------

def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, NaN kept NaN (Metal's conversion)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded).astype(np.uint16)


def from_bfloat16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """The array a kernel of logits dtype `dtype` reads, from float values."""
    v = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return np.ascontiguousarray(v)
    if dtype == "float16":
        return np.ascontiguousarray(v.astype(np.float16))
    return np.ascontiguousarray(to_bfloat16_bits(v))


def as_float64(stored: np.ndarray, dtype: str) -> np.ndarray:
    """What the stored values are, exactly, in float64."""
    if dtype == "bfloat16":
        return from_bfloat16_bits(stored).astype(np.float64)
    return np.asarray(stored).astype(np.float64)


def empty_storage(shape, dtype: str) -> np.ndarray:
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]
    # Filled with a sentinel so an element the kernel never writes cannot pass as a result.
    out = np.empty(shape, dtype=np_dtype)
    out.view(np.uint8)[...] = 0x7B
    return out


# --------------------------------------------------------------------------------------------
# The ctypes driver
# --------------------------------------------------------------------------------------------

class EmuCase(ctypes.Structure):
    _fields_ = [
        ("num_rows", ctypes.c_int64), ("num_classes", ctypes.c_int64),
        ("dtype", ctypes.c_int32), ("label_kind", ctypes.c_int32),
        ("direction", ctypes.c_int32), ("variant", ctypes.c_int32),
        ("gamma", ctypes.c_float), ("label_smoothing", ctypes.c_float),
        ("has_class_weights", ctypes.c_int32), ("has_ignore_class", ctypes.c_int32),
        ("ignore_class", ctypes.c_int64),
        ("max_total_threads_per_threadgroup", ctypes.c_uint32),
        ("thread_execution_width", ctypes.c_uint32),
        ("executor", ctypes.c_int32), ("plan_only", ctypes.c_int32),
        ("max_concurrent_threadgroups", ctypes.c_uint32), ("alias_gradient", ctypes.c_uint32),
        ("logits", ctypes.c_void_p), ("labels", ctypes.c_void_p),
        ("class_weights", ctypes.c_void_p), ("upstream", ctypes.c_void_p),
        ("output", ctypes.c_void_p), ("error_record", ctypes.c_void_p),
        ("has_row_stats", ctypes.c_int32), ("has_row_scales", ctypes.c_int32),
        ("row_stats", ctypes.c_void_p), ("row_scales", ctypes.c_void_p),
        ("scaled_gradient", ctypes.c_void_p),
    ]


class EmuResult(ctypes.Structure):
    _fields_ = [
        ("ok", ctypes.c_int32), ("dispatched", ctypes.c_int32), ("variant", ctypes.c_int32),
        ("threadgroups_per_grid", ctypes.c_uint32 * 3),
        ("threads_per_threadgroup", ctypes.c_uint32 * 3),
        ("threadgroup_memory_length", ctypes.c_uint32),
        ("threads_per_row", ctypes.c_uint32), ("rows_per_threadgroup", ctypes.c_uint32),
        ("num_bindings", ctypes.c_uint32), ("binding_roles", ctypes.c_int32 * MAX_BINDINGS),
        ("kernel_name", ctypes.c_char * 96), ("error", ctypes.c_char * 512),
        ("memory_counted", ctypes.c_int32), ("reserved2", ctypes.c_int32),
        ("bytes_read", ctypes.c_uint64 * len(ROLES)),
        ("bytes_written", ctypes.c_uint64 * len(ROLES)),
    ]


@dataclass
class EmuRun:
    ok: bool
    error: str
    dispatched: bool
    kernel_name: str
    variant: str
    threadgroups_per_grid: tuple
    threads_per_threadgroup: tuple
    threadgroup_memory_length: int
    threads_per_row: int
    rows_per_threadgroup: int
    bindings: List[str]
    output: Optional[np.ndarray]  # float64 view of what the kernel wrote
    raw_output: Optional[np.ndarray]
    error_record: np.ndarray      # 8 uint32 words
    row_stats: Optional[np.ndarray] = None        # float32 [N, 3]: what a forward wrote
    scaled_gradient: Optional[np.ndarray] = None  # float64 view, forward given row_scales
    # Device-memory bytes per role (memory_traffic.h), when the library counts them.
    memory_counted: bool = False
    bytes_read: Optional[Dict[str, int]] = None
    bytes_written: Optional[Dict[str, int]] = None

    @property
    def bad_label_count(self) -> int:
        return int(self.error_record[0])

    @property
    def min_bad_row(self) -> int:
        return int(self.error_record[1])

    @property
    def claimed(self) -> Optional[tuple]:
        if self.error_record[2] == 0:
            return None
        label = int(np.array([self.error_record[4], self.error_record[5]],
                             dtype=np.uint32).view(np.int64)[0])
        return int(self.error_record[3]), label


class Emulator:
    """Runs the CustomLoss kernels through the launch plan and the emulator (ctypes)."""

    def __init__(self, library: Path):
        self._lib = ctypes.CDLL(str(library))
        self._lib.tfmo_emu_run.argtypes = [ctypes.POINTER(EmuCase), ctypes.POINTER(EmuResult)]
        self._lib.tfmo_emu_run.restype = ctypes.c_int
        self._lib.tfmo_emu_run_raw.argtypes = [
            ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
            ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_uint32]
        self._lib.tfmo_emu_run_raw.restype = ctypes.c_int

    def run_raw(self, kernel: str, *, threads: int, groups: int, threadgroup_bytes: int,
                executor: str = "fibers") -> tuple:
        """Runs a sync_examples.metal kernel; returns (error message or "", buffer)."""
        buffer = np.zeros(max(groups, 1), dtype=np.float32)
        error = ctypes.create_string_buffer(512)
        self._lib.tfmo_emu_run_raw(kernel.encode(), threads, groups, threadgroup_bytes,
                                   buffer.ctypes.data, {"fibers": 0, "threads": 1}[executor],
                                   error, 512)
        return error.value.decode(), buffer

    def run(self, *, direction: str, logits: np.ndarray, labels: Optional[np.ndarray],
            dtype: str = "float32", label_kind: str = "int32", gamma: float = 0.0,
            label_smoothing: float = 0.0, class_weights: Optional[np.ndarray] = None,
            ignore_class: Optional[int] = None, upstream: Optional[np.ndarray] = None,
            variant: str = "auto", max_threads: int = 1024, simd_width: int = 32,
            executor: str = "fibers", plan_only: bool = False,
            num_rows: Optional[int] = None, num_classes: Optional[int] = None,
            row_stats: object = None, row_scales: Optional[np.ndarray] = None,
            alias: bool = False) -> EmuRun:
        """`logits`, `labels` (dense) and `upstream` are *stored* arrays (see `storage`).

        `row_stats`: forward: True to have the kernel write them (returned in the run);
        gradient: the float32 [N, 3] array a forward wrote, to read instead of a log-sum-exp
        pass. `row_scales` (forward, float32 [N]): also write the scaled gradient.
        `alias`: bind the gradient (the scaled gradient, or a gradient's output) to a copy of
        the logits, which the kernel then writes over, as on a Mac when TensorFlow forwards the
        logits' buffer; the run's gradient is that copy afterwards.
        """
        if alias:
            if direction == "forward" and row_scales is None:
                raise ValueError("alias needs a gradient to write: row_scales (forward)")
            logits = np.array(logits, copy=True, order="C")  # the caller's array stays intact
        n = int(logits.shape[0]) if num_rows is None else num_rows
        c = int(logits.shape[1]) if num_classes is None else num_classes
        keep: List[np.ndarray] = []

        def ptr(a: Optional[np.ndarray]) -> Optional[int]:
            if a is None:
                return None
            a = np.ascontiguousarray(a)
            keep.append(a)
            return a.ctypes.data if a.size else None

        out_shape = (n,) if direction == "forward" else (n, c)
        out = None if plan_only else empty_storage(out_shape, dtype)
        if alias and direction == "gradient":
            out = logits
        record = np.zeros(8, dtype=np.uint32)
        has_stats = row_stats is not None and row_stats is not False
        if direction == "forward":
            stats = np.full((n, 3), np.nan, np.float32) if has_stats else None
        else:
            stats = (np.ascontiguousarray(row_stats, dtype=np.float32) if has_stats else None)
        scales = None if row_scales is None else np.ascontiguousarray(row_scales, np.float32)
        scaled = (empty_storage((n, c), dtype)
                  if scales is not None and not plan_only else None)
        if alias and scaled is not None:
            scaled = logits
        case = EmuCase(
            num_rows=n, num_classes=c, dtype=DTYPES[dtype], label_kind=LABEL_KINDS[label_kind],
            direction=DIRECTIONS[direction], variant=VARIANTS[variant], gamma=gamma,
            label_smoothing=label_smoothing, has_class_weights=int(class_weights is not None),
            has_ignore_class=int(ignore_class is not None),
            ignore_class=0 if ignore_class is None else int(ignore_class),
            max_total_threads_per_threadgroup=max_threads, thread_execution_width=simd_width,
            executor={"fibers": 0, "threads": 1}[executor], plan_only=int(plan_only),
            max_concurrent_threadgroups=4, alias_gradient=int(alias),
            logits=ptr(logits), labels=ptr(labels),
            class_weights=ptr(None if class_weights is None
                              else np.asarray(class_weights, dtype=np.float32)),
            upstream=ptr(upstream), output=ptr(out), error_record=record.ctypes.data,
            has_row_stats=int(has_stats), has_row_scales=int(scales is not None),
            row_stats=None if stats is None or not stats.size else stats.ctypes.data,
            row_scales=ptr(scales), scaled_gradient=ptr(scaled))
        result = EmuResult()
        self._lib.tfmo_emu_run(ctypes.byref(case), ctypes.byref(result))
        variant_names = {0: "rowtg", 1: "rowsimd"}
        return EmuRun(
            ok=bool(result.ok), error=result.error.decode(), dispatched=bool(result.dispatched),
            kernel_name=result.kernel_name.decode(),
            variant=variant_names.get(result.variant, "?"),
            threadgroups_per_grid=tuple(result.threadgroups_per_grid),
            threads_per_threadgroup=tuple(result.threads_per_threadgroup),
            threadgroup_memory_length=int(result.threadgroup_memory_length),
            threads_per_row=int(result.threads_per_row),
            rows_per_threadgroup=int(result.rows_per_threadgroup),
            bindings=[ROLES[r] for r in list(result.binding_roles)[:result.num_bindings]],
            output=None if out is None else as_float64(out, dtype),
            raw_output=out, error_record=record,
            row_stats=stats if direction == "forward" else None,
            scaled_gradient=None if scaled is None else as_float64(scaled, dtype),
            memory_counted=bool(result.memory_counted),
            bytes_read=dict(zip(ROLES, [int(v) for v in result.bytes_read])),
            bytes_written=dict(zip(ROLES, [int(v) for v in result.bytes_written])))


def write_case_dir(directory: Path, fields: Dict[str, object],
                   arrays: Dict[str, np.ndarray]) -> None:
    """The input of `custom_loss_driver_main case DIR`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "case.txt").write_text("".join(f"{k} {v}\n" for k, v in fields.items()))
    for name in ("logits", "labels", "class_weights", "upstream", "row_scales", "row_stats"):
        a = arrays.get(name)
        (directory / f"{name}.bin").write_bytes(b"" if a is None
                                                else np.ascontiguousarray(a).tobytes())
