// See cuda_driver.h. What csrc/metal's encoder does on a Mac, with CUDA in place of Metal:
// pipeline by name -> CUfunction by host_name, setBuffer/setBytes -> LaunchArgs (one
// __grid_constant__ parameter), setThreadgroupMemoryLength -> dynamic shared memory,
// dispatchThreadgroups -> cuLaunchKernel with the plan's grid and threadgroup size.
#include "tests/msl_cuda/cuda_driver.h"
#include "tests/msl_host/custom_loss_case.h"

#include <cuda.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/metal/launch_plan.h"

namespace {

// ---- the parameter block, mirrored from msl_cuda::LaunchArgs (include/metal_stdlib) ----------
constexpr uint32_t kMaxBuffers = 12;  // >= TFMO_EMU_MAX_BINDINGS
constexpr uint32_t kInlineBytes = 64;
constexpr uint32_t kNameBytes = 128;
constexpr uint32_t kNoInline = 0xFFFFFFFFu;
struct LaunchArgs {
  void* buffers[kMaxBuffers];
  uint32_t num_buffers;
  uint32_t inline_index;
  uint32_t query_name;
  uint32_t reserved;
  alignas(16) unsigned char inline_bytes[kInlineBytes];
  uint32_t threads_per_grid[3];
};
static_assert(offsetof(LaunchArgs, num_buffers) == 96, "LaunchArgs layout");
static_assert(offsetof(LaunchArgs, inline_bytes) == 112, "LaunchArgs layout");
static_assert(offsetof(LaunchArgs, threads_per_grid) == 176, "LaunchArgs layout");
static_assert(sizeof(LaunchArgs) == 192, "LaunchArgs layout");
static_assert(kMaxBuffers <= TFMO_EMU_MAX_BINDINGS, "TfmoEmuResult reports every binding");
static_assert(sizeof(CustomLossParams) <= kInlineBytes, "params do not fit the inline bytes");

// ---- libcuda and libnvrtc, opened at run time ---------------------------------------------------
#define TFMO_STR2(x) #x
#define TFMO_STR(x) TFMO_STR2(x)  // after expansion: cuMemAlloc -> "cuMemAlloc_v2"
#define TFMO_CUDA_FUNCTIONS(X)                                                              \
  X(cuInit) X(cuGetErrorString) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuDeviceGet)       \
  X(cuDevicePrimaryCtxRetain) X(cuModuleLoadData) X(cuModuleGetFunction) X(cuFuncGetAttribute) \
  X(cuLaunchKernel) X(cuCtxSynchronize) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyDtoH)          \
  X(cuMemcpyHtoDAsync) X(cuMemsetD8) X(cuModuleGetFunctionCount) X(cuModuleEnumerateFunctions) \
  X(cuFuncGetName)

struct CudaApi {
#define TFMO_DECLARE(fn) decltype(&::fn) fn = nullptr;
  TFMO_CUDA_FUNCTIONS(TFMO_DECLARE)
#undef TFMO_DECLARE
  std::string error;
};

// NVRTC's C API (nvrtc.h), declared here so that only the library itself is needed.
typedef struct _nvrtcProgram* nvrtcProgram;
struct NvrtcApi {
  int (*nvrtcVersion)(int*, int*) = nullptr;
  int (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                            const char* const*) = nullptr;
  int (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*) = nullptr;
  int (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*) = nullptr;
  int (*nvrtcGetProgramLog)(nvrtcProgram, char*) = nullptr;
  int (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*) = nullptr;
  int (*nvrtcGetCUBIN)(nvrtcProgram, char*) = nullptr;
  int (*nvrtcDestroyProgram)(nvrtcProgram*) = nullptr;
  const char* (*nvrtcGetErrorString)(int) = nullptr;
  std::string error;
};

void* open_first(const std::vector<std::string>& names, std::string* tried) {
  for (const std::string& name : names) {
    if (name.empty()) continue;
    if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL)) return handle;
    *tried += " " + name + " (" + dlerror() + ")";
  }
  return nullptr;
}

const CudaApi& cuda() {
  static CudaApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    void* lib = open_first({"libcuda.so.1", "libcuda.so"}, &tried);
    if (lib == nullptr) {
      api.error = "cannot open the CUDA driver library:" + tried;
      return;
    }
#define TFMO_LOAD(fn)                                                        \
  api.fn = reinterpret_cast<decltype(&::fn)>(dlsym(lib, TFMO_STR(fn)));      \
  if (api.fn == nullptr && api.error.empty()) api.error = "libcuda lacks " TFMO_STR(fn);
    TFMO_CUDA_FUNCTIONS(TFMO_LOAD)
#undef TFMO_LOAD
  });
  return api;
}

