// What every kernel of TfMetalOps>MetalKernel (csrc/metal_kernel.h) reads and checks before it
// runs anything: the attributes, the grid, the output shapes, the order of the kernel's buffers
// and the bytes of init_value. One definition for the CPU kernel (csrc/cpu/metal_kernel_cpu.cc)
// and the Metal one (csrc/metal/metal_kernel_metal.mm), so both refuse the same input with the
// same message and bind the same buffer at the same [[buffer(i)]] index.
//
// Platform-neutral C++17 over TensorFlow's C API; reads no tensor data but the two HostMemory
// inputs (output_shapes, grid), so it works on GPU tensors too.
#ifndef TF_METAL_OPS_CSRC_METAL_KERNEL_ARGS_H_
#define TF_METAL_OPS_CSRC_METAL_KERNEL_ARGS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/tf_c.h"

namespace tf_metal_ops {

struct MetalKernelAttrs {
  std::string source;
  std::string kernel_name;
  std::vector<int64_t> threadgroup, output_ranks, shape_params;
  std::vector<TF_DataType> output_types;
  float init_value = 0;
  bool has_init_value = false;
  bool lockstep = true;
};

// Reads the attributes and checks what does not depend on the inputs (threadgroup, output_ranks).
Error ReadMetalKernelAttrs(TF_OpKernelConstruction* ctx, MetalKernelAttrs* attrs);

// The create and delete functions of every kernel of the op: a MetalKernelAttrs read by
// ReadMetalKernelAttrs (nullptr, the construction failed, when they are bad).
void* CreateMetalKernel(TF_OpKernelConstruction* ctx);
void DeleteMetalKernel(void* kernel);

// Three values, each in [1, 1024], at most 1024 threads in all.
Error CheckThreadgroup(const std::vector<int64_t>& threadgroup);

// `count` values, which must be 3, each in [1, 2^32 - 1]: threads per grid, as dispatchThreads
// counts them.
Error CheckGrid(const std::string& kernel_name, const int64_t* values, int64_t count,
                uint32_t grid[3]);

// The threadgroup cut to the grid in each dimension (MLX does the same before dispatching).
void ClampThreadgroup(const std::vector<int64_t>& threadgroup, const uint32_t grid[3],
                      uint32_t clamped[3]);

// One output's shape, element count and byte size.
struct OutputSpec {
  std::vector<int64_t> dims;
  int64_t elements = 0;
  size_t bytes = 0;
};

// Splits the concatenated `dims` (the output_shapes input, `count` values) by output_ranks;
// refuses a count that does not match, a negative dimension and a byte size beyond int64.
Error OutputSpecs(const MetalKernelAttrs& attrs, const int64_t* dims, int64_t count,
                  std::vector<OutputSpec>* specs);

// Bytes of one element of a dtype the op accepts; 0 for any other.
size_t ElementSize(TF_DataType dtype);

// init_value as one element of `dtype` (16-bit floats by their bit pattern, rounded to nearest
// even; integers by C++'s conversion, as the CPU path has always filled them).
Error InitValueBytes(TF_DataType dtype, float value, std::vector<uint8_t>* bytes);

// The 2-D grid of the Metal path's init_value fill (csrc/metal/fill_kernel_source.h), one
// thread per element: rows of up to kFillRowThreads threads. False when `elements` < 1 or the
// rows would be more than 2^32 - 1.
inline constexpr uint32_t kFillRowThreads = 65536;
bool FillGrid(int64_t elements, uint32_t grid[2]);

// The kernel's buffers in [[buffer(i)]] order, as tf_metal_ops/kernels.py generates the
// signature: each input, then (rank > 0 only) the shape, strides and ndim it asked for, in that
// order; then every output.
enum class BindingKind { kInput, kInputShape, kInputStrides, kInputNdim, kOutput };
struct Binding {
  BindingKind kind;
  int index;  // which input or output
};
std::vector<Binding> BufferBindings(const std::vector<int>& input_ranks,
                                    const std::vector<int64_t>& shape_params, int num_outputs);

// An input's `name_shape` (int32), `name_strides` (int64, row-contiguous, in elements) and
// `name_ndim` (int32) values.
struct ShapeParams {
  std::vector<int32_t> shape;
  std::vector<int64_t> strides;
  int32_t ndim = 0;
};
ShapeParams MakeShapeParams(const std::vector<int64_t>& dims);

// The bytes `binding` passes by value (a shape parameter), or {nullptr, 0} for a tensor.
struct InlineBytes {
  const void* data = nullptr;
  size_t length = 0;
};
InlineBytes InlineBytesOf(const Binding& binding, const std::vector<ShapeParams>& params);

// Everything a backend needs to run one call: the inputs, their shape parameters, the allocated
// outputs (filled with nothing yet), the bindings and the dispatch's geometry.
struct MetalKernelLaunch {
  std::vector<TensorPtr> inputs;
  std::vector<ShapeParams> shape_params;  // per input
  std::vector<TensorPtr> outputs;
  std::vector<OutputSpec> output_specs;
  std::vector<Binding> bindings;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threadgroup[3] = {1, 1, 1};  // clamped to the grid
  // False when every output is empty: a kernel then has nothing it could write, and no backend
  // runs it (the source is still compiled first, so a broken one still fails).
  bool has_work = false;
};

// Reads the inputs and the HostMemory grid and output_shapes, checks them, allocates the
// outputs and fills `launch`.
Error PrepareMetalKernelLaunch(const MetalKernelAttrs& attrs, TF_OpKernelContext* ctx,
                               MetalKernelLaunch* launch);

// "metal_kernel 'custom_kernel_...'": the prefix of the run-time errors.
std::string MetalKernelContext(const MetalKernelAttrs& attrs);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_KERNEL_ARGS_H_
