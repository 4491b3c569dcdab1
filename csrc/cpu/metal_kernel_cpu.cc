// The CPU kernel of TfMetalOps>MetalKernel (csrc/metal_kernel.h): the generated source, compiled
// for the host once (csrc/kernel_compiler.h), runs in the MSL emulator over the op's grid.
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/kernel_compiler.h"
#include "csrc/metal_kernel.h"
#include "csrc/problem.h"
#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace {

// What one GPU thread costs in ParallelFor's unit (elements touched): a guess for a small
// body, so that a worker gets at least about a thousand GPU threads.
constexpr int64_t kCostPerGpuThread = 64;

struct Attrs {
  std::string source;
  std::string kernel_name;
  std::vector<int64_t> threadgroup, output_ranks, shape_params;
  std::vector<TF_DataType> output_types;
  float init_value = 0;
  bool has_init_value = false;
  bool lockstep = true;
};

Error ReadString(TF_OpKernelConstruction* ctx, const char* name, std::string* out) {
  StatusPtr status = NewStatus();
  int32_t list_size = 0, total_size = 0;
  TF_OpKernelConstruction_GetAttrSize(ctx, name, &list_size, &total_size, status.get());
  if (Error e = FromStatus(status.get(), name); !e.ok()) return e;
  out->resize(static_cast<size_t>(total_size));
  TF_OpKernelConstruction_GetAttrString(ctx, name, out->data(), out->size(), status.get());
  return FromStatus(status.get(), name);
}

Error ReadInts(TF_OpKernelConstruction* ctx, const char* name, std::vector<int64_t>* out) {
  StatusPtr status = NewStatus();
  int32_t list_size = 0, total_size = 0;
  TF_OpKernelConstruction_GetAttrSize(ctx, name, &list_size, &total_size, status.get());
  if (Error e = FromStatus(status.get(), name); !e.ok()) return e;
  out->resize(static_cast<size_t>(list_size));
  TF_OpKernelConstruction_GetAttrInt64List(ctx, name, out->data(), list_size, status.get());
  return FromStatus(status.get(), name);
}

Error ReadAttrs(TF_OpKernelConstruction* ctx, Attrs* a) {
  for (auto [name, out] : {std::pair{"source", &a->source},
                           std::pair{"kernel_name", &a->kernel_name}}) {
    if (Error e = ReadString(ctx, name, out); !e.ok()) return e;
  }
  for (auto [name, out] : {std::pair{"threadgroup", &a->threadgroup},
                           std::pair{"output_ranks", &a->output_ranks},
                           std::pair{"shape_params", &a->shape_params}}) {
    if (Error e = ReadInts(ctx, name, out); !e.ok()) return e;
  }
  StatusPtr status = NewStatus();
  int32_t count = 0, total = 0;
  TF_OpKernelConstruction_GetAttrSize(ctx, "Tout", &count, &total, status.get());
  if (Error e = FromStatus(status.get(), "Tout"); !e.ok()) return e;
  a->output_types.resize(static_cast<size_t>(count));
  TF_OpKernelConstruction_GetAttrTypeList(ctx, "Tout", a->output_types.data(), count,
                                          status.get());
  if (Error e = FromStatus(status.get(), "Tout"); !e.ok()) return e;
  TF_OpKernelConstruction_GetAttrFloat(ctx, "init_value", &a->init_value, status.get());
  if (Error e = FromStatus(status.get(), "init_value"); !e.ok()) return e;
  TF_Bool has = 0;
  TF_OpKernelConstruction_GetAttrBool(ctx, "has_init_value", &has, status.get());
  if (Error e = FromStatus(status.get(), "has_init_value"); !e.ok()) return e;
  a->has_init_value = has != 0;
  TF_OpKernelConstruction_GetAttrBool(ctx, "lockstep", &has, status.get());
  if (Error e = FromStatus(status.get(), "lockstep"); !e.ok()) return e;
  a->lockstep = has != 0;
  // The Python wrapper checks this where the user passes it; a raw op call is checked here.
  const std::vector<int64_t>& tg = a->threadgroup;
  const auto in_range = [](int64_t d) { return d >= 1 && d <= 1024; };
  if (tg.size() != 3 || !in_range(tg[0]) || !in_range(tg[1]) || !in_range(tg[2]) ||
      tg[0] * tg[1] * tg[2] > 1024) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": threadgroup needs 3 values >= 1, at most 1024 threads in "
                                  "all, got " + ShapeString(tg));
  }
  if (a->output_ranks.size() != a->output_types.size()) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": output_ranks and Tout differ in length");
  }
  return Error::Ok();
}

