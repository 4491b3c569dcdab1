#!/usr/bin/env bash
# One binary across TensorFlow versions: builds the wheel once, then for each TensorFlow minor
# version installs that wheel next to tensorflow-cpu~=<version>.0rc0 in a fresh venv, checks that
# every TF_* symbol the native library imports is defined by that version's
# libtensorflow_framework.so.2, and runs the tests marked `tf_abi` there.
#
#   tests/cross_version.sh [version ...]          (default: 2.16 2.18 2.21 2.22)
#
# `~=2.22.0rc0` means ">= 2.22.0rc0, == 2.22.*": the newest 2.22 release, or its newest release
# candidate while no release is out (a pre-release in the specifier lets pip take one for that
# requirement alone, without --pre for every package).
#
# Environment:
#   PYTHON        builds the wheel (needs TensorFlow, pybind11, wheel and setuptools >= 77:
#                 the build uses the TensorFlow already installed, --no-build-isolation);
#                 its interpreter version is also the one of the test venvs. Default python3.
#   WHEEL         a wheel built already (CI's), to skip the build
#   CROSS_WORK    work directory (default: a temp dir, removed at exit)
#   TOO_OLD       also install this older TensorFlow (e.g. 2.15) and check that using
#                 tf_metal_ops fails with one clear message naming the supported minimum
#
# Cost, measured on 2 shared cores: ~1 min to create a venv and install one tensorflow-cpu,
# ~1-2 min for the default tests. CI (.ci/run) runs 2.16 (the oldest supported), 2.18 (what
# tensorflow-metal 1.2.0 needs) and 2.22 (the newest); 2.21 is the main run's own.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.16 2.18 2.21 2.22)
if [ -n "${CROSS_WORK:-}" ]; then
  WORK=$CROSS_WORK
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/tf_metal_ops_cross.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
start=$(date +%s)
step() { echo "=== [cross-version $(( $(date +%s) - start ))s] $*"; }
summary=()

if [ -z "${WHEEL:-}" ]; then
  step "building the wheel once (against $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))' 2>/dev/null || echo 'the installed TensorFlow'))"
  "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$ROOT"
  WHEEL=$(ls "$WORK"/dist/tf_metal_ops-*.whl)
fi
echo "wheel: $WHEEL"

# Prints the TF_* symbols that the library in $1 imports and the framework library in $2 lacks.
missing_symbols() {
  comm -23 \
    <(nm -D --undefined-only "$1" | awk '{print $NF}' | sed 's/@.*//' | grep '^TF_' | sort -u) \
    <(nm -D --defined-only "$2" | awk '{print $NF}' | sed 's/@.*//' | grep '^TF_' | sort -u)
}

OPENBLAS_REQUIREMENT=$(grep -o '"scipy-openblas32==[^;"]*' "$ROOT/pyproject.toml" | head -1 | tr -d '"')
[ -n "$OPENBLAS_REQUIREMENT" ] || { echo "cross_version.sh: no scipy-openblas32 pin in pyproject.toml" >&2; exit 1; }

make_venv() {  # make_venv DIR TF_VERSION
  "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  # The wheel goes in with --no-deps: its one Linux dependency besides NumPy, the OpenBLAS it
  # links (pyproject.toml's pin), is installed here.
  "$1/bin/python" -m pip install -q "tensorflow-cpu~=$2.0rc0" pytest pytest-xdist hypothesis "$OPENBLAS_REQUIREMENT"
}

for version in "${VERSIONS[@]}"; do
  t0=$(date +%s)
  venv="$WORK/venv-$version"
  step "TensorFlow $version: venv and install"
  make_venv "$venv" "$version"
  "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$WHEEL"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  library=$(ls "$site"/tf_metal_ops/_tf_metal_ops*.so)
  framework="$site/tensorflow/libtensorflow_framework.so.2"

  step "TensorFlow $version: the library's TF_* imports against $framework"
  missing=$(missing_symbols "$library" "$framework")
  if [ -n "$missing" ]; then
    echo "TensorFlow $version lacks symbols the library imports: $missing" >&2
    exit 1
  fi
  echo "all $(nm -D --undefined-only "$library" | awk '{print $NF}' | grep -c '^TF_') TF_* imports are defined"

  step "TensorFlow $version: the tests marked tf_abi"
  # From the work dir, so `import tf_metal_ops` finds the installed wheel, not the checkout;
  # tests/library_copy.py checks that it does before running the tests.
  # -n 0: one process (pyproject.toml's addopts ask for two), beside CI's sanitizer step.
  # One pytest cache for every version, outside the checkout: what the tests build there (the
  # MSL emulator library, metal_kernel's compiled kernels) does not depend on TensorFlow, and
  # its keys name the compiler and flags, so the versions after the first reuse it.
  (cd "$WORK" && TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/python" "$ROOT/tests/library_copy.py" \
     pytest "$site" -o cache_dir="$WORK/pytest_cache" -q -n 0 -m tf_abi "$ROOT/tests")
  summary+=("TensorFlow $version: ok in $(( $(date +%s) - t0 ))s")
  rm -rf "$venv"  # ~1.5 GB each
done

if [ -n "${TOO_OLD:-}" ]; then
  t0=$(date +%s)
  venv="$WORK/venv-$TOO_OLD"
  step "TensorFlow $TOO_OLD (unsupported): one clear message on first use"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "tensorflow-cpu==$TOO_OLD.*"
  "$venv/bin/python" -m pip install -q --no-deps "$WHEEL"
  # `import tf_metal_ops` itself succeeds on purpose (so `python -m tf_metal_ops info` can
  # explain the problem); the first name that needs the native library raises the message.
  if message=$(cd "$WORK" && "$venv/bin/python" -c "import tf_metal_ops; tf_metal_ops.custom_loss" 2>&1); then
    echo "tf_metal_ops.custom_loss next to TensorFlow $TOO_OLD worked; it must refuse" >&2
    exit 1
  fi
  echo "$message" | tail -1
  echo "$message" | tail -1 | grep -q "2.16" || { echo "the message does not name the supported minimum" >&2; exit 1; }
  summary+=("TensorFlow $TOO_OLD: refused at import in $(( $(date +%s) - t0 ))s")
  rm -rf "$venv"
fi

step "done"
printf '%s\n' "${summary[@]}"
