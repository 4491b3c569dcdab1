// The two functions rows_dispatch.h declares for each instruction-set variant and storage type,
// ComputeRows<kType> and ComputeSplitRows<kType>, instantiated here for the one storage type the
// including file names (TF_METAL_OPS_ROWS_STORAGE: kFloat, kHalf or kBFloat16). They choose the
// label kind's instance of the row kernels (simd_rows.h, simd_row_groups.h, simd_split_rows.h)
// at run time, and so compile every instance of that storage type. Kept apart from the kernels
// so that a program checking a few of the kernels' terms (tests/cpu_math/shared_math_check.cc)
// compiles only those: without these two, a template that nothing calls is never compiled.
//
// DELIBERATELY NO INCLUDE GUARD: included once per variant and storage type by simd_kernels.h,
// after the kernels.
#if !defined(TF_METAL_OPS_ROWS_STORAGE)
#error "define TF_METAL_OPS_ROWS_STORAGE (kFloat, kHalf or kBFloat16) before the row kernels"
#endif

// The C++ type each StorageType stores.
template <StorageType kType>
struct StorageOf;
template <>
struct StorageOf<StorageType::kFloat> {
  using Type = float;
};
template <>
struct StorageOf<StorageType::kHalf> {
  using Type = Half;
};
template <>
struct StorageOf<StorageType::kBFloat16> {
  using Type = BFloat16;
};

// One storage type's rows, by label kind (dense targets share the logits' type).
template <StorageType kType>
void ComputeRows(const RowsArgs& args, int64_t begin, int64_t end) {
  using T = typename StorageOf<kType>::Type;
  switch (args.label_kind) {
    case LabelKind::kSparseInt32: return ComputeRowsTyped<T, int32_t>(args, begin, end);
    case LabelKind::kSparseInt64: return ComputeRowsTyped<T, int64_t>(args, begin, end);
    case LabelKind::kDense: return ComputeRowsTyped<T, T>(args, begin, end);
  }
}
template void ComputeRows<StorageType::TF_METAL_OPS_ROWS_STORAGE>(const RowsArgs& args,
                                                                  int64_t begin, int64_t end);

// One storage type's batch, by label kind.
template <StorageType kType>
bool ComputeSplitRows(const RowsArgs& args, int64_t num_rows, int threads,
                      ParallelTasks parallel) {
  using T = typename StorageOf<kType>::Type;
  switch (args.label_kind) {
    case LabelKind::kSparseInt32:
      return ComputeSplitRowsTyped<T, int32_t>(args, num_rows, threads, parallel);
    case LabelKind::kSparseInt64:
      return ComputeSplitRowsTyped<T, int64_t>(args, num_rows, threads, parallel);
    case LabelKind::kDense: return false;
  }
  return false;
}
template bool ComputeSplitRows<StorageType::TF_METAL_OPS_ROWS_STORAGE>(const RowsArgs& args,
                                                                       int64_t num_rows,
                                                                       int threads,
                                                                       ParallelTasks parallel);
