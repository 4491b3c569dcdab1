// The vectorized row kernels of one instruction set, in the order each part needs the one before:
// the vectors and their math (simd_vector.h), the passes over a row (simd_rows.h), rows of few
// classes computed kLanes at a time (simd_row_groups.h), and few rows of many classes split into
// blocks over the threads (simd_split_rows.h); then the variant's two entry points for one
// storage type, which choose among its instances at run time (simd_entry_points.h).
//
// DELIBERATELY NO INCLUDE GUARD: included once per instruction set and storage type, inside that
// set's own namespace (rows_portable.h, rows_avx2.h, rows_avx512.h), after
// TF_METAL_OPS_SIMD_LANES is defined and the standard headers are included (see simd_vector.h).
#include "csrc/cpu/simd/simd_vector.h"
#include "csrc/cpu/simd/simd_rows.h"
#include "csrc/cpu/simd/simd_row_groups.h"
#include "csrc/cpu/simd/simd_split_rows.h"
#include "csrc/cpu/simd/simd_entry_points.h"
