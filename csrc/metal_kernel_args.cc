// See metal_kernel_args.h.
#include "csrc/metal_kernel_args.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>

#include "csrc/cpu/float_types.h"
#include "csrc/metal_kernel.h"
#include "csrc/pending_errors.h"
#include "csrc/problem.h"

namespace tf_metal_ops {
namespace {

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

Error ReadBool(TF_OpKernelConstruction* ctx, const char* name, bool* out) {
  StatusPtr status = NewStatus();
  TF_Bool value = 0;
  TF_OpKernelConstruction_GetAttrBool(ctx, name, &value, status.get());
  *out = value != 0;
  return FromStatus(status.get(), name);
}

template <typename T>
void SetBytes(const T& value, std::vector<uint8_t>* bytes) {
  const auto* first = reinterpret_cast<const uint8_t*>(&value);
  bytes->assign(first, first + sizeof(T));
}

}  // namespace

std::string MetalKernelContext(const MetalKernelAttrs& attrs) {
  return "metal_kernel '" + attrs.kernel_name + "'";
}

Error CheckThreadgroup(const std::vector<int64_t>& tg) {
  const auto in_range = [](int64_t d) { return d >= 1 && d <= 1024; };
  // Each value is checked before the product, so the product cannot overflow.
  if (tg.size() != 3 || !in_range(tg[0]) || !in_range(tg[1]) || !in_range(tg[2]) ||
      tg[0] * tg[1] * tg[2] > 1024) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": threadgroup needs 3 values >= 1, at most 1024 threads in "
                                  "all, got " + ShapeString(tg));
  }
  return Error::Ok();
}

Error ReadMetalKernelAttrs(TF_OpKernelConstruction* ctx, MetalKernelAttrs* a) {
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
  if (Error e = ReadBool(ctx, "has_init_value", &a->has_init_value); !e.ok()) return e;
  if (Error e = ReadBool(ctx, "lockstep", &a->lockstep); !e.ok()) return e;
  // The Python wrapper checks this where the user passes it; a raw op call is checked here.
  if (Error e = CheckThreadgroup(a->threadgroup); !e.ok()) return e;
  if (a->output_ranks.size() != a->output_types.size()) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": output_ranks and Tout differ in length");
  }
  for (int64_t rank : a->output_ranks) {
    if (rank < 0) {
      return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                    ": output_ranks must be >= 0, got " +
                                    ShapeString(a->output_ranks));
    }
  }
  return Error::Ok();
}

void* CreateMetalKernel(TF_OpKernelConstruction* ctx) {
  auto attrs = std::make_unique<MetalKernelAttrs>();
  if (Error e = ReadMetalKernelAttrs(ctx, attrs.get()); !e.ok()) {
    FailConstruction(ctx, e);
    return nullptr;
  }
  return attrs.release();
}

void DeleteMetalKernel(void* kernel) { delete static_cast<MetalKernelAttrs*>(kernel); }

Error CheckGrid(const std::string& kernel_name, const int64_t* values, int64_t count,
                uint32_t grid[3]) {
  if (count != 3) {
    return Error::InvalidArgument("metal_kernel '" + kernel_name +
                                  "': grid must hold 3 int64 values, got " +
                                  std::to_string(count));
  }
  for (int d = 0; d < 3; ++d) {
    if (values[d] < 1 || values[d] > 0xFFFFFFFFll) {
      return Error::InvalidArgument("metal_kernel '" + kernel_name + "': grid." + "xyz"[d] +
                                    " must be in [1, 4294967295], got " +
                                    std::to_string(values[d]));
    }
    grid[d] = static_cast<uint32_t>(values[d]);
  }
  return Error::Ok();
}

void ClampThreadgroup(const std::vector<int64_t>& threadgroup, const uint32_t grid[3],
                      uint32_t clamped[3]) {
  for (int d = 0; d < 3; ++d) {
    clamped[d] = static_cast<uint32_t>(std::min<int64_t>(threadgroup[d], grid[d]));
  }
}

size_t ElementSize(TF_DataType dtype) {
  switch (dtype) {
    case TF_BOOL:
    case TF_UINT8: return 1;
    case TF_HALF:
    case TF_BFLOAT16: return 2;
    case TF_FLOAT:
    case TF_INT32:
    case TF_UINT32: return 4;
    case TF_INT64: return 8;
    default: return 0;
  }
}

