#!/usr/bin/env bash
# Builds the native library with AddressSanitizer + UndefinedBehaviorSanitizer and runs the tests
# marked `native` (the native code's memory and error paths) against it. Any sanitizer report aborts the Python process, which fails the test (or
# the whole run) that triggered it.
#
#   tests/sanitizer/build_and_run.sh [extra pytest arguments, e.g. -x or -k name]
#
# Environment:
#   PYTHON            the Python with TensorFlow, pybind11, pytest, hypothesis and
#                     setuptools >= 77 (default: python3)
#   CXX               the compiler whose sanitizer runtime is preloaded (default: g++)
#   SANITIZER_WORK    where the build and the package copy go (default: a new temp dir,
#                     removed at exit; set it to keep them)
#
# How the tests see the sanitized library without touching the checkout: the package's Python
# files are copied into $SANITIZER_WORK/pkg/tf_metal_ops next to the sanitized library, and
# pytest runs from $SANITIZER_WORK with that directory first on PYTHONPATH
# (tests/library_copy.py, which checks in the test process that the library actually loaded is
# the sanitized one before running anything).
#
# Why these settings:
#   LD_PRELOAD of the ASan runtime (and libstdc++, see below): Python itself is not
#     instrumented, and ASan must own malloc from the first allocation, so its runtime has to
#     be loaded before anything else.
#   detect_leaks=0: Python and TensorFlow keep many allocations alive until exit on purpose;
#     leak reports would be noise (tests/test_robustness.py measures leaks directly).
#   halt_on_error=1, -fno-sanitize-recover=all: the first finding stops the process.
#   -O1 (TF_METAL_OPS_OPTIMIZE, in place of the release build's -O3): instrumented at -O3, the
#     vectorized row kernels' three instruction-set variants took most of this job's time to
#     compile (docs/performance.md, "CI").
#   TF_METAL_OPS_ROW_VARIANTS=host: on a CPU without AVX-512, the AVX-512 row kernels are left
#     out (setup.py): instrumented, they are minutes of compiling for a variant the CPU never
#     selects. Where the CPU has AVX-512 all three variants are built and run.
#   -g1: line tables only, which is what a sanitizer report's stack (function, file and line)
#     reads; full debug information of the row kernels' many inlined template instances took
#     a third of their instrumented compile.
#   float-cast-overflow (not part of gcc's -fsanitize=undefined): a NaN or huge float turned
#     into an integer is undefined behaviour too.
#   -fno-sanitize=object-size: UBSan's object-size check tests an access against the size of
#     the object the compiler can see, which ASan already checks for every access, to the
#     byte, through its redzones. Left in, it was a fifth of the instrumented row kernels'
#     compile (docs/performance.md, "CI").
#   TF_METAL_OPS_KERNEL_SANITIZE=address and TF_METAL_OPS_CLANG=$CXX: metal_kernel's JIT-compiled
#     kernels and their emulator are built with -fsanitize=address by $CXX, against the runtime
#     preloaded here (the library's own flags do not reach a kernel compiled at run time).
#   The memory-flatness tests are deselected: ASan's quarantine and allocator change both the
#     heap accounting and the RSS they measure.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
CXX=${CXX:-g++}
if [ -n "${SANITIZER_WORK:-}" ]; then
  WORK=$SANITIZER_WORK
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/tf_metal_ops_sanitizer.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
start=$(date +%s)
step() { echo "=== [sanitizer $(( $(date +%s) - start ))s] $*"; }

"$PYTHON" - <<'EOF'
import sys
import setuptools
major = int(setuptools.__version__.split(".")[0])
if major < 77:
    sys.exit(f"setuptools {setuptools.__version__} is too old to read pyproject.toml's license "
             "field: `pip install 'setuptools>=77'` in this Python first")
EOF

ASAN_RUNTIME=$("$CXX" -print-file-name=libasan.so)
if [ ! -e "$ASAN_RUNTIME" ]; then
  echo "the ASan runtime of $CXX was not found (got '$ASAN_RUNTIME'): install libasan (gcc) or libclang-rt-dev (clang)" >&2
  exit 2
fi

step "building the native library with -fsanitize=address,undefined ($CXX)"
SANITIZE="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize=object-size"
SANITIZE="$SANITIZE -fno-sanitize-recover=all -fno-omit-frame-pointer -g1"
(
  cd "$ROOT"
  # CFLAGS reach C++ compiles on older setuptools, CXXFLAGS on newer ones; both are harmless.
  # --force: objects of an earlier build in a reused SANITIZER_WORK may have other flags.
  CC="$CXX" CXX="$CXX" CFLAGS="$SANITIZE" CXXFLAGS="$SANITIZE" TF_METAL_OPS_OPTIMIZE=-O1 \
    TF_METAL_OPS_ROW_VARIANTS=host LDFLAGS="-fsanitize=address,undefined,float-cast-overflow" \
    "$PYTHON" setup.py -q build_ext --force --build-lib "$WORK/lib" --build-temp "$WORK/obj"
)
LIBRARY=$(ls "$WORK"/lib/tf_metal_ops/_tf_metal_ops*.so)
# (grep reads all of nm's output: with pipefail, grep -q's early exit would fail the pipe)
if [ "$(nm -D --undefined-only "$LIBRARY" | grep -c "__asan_report")" -eq 0 ]; then
  echo "$LIBRARY is not instrumented (the compiler flags did not reach the build)" >&2
  exit 2
fi

step "a package copy next to the sanitized library"
# With the MSL emulator's sources, which build_ext installed next to the library: metal_kernel
# compiles users' kernels against them.
"$PYTHON" "$ROOT/tests/library_copy.py" make "$WORK/pkg" "$LIBRARY" "$WORK/lib/tf_metal_ops/emulator"

# libstdc++ is preloaded too: Python is a C program, so without it ASan's __cxa_throw
# interceptor finds no real __cxa_throw at start-up and the first C++ exception (TensorFlow
# throws them inside tf.function tracing) aborts with "CHECK failed ... real___cxa_throw".
STDCXX=$("$CXX" -print-file-name=libstdc++.so)
export LD_PRELOAD="$ASAN_RUNTIME $STDCXX"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:print_summary=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
# Users' kernels (metal_kernel) compiled in this step are instrumented too, by the compiler
# whose runtime is preloaded: an out-of-bounds access in a kernel is reported like one in the
# library (tests/test_metal_kernel_asan.py).
export TF_METAL_OPS_KERNEL_SANITIZE=address
export TF_METAL_OPS_CLANG="$CXX"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
cd "$WORK"

step "tests marked native under ASan + UBSan (first: the sanitized library is the one loaded)"
# __asan_init: the preloaded runtime is live in the test process.
"$PYTHON" "$ROOT/tests/library_copy.py" pytest "$WORK/pkg" --require-symbol __asan_init \
  -p no:cacheprovider -q -ra -m native "$ROOT/tests" \
  -k "not memory_stays_flat and not error_path_leaks" "$@"
step "done"
