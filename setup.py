"""Builds tf_metal_ops's native library against the installed TensorFlow's C headers.

How the build finds TensorFlow: it locates the `tensorflow` package in the Python that runs the
build (without importing it) and uses `<tensorflow>/include` for the C headers and
`<tensorflow>/libtensorflow_framework.so.2` (`.2.dylib` on macOS) for the C API's symbols.
`pip install .` does this in an isolated build environment that pyproject.toml fills with a
recent TensorFlow; `pip install --no-build-isolation .` builds against the TensorFlow already
installed. Either way the binary uses only TensorFlow's C API, whose symbols are stable across
the supported versions, so one build serves every one of them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent
IS_MACOS = sys.platform == "darwin"
# The Metal GPU kernels (csrc/metal/, kernels/) are built only where tensorflow-metal runs: macOS on
# Apple silicon. Everywhere else the package is the CPU op alone and this file builds exactly what
# it would without them.
BUILD_METAL = IS_MACOS and platform.machine() == "arm64"

# The distributions that provide the `tensorflow` module, in the order we ask for a version
# (the same list as tf_metal_ops/_native.py, which the build cannot import).
TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-macos",
    "tensorflow-intel",
    "tf-nightly",
    "tf-nightly-cpu",
)


def tensorflow_dir() -> Path:
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "tf_metal_ops: building needs TensorFlow's C headers, but no `tensorflow` package "
            "is installed in this Python. Install tensorflow-cpu (Linux) or tensorflow (macOS) "
            "first, or build with plain `pip install .` (build isolation installs it)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def tensorflow_version() -> str:
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


# The BLAS of the CPU kernels' matrix products (csrc/cpu/gemm.h). On Linux: OpenBLAS from the
# scipy-openblas32 wheel, a build requirement and (Linux only) a run-time dependency of the same
# version (pyproject.toml). Its symbols carry a `scipy_` prefix, so the process's other BLAS
# copies (NumPy's, TensorFlow's) and ours never bind to each other's.
OPENBLAS_PACKAGE = "scipy_openblas32"


def openblas_dirs() -> tuple:
    """(include dir, lib dir, library name) of the installed scipy-openblas32, found without
    importing anything but that package (whose import loads no library)."""
    try:
        import scipy_openblas32
    except ImportError:
        sys.exit(
            "tf_metal_ops: building on Linux needs the scipy-openblas32 wheel (OpenBLAS for the "
            "CPU kernels' products): `pip install scipy-openblas32`, or build with plain "
            "`pip install .` (build isolation installs it)."
        )
    return (scipy_openblas32.get_include_dir(), scipy_openblas32.get_lib_dir(),
            scipy_openblas32.get_library())


# The platforms the build knows, as native_extension() names them.
LINUX, MACOS_X86_64, MACOS_ARM64 = "linux", "macos-x86_64", "macos-arm64"
if not IS_MACOS:
    HOST_TARGET = LINUX
else:
    HOST_TARGET = MACOS_ARM64 if BUILD_METAL else MACOS_X86_64

# TF_METAL_OPS_ROW_VARIANTS=host builds only the row kernels' instruction-set variants that this
# machine's CPU runs (the default, all, builds every one of its architecture). It is for a build
# that runs only where it is built and whose compile is its cost: the sanitizer build
# (tests/sanitizer/build_and_run.sh), where an instrumented AVX-512 variant on a CPU without
# AVX-512 adds minutes of compiling and is never selected. Only that variant is ever left out:
# the baseline is every build's fallback, and AVX2 is the least a CPU with AVX-512 has.
ROW_VARIANTS = ("all", "host")


def row_sources(isa: str) -> list:
    """The files of one instruction-set variant of the row kernels: one per storage type
    (csrc/cpu/simd/rows_dispatch.h says why)."""
    return [f"csrc/cpu/simd/rows_{isa}_{dtype}.cc" for dtype in ("float32", "float16", "bfloat16")]


AVX512_SOURCES = row_sources("avx512")
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # rows_dispatch.cc's test


def host_runs_avx512(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether Linux reports the AVX-512 subsets the AVX-512 variant needs (it reports them only
    where the OS also saves their registers); True where it cannot tell, so nothing the CPU
    might select is left out."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return True
    for line in lines:
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return all(flag in flags for flag in AVX512_CPU_FLAGS)
    return True


# csrc/metal/ is the host code of the Metal kernels. Its Objective-C++ files (.mm) need Apple's
# frameworks and are compiled for macOS arm64 only. Its C++ files (.cc: the launch plan, the
# error-record slots, the kernel-source lookup) are platform-neutral C++17, which the Linux tests
# also compile on their own (tests/msl_host, tests/msl_cuda, tests/test_metal_kernel_source.py).
# The native library takes them for macOS arm64 only, except those listed here, which every build
# has: python_module.cc exposes the error-record slots' bookkeeping to the tests on every platform.
METAL_SOURCES_IN_EVERY_BUILD = ("csrc/metal/error_record_slots.cc",)

# Objective-C++ (.mm) only: ARC, which the host code relies on to release every Metal object on
# every path. The C++ files get no Objective-C flags at all.
OBJC_COMPILE_ARGS = ["-fobjc-arc"]


def native_extension(
    target: str = HOST_TARGET, tf_dir: Path | None = None, tf_version: str | None = None
) -> Pybind11Extension:
    """The native library as `target` builds it, against the TensorFlow in `tf_dir`.

    The defaults are this machine and the TensorFlow installed in this Python: what setup() builds.
    tests/cross/macos_arm64_build.sh calls it with MACOS_ARM64 and the TensorFlow of a macOS
    wheel, so that its cross-build uses exactly these sources, macros and flags.
    """
    if target not in (LINUX, MACOS_X86_64, MACOS_ARM64):
        raise ValueError(
            f"target must be one of {LINUX!r}, {MACOS_X86_64!r}, {MACOS_ARM64!r}; got {target!r}"
        )
    if tf_dir is None:
        tf_dir = tensorflow_dir()
    if tf_version is None:
        tf_version = tensorflow_version()
    include_dir = tf_dir / "include"
    if not (include_dir / "tensorflow" / "c" / "kernels.h").exists():
        sys.exit(f"tf_metal_ops: {include_dir} has no tensorflow/c/kernels.h; is TensorFlow intact?")

    sources = [
        "csrc/ops.cc",
        "csrc/problem.cc",
        "csrc/pending_errors.cc",
        "csrc/runtime.cc",
        "csrc/python_module.cc",
        "csrc/kernel_compiler.cc",
        "csrc/msl_source.cc",
        "csrc/metal_kernel_args.cc",
        "csrc/cpu/custom_loss_cpu.cc",
        "csrc/cpu/metal_kernel_cpu.cc",
        "csrc/cpu/add_into_cpu.cc",
        "csrc/cpu/linear_cross_entropy_cpu.cc",
        "csrc/cpu/gemm.cc",
        "csrc/cpu/thread_pool.cc",
        "csrc/cpu/memory_floor.cc",
        # The vectorized rows: the dispatch, and per instruction set one file per storage type,
        # each compiling csrc/cpu/simd/simd_kernels.h for its own.
        "csrc/cpu/simd/rows_dispatch.cc",
        *row_sources("portable"),
        *row_sources("avx2"),
        *AVX512_SOURCES,
        *METAL_SOURCES_IN_EVERY_BUILD,
    ]
    define_macros = [("TF_METAL_OPS_BUILT_AGAINST_TF", f'"{tf_version}"')]
    row_variants = os.environ.get("TF_METAL_OPS_ROW_VARIANTS", "all")
    if row_variants not in ROW_VARIANTS:
        sys.exit(f"TF_METAL_OPS_ROW_VARIANTS must be one of {', '.join(ROW_VARIANTS)}, got "
                 f"{row_variants!r}")
    if (row_variants == "host" and target == LINUX and platform.machine() == "x86_64"
            and not host_runs_avx512()):
        sources = [source for source in sources if source not in AVX512_SOURCES]
        define_macros.append(("TF_METAL_OPS_WITHOUT_AVX512", "1"))
    # -ffp-contract=off: no multiply-add fused behind our back. The kernels spell each fused
    # multiply-add they want (Fma in csrc/cpu/simd/simd_vector.h); left to the compiler, whether
    # `p * total - w` fuses depends on inlining context, so the same formula in two code paths
    # (a gradient given the forward's row statistics, or not) could round differently.
    # tests/test_simd_math.py builds with the same flag.
    # TF_METAL_OPS_OPTIMIZE replaces -O3 for builds that are not for speed: the sanitizer build
    # (tests/sanitizer/build_and_run.sh) takes -O1, at which its instrumented compile of the
    # vectorized row kernels takes far less time.
    optimize = os.environ.get("TF_METAL_OPS_OPTIMIZE", "-O3")
    if optimize not in ("-O0", "-O1", "-O2", "-O3"):
        sys.exit(f"TF_METAL_OPS_OPTIMIZE must be one of -O0, -O1, -O2, -O3, got {optimize!r}")
    extra_compile_args = [optimize, "-fno-strict-aliasing", "-ffp-contract=off"]
    extra_link_args = []
    include_dirs = [str(ROOT), str(include_dir)]
    if target != LINUX:
        # Accelerate's current CBLAS interface (csrc/cpu/gemm.cc).
        define_macros += [("ACCELERATE_NEW_LAPACK", "1")]
        extra_link_args += ["-framework", "Accelerate"]
        framework = "libtensorflow_framework.2.dylib"
        extra_link_args += [str(tf_dir / framework), "-Wl,-rpath,@loader_path/../tensorflow"]
        if target == MACOS_ARM64:
            sources += metal_sources()
            # runtime.cc reports MetalCompiledIn() from this; the .mm files need the frameworks.
            # TF_METAL_OPS_KERNEL_LIBRARY is added by MetalBuildExt once it knows whether the
            # .metallib could be built.
            define_macros += [("TF_METAL_OPS_WITH_METAL", "1")]
            extra_link_args += ["-framework", "Foundation", "-framework", "Metal"]
    else:
        framework = "libtensorflow_framework.so.2"
        extra_link_args += [
            f"-L{tf_dir}",
            f"-l:{framework}",
            # Installed next to tensorflow/ in site-packages; when TensorFlow is already loaded
            # (tf_metal_ops imports it first) the loader reuses it by its soname anyway.
            "-Wl,-rpath,$ORIGIN/../tensorflow",
        ]
        blas_include, blas_lib, blas_name = openblas_dirs()
        include_dirs.append(blas_include)
        extra_link_args += [
            f"-L{blas_lib}",
            f"-l{blas_name}",
            # The wheel installs next to tf_metal_ops/ in site-packages; tf_metal_ops/_native.py
            # also loads it (by soname) before the library, for layouts where this path is not
            # it (a source checkout's in-place build, a copied package).
            f"-Wl,-rpath,$ORIGIN/../{OPENBLAS_PACKAGE}/lib",
        ]
    return Pybind11Extension(
        "tf_metal_ops._tf_metal_ops",
        sources=sources,
        # setuptools does not scan #includes: without these, editing only a header leaves an
        # in-place build stale.
        depends=sorted(str(p.relative_to(ROOT))
                       for p in [*(ROOT / "csrc").rglob("*.h"), *(ROOT / "kernels").glob("*.h")]),
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        cxx_std=17,
    )


# --- macOS arm64 only: the Metal kernels ------------------------------------------------------
# How the kernel library reaches the user (csrc/metal/kernel_source.h has the run-time side):
#   - kernels/custom_loss.metal (+ the headers it includes) is always installed as
#     tf_metal_ops/kernels/, so the library can be compiled from source at first use;
#   - when the Metal toolchain is present (`xcrun -sdk macosx metal`; recent Xcode ships it as a
#     separate component, the Command Line Tools may lack it) it is also precompiled, with fast
#     math off, into tf_metal_ops/custom_loss.metallib, which the loader tries first.
# An in-place build (`setup.py build_ext --inplace`, editable installs) writes only the .metallib
# next to the native library (ignored by git); the loader then finds the source in ../kernels/.
METAL_KERNEL_SOURCE = "kernels/custom_loss.metal"
METALLIB_NAME = "custom_loss.metallib"


def metal_sources() -> list:
    """macOS arm64's part of csrc/metal/: the .mm files, and the .cc files not built anyway."""
    metal_dir = ROOT / "csrc" / "metal"
    objc = sorted(str(p.relative_to(ROOT)) for p in metal_dir.glob("*.mm"))
    cpp = sorted(str(p.relative_to(ROOT)) for p in metal_dir.glob("*.cc"))
    return objc + [path for path in cpp if path not in METAL_SOURCES_IN_EVERY_BUILD]


