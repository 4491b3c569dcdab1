#!/usr/bin/env bash
# Builds the native library for Linux aarch64 twice (clang 16 and gcc 12, cross-compiled from
# x86-64) and runs the tests of the NEON code path against each build under qemu-aarch64 user
# emulation, with TensorFlow's own aarch64 wheel and an aarch64 CPython 3.11.
#
#   tests/cross/aarch64_qemu.sh [extra pytest arguments, e.g. -x or -k name]
#
# For Debian 12 x86-64, as root (CI): it installs what it needs with apt. Under emulation
# TensorFlow imports in about 45 s, so it runs, per build, what only NEON can break:
#   tests/cpu_math/simd_math_check.cc   NEON exp/log/log1p/expm1 within the ulps of
#                                       tests/test_simd_math.py (every 256th float32)
#   the tests marked `simd`             the CPU kernels against the reference, their
#                                       bit-for-bit paths, float32 error at C = 32000-262144,
#                                       and linear_cross_entropy's native op on the aarch64
#                                       scipy-openblas32 wheel's OpenBLAS
# The two builds' math checks, then their test runs, go side by side (one process each); each
# test run first checks that the library it loaded is its build's.
#
# Environment:
#   PYTHON          a host Python with pip (default: python3); only pip runs in it
#   AARCH64_WORK    where downloads, the aarch64 root file system and the builds go, kept between
#                   runs as a cache (default: ~/.cache/tf_metal_ops_aarch64)
#   AARCH64_PREPARE_ONLY=1  stop once the downloads are in AARCH64_WORK (the root file system,
#                   TensorFlow's aarch64 wheel and the test tools): CI fetches them while other
#                   steps compile, and a later run with the same AARCH64_WORK builds and tests
#
# How it fits together:
#   - The aarch64 CPython is unpacked from Debian's arm64 .debs (`apt-get download` with a
#     private apt state under $AARCH64_WORK, then `dpkg-deb -x`): installing python3:arm64 with
#     apt would remove the host's python3.
#   - TensorFlow and the test tools are installed by the host's pip for the aarch64 platform
#     (`--platform manylinux_2_27_aarch64 --only-binary=:all:`, and the older manylinux levels) into one directory, put on
#     PYTHONPATH. TensorFlow has no aarch64 tensorflow-cpu wheel; the `tensorflow` one is CPU-only
#     there.
#   - qemu is called explicitly (no binfmt_misc needed): bin/python3 under $AARCH64_WORK is a
#     host script that starts the aarch64 python under qemu, with `-0` giving the guest that
#     script as argv[0], so sys.executable is it too and tests that start a child Python work.
#   - The library is built by setup.py itself, run by the emulated aarch64 Python (its sysconfig
#     gives the extension suffix, TensorFlow is found where it will be loaded from) with the
#     host's cross compilers as CC/CXX/LDSHARED: qemu-user runs a host binary natively when the
#     guest starts one. The sources and flags are therefore exactly setup.py's.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=${AARCH64_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/tf_metal_ops_aarch64}
TENSORFLOW_REQUIREMENT="tensorflow==2.21.0"
# The tools the tests import, beside TensorFlow (its own dependencies come with it).
# scipy-openblas32 is also the BLAS the aarch64 build links (setup.py finds it in this target
# directory when the emulated Python runs setup.py): pyproject.toml's pin, read from there.
OPENBLAS_REQUIREMENT=$(grep -o '"scipy-openblas32==[^;"]*' "$ROOT/pyproject.toml" | head -1 | tr -d '"')
[ -n "$OPENBLAS_REQUIREMENT" ] || { echo "aarch64_qemu.sh: no scipy-openblas32 pin in pyproject.toml" >&2; exit 1; }
TEST_REQUIREMENTS=(pytest pytest-xdist hypothesis pybind11 "setuptools>=77" "$OPENBLAS_REQUIREMENT")
# The aarch64 CPython 3.11 and the shared libraries it and TensorFlow's wheel load (Debian 12).
ARM64_PACKAGES=(
  libc6 libgcc-s1 libstdc++6 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
  libpython3.11-dev libpython3.11 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5
  libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libdb5.3
  libgdbm6 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
  libcom-err2 libkeyutils1 libzstd1
)
mkdir -p "$WORK"
start=$(date +%s)
step() { echo "=== [aarch64 $(( $(date +%s) - start ))s] $*"; }
fail() { echo "aarch64_qemu.sh: $*" >&2; exit 1; }

step "Debian packages: qemu-user-static, the aarch64 gcc 12 cross toolchain, clang 16"
export DEBIAN_FRONTEND=noninteractive
if ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-g++-12 >/dev/null ||
   ! command -v clang++-16 >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq qemu-user-static g++-12-aarch64-linux-gnu clang-16 >/dev/null
fi
QEMU=$(command -v qemu-aarch64-static)
GCC_VERSION=$(aarch64-linux-gnu-g++-12 -dumpversion)
[ "${GCC_VERSION%%.*}" -ge 12 ] || fail "aarch64-linux-gnu-g++-12 is version $GCC_VERSION"

