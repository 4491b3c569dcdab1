// The CPU kernel of TfMetalOps>MetalKernel (csrc/metal_kernel.h): the generated source, compiled
// for the host once (csrc/kernel_compiler.h), runs in the MSL emulator over the op's grid.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/cpu/parallel_for.h"
#include "csrc/kernel_compiler.h"
#include "csrc/metal_kernel.h"
#include "csrc/metal_kernel_args.h"
#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace {

// What one GPU thread costs in ParallelFor's unit (elements touched): a guess for a small
// body, so that a worker gets at least about a thousand GPU threads.
constexpr int64_t kCostPerGpuThread = 64;

// Fills an output with init_value's bytes (metal_kernel_args.h converts it to the dtype).
void FillOutput(TF_Tensor* out, const std::vector<uint8_t>& element) {
  auto* data = static_cast<uint8_t*>(TF_TensorData(out));
  const size_t bytes = TF_TensorByteSize(out);
  if (bytes < element.size()) return;
  std::memcpy(data, element.data(), element.size());
  // Doubling copies: log2(elements) memcpy calls, each from the part already filled.
  for (size_t filled = element.size(); filled < bytes;) {
    const size_t chunk = std::min(filled, bytes - filled);
    std::memcpy(data + filled, data, chunk);
    filled += chunk;
  }
}

Error Run(const MetalKernelAttrs& a, TF_OpKernelContext* ctx) {
  MetalKernelLaunch launch;
  if (Error e = PrepareMetalKernelLaunch(a, ctx, &launch); !e.ok()) return e;
  KernelRunFunction run = nullptr;
  if (std::string e = LoadKernel(a.source, &run); !e.empty()) {
    return Error::InvalidArgument(MetalKernelContext(a) + ": " + e);
  }
  if (a.has_init_value) {
    for (size_t o = 0; o < launch.outputs.size(); ++o) {
      std::vector<uint8_t> element;
      if (Error e = InitValueBytes(a.output_types[o], a.init_value, &element); !e.ok()) return e;
      FillOutput(launch.outputs[o].get(), element);
    }
  }
  if (!launch.has_work) return Error::Ok();

  // Host addresses in [[buffer(i)]] order (metal_kernel_args.h's bindings).
  static char empty_buffer[16];  // a valid address for empty tensors, never read
  auto address = [](TF_Tensor* t) -> void* {
    return TF_TensorByteSize(t) > 0 ? TF_TensorData(t) : empty_buffer;
  };
  std::vector<void*> buffers;
  for (const Binding& binding : launch.bindings) {
    switch (binding.kind) {
      case BindingKind::kInput:
        buffers.push_back(address(launch.inputs[binding.index].get()));
        break;
      case BindingKind::kOutput:
        buffers.push_back(address(launch.outputs[binding.index].get()));
        break;
      default:
        buffers.push_back(const_cast<void*>(InlineBytesOf(binding, launch.shape_params).data));
    }
  }
  const uint32_t* grid = launch.grid;
  const uint32_t* threadgroup = launch.threadgroup;
  // Threadgroups run concurrently, as on a GPU: ranges of them on the package's thread pool.
  int64_t groups = 1, threads_per_group = 1;
  for (int d = 0; d < 3; ++d) {
    groups *= (grid[d] + threadgroup[d] - 1) / threadgroup[d];
    threads_per_group *= threadgroup[d];
  }
  std::mutex mu;
  std::string first_error;
  ParallelFor(groups, threads_per_group * kCostPerGpuThread, [&](int64_t begin, int64_t end) {
    char error[1024] = {0};
    if (run(a.kernel_name.c_str(), grid, threadgroup, kEmulatedSimdWidth, a.lockstep ? 1 : 0,
            static_cast<uint64_t>(begin), static_cast<uint64_t>(end), buffers.data(),
            buffers.size(), error, sizeof(error)) != 0) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.empty()) first_error = error;
    }
  });
  if (!first_error.empty()) {
    return Error::InvalidArgument(MetalKernelContext(a) + ": " + first_error);
  }
  return Error::Ok();
}

void Compute(void* kernel, TF_OpKernelContext* ctx) {
  if (Error e = Run(*static_cast<const MetalKernelAttrs*>(kernel), ctx); !e.ok()) {
    FailKernel(ctx, e);
  }
}

void RegisterKernel() {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder =
      TF_NewKernelBuilder(kMetalKernelOpName, "CPU", &CreateMetalKernel, &Compute,
                          &DeleteMetalKernel);
  TF_RegisterKernelBuilder((std::string(kMetalKernelOpName) + "_CPU").c_str(), builder,
                           status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    std::fprintf(stderr, "tf_metal_ops: registering the CPU kernel of %s failed: %s\n",
                 kMetalKernelOpName, TF_Message(status.get()));
  }
}

const bool metal_kernel_registered = (RegisterKernel(), true);

}  // namespace
}  // namespace tf_metal_ops