template <typename T>
void Fill(void* data, int64_t count, T value) {
  T* p = static_cast<T*>(data);
  for (int64_t i = 0; i < count; ++i) p[i] = value;
}

// Fills an output with init_value converted to its dtype (16-bit floats by their bit pattern).
void FillOutput(TF_Tensor* out, float value) {
  const int64_t n = TF_TensorElementCount(out);
  void* data = TF_TensorData(out);
  switch (TF_TensorType(out)) {
    case TF_FLOAT: return Fill<float>(data, n, value);
    case TF_INT32: return Fill<int32_t>(data, n, static_cast<int32_t>(value));
    case TF_INT64: return Fill<int64_t>(data, n, static_cast<int64_t>(value));
    case TF_UINT32: return Fill<uint32_t>(data, n, static_cast<uint32_t>(value));
    case TF_UINT8: return Fill<uint8_t>(data, n, static_cast<uint8_t>(value));
    case TF_BOOL: return Fill<bool>(data, n, value != 0);
    case TF_BFLOAT16: {
      BFloat16 bits;
      Store(value, &bits);
      return Fill<BFloat16>(data, n, bits);
    }
    case TF_HALF: {
      Half bits;
      Store(value, &bits);
      return Fill<Half>(data, n, bits);
    }
    default: return;
  }
}

// One input's shape / strides / ndim buffers, alive for the launch.
struct ShapeBuffers {
  std::vector<int32_t> shape;
  std::vector<int64_t> strides;
  int32_t ndim = 0;
};

