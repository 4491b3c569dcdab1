// The portable variant's row kernels for float32 logits (rows_dispatch.h: why a file each).
#define TF_METAL_OPS_ROWS_STORAGE kFloat
#include "csrc/cpu/simd/rows_portable.h"