const NvrtcApi& nvrtc() {
  static NvrtcApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    const char* env = std::getenv("TFMO_NVRTC_LIBRARY");
    void* lib = open_first({env == nullptr ? "" : env, "libnvrtc.so.13", "libnvrtc.so.12",
                            "libnvrtc.so"}, &tried);
    if (lib == nullptr) {
      api.error = "cannot open NVRTC (set TFMO_NVRTC_LIBRARY):" + tried;
      return;
    }
#define TFMO_LOAD(fn)                                                        \
  *reinterpret_cast<void**>(&api.fn) = dlsym(lib, #fn);                      \
  if (api.fn == nullptr && api.error.empty()) api.error = "libnvrtc lacks " #fn;
    TFMO_LOAD(nvrtcVersion) TFMO_LOAD(nvrtcCreateProgram) TFMO_LOAD(nvrtcCompileProgram)
    TFMO_LOAD(nvrtcGetProgramLogSize) TFMO_LOAD(nvrtcGetProgramLog) TFMO_LOAD(nvrtcGetCUBINSize)
    TFMO_LOAD(nvrtcGetCUBIN) TFMO_LOAD(nvrtcDestroyProgram) TFMO_LOAD(nvrtcGetErrorString)
#undef TFMO_LOAD
  });
  return api;
}

std::string cu_error(CUresult r, const char* what) {
  const char* text = nullptr;
  if (cuda().cuGetErrorString != nullptr) cuda().cuGetErrorString(r, &text);
  return std::string(what) + ": CUDA error " + std::to_string(static_cast<int>(r)) + " (" +
         (text == nullptr ? "?" : text) + ")";
}

void copy_text(char* dst, size_t size, const std::string& text) {
  if (dst != nullptr && size > 0) std::snprintf(dst, size, "%s", text.c_str());
}

