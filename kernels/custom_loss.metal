// The CustomLoss kernels, one [[host_name]] per logits dtype x label kind x direction x variant:
//   tfmo_custom_loss_<forward|gradient>_<rowtg|rowsimd>_<f32|f16|bf16>_<i32|i64|dense>
// and for sparse labels two cross-entropy kernels each (gamma == 0, no class weights;
// custom_loss.h's KernelForm), without and with label smoothing:
//   tfmo_custom_loss_<forward|gradient>_<rowtg|rowsimd>_<f32|f16|bf16>_<i32|i64>_<plain|smoothed>
// The names are built by csrc/metal/launch_plan.cc (KernelName) and double as the pipeline-cache
// key. The kernels themselves, and the derivation of what they compute, are in custom_loss.h.
//
// Compile with fast math off (see custom_loss.h): offline `-fno-fast-math`, at run time
// MTLCompileOptions.mathMode = MTLMathModeSafe (macOS 15+) or fastMathEnabled = NO.
#include "custom_loss.h"

// One kernel: its host name from the tokens, its template from the label type, kDense and the
// KernelForm.
#define TFMO_INSTANTIATE_FORM(direction, variant, type_name, suffix, T, LabelT, dense, form)  \
  TFMO_INSTANTIATE_KERNEL(                                                                    \
      "tfmo_custom_loss_" #direction "_" #variant "_" #type_name suffix,                      \
      tf_metal_ops::kernels::custom_loss_##direction##_##variant<                             \
          T, LabelT, dense, tf_metal_ops::kernels::form>)

#define TFMO_INSTANTIATE_LABEL_KINDS(dir, variant, type_name, T)                              \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_i32", T, int, false, kFormGeneral)          \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_i64", T, long, false, kFormGeneral)         \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_dense", T, T, true, kFormGeneral)           \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_i32_plain", T, int, false, kFormPlain)      \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_i64_plain", T, long, false, kFormPlain)     \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_i32_smoothed", T, int, false, kFormSmoothed) \
  TFMO_INSTANTIATE_FORM(dir, variant, type_name, "_i64_smoothed", T, long, false, kFormSmoothed)

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
