// The two functions rows_dispatch.h declares for each instruction-set variant, ComputeRows and
// ComputeSplitRows: they choose the storage type's and label kind's instance of the row kernels
// (simd_rows.h, simd_row_groups.h, simd_split_rows.h) at run time, and so compile every
// instance. Kept apart from the kernels so that a program checking a few of the kernels' terms
// (tests/cpu_math/shared_math_check.cc) compiles only those: without these two, a template
// that nothing calls is never compiled.
//
// DELIBERATELY NO INCLUDE GUARD: included once per variant by simd_kernels.h, after the kernels.

// One storage type's rows, by label kind (dense targets share the logits' type).
template <typename T>
void ComputeRowsOfType(const RowsArgs& args, int64_t begin, int64_t end) {
  switch (args.label_kind) {
    case LabelKind::kSparseInt32: return ComputeRowsTyped<T, int32_t>(args, begin, end);
    case LabelKind::kSparseInt64: return ComputeRowsTyped<T, int64_t>(args, begin, end);
    case LabelKind::kDense: return ComputeRowsTyped<T, T>(args, begin, end);
  }
}

// The entry point of this ISA's variant (declared in rows_dispatch.h).
void ComputeRows(const RowsArgs& args, int64_t begin, int64_t end) {
  switch (args.type) {
    case StorageType::kFloat: return ComputeRowsOfType<float>(args, begin, end);
    case StorageType::kHalf: return ComputeRowsOfType<Half>(args, begin, end);
    case StorageType::kBFloat16: return ComputeRowsOfType<BFloat16>(args, begin, end);
  }
}

// One storage type's batch, by label kind.
template <typename T>
bool ComputeSplitRowsOfType(const RowsArgs& args, int64_t num_rows, int threads,
                            ParallelTasks parallel) {
  switch (args.label_kind) {
    case LabelKind::kSparseInt32:
      return ComputeSplitRowsTyped<T, int32_t>(args, num_rows, threads, parallel);
    case LabelKind::kSparseInt64:
      return ComputeSplitRowsTyped<T, int64_t>(args, num_rows, threads, parallel);
    case LabelKind::kDense: return false;
  }
  return false;
}

// The entry point of this ISA's variant (declared in rows_dispatch.h).
bool ComputeSplitRows(const RowsArgs& args, int64_t num_rows, int threads,
                      ParallelTasks parallel) {
  switch (args.type) {
    case StorageType::kFloat:
      return ComputeSplitRowsOfType<float>(args, num_rows, threads, parallel);
    case StorageType::kHalf:
      return ComputeSplitRowsOfType<Half>(args, num_rows, threads, parallel);
    case StorageType::kBFloat16:
      return ComputeSplitRowsOfType<BFloat16>(args, num_rows, threads, parallel);
  }
  return false;
}