bool read_text(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

// ---- the loaded module ------------------------------------------------------------------------
struct Kernel {
  std::string name;
  CUfunction function;
  uint32_t pointer_params;  // buffers + threadgroup scratch, as the kernel declares them
  int registers;
  int max_threads_per_block;
  int local_bytes;
};
std::vector<Kernel> g_kernels;

const Kernel* find_kernel(const std::string& name) {
  for (const Kernel& k : g_kernels) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

}  // namespace

namespace {

// NVRTC: `source` (named `program_name` in messages) with the stand-in on the include path ->
// sm_<arch> cubin at cubin_path; the log (warnings too) to `log`.
int compile_program(const std::string& root, const std::string& source, const char* program_name,
                    const std::vector<std::string>& extra_options, int32_t arch,
                    const char* cubin_path, char* log, uint32_t log_size) {
  const NvrtcApi& api = nvrtc();
  if (!api.error.empty()) {
    copy_text(log, log_size, api.error);
    return 0;
  }
  std::vector<std::string> options = {
      "-default-device",
      "-std=c++17",
      "--gpu-architecture=sm_" + std::to_string(arch),
      "--ptxas-options=-v",  // registers, spills and shared memory per kernel, in the log
      "-lineinfo",  // source lines in compute-sanitizer reports; no change to the code
      "-I" + root + "/tests/msl_cuda/include",
      // MSL's attributes ([[kernel]], [[buffer(i)]], [[thread_index_in_threadgroup]], ...) are
      // unknown here and ignored; one warning per use would bury the rest of the log.
      "--diag-suppress=1097",
  };
  options.insert(options.end(), extra_options.begin(), extra_options.end());
  std::vector<const char*> argv;
  for (const std::string& o : options) argv.push_back(o.c_str());
  nvrtcProgram program = nullptr;
  int rc = api.nvrtcCreateProgram(&program, source.c_str(), program_name, 0, nullptr, nullptr);
  if (rc != 0) {
    copy_text(log, log_size, std::string("nvrtcCreateProgram: ") + api.nvrtcGetErrorString(rc));
    return 0;
  }
  rc = api.nvrtcCompileProgram(program, static_cast<int>(argv.size()), argv.data());
  size_t log_bytes = 0;
  api.nvrtcGetProgramLogSize(program, &log_bytes);
  std::string text(log_bytes, '\0');
  if (log_bytes > 0) api.nvrtcGetProgramLog(program, &text[0]);
  if (!text.empty() && text.back() == '\0') text.pop_back();
  bool ok = rc == 0;
  if (ok) {
    size_t bytes = 0;
    api.nvrtcGetCUBINSize(program, &bytes);
    std::vector<char> cubin(bytes);
    api.nvrtcGetCUBIN(program, cubin.data());
    std::ofstream out(cubin_path, std::ios::binary);
    out.write(cubin.data(), static_cast<std::streamsize>(bytes));
    if (!out) {
      text += "\ncannot write " + std::string(cubin_path);
      ok = false;
    }
  } else {
    text = std::string("nvrtcCompileProgram: ") + api.nvrtcGetErrorString(rc) + "\n" + text;
  }
  api.nvrtcDestroyProgram(&program);
  copy_text(log, log_size, text);
  return ok ? 1 : 0;
}

}  // namespace

extern "C" int tfmo_cuda_compile(const char* repo_root, int32_t arch, const char* cubin_path,
                                 char* log, uint32_t log_size) {
  const std::string root = repo_root;
  std::string source;
  if (!read_text(root + "/kernels/custom_loss.metal", &source)) {
    copy_text(log, log_size, "cannot read " + root + "/kernels/custom_loss.metal");
    return 0;
  }
  // The source text is the file itself: the stand-in comes in through the include path only.
  // -D__METAL__ is the Metal compiler's own macro: custom_loss_params.h takes its Metal branch
  // (MSL's uint / long, no C++ standard headers, which NVRTC lacks), as on the Mac.
  return compile_program(root, source, "custom_loss.metal", {"-D__METAL__", "-I" + root + "/kernels"},
                         arch, cubin_path, log, log_size);
}

extern "C" int tfmo_cuda_compile_generated(const char* repo_root, const char* source,
                                           int32_t arch, const char* cubin_path, char* log,
                                           uint32_t log_size) {
  // TFMO_MSL_HOST: the source's emulator block (its registration names the attributes, which
  // TFMO_GENERATED_KERNEL repeats) rather than the Metal compiler's explicit instantiation.
  // That block's registration flag is never read here: warning 177 says so once per source.
  return compile_program(repo_root, source, "generated.metal",
                         {"-D__METAL__", "-DTFMO_MSL_GENERATED", "-DTFMO_MSL_HOST",
                          "--diag-suppress=177"},
                         arch,
                         cubin_path, log, log_size);
}

extern "C" int tfmo_cuda_load(const char* cubin_path, char* error, uint32_t error_size) {
  const CudaApi& api = cuda();
  if (!api.error.empty()) {
    copy_text(error, error_size, api.error);
    return -1;
  }
  auto fail = [&](const std::string& message) {
    copy_text(error, error_size, message);
    return -1;
  };
  std::string image;
  if (!read_text(cubin_path, &image)) return fail("cannot read " + std::string(cubin_path));
  CUresult r = api.cuInit(0);
  if (r != CUDA_SUCCESS) return fail(cu_error(r, "cuInit"));
  CUcontext context = nullptr;
  api.cuCtxGetCurrent(&context);
  if (context == nullptr) {
    CUdevice device;
    if ((r = api.cuDeviceGet(&device, 0)) != CUDA_SUCCESS) return fail(cu_error(r, "cuDeviceGet"));
    if ((r = api.cuDevicePrimaryCtxRetain(&context, device)) != CUDA_SUCCESS)
      return fail(cu_error(r, "cuDevicePrimaryCtxRetain"));
    if ((r = api.cuCtxSetCurrent(context)) != CUDA_SUCCESS)
      return fail(cu_error(r, "cuCtxSetCurrent"));
  }
  CUmodule module;
  if ((r = api.cuModuleLoadData(&module, image.data())) != CUDA_SUCCESS)
    return fail(cu_error(r, "cuModuleLoadData"));

  CUdeviceptr name_buffer;
  if ((r = api.cuMemAlloc(&name_buffer, kNameBytes)) != CUDA_SUCCESS)
    return fail(cu_error(r, "cuMemAlloc"));
  g_kernels.clear();
  unsigned count = 0;
  if ((r = api.cuModuleGetFunctionCount(&count, module)) != CUDA_SUCCESS)
    return fail(cu_error(r, "cuModuleGetFunctionCount"));
  std::vector<CUfunction> functions(count);
  if (count > 0 &&
      (r = api.cuModuleEnumerateFunctions(functions.data(), count, module)) != CUDA_SUCCESS)
    return fail(cu_error(r, "cuModuleEnumerateFunctions"));
  for (CUfunction f : functions) {
    const char* mangled = nullptr;
    api.cuFuncGetName(&mangled, f);
    const std::string symbol = mangled == nullptr ? "?" : mangled;
    // Cleared first: the entry writes only the name and the last byte, and all 128 come back.
    if ((r = api.cuMemsetD8(name_buffer, 0, kNameBytes)) != CUDA_SUCCESS)
      return fail(cu_error(r, "cuMemsetD8"));
    LaunchArgs args;
    std::memset(&args, 0, sizeof(args));
    args.buffers[0] = reinterpret_cast<void*>(name_buffer);
    args.query_name = 1;
    args.inline_index = kNoInline;
    void* params[] = {&args};
    if ((r = api.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr)) != CUDA_SUCCESS)
      return fail(cu_error(r, ("query " + symbol).c_str()));
    char name[kNameBytes];
    if ((r = api.cuMemcpyDtoH(name, name_buffer, kNameBytes)) != CUDA_SUCCESS)
      return fail(cu_error(r, "cuMemcpyDtoH"));
    Kernel k;
    k.pointer_params = static_cast<unsigned char>(name[kNameBytes - 1]);
    name[kNameBytes - 1] = '\0';
    k.name = name;
    k.function = f;
    api.cuFuncGetAttribute(&k.registers, CU_FUNC_ATTRIBUTE_NUM_REGS, f);
    api.cuFuncGetAttribute(&k.max_threads_per_block, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f);
    api.cuFuncGetAttribute(&k.local_bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f);
    if (find_kernel(k.name) != nullptr) return fail("two entry points are named " + k.name);
    g_kernels.push_back(k);
  }
  api.cuMemFree(name_buffer);
  return static_cast<int>(g_kernels.size());
}

