#!/usr/bin/env bash
# Builds the whole native library as a macOS arm64 Mach-O bundle on Linux and checks the link.
#
#   tests/cross/macos_arm64_build.sh
#
# Nobody here has a Mac, and a Mac builds this package with Apple's clang. This script compiles
# every source setup.py compiles on Apple silicon (the C++ and the Objective-C++ csrc/metal/*.mm,
# with ARC, blocks and Apple's Objective-C runtime, not GNUstep) with setup.py's own settings
# (setup.native_extension(MACOS_ARM64, ...): sources, macros, include directories and flags),
# links it with ld64.lld as a two-level-namespace bundle against the real
# libtensorflow_framework.2.dylib of TensorFlow's macOS arm64 wheel, with `-undefined error`
# except Python's own _Py* symbols, and checks the result (tests/cross/check_macos_bundle.py says
# what). It never runs the library: the result was cross-built and link-checked, never loaded on
# a Mac. The .metallib cannot be built off a Mac either (the run-time compile of the shipped
# source is what such a build uses, and what this build is configured for).
#
# What stands in for Apple's SDK, which is not available off a Mac:
#   - the macOS C library headers and libSystem.tbd from the ziglang wheel on PyPI (zig ships
#     them to cross-compile for macOS);
#   - Debian's libc++ 19 headers, with Apple's libc++ configuration (tests/cross/macos_libcxx);
#   - tests/apple_decls for Foundation, Metal, libdispatch and Accelerate: our declarations, written from
#     Apple's documentation, of exactly the Apple APIs the .mm files use (also what
#     tests/test_objc_syntax.py checks them against). So the compile checks our code against
#     those declarations, not against Apple's own headers;
#   - tests/cross/macos_stubs: .tbd link stubs for Foundation, Metal, Accelerate, libobjc and
#     libc++ listing
#     the symbols we bind to, each name from a public source cited in the file;
#   - tests/cross/macos_platform_version.c: compiler-rt's ___isPlatformVersionAtLeast (for
#     @available), which a Mac's clang links in by itself and Debian's clang cannot;
#   - the CPython headers TensorFlow's macOS wheel ships (include/external/local_config_python).
#
# Needs (CI's .ci/run installs them): Debian's clang-19, lld-19, llvm-19 and libc++-19-dev;
# $PYTHON with setuptools and pybind11 (to import setup.py); PyPI. Every missing piece is an
# error, never a skip.
#
# Environment:
#   PYTHON           the Python to import setup.py with and run pip (default: python3)
#   TF_MACOS_VERSION the TensorFlow whose macOS arm64 wheel is linked against (default 2.19.1)
#   ZIGLANG_VERSION  the ziglang wheel the macOS C headers and libSystem.tbd come from (0.15.2)
#   MACOS_CROSS_WORK where downloads and the build go (default: a new temp dir, removed at exit)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/tests/cross"
PYTHON=${PYTHON:-python3}
TF_MACOS_VERSION=${TF_MACOS_VERSION:-2.19.1}
ZIGLANG_VERSION=${ZIGLANG_VERSION:-0.15.2}
LLVM=19
if [ -n "${MACOS_CROSS_WORK:-}" ]; then
  WORK=$MACOS_CROSS_WORK
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/tf_metal_ops_macos.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
start=$(date +%s)
step() { echo "=== [macos-arm64 $(( $(date +%s) - start ))s] $*"; }
fail() { echo "macos_arm64_build: $*" >&2; exit 1; }

step "tools"
for tool in clang-$LLVM clang++-$LLVM ld64.lld-$LLVM llvm-nm-$LLVM llvm-objdump-$LLVM; do
  command -v "$tool" >/dev/null || fail "$tool not found: apt-get install clang-$LLVM lld-$LLVM llvm-$LLVM"
done
LIBCXX_HEADERS=/usr/lib/llvm-$LLVM/include/c++/v1
[ -f "$LIBCXX_HEADERS/vector" ] || fail "no libc++ headers in $LIBCXX_HEADERS: apt-get install libc++-$LLVM-dev"
"$PYTHON" -c "import setuptools, pybind11" 2>/dev/null \
  || fail "$PYTHON lacks setuptools or pybind11, which importing setup.py needs: $PYTHON -m pip install setuptools pybind11"

step "downloads: TensorFlow $TF_MACOS_VERSION's macOS arm64 wheel, ziglang $ZIGLANG_VERSION"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform macosx_12_0_arm64 \
  --python-version 3.11 --implementation cp --dest "$WORK/wheels" "tensorflow==$TF_MACOS_VERSION"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --dest "$WORK/wheels" "ziglang==$ZIGLANG_VERSION"
TF_WHEEL=$(ls "$WORK"/wheels/tensorflow-"$TF_MACOS_VERSION"-*macosx*arm64.whl)
ZIG_WHEEL=$(ls "$WORK"/wheels/ziglang-"$ZIGLANG_VERSION"-*.whl)