Error OutputSpecs(const MetalKernelAttrs& a, const int64_t* all_dims, int64_t count,
                  std::vector<OutputSpec>* specs) {
  int64_t total_rank = 0;
  for (int64_t r : a.output_ranks) total_rank += r;
  if (count != total_rank) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) + ": output_shapes holds " +
                                  std::to_string(count) + " dims, the output ranks add up to " +
                                  std::to_string(total_rank));
  }
  specs->clear();
  int64_t offset = 0;
  for (size_t o = 0; o < a.output_types.size(); ++o) {
    OutputSpec spec;
    spec.dims.assign(all_dims + offset, all_dims + offset + a.output_ranks[o]);
    offset += a.output_ranks[o];
    const size_t element = ElementSize(a.output_types[o]);
    if (element == 0) {
      return Error::InvalidArgument(MetalKernelContext(a) + ": output " + std::to_string(o) +
                                    " has a dtype the op does not support");
    }
    const int64_t limit = std::numeric_limits<int64_t>::max() / static_cast<int64_t>(element);
    int64_t elements = 1;
    for (int64_t d : spec.dims) {
      if (d < 0 || (d > 0 && elements > limit / d)) {
        return Error::InvalidArgument(MetalKernelContext(a) + ": output " + std::to_string(o) +
                                      " has the shape " + ShapeString(spec.dims) +
                                      " (a negative dimension, or too many bytes)");
      }
      elements *= d;
    }
    spec.elements = elements;
    spec.bytes = static_cast<size_t>(elements) * element;
    specs->push_back(std::move(spec));
  }
  return Error::Ok();
}

Error InitValueBytes(TF_DataType dtype, float value, std::vector<uint8_t>* bytes) {
  switch (dtype) {
    case TF_FLOAT: SetBytes(value, bytes); break;
    case TF_INT32: SetBytes(static_cast<int32_t>(value), bytes); break;
    case TF_INT64: SetBytes(static_cast<int64_t>(value), bytes); break;
    case TF_UINT32: SetBytes(static_cast<uint32_t>(value), bytes); break;
    case TF_UINT8: SetBytes(static_cast<uint8_t>(value), bytes); break;
    case TF_BOOL: SetBytes(static_cast<uint8_t>(value != 0 ? 1 : 0), bytes); break;
    case TF_HALF: {
      Half bits;
      Store(value, &bits);
      SetBytes(bits, bytes);
      break;
    }
    case TF_BFLOAT16: {
      BFloat16 bits;
      Store(value, &bits);
      SetBytes(bits, bytes);
      break;
    }
    default:
      return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                    ": init_value for an unsupported dtype " +
                                    std::to_string(dtype));
  }
  return Error::Ok();
}

bool FillGrid(int64_t elements, uint32_t grid[2]) {
  if (elements < 1) return false;
  const int64_t row = std::min<int64_t>(elements, kFillRowThreads);
  const int64_t rows = (elements - 1) / row + 1;
  if (rows > 0xFFFFFFFFll) return false;
  grid[0] = static_cast<uint32_t>(row);
  grid[1] = static_cast<uint32_t>(rows);
  return true;
}

std::vector<Binding> BufferBindings(const std::vector<int>& input_ranks,
                                    const std::vector<int64_t>& shape_params, int num_outputs) {
  std::vector<Binding> bindings;
  for (size_t i = 0; i < input_ranks.size(); ++i) {
    const int input = static_cast<int>(i);
    bindings.push_back({BindingKind::kInput, input});
    if (input_ranks[i] == 0) continue;  // a scalar has no shape parameters
    const int64_t bits = i < shape_params.size() ? shape_params[i] : 0;
    if (bits & kShapeParamShape) bindings.push_back({BindingKind::kInputShape, input});
    if (bits & kShapeParamStrides) bindings.push_back({BindingKind::kInputStrides, input});
    if (bits & kShapeParamNdim) bindings.push_back({BindingKind::kInputNdim, input});
  }
  for (int o = 0; o < num_outputs; ++o) bindings.push_back({BindingKind::kOutput, o});
  return bindings;
}

