# Sourced by run_on_gpu.sh and run_user_kernels.sh: finds NVRTC and builds the driver.
#
#   tfmo_build WORK   # -> WORK/tfmo_cuda_main and WORK/libtfmo_cuda.so; returns 1 on failure
#
# Uses $repo, $here, $cuda_home and note() of the sourcing script. NVRTC: $TFMO_NVRTC_LIBRARY if
# set, else the toolkit's, else the wheel's (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib on
# python3's sys.path); exported as TFMO_NVRTC_LIBRARY, its directory on LD_LIBRARY_PATH.
tfmo_build() {
  local work=$1 nvrtc=${TFMO_NVRTC_LIBRARY:-}
  if [ -z "$nvrtc" ]; then
    nvrtc=$(ls "$cuda_home"/lib64/libnvrtc.so.[0-9]* 2>/dev/null | grep -v builtins | head -1)
  fi
  if [ -z "$nvrtc" ]; then
    nvrtc=$(python3 -c 'import glob, os, sys
hits = [h for p in sys.path for h in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so.*"))) if "builtins" not in h]
print(hits[0] if hits else "")')
  fi
  if [ -z "$nvrtc" ]; then
    note "FAIL: no NVRTC library found"
    return 1
  fi
  export TFMO_NVRTC_LIBRARY="$nvrtc"
  export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  note "NVRTC: $nvrtc"

  note "build"
  local sources=("$here/cuda_driver.cc" "$repo/csrc/metal/launch_plan.cc")
  local flags=(-std=c++17 -O2 -Wall -Wextra -Werror -I"$repo" -I"$cuda_home/include")
  "${CXX:-g++}" "${flags[@]}" "${sources[@]}" "$here/cuda_driver_main.cc" -ldl -o "$work/tfmo_cuda_main" 2>&1 | tee -a "$log" &&
    "${CXX:-g++}" "${flags[@]}" -fPIC -shared "${sources[@]}" -ldl -o "$work/libtfmo_cuda.so" 2>&1 | tee -a "$log"
  if [ ! -x "$work/tfmo_cuda_main" ] || [ ! -f "$work/libtfmo_cuda.so" ]; then
    note "FAIL: build"
    return 1
  fi
}