step "the parts of the wheels the build needs"
rm -rf "$WORK/tf" "$WORK/zig" "$WORK/sdk" "$WORK/apple_decls"
"$PYTHON" "$HERE/extract_tf_macos.py" "$TF_WHEEL" "$WORK/tf"
TF_DIR="$WORK/tf/tensorflow"
"$PYTHON" - "$ZIG_WHEEL" "$WORK/zig" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        if name.startswith(("ziglang/lib/libc/include/any-macos-any/", "ziglang/lib/libc/darwin/")):
            wheel.extract(name, sys.argv[2])
PY
ZIG_LIBC="$WORK/zig/ziglang/lib/libc"
[ -f "$ZIG_LIBC/darwin/libSystem.tbd" ] && [ -f "$ZIG_LIBC/include/any-macos-any/dlfcn.h" ] \
  || fail "ziglang $ZIGLANG_VERSION has no macOS libSystem.tbd or headers where expected"
SDK_VERSION=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['MinimalDisplayName'])" \
  "$ZIG_LIBC/darwin/SDKSettings.json")

# The SDK directory, laid out as Apple's (ld64's -syslibroot and clang's -isysroot search it):
# usr/include, usr/lib/*.tbd, System/Library/Frameworks/*.framework/*.tbd.
mkdir -p "$WORK/sdk/usr/lib"
cp -r "$ZIG_LIBC/include/any-macos-any" "$WORK/sdk/usr/include"
cp "$ZIG_LIBC/darwin/libSystem.tbd" "$WORK/sdk/usr/lib/"
cp "$HERE/macos_stubs/libobjc.A.tbd" "$WORK/sdk/usr/lib/"
ln -s libobjc.A.tbd "$WORK/sdk/usr/lib/libobjc.tbd"
cp "$HERE/macos_stubs/libc++.tbd" "$WORK/sdk/usr/lib/"
for framework in Foundation Metal Accelerate; do
  mkdir -p "$WORK/sdk/System/Library/Frameworks/$framework.framework"
  cp "$HERE/macos_stubs/$framework.tbd" "$WORK/sdk/System/Library/Frameworks/$framework.framework/"
done
# Only the Objective-C frameworks from tests/apple_decls; its dlfcn.h (for the syntax check on
# Linux) would hide macOS's own, which the SDK directory has.
mkdir -p "$WORK/apple_decls"
for dir in Foundation Metal dispatch Accelerate; do
  [ -d "$ROOT/tests/apple_decls/$dir" ] || fail "tests/apple_decls/$dir is missing"
  ln -s "$ROOT/tests/apple_decls/$dir" "$WORK/apple_decls/$dir"
done

step "compile and link (setup.py's macOS arm64 settings)"
rm -rf "$WORK/build"
BUNDLE="$WORK/build/_tf_metal_ops.cpython-311-darwin.so"
FLAT_PROBE="$WORK/build/flat_lookup_probe.so"
"$PYTHON" "$HERE/build_macos_bundle.py" --sdk "$WORK/sdk" --sdk-version "$SDK_VERSION" \
  --tensorflow "$TF_DIR" --tf-version "$TF_MACOS_VERSION" --apple-decls "$WORK/apple_decls" \
  --libcxx-headers "$LIBCXX_HEADERS" --clang "clang++-$LLVM" --ld "ld64.lld-$LLVM" \
  --nm "llvm-nm-$LLVM" --work "$WORK/build" --out "$BUNDLE" --flat-probe "$FLAT_PROBE"

step "checks of the bundle"
"$PYTHON" "$HERE/check_macos_bundle.py" "$BUNDLE" "$TF_DIR/libtensorflow_framework.2.dylib" \
  --llvm-suffix "-$LLVM" > "$WORK/build/checks.log" 2>&1 || { cat "$WORK/build/checks.log"; fail "a check failed"; }
cat "$WORK/build/checks.log"
CHECKS=$(tail -1 "$WORK/build/checks.log")

step "negative test: the checker refuses a bundle linked with -undefined dynamic_lookup, no libobjc"
if "$PYTHON" "$HERE/check_macos_bundle.py" "$FLAT_PROBE" "$TF_DIR/libtensorflow_framework.2.dylib" \
  --llvm-suffix "-$LLVM" > "$WORK/build/flat_probe.log" 2>&1; then
  cat "$WORK/build/flat_probe.log"
  fail "the checker accepted a bundle whose Objective-C runtime calls are bound by flat lookup"
fi
grep -q "FAIL no flat-namespace binding but Python's" "$WORK/build/flat_probe.log" \
  || { cat "$WORK/build/flat_probe.log"; fail "the checker refused the probe, but not for its flat bindings"; }
echo "  ok   refused, for its flat-namespace bindings of _objc_*"

step "done in $(( $(date +%s) - start ))s"
echo "macos_arm64_build: $TF_MACOS_VERSION macOS arm64 wheel, ${CHECKS#check_macos_bundle: }, negative test passed (cross-built and link-checked, never loaded on a Mac)"
