// Parameters of the CustomLoss Metal kernels: one header read by the Metal compiler (the kernels),
// by the host code that encodes them (csrc/metal/launch_plan.*, csrc/metal/*.mm) and by the Linux
// emulator (tests/msl_host/), so the byte layout of what the host sends cannot drift from what the
// kernel reads.
//
// Layout rules: only 32-bit and 64-bit scalars, each at an offset that is a multiple of its size,
// and a total size that is a multiple of 8. MSL and C++ then agree on every offset (MSL's `long` is
// 64-bit with 8-byte alignment, like int64_t); the host side static_asserts them.
//
// Buffer indices: a kernel's buffer arguments are declared in the order of their index (index k is
// the k-th argument), the same for every kernel, so the Linux emulator can bind them by position.
// tests/test_msl_emulator.py checks the kernels' signatures against this.
#ifndef TF_METAL_OPS_KERNELS_CUSTOM_LOSS_PARAMS_H_
#define TF_METAL_OPS_KERNELS_CUSTOM_LOSS_PARAMS_H_

#ifdef __METAL__
#include <metal_stdlib>
typedef uint tfmo_u32;
typedef int tfmo_i32;
typedef long tfmo_i64;
#else
#include <cstddef>
#include <cstdint>
typedef uint32_t tfmo_u32;
typedef int32_t tfmo_i32;
typedef int64_t tfmo_i64;
#endif

// [[buffer(i)]] indices, shared by every CustomLoss kernel.
#define TFMO_BUFFER_LOGITS 0         // const T[N, C]
#define TFMO_BUFFER_LABELS 1         // const int32/int64 [N] (sparse) or const T[N, C] (dense)
#define TFMO_BUFFER_CLASS_WEIGHTS 2  // const float[C]; not read when has_class_weights == 0
#define TFMO_BUFFER_PARAMS 3         // constant CustomLossParams (setBytes)
#define TFMO_BUFFER_ERROR_RECORD 4   // CustomLossErrorRecord, shared storage, host-initialized
#define TFMO_BUFFER_OUTPUT 5         // T[N] loss (forward) or T[N, C] d logits (gradient)
#define TFMO_BUFFER_UPSTREAM 6       // gradient kernels: const T[N], the upstream gradient
#define TFMO_BUFFER_ROW_SCALES 6     // forward kernels: const float[N], the reduced loss's s_i;
                                     // read when has_row_scales (the same per-row factor of a
                                     // gradient as UPSTREAM, so the same index)
#define TFMO_BUFFER_ROW_STATS 7      // float[N, 3] (max, log_sum, 1/sum; csrc/problem.h): the
                                     // forward writes them, the gradient reads them, when
                                     // has_row_stats
#define TFMO_BUFFER_SCALED_GRADIENT 8  // forward kernels: T[N, C], row_scales[i] * d loss_i / d z_i,
                                       // written when has_row_scales
// [[threadgroup(i)]] index of the reduction scratch of the row-per-threadgroup kernels.
#define TFMO_THREADGROUP_SCRATCH 0

// Kernel variants (CustomLossParams::variant; also spelled in the kernel names).
#define TFMO_VARIANT_ROW_PER_THREADGROUP 0  // "rowtg": one row per threadgroup, C large
#define TFMO_VARIANT_ROW_PER_LANE_GROUP 1   // "rowsimd": one row per group of SIMD lanes, C small

struct CustomLossParams {
  tfmo_u32 num_rows;           // N (rows = examples); the kernels index rows with 32 bits
  tfmo_u32 num_classes;        // C >= 1
  float gamma;                 // focal exponent, >= 0
  tfmo_u32 has_class_weights;  // 0: every a_c is 1 and the class_weights buffer is not read
  tfmo_u32 has_ignore_class;   // 1: rows whose sparse label == ignore_class get loss 0, grad 0
  tfmo_u32 variant;            // TFMO_VARIANT_*
  tfmo_i64 ignore_class;       // compared with the label widened to 64 bits
  // Label smoothing eps reaches the kernels as the two coefficients of q_c = (1 - eps) t_c + eps / C.
  float smooth_on;             // 1 - eps: weight of the target distribution t in q
  float smooth_off;            // eps / C: uniform part of q (0 for eps == 0: one class per row)
  tfmo_u32 threads_per_row;    // lanes per row: the threadgroup size (rowtg), or a power of two
                               // <= the SIMD width (rowsimd)
  tfmo_u32 rows_per_threadgroup;  // 1 (rowtg) or threadgroup size / threads_per_row (rowsimd)
  tfmo_u32 has_row_stats;   // forward: write row_stats; gradient: take max and log_sum from them
                            // instead of a log-sum-exp pass over the row
  tfmo_u32 has_row_scales;  // forward only: also write the scaled gradient (needs row_scales)
};

