// The AVX2 variant's row kernels for bfloat16 logits (rows_dispatch.h: why a file each).
#define TF_METAL_OPS_ROWS_STORAGE kBFloat16
#include "csrc/cpu/simd/rows_avx2.h"
