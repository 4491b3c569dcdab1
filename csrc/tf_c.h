// Small owners and error helpers for TensorFlow's C API.
//
// Every TF_Status* and TF_Tensor* the library creates is held by one of these owners from the
// moment it exists, so an early return on any error path releases it.
#ifndef TF_METAL_OPS_CSRC_TF_C_H_
#define TF_METAL_OPS_CSRC_TF_C_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

namespace tf_metal_ops {

struct StatusDeleter {
  void operator()(TF_Status* status) const { TF_DeleteStatus(status); }
};
using StatusPtr = std::unique_ptr<TF_Status, StatusDeleter>;
inline StatusPtr NewStatus() { return StatusPtr(TF_NewStatus()); }

struct TensorDeleter {
  void operator()(TF_Tensor* tensor) const { TF_DeleteTensor(tensor); }
};
using TensorPtr = std::unique_ptr<TF_Tensor, TensorDeleter>;

// The outcome of a check in our own code. Plain data rather than a TF_Status so that the
// platform-neutral validation can build messages without allocating TensorFlow objects.
struct Error {
  TF_Code code = TF_OK;
  std::string message;

  bool ok() const { return code == TF_OK; }
  static Error Ok() { return {}; }
  static Error InvalidArgument(std::string message) {
    return {TF_INVALID_ARGUMENT, std::move(message)};
  }
  static Error Internal(std::string message) { return {TF_INTERNAL, std::move(message)}; }
};

// Reports `error` as the kernel's failure: TensorFlow raises it in Python as the exception
// class that matches the code (InvalidArgumentError for TF_INVALID_ARGUMENT).
inline void FailKernel(TF_OpKernelContext* ctx, const Error& error) {
  StatusPtr status = NewStatus();
  TF_SetStatus(status.get(), error.code, error.message.c_str());
  TF_OpKernelContext_Failure(ctx, status.get());
}

inline void FailConstruction(TF_OpKernelConstruction* ctx, const Error& error) {
  StatusPtr status = NewStatus();
  TF_SetStatus(status.get(), error.code, error.message.c_str());
  TF_OpKernelConstruction_Failure(ctx, status.get());
}

// Converts a TF_Status that a C API call filled in; `what` says which call, for the message.
inline Error FromStatus(const TF_Status* status, const std::string& what) {
  if (TF_GetCode(status) == TF_OK) return Error::Ok();
  return {TF_GetCode(status), what + ": " + TF_Message(status)};
}

// A tensor's shape.
inline std::vector<int64_t> Dims(const TF_Tensor* tensor) {
  std::vector<int64_t> dims(TF_NumDims(tensor));
  for (size_t i = 0; i < dims.size(); ++i) dims[i] = TF_Dim(tensor, static_cast<int>(i));
  return dims;
}

// Input `index` of the running kernel, owned.
inline Error GetInput(TF_OpKernelContext* ctx, int index, TensorPtr* out) {
  StatusPtr status = NewStatus();
  TF_Tensor* tensor = nullptr;
  TF_GetInput(ctx, index, &tensor, status.get());
  out->reset(tensor);
  return FromStatus(status.get(), "reading input " + std::to_string(index));
}

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_TF_C_H_