Error Run(const Attrs& a, TF_OpKernelContext* ctx) {
  const int num_inputs = TF_NumInputs(ctx) - 2;
  TensorPtr shapes_tensor, grid_tensor;
  if (Error e = GetInput(ctx, num_inputs, &shapes_tensor); !e.ok()) return e;
  if (Error e = GetInput(ctx, num_inputs + 1, &grid_tensor); !e.ok()) return e;
  if (TF_TensorElementCount(grid_tensor.get()) != 3 ||
      TF_TensorType(grid_tensor.get()) != TF_INT64) {
    return Error::InvalidArgument("metal_kernel '" + a.kernel_name +
                                  "': grid must hold 3 int64 values, got shape " +
                                  ShapeString(Dims(grid_tensor.get())));
  }
  const auto* grid_values = static_cast<const int64_t*>(TF_TensorData(grid_tensor.get()));
  for (int d = 0; d < 3; ++d) {
    if (grid_values[d] < 1 || grid_values[d] > 0xFFFFFFFFll) {
      return Error::InvalidArgument("metal_kernel '" + a.kernel_name + "': grid." + "xyz"[d] +
                                    " must be in [1, 4294967295], got " +
                                    std::to_string(grid_values[d]));
    }
  }
  int64_t total_rank = 0;
  for (int64_t r : a.output_ranks) total_rank += r;
  if (TF_TensorElementCount(shapes_tensor.get()) != total_rank ||
      TF_TensorType(shapes_tensor.get()) != TF_INT64) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) + ": output_shapes holds " +
                                  std::to_string(TF_TensorElementCount(shapes_tensor.get())) +
                                  " dims, the output ranks add up to " +
                                  std::to_string(total_rank));
  }
  if (static_cast<int>(a.shape_params.size()) != num_inputs) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": shape_params needs one value per input");
  }
  KernelRunFunction run = nullptr;
  if (std::string e = LoadKernel(a.source, &run); !e.empty()) {
    return Error::InvalidArgument("metal_kernel '" + a.kernel_name + "': " + e);
  }

  // Buffers in [[buffer(i)]] order: each input and its shape parameters, then the outputs.
  std::vector<TensorPtr> keep;
  std::vector<std::unique_ptr<ShapeBuffers>> shape_buffers;
  std::vector<void*> buffers;
  static char empty_buffer[16];  // a valid address for empty tensors, never read
  auto address = [](TF_Tensor* t) -> void* {
    return TF_TensorByteSize(t) > 0 ? TF_TensorData(t) : empty_buffer;
  };
  for (int i = 0; i < num_inputs; ++i) {
    TensorPtr input;
    if (Error e = GetInput(ctx, i, &input); !e.ok()) return e;
    buffers.push_back(address(input.get()));
    const std::vector<int64_t> dims = Dims(input.get());
    if (!dims.empty() && a.shape_params[i] != 0) {
      auto params = std::make_unique<ShapeBuffers>();
      params->ndim = static_cast<int32_t>(dims.size());
      params->strides.resize(dims.size());
      int64_t stride = 1;
      for (size_t d = dims.size(); d-- > 0;) {
        params->strides[d] = stride;  // row-contiguous: TensorFlow's layout
        stride *= dims[d];
      }
      params->shape.assign(dims.begin(), dims.end());
      if (a.shape_params[i] & kShapeParamShape) buffers.push_back(params->shape.data());
      if (a.shape_params[i] & kShapeParamStrides) buffers.push_back(params->strides.data());
      if (a.shape_params[i] & kShapeParamNdim) buffers.push_back(&params->ndim);
      shape_buffers.push_back(std::move(params));
    }
    keep.push_back(std::move(input));
  }
  const auto* all_dims = static_cast<const int64_t*>(TF_TensorData(shapes_tensor.get()));
  int64_t offset = 0;
  for (size_t o = 0; o < a.output_types.size(); ++o) {
    std::vector<int64_t> dims(all_dims + offset, all_dims + offset + a.output_ranks[o]);
    offset += a.output_ranks[o];
    int64_t count = 1;
    for (int64_t d : dims) {
      const int64_t limit = std::numeric_limits<int64_t>::max() /
                            static_cast<int64_t>(TF_DataTypeSize(a.output_types[o]));
      if (d < 0 || (d > 0 && count > limit / d)) {
        return Error::InvalidArgument("metal_kernel '" + a.kernel_name + "': output " +
                                      std::to_string(o) + " has the shape " + ShapeString(dims) +
                                      " (a negative dimension, or too many bytes)");
      }
      count *= d;
    }
    StatusPtr status = NewStatus();
    TensorPtr out(TF_AllocateOutput(ctx, static_cast<int>(o), a.output_types[o], dims.data(),
                                    static_cast<int>(dims.size()),
                                    static_cast<size_t>(count) * TF_DataTypeSize(a.output_types[o]),
                                    status.get()));
    if (Error e = FromStatus(status.get(), "allocating an output"); !e.ok()) return e;
    if (a.has_init_value) FillOutput(out.get(), a.init_value);
    buffers.push_back(address(out.get()));
    keep.push_back(std::move(out));
  }
  uint32_t grid[3], threadgroup[3];
  for (int d = 0; d < 3; ++d) {
    grid[d] = static_cast<uint32_t>(grid_values[d]);
    // A threadgroup larger than the grid is cut to it (MLX does the same before dispatching).
    threadgroup[d] = static_cast<uint32_t>(std::min(a.threadgroup[d], grid_values[d]));
  }
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
    return Error::InvalidArgument("metal_kernel '" + a.kernel_name + "': " + first_error);
  }
  return Error::Ok();
}

void* Create(TF_OpKernelConstruction* ctx) {
  auto attrs = std::make_unique<Attrs>();
  if (Error e = ReadAttrs(ctx, attrs.get()); !e.ok()) {
    FailConstruction(ctx, e);
    return nullptr;
  }
  return attrs.release();
}

void Compute(void* kernel, TF_OpKernelContext* ctx) {
  if (Error e = Run(*static_cast<const Attrs*>(kernel), ctx); !e.ok()) FailKernel(ctx, e);
}

void Delete(void* kernel) { delete static_cast<Attrs*>(kernel); }

void RegisterKernel() {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder =
      TF_NewKernelBuilder(kMetalKernelOpName, "CPU", &Create, &Compute, &Delete);
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
