// The Metal kernels on an NVIDIA GPU: kernels/custom_loss.metal compiled unchanged by NVRTC
// through the CUDA stand-in for <metal_stdlib> (include/metal_stdlib), loaded with the CUDA driver
// API, and launched with exactly what csrc/metal/launch_plan.cc's gpu::PlanLaunch tells the macOS
// encoder: kernel name, grid, threadgroup size, threadgroup memory, the buffer at each index and
// the params bytes. Test-only (never shipped, never built by CI: it needs a GPU).
//
// The case and result structs are the Linux emulator's (tests/msl_host/custom_loss_driver.h), so
// the two drivers take the same cases; here every pointer is a device pointer and the executor
// fields are not used. libcuda and libnvrtc are opened at run time (dlopen): the program builds
// with any C++17 compiler and cuda.h, and TFMO_NVRTC_LIBRARY may name the NVRTC library.
#ifndef TF_METAL_OPS_TESTS_MSL_CUDA_CUDA_DRIVER_H_
#define TF_METAL_OPS_TESTS_MSL_CUDA_CUDA_DRIVER_H_

#include <cstdint>

#include "tests/msl_host/custom_loss_driver.h"

extern "C" {

// NVRTC: kernels/custom_loss.metal (under repo_root) -> sm_<arch> cubin at cubin_path. Needs no
// GPU. Writes the compile log (warnings too) to `log`. Returns 1, or 0 with the reason in `log`.
int tfmo_cuda_compile(const char* repo_root, int32_t arch, const char* cubin_path, char* log,
                      uint32_t log_size);

// NVRTC: one generated kernel of tf_metal_ops.metal_kernel (its MSL source as the CPU path
// compiles it, with TFMO_GENERATED_KERNEL appended: tests/msl_cuda/user_kernels.py) -> cubin.
// Same contract as tfmo_cuda_compile.
int tfmo_cuda_compile_generated(const char* repo_root, const char* source, int32_t arch,
                                const char* cubin_path, char* log, uint32_t log_size);

// Loads the cubin into the calling thread's current context (the primary context of device 0 if
// there is none, as PyTorch's) and asks every entry point for its host_name. Returns the number
// of kernels, or -1 with the reason in `error`.
int tfmo_cuda_load(const char* cubin_path, char* error, uint32_t error_size);

// The i-th loaded kernel: its host_name, registers per thread, the most threads per block it can
// be launched with (CUDA's maxTotalThreadsPerThreadgroup) and its local (spill) bytes per thread.
int tfmo_cuda_kernel_info(int32_t i, char* name, uint32_t name_size, int32_t* registers,
                          int32_t* max_threads_per_block, int32_t* local_bytes);

// One CustomLoss launch, as the encoder makes it, on `stream` (a CUstream; null: the legacy
// default stream). c->max_total_threads_per_threadgroup == 0 takes the kernel's own limit.
// init_error_record: 1 = reset c->error_record (a device pointer, 32 bytes) first, as the encoder
// initializes its shared-storage record; 0 leaves it (repeated timing launches). Asynchronous:
// launch errors are reported, execution errors surface at the next synchronization.
// Returns 1, or 0 with the reason in r->error.
int tfmo_cuda_run(const TfmoEmuCase* c, TfmoEmuResult* r, void* stream, int32_t init_error_record);

// One launch of a loaded generated kernel as Metal's dispatchThreads makes it:
// threads_per_grid[3] threads in threadgroups of threads_per_threadgroup[3] (the edge ones cut
// at the grid), buffers[i] (device pointers) at [[buffer(i)]]. Asynchronous, on `stream`.
// Returns 1, or 0 with the reason in `error`.
int tfmo_cuda_run_generated(const char* name, const uint32_t* threads_per_grid,
                            const uint32_t* threads_per_threadgroup, void* const* buffers,
                            uint32_t num_buffers, void* stream, char* error, uint32_t error_size);

}  // extern "C"

#endif  // TF_METAL_OPS_TESTS_MSL_CUDA_CUDA_DRIVER_H_
