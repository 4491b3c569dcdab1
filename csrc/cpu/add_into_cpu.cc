// The CPU kernel of AddInto (csrc/add_into.h: why it writes into its input, and the contract
// that makes that safe).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "csrc/add_into.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/problem.h"
#include "csrc/tf_c.h"

namespace tf_metal_ops {
namespace {

// Elements per ParallelFor row: the sum is one pass over memory, so a thread gets whole blocks
// of a few pages rather than single elements.
constexpr int64_t kBlockElements = 16 * 1024;

int64_t Product(const std::vector<int64_t>& dims, size_t from) {
  int64_t product = 1;
  for (size_t i = from; i < dims.size(); ++i) product *= dims[i];
  return product;
}

template <typename T>
void AddBlocks(T* sum, const T* addend, int64_t count) {
  const int64_t blocks = (count + kBlockElements - 1) / kBlockElements;
  ParallelFor(blocks, kBlockElements, [&](int64_t begin, int64_t end) {
    const int64_t stop = std::min(count, end * kBlockElements);
    for (int64_t i = begin * kBlockElements; i < stop; ++i) sum[i] += addend[i];
  });
}

// Adds `addend` into `sum` from element `offset` on.
void AddAt(TF_Tensor* sum, const TF_Tensor* addend, int64_t offset) {
  const int64_t count = TF_TensorElementCount(addend);
  if (TF_TensorType(addend) == TF_DOUBLE) {
    AddBlocks(static_cast<double*>(TF_TensorData(sum)) + offset,
              static_cast<const double*>(TF_TensorData(addend)), count);
  } else {
    AddBlocks(static_cast<float*>(TF_TensorData(sum)) + offset,
              static_cast<const float*>(TF_TensorData(addend)), count);
  }
}

struct Request {
  bool first = false;
  int64_t row_offset = 0;
  std::vector<int64_t> shape;  // the sum's
};

Error ReadRequest(TF_OpKernelContext* ctx, Request* request) {
  TensorPtr first, offset, shape;
  for (auto [index, tensor] : {std::pair{kAddIntoFirst, &first},
                               std::pair{kAddIntoRowOffset, &offset},
                               std::pair{kAddIntoShape, &shape}}) {
    if (Error e = GetInput(ctx, index, tensor); !e.ok()) return e;
  }
  if (TF_NumDims(first.get()) != 0 || TF_NumDims(offset.get()) != 0 ||
      TF_NumDims(shape.get()) != 1) {
    return Error::InvalidArgument("AddInto: first and row_offset must be scalars and shape a "
                                  "vector, got shapes " + ShapeString(Dims(first.get())) + ", " +
                                  ShapeString(Dims(offset.get())) + ", " +
                                  ShapeString(Dims(shape.get())));
  }
  request->first = *static_cast<const bool*>(TF_TensorData(first.get()));
  request->row_offset = *static_cast<const int64_t*>(TF_TensorData(offset.get()));
  const auto* dims = static_cast<const int64_t*>(TF_TensorData(shape.get()));
  request->shape.assign(dims, dims + TF_Dim(shape.get(), 0));
  return Error::Ok();
}

// Whether the addend's rows fit the sum's at the offset.
Error CheckPlacement(const Request& request, const std::vector<int64_t>& addend) {
  const std::vector<int64_t>& sum = request.shape;
  const bool fits = !sum.empty() && addend.size() == sum.size() &&
                    std::equal(addend.begin() + 1, addend.end(), sum.begin() + 1) &&
                    request.row_offset >= 0 && request.row_offset + addend[0] <= sum[0];
  // The sum's size in bytes must be representable (a raw call may ask for any shape).
  const int64_t row_bytes = Product(addend, 1) * 8;
  if (fits && (row_bytes == 0 || sum[0] <= std::numeric_limits<int64_t>::max() / row_bytes)) {
    return Error::Ok();
  }
  return Error::InvalidArgument("AddInto: an addend of shape " + ShapeString(addend) +
                                " does not fit a sum of shape " + ShapeString(sum) +
                                " at row " + std::to_string(request.row_offset));
}

// The first call: the addend becomes the sum, in its own buffer when nothing else holds it.
// `addend` is our handle on it, which counts as an owner and would forbid taking the buffer
// over: it is dropped first, and the input read again only for the copy.
Error StartWithAddend(TF_OpKernelContext* ctx, TensorPtr addend) {
  const std::vector<int64_t> dims = Dims(addend.get());
  addend.reset();
  const int candidates[] = {kAddIntoAddend};
  int forwarded = -1;
  StatusPtr status = NewStatus();
  TensorPtr out(TF_ForwardInputOrAllocateOutput(ctx, candidates, 1, 0, dims.data(),
                                                static_cast<int>(dims.size()), &forwarded,
                                                status.get()));
  if (Error e = FromStatus(status.get(), "AddInto: allocating the sum"); !e.ok()) return e;
  if (forwarded == kAddIntoAddend) return Error::Ok();
  if (Error e = GetInput(ctx, kAddIntoAddend, &addend); !e.ok()) return e;
  if (TF_TensorByteSize(addend.get()) > 0) {
    std::memcpy(TF_TensorData(out.get()), TF_TensorData(addend.get()),
                TF_TensorByteSize(addend.get()));
  }
  return Error::Ok();
}

// The first call with the addend covering part of the sum: zeros, then the addend's rows.
Error StartWithZeros(TF_OpKernelContext* ctx, const Request& request, const TF_Tensor* addend) {
  const TF_DataType type = TF_TensorType(addend);
  const size_t bytes = static_cast<size_t>(Product(request.shape, 0)) * TF_DataTypeSize(type);
  StatusPtr status = NewStatus();
  TensorPtr out(TF_AllocateOutput(ctx, 0, type, request.shape.data(),
                                  static_cast<int>(request.shape.size()), bytes, status.get()));
  if (Error e = FromStatus(status.get(), "AddInto: allocating the sum"); !e.ok()) return e;
  if (bytes > 0) std::memset(TF_TensorData(out.get()), 0, bytes);
  AddAt(out.get(), addend, request.row_offset * Product(request.shape, 1));
  return Error::Ok();
}

Error AddToSum(TF_OpKernelContext* ctx, const Request& request, TF_Tensor* accumulator,
               const TF_Tensor* addend) {
  if (Dims(accumulator) != request.shape) {
    return Error::InvalidArgument("AddInto: the accumulator's shape " +
                                  ShapeString(Dims(accumulator)) + " is not the sum's " +
                                  ShapeString(request.shape));
  }
  AddAt(accumulator, addend, request.row_offset * Product(request.shape, 1));
  StatusPtr status = NewStatus();
  TF_SetOutput(ctx, 0, accumulator, status.get());  // the same buffer: no copy
  return FromStatus(status.get(), "AddInto: setting the sum");
}

Error Run(TF_OpKernelContext* ctx) {
  Request request;
  if (Error e = ReadRequest(ctx, &request); !e.ok()) return e;
  TensorPtr addend;
  if (Error e = GetInput(ctx, kAddIntoAddend, &addend); !e.ok()) return e;
  const std::vector<int64_t> addend_dims = Dims(addend.get());
  if (Error e = CheckPlacement(request, addend_dims); !e.ok()) return e;
  if (request.first) {
    if (request.row_offset == 0 && addend_dims == request.shape) {
      return StartWithAddend(ctx, std::move(addend));
    }
    return StartWithZeros(ctx, request, addend.get());
  }
  TensorPtr accumulator;
  if (Error e = GetInput(ctx, kAddIntoAccumulator, &accumulator); !e.ok()) return e;
  return AddToSum(ctx, request, accumulator.get(), addend.get());
}

void Compute(void* /*kernel*/, TF_OpKernelContext* ctx) {
  if (Error e = Run(ctx); !e.ok()) FailKernel(ctx, e);
}

void RegisterKernel() {
  StatusPtr status = NewStatus();
  TF_KernelBuilder* builder =
      TF_NewKernelBuilder(kAddIntoOpName, "CPU", nullptr, &Compute, nullptr);
  TF_RegisterKernelBuilder((std::string(kAddIntoOpName) + "_CPU").c_str(), builder,
                           status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    std::fprintf(stderr, "tf_metal_ops: registering the CPU kernel of %s failed: %s\n",
                 kAddIntoOpName, TF_Message(status.get()));
  }
}

const bool add_into_registered = (RegisterKernel(), true);

}  // namespace
}  // namespace tf_metal_ops