step "the aarch64 CPython 3.11 from Debian's arm64 packages"
ROOTFS=$WORK/rootfs
if [ ! -e "$ROOTFS/.complete" ]; then
  APT_DIR=$WORK/apt
  mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/debs"
  : > "$APT_DIR/status"
  # A private apt state: the host's package lists and dpkg database stay as they are.
  apt_arm64=(-o APT::Architecture=arm64 -o APT::Architectures::=arm64
             -o Dir::State::Lists="$APT_DIR/lists" -o Dir::State::status="$APT_DIR/status"
             -o Dir::Cache="$APT_DIR/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  apt-get "${apt_arm64[@]}" update -qq
  (cd "$APT_DIR/debs" && rm -f ./*.deb && apt-get "${apt_arm64[@]}" download "${ARM64_PACKAGES[@]/%/:arm64}")
  rm -rf "$ROOTFS"
  mkdir -p "$ROOTFS"
  for deb in "$APT_DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$ROOTFS"; done
  touch "$ROOTFS/.complete"
fi
[ -x "$ROOTFS/usr/bin/python3.11" ] || fail "$ROOTFS/usr/bin/python3.11 is missing"

# The emulated python as a host command (see the top of this file).
mkdir -p "$WORK/bin"
cat > "$WORK/bin/python3" <<EOF
#!/bin/sh
PYTHONHOME="$ROOTFS/usr" exec "$QEMU" -L "$ROOTFS" -0 "\$0" "$ROOTFS/usr/bin/python3.11" "\$@"
EOF
chmod +x "$WORK/bin/python3"
EMULATED=$WORK/bin/python3
"$EMULATED" -c "import platform, sys; assert platform.machine() == 'aarch64', platform.machine(); print('emulated', sys.version.split()[0], platform.machine())"

step "$TENSORFLOW_REQUIREMENT and ${TEST_REQUIREMENTS[*]} for manylinux aarch64"
SITE=$WORK/site-packages
wanted="$TENSORFLOW_REQUIREMENT ${TEST_REQUIREMENTS[*]}"
if [ ! -e "$SITE/.complete" ] || [ "$(cat "$SITE/.complete")" != "$wanted" ]; then
  rm -rf "$SITE"
  # Every manylinux level up to Debian 12's glibc 2.36 that TensorFlow's dependencies use
  # (libclang's aarch64 wheel is manylinux2014).
  "$PYTHON" -m pip install -q --target "$SITE" --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform manylinux_2_27_aarch64 --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
    "$TENSORFLOW_REQUIREMENT" "${TEST_REQUIREMENTS[@]}"
  echo "$wanted" > "$SITE/.complete"
fi
if [ "${AARCH64_PREPARE_ONLY:-}" = 1 ]; then
  step "downloads ready in $WORK (AARCH64_PREPARE_ONLY=1: no build, no tests)"
  exit 0
fi
export PYTHONPATH="$SITE"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

# One build per compiler: name, C compiler, C++ compiler (each a host cross compiler).
BUILDS=(
  "clang|clang-16 --target=aarch64-linux-gnu|clang++-16 --target=aarch64-linux-gnu"
  "gcc|aarch64-linux-gnu-gcc-12|aarch64-linux-gnu-g++-12"
)
# The aarch64 Python headers: Debian's multiarch pyconfig.h includes
# <aarch64-linux-gnu/python3.11/pyconfig.h>, which lies under $ROOTFS/usr/include.
PYTHON_INCLUDES="-I$ROOTFS/usr/include/python3.11 -I$ROOTFS/usr/include"
[ -e "$ROOTFS/usr/include/aarch64-linux-gnu/python3.11/pyconfig.h" ] ||
  fail "the arm64 pyconfig.h is missing from $ROOTFS"

for build in "${BUILDS[@]}"; do
  IFS='|' read -r name cc cxx <<<"$build"
  out=$WORK/build/$name
  step "building the native library for aarch64 with $cxx (setup.py under the emulated Python)"
  rm -rf "$out"
  mkdir -p "$out"
  (
    cd "$ROOT"
    CC="$cc" CXX="$cxx" LDSHARED="$cxx -shared" LDCXXSHARED="$cxx -shared" \
      CFLAGS="$PYTHON_INCLUDES" CXXFLAGS="$PYTHON_INCLUDES" \
      "$EMULATED" setup.py -q build_ext --force --build-lib "$out/lib" --build-temp "$out/obj"
  )
  library=$(ls "$out"/lib/tf_metal_ops/_tf_metal_ops*.so)
  case "$library" in *aarch64-linux-gnu.so) ;; *) fail "$library is not named for aarch64" ;; esac
  readelf -h "$library" | grep -q "Machine:.*AArch64" || fail "$library is not an AArch64 object"
  compiler_tag=$([ "$name" = clang ] && echo "clang version 16" || echo "GCC: .*12\.")
  readelf -p .comment "$library" | grep -q "$compiler_tag" || fail "$library was not built by $name"

  # A package copy next to the library, as tests/sanitizer/build_and_run.sh makes.
  "$PYTHON" "$ROOT/tests/library_copy.py" make "$out/pkg" "$library"

  # The vector math check, with the flags of tests/test_simd_math.py's baseline build; it runs
  # below, beside the other build's.
  $cxx -O2 -std=c++17 -Wall -Wno-psabi -ffp-contract=off "-I$ROOT" -o "$out/simd_math_check" \
    "$ROOT/tests/cpu_math/simd_math_check.cc"
done

# Each check is one emulated thread: the two builds' run side by side.
step "the vector math of both NEON builds under qemu, side by side: tests/cpu_math/simd_math_check.cc"
pids=()
for build in "${BUILDS[@]}"; do
  IFS='|' read -r name cc cxx <<<"$build"
  "$QEMU" -L "$ROOTFS" "$WORK/build/$name/simd_math_check" 256 > "$WORK/build/$name/simd_math.json" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || fail "simd_math_check failed under qemu"; done
for build in "${BUILDS[@]}"; do
  IFS='|' read -r name cc cxx <<<"$build"
  "$PYTHON" - "$ROOT/tests/test_simd_math.py" "$WORK/build/$name/simd_math.json" "$name" <<'EOF'
import ast, json, sys
# The bounds tests/test_simd_math.py asserts (its MAX_ULP), read from that file.
tree = ast.parse(open(sys.argv[1]).read())
bounds = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              and any(getattr(t, "id", None) == "MAX_ULP" for t in node.targets))
results = {}
for line in open(sys.argv[2]):
    record = json.loads(line)
    results.setdefault(record["function"], {}).update(record)
failed = [f"{f}: {results.get(f)}" for f in sorted(bounds)
          if f not in results or results[f]["max_ulp"] > bounds[f] or results[f]["special_failures"]]
print(sys.argv[3], "NEON math:", ", ".join(f"{f} {results[f]['max_ulp']:.2f} ulp" for f in sorted(bounds) if f in results))
if failed:
    sys.exit("simd math check failed: " + "; ".join(failed))
EOF
done

# test_simd_math.py builds its check with the host's compiler; the NEON build of that check ran
# above, under qemu, against the same bounds.
step "tests marked simd (less baseline_isa) under qemu-aarch64, both builds side by side"
# Each build's tests run in one emulated Python that first checks the library it loads is that
# build's (tests/library_copy.py; TensorFlow's import under emulation takes about 40 s: once per
# build, not twice).
pids=()
for build in "${BUILDS[@]}"; do
  IFS='|' read -r name cc cxx <<<"$build"
  out=$WORK/build/$name
  # From the build directory, so the checkout's tf_metal_ops/ is not what gets imported.
  # OPENBLAS_CORETYPE: qemu's default CPU ("max") advertises SME, for which the OpenBLAS wheel's
  # run-time dispatch picks a kernel table whose sgemm_alpha_beta2x2 is an empty stub (it prints
  # "should never get called" and leaves C wrong); a Neoverse N1 (NEON, the Linux servers' core)
  # is what these tests mean to check.
  # -n 0: one emulated process per build (pyproject.toml's addopts ask for two), the two builds
  # side by side on the two cores.
  # The status goes to pytest.rc either way (under set -e a failing pytest would otherwise end
  # the subshell before it is written, and the wait below the script before the logs are shown).
  (if cd "$out" && OPENBLAS_CORETYPE=NEOVERSEN1 PYTHONPATH="$out/pkg:$SITE" "$EMULATED" \
     "$ROOT/tests/library_copy.py" pytest "$out/pkg" -p no:cacheprovider -q -ra -n 0 \
     -m "simd and not baseline_isa" "$ROOT/tests" --ignore="$ROOT/tests/test_simd_math.py" \
     "$@" > "$out/pytest.log" 2>&1; then echo 0; else echo $?; fi > "$out/pytest.rc") &
  pids+=($!)
done
wait "${pids[@]}"
summary=()
status=0
for build in "${BUILDS[@]}"; do
  IFS='|' read -r name cc cxx <<<"$build"
  out=$WORK/build/$name
  echo "--- $name build, pytest (last lines of $out/pytest.log):"
  grep -m1 "^loaded:" "$out/pytest.log" || echo "the $name library's load check printed nothing"
  tail -n 25 "$out/pytest.log"
  rc=$(cat "$out/pytest.rc")
  result=$(grep -E "^=* ?[0-9]+ (passed|failed)" "$out/pytest.log" | tail -1 | sed 's/=//g; s/ in [0-9.]*s.*//; s/^ *//')
  [ "$rc" -eq 0 ] || status=1
  summary+=("$name: ${result:-no result (pytest exit $rc)}, simd math check passed")
done
[ "$status" -eq 0 ] || fail "tests failed under emulation: ${summary[*]}"
step "done"
joined=$(printf '%s; ' "${summary[@]}")
echo "aarch64 under qemu: ${joined%; } (marker: simd)"
