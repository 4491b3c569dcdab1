#!/usr/bin/env bash
# Builds the native library for x86-64 with clang 16 (setup.py's own sources and flags, clang as
# CC/CXX/LDSHARED) and runs the op tests against it: the compiler of Apple's and many Linux
# users' builds, next to CI's gcc: the tests marked `simd` (the CPU kernels' arithmetic, where
# a compiler's code generation can differ), and tests/test_simd_math.py's vector math.
#
#   tests/cross/clang_x86.sh [extra pytest arguments, e.g. -x or -k name]
#
# Environment:
#   PYTHON       the Python with TensorFlow, pybind11, pytest, hypothesis and setuptools >= 77
#                (default: python3)
#   CLANG        the clang++ to build with (default: clang++-16)
#   CLANG_WORK   where the build and the package copy go (default: a new temp dir, removed at
#                exit; set it to keep them)
#
# As tests/sanitizer/build_and_run.sh does, the tests see the clang library through a copy of
# the package's Python files next to it, first on PYTHONPATH, with pytest run from outside the
# checkout (tests/library_copy.py, which checks that the library loaded is that one); the
# script checks that it was built by clang.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
CLANG=${CLANG:-clang++-16}
if [ -n "${CLANG_WORK:-}" ]; then
  WORK=$CLANG_WORK
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/tf_metal_ops_clang.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
start=$(date +%s)
step() { echo "=== [clang x86-64 $(( $(date +%s) - start ))s] $*"; }
command -v "$CLANG" >/dev/null || { echo "$CLANG not found: apt-get install clang-16" >&2; exit 2; }

step "building the native library with $("$CLANG" --version | head -1)"
(
  cd "$ROOT"
  # --force: objects of an earlier build in a reused CLANG_WORK may come from another compiler.
  CC="$CLANG" CXX="$CLANG" LDSHARED="$CLANG -shared" LDCXXSHARED="$CLANG -shared" \
    "$PYTHON" setup.py -q build_ext --force --build-lib "$WORK/lib" --build-temp "$WORK/obj"
)
LIBRARY=$(ls "$WORK"/lib/tf_metal_ops/_tf_metal_ops*.so)
# Every object file of ours leaves clang's identification in .comment (gcc's comes from crt files).
readelf -p .comment "$LIBRARY" | grep -q "clang version" || { echo "$LIBRARY was not built by clang" >&2; exit 2; }

"$PYTHON" "$ROOT/tests/library_copy.py" make "$WORK/pkg" "$LIBRARY"
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
cd "$WORK"

step "tests marked simd against the clang build (test_simd_math.py's checks built with $CLANG)"
CXX="$CLANG" "$PYTHON" "$ROOT/tests/library_copy.py" pytest "$WORK/pkg" \
  -p no:cacheprovider -q -ra -m simd "$ROOT/tests" "$@" | tee "$WORK/pytest.log"
result=$(grep -E "^=* ?[0-9]+ (passed|failed)" "$WORK/pytest.log" | tail -1 | sed 's/=//g; s/ in [0-9.]*s.*//; s/^ *//')
step "done"
echo "clang x86-64: ${result} (marker: simd)"