def kernel_library_macro(precompiled: bool) -> tuple:
    """Tells runtime.cc where the kernels come from: the .metallib, or the source at first use."""
    return ("TF_METAL_OPS_KERNEL_LIBRARY", '"precompiled"' if precompiled else '"source"')


# The MSL emulator (csrc/emulator/: its runtime and the stand-in <metal_stdlib>) is package data:
# metal_kernel compiles users' kernels against it at run time (tf_metal_ops/kernels.py finds it
# as tf_metal_ops/emulator/ in an installed package, csrc/emulator/ in a checkout).
EMULATOR_DIR = ROOT / "csrc" / "emulator"


# --- Objects reused across builds ---------------------------------------------------------------
# pip compiles in a fresh temporary directory on every install, so the README's second command
# (`pip install -e ".[cpu,test]"` after the first's `.[cpu,demo]`) and CI's wheel would compile
# every object again: about four minutes on two cores, nearly all of it the vectorized row
# kernels. ccache would skip those compiles, but it is a system package and the README's commands
# need Python alone; pybind11's own `needs_recompile` hook sees only file times, which do not
# survive a fresh directory and miss a changed flag. So the build keeps its objects in
# build/object-cache/ (ignored by git, like the rest of build/), keyed as ccache's preprocessor
# mode keys them: the compiler (its --version), the compile command without its include
# directories, and the source's preprocessed text, which holds every header's content whichever
# directory it came from (pip's isolated build environment puts TensorFlow somewhere new each
# time). `setup.py build_ext --force` neither reads nor writes the cache; deleting build/ empties it.
# Linux only: on macOS the command distutils runs is rewritten by its compiler_fixup
# (ARCHFLAGS, -arch), and the deployment target comes from the environment, which a key of the
# command would miss; a Mac's build stays as setuptools makes it.
OBJECT_CACHE_DIR = ROOT / "build" / "object-cache"
# The least recently used objects go once the cache holds more than this.
OBJECT_CACHE_MAX_BYTES = 1 << 30
INCLUDE_FLAGS = ("-I", "-isystem", "-iquote", "-idirafter")
# Environment variables that change what gcc or clang produce without changing the command or
# the preprocessed text.
COMPILER_ENVIRONMENT = ("COMPILER_PATH", "GCC_EXEC_PREFIX", "CCC_OVERRIDE_OPTIONS")