ShapeParams MakeShapeParams(const std::vector<int64_t>& dims) {
  ShapeParams params;
  params.ndim = static_cast<int32_t>(dims.size());
  params.shape.assign(dims.begin(), dims.end());
  params.strides.resize(dims.size());
  int64_t stride = 1;
  for (size_t d = dims.size(); d-- > 0;) {
    params.strides[d] = stride;  // row-contiguous: TensorFlow's layout
    stride *= dims[d];
  }
  return params;
}

InlineBytes InlineBytesOf(const Binding& binding, const std::vector<ShapeParams>& params) {
  switch (binding.kind) {
    case BindingKind::kInputShape: {
      const auto& shape = params[binding.index].shape;
      return {shape.data(), shape.size() * sizeof(int32_t)};
    }
    case BindingKind::kInputStrides: {
      const auto& strides = params[binding.index].strides;
      return {strides.data(), strides.size() * sizeof(int64_t)};
    }
    case BindingKind::kInputNdim:
      return {&params[binding.index].ndim, sizeof(int32_t)};
    case BindingKind::kInput:
    case BindingKind::kOutput:
      return {};
  }
  return {};
}

Error PrepareMetalKernelLaunch(const MetalKernelAttrs& a, TF_OpKernelContext* ctx,
                               MetalKernelLaunch* launch) {
  // A GPU error found after an earlier op returned fails the next op of ours, this one too, as
  // the loss ops do (pending_errors.h).
  if (Error e = TakePendingError(); !e.ok()) return e;
  const int num_inputs = TF_NumInputs(ctx) - 2;
  if (static_cast<int>(a.shape_params.size()) != num_inputs) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": shape_params needs one value per input");
  }
  TensorPtr shapes_tensor, grid_tensor;
  if (Error e = GetInput(ctx, num_inputs, &shapes_tensor); !e.ok()) return e;
  if (Error e = GetInput(ctx, num_inputs + 1, &grid_tensor); !e.ok()) return e;
  // Both are HostMemory inputs on every device: their data is a host pointer.
  if (TF_TensorType(grid_tensor.get()) != TF_INT64) {
    return Error::InvalidArgument(MetalKernelContext(a) +
                                  ": grid must hold 3 int64 values, got dtype " +
                                  std::to_string(TF_TensorType(grid_tensor.get())));
  }
  if (Error e = CheckGrid(a.kernel_name,
                          static_cast<const int64_t*>(TF_TensorData(grid_tensor.get())),
                          TF_TensorElementCount(grid_tensor.get()), launch->grid);
      !e.ok()) {
    return e;
  }
  ClampThreadgroup(a.threadgroup, launch->grid, launch->threadgroup);
  if (TF_TensorType(shapes_tensor.get()) != TF_INT64) {
    return Error::InvalidArgument(std::string(kMetalKernelOpName) +
                                  ": output_shapes must be int64");
  }
  if (Error e = OutputSpecs(a, static_cast<const int64_t*>(TF_TensorData(shapes_tensor.get())),
                            TF_TensorElementCount(shapes_tensor.get()), &launch->output_specs);
      !e.ok()) {
    return e;
  }

  std::vector<int> ranks;
  for (int i = 0; i < num_inputs; ++i) {
    TensorPtr input;
    if (Error e = GetInput(ctx, i, &input); !e.ok()) return e;
    const std::vector<int64_t> dims = Dims(input.get());
    ranks.push_back(static_cast<int>(dims.size()));
    launch->shape_params.push_back(MakeShapeParams(dims));
    launch->inputs.push_back(std::move(input));
  }
  launch->has_work = false;
  for (size_t o = 0; o < launch->output_specs.size(); ++o) {
    const OutputSpec& spec = launch->output_specs[o];
    StatusPtr status = NewStatus();
    TensorPtr out(TF_AllocateOutput(ctx, static_cast<int>(o), a.output_types[o], spec.dims.data(),
                                    static_cast<int>(spec.dims.size()), spec.bytes,
                                    status.get()));
    if (Error e = FromStatus(status.get(), "allocating an output"); !e.ok()) return e;
    launch->has_work = launch->has_work || spec.bytes > 0;
    launch->outputs.push_back(std::move(out));
  }
  launch->bindings = BufferBindings(ranks, a.shape_params, static_cast<int>(a.output_types.size()));
  return Error::Ok();
}

}  // namespace tf_metal_ops