// Written by the kernels when a sparse label is outside [0, C) and is not ignore_class; read by
// the host after commitAndWait, or in commit mode by a completion handler once the GPU is done
// (csrc/pending_errors.h). The host initializes it with InitCustomLossErrorRecord. Every
// field is accessed with 32-bit atomics (relaxed) by the kernels, because rows run concurrently:
//   bad_label_count  number of rows with a bad label (wraps at 2^32; > 0 means "error")
//   min_bad_row      lowest such row (0xFFFFFFFF: none), deterministic
//   claimed          0 until one bad row claims the detail slot (compare-and-swap 0 -> 1)
//   detail_row, detail_label_lo/hi
//                    that row and its label (int64, two's complement halves); written only by
//                    the claiming thread, so row and label always belong together. Which bad row
//                    claims it is not deterministic when there are several: report min_bad_row
//                    and bad_label_count alongside it.
#define TFMO_ERROR_BAD_LABEL_COUNT 0
#define TFMO_ERROR_MIN_BAD_ROW 1
#define TFMO_ERROR_CLAIMED 2
#define TFMO_ERROR_DETAIL_ROW 3
#define TFMO_ERROR_DETAIL_LABEL_LO 4
#define TFMO_ERROR_DETAIL_LABEL_HI 5
#define TFMO_ERROR_RECORD_WORDS 8  // 32 bytes; words 6 and 7 are reserved (0)
#define TFMO_ERROR_NO_ROW 0xFFFFFFFFu

struct CustomLossErrorRecord {
  tfmo_u32 words[TFMO_ERROR_RECORD_WORDS];
};

#ifndef __METAL__
static_assert(sizeof(CustomLossParams) == 56, "CustomLossParams layout changed: update the kernels");
static_assert(offsetof(CustomLossParams, num_rows) == 0, "layout");
static_assert(offsetof(CustomLossParams, num_classes) == 4, "layout");
static_assert(offsetof(CustomLossParams, gamma) == 8, "layout");
static_assert(offsetof(CustomLossParams, has_class_weights) == 12, "layout");
static_assert(offsetof(CustomLossParams, has_ignore_class) == 16, "layout");
static_assert(offsetof(CustomLossParams, variant) == 20, "layout");
static_assert(offsetof(CustomLossParams, ignore_class) == 24, "layout");
static_assert(offsetof(CustomLossParams, smooth_on) == 32, "layout");
static_assert(offsetof(CustomLossParams, smooth_off) == 36, "layout");
static_assert(offsetof(CustomLossParams, threads_per_row) == 40, "layout");
static_assert(offsetof(CustomLossParams, rows_per_threadgroup) == 44, "layout");
static_assert(offsetof(CustomLossParams, has_row_stats) == 48, "layout");
static_assert(offsetof(CustomLossParams, has_row_scales) == 52, "layout");
static_assert(sizeof(float) == 4, "float must be IEEE binary32");
static_assert(sizeof(CustomLossErrorRecord) == 32, "CustomLossErrorRecord layout changed");

// The state the kernels expect before they run: no bad label seen.
inline void InitCustomLossErrorRecord(CustomLossErrorRecord* record) {
  for (int i = 0; i < TFMO_ERROR_RECORD_WORDS; ++i) record->words[i] = 0;
  record->words[TFMO_ERROR_MIN_BAD_ROW] = TFMO_ERROR_NO_ROW;
}

inline bool CustomLossErrorRecordHasError(const CustomLossErrorRecord& record) {
  return record.words[TFMO_ERROR_CLAIMED] != 0;
}

// The claimed bad label, as the int64 the kernel read.
inline int64_t CustomLossErrorRecordLabel(const CustomLossErrorRecord& record) {
  const uint64_t bits = (static_cast<uint64_t>(record.words[TFMO_ERROR_DETAIL_LABEL_HI]) << 32) |
                        record.words[TFMO_ERROR_DETAIL_LABEL_LO];
  return static_cast<int64_t>(bits);
}
#endif  // !__METAL__

#endif  // TF_METAL_OPS_KERNELS_CUSTOM_LOSS_PARAMS_H_
