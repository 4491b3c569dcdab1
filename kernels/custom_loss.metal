// The CustomLoss kernels, one [[host_name]] per logits dtype x label kind x direction x variant:
//   tfmo_custom_loss_<forward|gradient>_<rowtg|rowsimd>_<f32|f16|bf16>_<i32|i64|dense>
// and for sparse labels a plain cross-entropy kernel (gamma == 0, no label smoothing, no class
// weights; custom_loss.h's kPlain) each:
//   tfmo_custom_loss_<forward|gradient>_<rowtg|rowsimd>_<f32|f16|bf16>_<i32|i64>_plain
// The names are built by csrc/metal/launch_plan.cc (KernelName) and double as the pipeline-cache
// key. The kernels themselves, and the derivation of what they compute, are in custom_loss.h.
//
// Compile with fast math off (see custom_loss.h): offline `-fno-fast-math`, at run time
// MTLCompileOptions.mathMode = MTLMathModeSafe (macOS 15+) or fastMathEnabled = NO.
#include "custom_loss.h"

#define TFMO_INSTANTIATE_LABEL_KINDS(direction, variant, type_name, T)                            \
  TFMO_INSTANTIATE_KERNEL(                                                                        \
      "tfmo_custom_loss_" #direction "_" #variant "_" #type_name "_i32",                          \
      tf_metal_ops::kernels::custom_loss_##direction##_##variant<T, int, false, false>)           \
  TFMO_INSTANTIATE_KERNEL(                                                                        \
      "tfmo_custom_loss_" #direction "_" #variant "_" #type_name "_i64",                          \
      tf_metal_ops::kernels::custom_loss_##direction##_##variant<T, long, false, false>)          \
  TFMO_INSTANTIATE_KERNEL(                                                                        \
      "tfmo_custom_loss_" #direction "_" #variant "_" #type_name "_dense",                        \
      tf_metal_ops::kernels::custom_loss_##direction##_##variant<T, T, true, false>)              \
  TFMO_INSTANTIATE_KERNEL(                                                                        \
      "tfmo_custom_loss_" #direction "_" #variant "_" #type_name "_i32_plain",                    \
      tf_metal_ops::kernels::custom_loss_##direction##_##variant<T, int, false, true>)            \
  TFMO_INSTANTIATE_KERNEL(                                                                        \
      "tfmo_custom_loss_" #direction "_" #variant "_" #type_name "_i64_plain",                    \
      tf_metal_ops::kernels::custom_loss_##direction##_##variant<T, long, false, true>)

#define TFMO_INSTANTIATE_DTYPE(type_name, T)                    \
  TFMO_INSTANTIATE_LABEL_KINDS(forward, rowtg, type_name, T)    \
  TFMO_INSTANTIATE_LABEL_KINDS(gradient, rowtg, type_name, T)   \
  TFMO_INSTANTIATE_LABEL_KINDS(forward, rowsimd, type_name, T)  \
  TFMO_INSTANTIATE_LABEL_KINDS(gradient, rowsimd, type_name, T)

TFMO_INSTANTIATE_DTYPE(f32, float)
TFMO_INSTANTIATE_DTYPE(f16, half)

// bfloat is a Metal 3.1 type (macOS 14). Without it the bf16 names are absent from the library
// and the encoder reports that bfloat16 needs a newer macOS.
#if defined(__HAVE_BFLOAT__)
TFMO_INSTANTIATE_DTYPE(bf16, bfloat)
#endif