def compiler_driver(compiler, source: str) -> tuple:
    """The compiler (with its own flags) distutils' Unix compiler runs for `source`: its C++
    driver for C++ sources where it has one (setuptools >= 72), as its `_compile` chooses."""
    if compiler.detect_language(source) == "c++" and getattr(compiler, "compiler_so_cxx", None):
        return tuple(compiler.compiler_so_cxx)
    return tuple(compiler.compiler_so)


def compile_args(cc_args: list, extra_postargs: list) -> list:
    """The rest of that command, without its `-c src -o obj`."""
    return [*(a for a in cc_args if a != "-c"), *extra_postargs]


def with_debug_info(command: list) -> bool:
    """Whether the command's last -g option asks for debug information (pybind11 adds -g0)."""
    levels = [a for a in command if a.startswith("-g") and a[2:] in ("", "0", "1", "2", "3")]
    return bool(levels) and levels[-1] != "-g0"


def without_include_dirs(command: list) -> list:
    kept, skip_next = [], False
    for argument in command:
        if skip_next:
            skip_next = False
        elif argument in INCLUDE_FLAGS:
            skip_next = True
        elif not argument.startswith(INCLUDE_FLAGS):
            kept.append(argument)
    return kept


class ObjectCache:
    """Compiled objects by the hash of everything that decides their bytes (see above)."""

    def __init__(self, directory: Path, max_bytes: int = OBJECT_CACHE_MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self.reused = 0
        self.compiled = 0
        self._lock = threading.Lock()  # the counts: ParallelCompile compiles on several threads
        self._compilers: dict = {}

    def _compiler_identity(self, driver: tuple):
        """The driver's resolved path and --version, or None when it cannot be run."""
        if driver not in self._compilers:
            try:
                version = subprocess.run([*driver, "--version"], capture_output=True, text=True,
                                         check=True).stdout
            except (OSError, subprocess.CalledProcessError):
                version = None
            resolved = shutil.which(driver[0])
            self._compilers[driver] = (None if version is None else
                                       f"{os.path.realpath(resolved) if resolved else driver[0]}\n{version}")
        return self._compilers[driver]

    def key(self, driver: tuple, command: list, source: str):
        """The object's key, or None when the compiler cannot preprocess `source` (the compile
        then runs uncached and reports its own error). `command` starts with `driver`."""
        identity = self._compiler_identity(driver)
        if identity is None:
            return None
        # Without line markers the text does not name the directories the headers came from;
        # with debug information the object holds line numbers, which only the markers keep.
        preprocess = ["-E"] if with_debug_info(command) else ["-E", "-P"]
        try:
            preprocessed = subprocess.run([*command, *preprocess, source], capture_output=True,
                                          check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        digest = hashlib.sha256()
        environment = [f"{name}={os.environ.get(name, '')}" for name in COMPILER_ENVIRONMENT]
        for part in (identity, *environment, *without_include_dirs(command), Path(source).name):
            digest.update(part.encode() + b"\0")
        digest.update(preprocessed)
        return digest.hexdigest()

    def _count(self, reused: bool) -> None:
        with self._lock:
            if reused:
                self.reused += 1
            else:
                self.compiled += 1

    def _reuse(self, cached: Path, obj) -> bool:
        """Copies the cached object to `obj`; False when it is gone (another build pruned it)."""
        try:
            Path(obj).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cached, obj)
            os.utime(cached)  # recently used: pruned last
        except FileNotFoundError:
            return False
        return True

    def _store(self, obj, cached: Path) -> None:
        """Keeps a copy of `obj`; a cache that cannot be written leaves the build as it is."""
        # Written whole, then renamed: a concurrent build never sees half an object.
        partial = cached.with_name(f"{cached.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(obj, partial)
            os.replace(partial, cached)
        except OSError:
            partial.unlink(missing_ok=True)

    def compile(self, compile_one, obj, src, ext, cc_args, extra_postargs, pp_opts) -> None:
        """distutils' `_compile`, with the object taken from the cache when it is there."""
        driver = compiler_driver(self._compiler, src)
        key = self.key(driver, [*driver, *compile_args(cc_args, extra_postargs)], src)
        cached = self.directory / f"{key}.o"
        if key is not None and self._reuse(cached, obj):
            self._count(reused=True)
            return
        compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)
        self._count(reused=False)
        if key is not None:
            self._store(obj, cached)

    def install(self, compiler) -> None:
        """Routes `compiler`'s per-object compiles (pybind11's ParallelCompile calls `_compile`
        for each object, on its threads) through the cache."""
        self._compiler = compiler
        compile_one = compiler._compile

        def cached_compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            self.compile(compile_one, obj, src, ext, cc_args, extra_postargs, pp_opts)

        compiler._compile = cached_compile

    def prune(self) -> None:
        """Drops the least recently used objects beyond max_bytes (another build may be pruning
        too: a file already gone is skipped)."""
        objects = []
        for path in self.directory.glob("*.o"):
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            objects.append((status.st_mtime, status.st_size, path))
        total = 0
        for _, size, path in sorted(objects, key=lambda entry: entry[0], reverse=True):
            total += size
            if total > self.max_bytes:
                path.unlink(missing_ok=True)


class CachingBuildExt(build_ext):
    """build_ext that reuses objects from build/object-cache/ (above), on Linux, unless --force."""

    def build_extensions(self) -> None:
        if self.force or self.compiler.compiler_type != "unix" or sys.platform != "linux":
            super().build_extensions()
            return
        cache = ObjectCache(OBJECT_CACHE_DIR)
        cache.install(self.compiler)
        super().build_extensions()
        cache.prune()
        if cache.reused + cache.compiled:  # (none when build_ext found the library up to date)
            print(f"tf_metal_ops: {cache.reused} of {cache.reused + cache.compiled} objects "
                  f"reused from {OBJECT_CACHE_DIR}")


class PackagedBuildExt(CachingBuildExt):
    """build_ext that also installs the MSL emulator's sources next to the library."""

    def build_extension(self, ext) -> None:
        if not self.inplace:
            package_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
            for source in sorted(p for p in EMULATOR_DIR.rglob("*") if p.is_file()):
                destination = package_dir / "emulator" / source.relative_to(EMULATOR_DIR)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)
        super().build_extension(ext)


