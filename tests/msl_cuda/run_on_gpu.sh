#!/usr/bin/env bash
# The Metal kernels on an NVIDIA GPU, all of it in one go: build the driver, compile
# kernels/custom_loss.metal unchanged with NVRTC, run the correctness matrix against the float64
# reference, time a training step against PyTorch, Liger-Kernel and the copy floor, and run the
# matrix again under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).
#
#   tests/msl_cuda/run_on_gpu.sh [RESULTS_DIR]     (default: a fresh temporary directory)
#
# Needs: an NVIDIA GPU of compute capability 9.0 (ARCH=NN for another), its driver (libcuda),
# cuda.h and NVRTC (CUDA_HOME, default /usr/local/cuda; or the nvidia-cuda-nvrtc wheel beside
# PyTorch), g++, compute-sanitizer, python3 with numpy, pytest, torch and triton; liger-kernel is
# optional (its rows say so when it is missing). Writes RESULTS_DIR/RESULTS.md (the summary) and
# the logs beside it. Exit status: 0 when every step passed.
#
# A probe between full runs: QUICK=1 times three shapes, ours reduced and old against Liger
# (gpu_bench.py's QUICK), and skips the sanitizers, ncu and the summary; CUBIN=FILE takes a cubin
# compiled elsewhere by `tfmo_cuda_main compile` (the same NVRTC version) instead of compiling.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-$(mktemp -d)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
arch=${ARCH:-90}
status=0
log="$work/run.log"
: >"$log"
note() { echo "== $*" | tee -a "$log"; }

note "environment"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$cuda_home/bin/nvcc" --version | tail -2
  "$(command -v compute-sanitizer || echo "$cuda_home/bin/compute-sanitizer")" --version | head -2
  python3 -c 'import sys, numpy, torch, triton; print("python", sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__, "triton", triton.__version__)'
} >"$out/env.txt" 2>&1
cat "$out/env.txt" | tee -a "$log"

. "$here/build.sh"
tfmo_build "$work" || exit 1
cubin="$work/custom_loss.cubin"
start=$(date +%s%N)
if [ -n "${CUBIN:-}" ]; then
  cp "$CUBIN" "$cubin" && echo "cubin from $CUBIN" >"$out/nvrtc_log.txt"
elif ! "$work/tfmo_cuda_main" compile "$repo" "$cubin" "$arch" >"$out/nvrtc_log.txt" 2>&1; then
  note "FAIL: NVRTC"
  tail -30 "$out/nvrtc_log.txt" | tee -a "$log"
  exit 1
fi
note "NVRTC compiled kernels/custom_loss.metal in $((($(date +%s%N) - start) / 1000000)) ms; warnings: $(grep -c 'warning' "$out/nvrtc_log.txt")" |
  tee -a "$out/nvrtc_log.txt"
"$work/tfmo_cuda_main" info "$cubin" >"$out/kernels.txt" 2>&1 || status=1
tail -1 "$out/kernels.txt" | tee -a "$log"

note "correctness"
cases="$work/cases"
python3 "$here/gpu_cases.py" write "$cases" 2>&1 | tee -a "$log"
{
  echo "# plain run"
  "$work/tfmo_cuda_main" cases "$cubin" "$cases"/*/ 2>&1 | tail -20
  python3 "$here/gpu_cases.py" check "$cases" 2>&1
} >"$out/correctness.txt"
grep -q ', 0 failed' "$out/correctness.txt" || status=1
tail -2 "$out/correctness.txt" | tee -a "$log"

note "timing"
timeout "${BENCH_TIMEOUT:-600}" python3 "$here/gpu_bench.py" "$work/libtfmo_cuda.so" "$cubin" "$out/bench.json" 2>&1 |
  tail -25 | tee -a "$log" || status=1
[ -s "$out/bench.json" ] || status=1
if [ "${QUICK:-0}" = 1 ]; then
  note "quick: no sanitizers, ncu or summary; exit $status"
  exit $status
fi

note "compute-sanitizer"
sanitizer=$(command -v compute-sanitizer || ls "$cuda_home"/bin/compute-sanitizer \
  "$cuda_home"/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
: >"$out/sanitizers.txt"
for tool in memcheck racecheck synccheck initcheck; do
  rm -f "$cases"/*/output.bin "$cases"/*/row_stats_out.bin "$cases"/*/scaled_gradient.bin
  start=$(date +%s)
  timeout "${SANITIZER_TIMEOUT:-120}" "${sanitizer:-compute-sanitizer}" --tool "$tool" --error-exitcode 99 \
    "$work/tfmo_cuda_main" cases "$cubin" "$cases"/*/ >"$work/$tool.txt" 2>&1
  rc=$?
  check=$(python3 "$here/gpu_cases.py" check "$cases" 2>&1 | tail -1)
  {
    echo "## $tool: exit $rc, $(($(date +%s) - start)) s"
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|cases run' "$work/$tool.txt"
    grep -m 20 -E '^=+ +(Invalid|Race|Barrier|Uninitialized|Error|Warning)' "$work/$tool.txt"
    [ "$rc" = 0 ] || tail -5 "$work/$tool.txt"
    echo "outputs under $tool: $check"
  } >>"$out/sanitizers.txt"
  [ "$rc" = 0 ] || status=1
  tail -4 "$out/sanitizers.txt" | tee -a "$log"
done

note "ncu"
# Where the time goes in the two kernels at two sizes: throughput against the chip's peaks,
# occupancy. The module's name queries (one per kernel) come first: skipped.
ncu_bin=$(command -v ncu || ls "$cuda_home"/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
queries=$(tail -1 "$out/kernels.txt" | cut -d' ' -f1)
: >"$out/profile.txt"
if [ -n "$ncu_bin" ]; then
  for shape in "65536 1000 0" "65536 1000 2" "8192 128256 0" "8192 128256 2"; do
    read -r pn pc pd <<<"$shape"
    echo "## $pn x $pc, $([ "$pd" = 0 ] && echo float32 || echo bfloat16)" >>"$out/profile.txt"
    timeout 150 "$ncu_bin" --clock-control none --section SpeedOfLight --section Occupancy \
      --section LaunchStats --launch-skip "$queries" --launch-count 2 \
      "$work/tfmo_cuda_main" synth "$cubin" "$pn" "$pc" "$pd" >"$work/ncu.txt" 2>&1 || status=1
    grep -E 'custom_loss_|Duration|Throughput|Occupancy|Registers Per|Block Size|ERR' "$work/ncu.txt" |
      sed -E 's/void msl_cuda::entry<&tf_metal_ops::kernels::(custom_loss_[a-z_]+)<([^>]*)>>\(msl_cuda::LaunchArgs\)/\1<\2>/' |
      cut -c1-160 >>"$out/profile.txt"
  done
else
  echo "ncu not found" >>"$out/profile.txt"
fi
tail -12 "$out/profile.txt" | tee -a "$log"

note "summary"
python3 "$here/summarize.py" "$out" >"$out/RESULTS.md" 2>>"$log" || status=1
cat "$out/RESULTS.md"
note "exit $status"
exit $status