extern "C" int tfmo_cuda_kernel_info(int32_t i, char* name, uint32_t name_size, int32_t* registers,
                                     int32_t* max_threads_per_block, int32_t* local_bytes) {
  if (i < 0 || static_cast<size_t>(i) >= g_kernels.size()) return 0;
  const Kernel& k = g_kernels[static_cast<size_t>(i)];
  copy_text(name, name_size, k.name);
  *registers = k.registers;
  *max_threads_per_block = k.max_threads_per_block;
  *local_bytes = k.local_bytes;
  return 1;
}

extern "C" int tfmo_cuda_run(const TfmoEmuCase* c, TfmoEmuResult* result, void* stream,
                             int32_t init_error_record) {
  namespace gpu = tf_metal_ops::gpu;
  using gpu::BufferRole;
  std::memset(result, 0, sizeof(*result));
  for (int32_t& role : result->binding_roles) role = -1;
  auto fail = [&](const std::string& message) {
    copy_text(result->error, sizeof(result->error), message);
    return 0;
  };
  const CudaApi& api = cuda();
  if (!api.error.empty()) return fail(api.error);

  const gpu::LaunchDesc desc = msl_host::LaunchDescOf(*c);

  // The encoder asks the pipeline for its limits; the pipeline exists before the plan (by name).
  const std::string name = gpu::KernelName(desc);
  if (name.empty()) return fail("plan: " + gpu::PlanLaunch(desc, {}).error);
  const Kernel* kernel = find_kernel(name);
  if (kernel == nullptr) return fail("no kernel named " + name + " in the module");
  gpu::PipelineLimits limits;
  limits.max_total_threads_per_threadgroup =
      c->max_total_threads_per_threadgroup != 0
          ? c->max_total_threads_per_threadgroup
          : static_cast<uint32_t>(kernel->max_threads_per_block);
  limits.thread_execution_width = c->thread_execution_width;
  if (limits.thread_execution_width != 32) return fail("a warp is 32 lanes: simd_width must be 32");
  const gpu::LaunchPlan plan = gpu::PlanLaunch(desc, limits);
  if (!plan.ok) return fail("plan: " + plan.error);
  if (plan.kernel_name != name) return fail("plan: KernelName() != plan.kernel_name");

  msl_host::ReportPlan(plan, result);

  // Bind by role at the plan's indices, as the encoder does.
  LaunchArgs args;
  std::memset(&args, 0, sizeof(args));
  args.inline_index = kNoInline;
  if (plan.bindings.size() > kMaxBuffers) return fail("plan: more bindings than LaunchArgs holds");
  std::vector<bool> bound(plan.bindings.size(), false);
  for (const gpu::BufferBinding& b : plan.bindings) {
    if (b.index >= plan.bindings.size() || bound[b.index])
      return fail("plan: binding indices are not 0..n-1");
    bound[b.index] = true;
    result->binding_roles[b.index] = static_cast<int32_t>(b.role);
    if (b.role == BufferRole::kParams) {
      if (!b.inline_bytes || b.length != sizeof(CustomLossParams))
        return fail("plan: params binding is not inline");
      std::memcpy(args.inline_bytes, &plan.params, sizeof(CustomLossParams));
      args.inline_index = b.index;
    }
    args.buffers[b.index] = msl_host::CaseBuffer(*c, b.role);
  }
  args.num_buffers = static_cast<uint32_t>(plan.bindings.size());
  // The kernel's own parameter list must be what the plan binds (+ the scratch, rowtg).
  const uint32_t expected = args.num_buffers + (plan.threadgroup_memory_length > 0 ? 1u : 0u);
  if (kernel->pointer_params != expected) {
    return fail("plan binds " + std::to_string(expected) + " buffers (with scratch) but " + name +
                " takes " + std::to_string(kernel->pointer_params));
  }
  if (c->plan_only) {
    result->ok = 1;
    return 1;
  }
  CUstream cu_stream = static_cast<CUstream>(stream);
  if (init_error_record && c->error_record != nullptr) {
    static CustomLossErrorRecord initial = [] {
      CustomLossErrorRecord record;
      InitCustomLossErrorRecord(&record);
      return record;
    }();
    CUresult r = api.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(c->error_record), &initial,
                                       sizeof(initial), cu_stream);
    if (r != CUDA_SUCCESS) return fail(cu_error(r, "error record"));
  }
  if (!plan.dispatch) {  // N == 0: the encoder encodes nothing
    result->ok = 1;
    return 1;
  }
  void* params[] = {&args};
  CUresult r = api.cuLaunchKernel(
      kernel->function, plan.threadgroups_per_grid[0], plan.threadgroups_per_grid[1],
      plan.threadgroups_per_grid[2], plan.threads_per_threadgroup[0],
      plan.threads_per_threadgroup[1], plan.threads_per_threadgroup[2],
      plan.threadgroup_memory_length, cu_stream, params, nullptr);
  if (r != CUDA_SUCCESS) return fail(cu_error(r, ("launch " + name).c_str()));
  result->dispatched = 1;
  result->ok = 1;
  return 1;
}