class MetalBuildExt(PackagedBuildExt):
    """build_ext that also compiles Objective-C++ (.mm, with ARC) and the Metal kernel library."""

    def build_extensions(self) -> None:
        compiler = self.compiler
        # distutils knows .m but not .mm; clang picks Objective-C++ from the extension itself.
        if ".mm" not in compiler.src_extensions:
            compiler.src_extensions = [*compiler.src_extensions, ".mm"]
        compile_one = compiler._compile

        def compile_with_arc(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if ext == ".mm":
                extra_postargs = [*extra_postargs, *OBJC_COMPILE_ARGS]
            compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)

        compiler._compile = compile_with_arc
        super().build_extensions()

    def build_extension(self, ext) -> None:
        package_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        package_dir.mkdir(parents=True, exist_ok=True)
        precompiled = self._build_metallib(package_dir / METALLIB_NAME)
        if not self.inplace:
            self._install_kernel_source(package_dir / "kernels")
        # Replaced, not appended: build_ext may run more than once on the same Extension.
        ext.define_macros = [m for m in ext.define_macros if m[0] != "TF_METAL_OPS_KERNEL_LIBRARY"]
        ext.define_macros.append(kernel_library_macro(precompiled))
        super().build_extension(ext)

    def _install_kernel_source(self, destination: Path) -> None:
        destination.mkdir(parents=True, exist_ok=True)
        for pattern in ("*.metal", "*.h"):
            for path in sorted((ROOT / "kernels").glob(pattern)):
                shutil.copy2(path, destination / path.name)

    def _build_metallib(self, output: Path) -> bool:
        """Precompiles the kernels; False (and no stale library left behind) when it cannot."""
        # A .metallib from an earlier build would be loaded before the current source: remove it
        # first, so a failed build falls back to compiling the current source at run time.
        if output.exists():
            output.unlink()
        if shutil.which("xcrun") is None:
            print("tf_metal_ops: xcrun not found; the Metal kernels will be compiled at first use")
            return False
        air = Path(self.build_temp).resolve() / "custom_loss.air"
        air.parent.mkdir(parents=True, exist_ok=True)
        commands = [
            # -fno-fast-math: precise exp/log and no reassociation (Metal defaults to fast math).
            ["xcrun", "-sdk", "macosx", "metal", "-fno-fast-math", "-I", str(ROOT / "kernels"),
             "-c", str(ROOT / METAL_KERNEL_SOURCE), "-o", str(air)],
            ["xcrun", "-sdk", "macosx", "metallib", str(air), "-o", str(output)],
        ]
        for command in commands:
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False)
            except OSError as error:
                result = None
                reason = str(error)
            else:
                reason = (result.stderr or result.stdout).strip()
            if result is None or result.returncode != 0:
                print(
                    "tf_metal_ops: precompiling the Metal kernels failed, they will be compiled "
                    f"at first use instead ({' '.join(command[:4])}: {reason[:2000]})"
                )
                if output.exists():
                    output.unlink()
                return False
        return True


# Guarded so that tests/cross/macos_arm64_build.sh can import native_extension() without building.
# pip's build backend and `python setup.py ...` both run this file as __main__.
if __name__ == "__main__":
    # setuptools compiles an extension's sources one after another; pybind11's helper compiles
    # them on a thread each, as many at once as TF_METAL_OPS_BUILD_JOBS says (default: every
    # core). On a 2-core machine that halves the build, the sanitizer build's 10 minutes most.
    ParallelCompile("TF_METAL_OPS_BUILD_JOBS").install()
    setup(
        ext_modules=[native_extension()],
        cmdclass={"build_ext": MetalBuildExt if BUILD_METAL else PackagedBuildExt},
    )
