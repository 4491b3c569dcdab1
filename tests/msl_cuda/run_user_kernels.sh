#!/usr/bin/env bash
# tf_metal_ops.metal_kernel's generated sources on an NVIDIA GPU, checked against the CPU path:
# build the driver, then compile each case's source with NVRTC against the CUDA stand-in, launch
# it as dispatchThreads does and compare with the emulator's outputs (user_kernels.py run).
#
#   python tests/msl_cuda/user_kernels.py write CASES      # first, where TensorFlow runs
#   tests/msl_cuda/run_user_kernels.sh CASES [RESULTS_DIR]  # then, on the GPU machine
#
# Needs what run_on_gpu.sh needs, less torch and triton. SANITIZERS=1 runs the cases again under
# compute-sanitizer (memcheck, racecheck, synccheck). CUSTOM_LOSS=1 also runs run_on_gpu.sh's
# correctness matrix of kernels/custom_loss.metal (the stand-in and the driver are shared; its
# cubin from CUBIN=FILE if given, else compiled here). Exit status: 0 when every step passed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cases=$(cd "$1" && pwd)
out=${2:-$(mktemp -d)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
arch=${ARCH:-90}
status=0
log="$out/run.log"
: >"$log"
note() { echo "== $*" | tee -a "$log"; }

note "environment"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, numpy; print("python", sys.version.split()[0], "numpy", numpy.__version__)'
} 2>&1 | tee -a "$log"

. "$here/build.sh"
tfmo_build "$work" || exit 1

note "generated kernels"
python3 "$here/user_kernels.py" run "$cases" "$work/libtfmo_cuda.so" "$arch" 2>&1 |
  tee "$out/user_kernels.txt" | tee -a "$log" >/dev/null
[ "${PIPESTATUS[0]}" = 0 ] || status=1
tail -1 "$out/user_kernels.txt"
cp "$cases/results.json" "$out/user_kernels.json" 2>/dev/null

if [ "${SANITIZERS:-0}" = 1 ]; then
  sanitizer=$(command -v compute-sanitizer || ls "$cuda_home"/bin/compute-sanitizer \
    "$cuda_home"/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck synccheck; do
    start=$(date +%s)
    timeout "${SANITIZER_TIMEOUT:-150}" "${sanitizer:-compute-sanitizer}" --tool "$tool" \
      --error-exitcode 99 python3 "$here/user_kernels.py" run "$cases" "$work/libtfmo_cuda.so" \
      "$arch" >"$work/$tool.txt" 2>&1
    rc=$?
    {
      echo "## $tool: exit $rc, $(($(date +%s) - start)) s"
      grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|matched the emulator' "$work/$tool.txt"
      grep -m 10 -E '^=+ +(Invalid|Race|Barrier|Uninitialized|Error|Warning)' "$work/$tool.txt"
      [ "$rc" = 0 ] || tail -5 "$work/$tool.txt"
    } | tee -a "$out/sanitizers.txt" | tee -a "$log"
    [ "$rc" = 0 ] || status=1
  done
fi

if [ "${CUSTOM_LOSS:-0}" = 1 ]; then
  note "kernels/custom_loss.metal: correctness matrix"
  cubin="$work/custom_loss.cubin"
  if [ -n "${CUBIN:-}" ]; then
    cp "$CUBIN" "$cubin"
  elif ! "$work/tfmo_cuda_main" compile "$repo" "$cubin" "$arch" >"$out/nvrtc_log.txt" 2>&1; then
    note "FAIL: NVRTC"
    status=1
  fi
  python3 "$here/gpu_cases.py" write "$work/cases" >>"$log" 2>&1
  {
    "$work/tfmo_cuda_main" cases "$cubin" "$work/cases"/*/ 2>&1 | tail -3
    python3 "$here/gpu_cases.py" check "$work/cases" 2>&1
  } >"$out/custom_loss.txt"
  grep -q ', 0 failed' "$out/custom_loss.txt" || status=1
  tail -2 "$out/custom_loss.txt" | tee -a "$log"
fi
note "exit $status"
exit $status