extern "C" int tfmo_cuda_run_generated(const char* name, const uint32_t* threads_per_grid,
                                       const uint32_t* threads_per_threadgroup,
                                       void* const* buffers, uint32_t num_buffers, void* stream,
                                       char* error, uint32_t error_size) {
  auto fail = [&](const std::string& message) {
    copy_text(error, error_size, message);
    return 0;
  };
  const CudaApi& api = cuda();
  if (!api.error.empty()) return fail(api.error);
  const Kernel* kernel = find_kernel(name);
  if (kernel == nullptr) return fail("no kernel named " + std::string(name) + " in the module");
  if (kernel->pointer_params != num_buffers) {
    return fail(std::string(name) + " takes " + std::to_string(kernel->pointer_params) +
                " buffers, " + std::to_string(num_buffers) + " given");
  }
  if (num_buffers > kMaxBuffers) return fail("more buffers than LaunchArgs holds");
  uint64_t threads = 1;
  uint32_t groups[3];
  for (int a = 0; a < 3; ++a) {
    if (threads_per_grid[a] == 0 || threads_per_threadgroup[a] == 0)
      return fail("grid and threadgroup sizes must be >= 1");
    threads *= threads_per_threadgroup[a];
    groups[a] = static_cast<uint32_t>((uint64_t{threads_per_grid[a]} + threads_per_threadgroup[a] -
                                       1) / threads_per_threadgroup[a]);
  }
  if (threads > static_cast<uint64_t>(kernel->max_threads_per_block)) {
    return fail("a threadgroup of " + std::to_string(threads) + " threads; " + name +
                " takes at most " + std::to_string(kernel->max_threads_per_block));
  }
  LaunchArgs args;
  std::memset(&args, 0, sizeof(args));
  args.inline_index = kNoInline;
  args.num_buffers = num_buffers;
  for (uint32_t i = 0; i < num_buffers; ++i) args.buffers[i] = buffers[i];
  for (int a = 0; a < 3; ++a) args.threads_per_grid[a] = threads_per_grid[a];
  void* params[] = {&args};
  CUresult r = api.cuLaunchKernel(kernel->function, groups[0], groups[1], groups[2],
                                  threads_per_threadgroup[0], threads_per_threadgroup[1],
                                  threads_per_threadgroup[2], 0, static_cast<CUstream>(stream),
                                  params, nullptr);
  if (r != CUDA_SUCCESS) return fail(cu_error(r, ("launch " + std::string(name)).c_str()));
  return 1;
}
