// Rows of many classes split into blocks of classes, so that few rows still fill every thread.
//
// DELIBERATELY NO INCLUDE GUARD: compiled once per instruction set, after simd_rows.h (see there
// and rows_dispatch.h).
//
// A batch of 8 rows of 262144 classes (a language model's last token at a large vocabulary)
// gives a thread pool of 16 only 8 rows to share. Here each row is cut into blocks of
// kSplitBlockClasses classes and its passes run block by block, as separate tasks:
//
//   phase 1  every block's max and min                        (tasks: row x block)
//   then     per row: max, min, the labelled logit z_y         (in order, on the caller)
//   phase 2  every block's e_c = exp(z_c - max), stored where the gradient needs it, and its
//            sums `others` (float terms folded into double lanes, as SumOfBlocks does) and `ties`
//   then     per row: the block sums added in block order, the loss, the statistics
//   phase 3  every block's gradient p_c g_y, and the labelled element (-r_y g_y)
//
// What a task computes depends only on its row and block, and the per-row steps add the blocks
// in their order, so the results are the same bit for bit whatever the number of threads and
// however the tasks are spread. With enough rows to keep every thread busy (4 per thread, as
// ParallelFor cuts rows), a task is a whole row instead: its three phases one after the other,
// which keeps the row in the cache between them, computing exactly the same.
//
// Only what this walk serves is split: sparse labels without smoothing (the labelled class alone
// carries weight: one scalar term per row, any gamma), with C >= kSplitMinClasses. The stored
// e_c go into the gradient row, so a forward writing its scaled gradient, or a gradient op
// without the forward's statistics, needs float logits; over the logits themselves too (each
// block is read before its e_c overwrite it, and phase 3 reads only e_c). Other rows take
// simd_rows.h's walk.

#ifndef TF_METAL_OPS_SIMD_LANES
#error "include simd_vector.h and simd_rows.h before simd_split_rows.h"
#endif

// A multiple of kFoldVectors * kLanes, so every block's sum is folded from its first element.
constexpr int64_t kSplitBlockClasses = 16384;
constexpr int64_t kSplitMinClasses = 4 * kSplitBlockClasses;
// Rows per thread from which a task is a whole row.
constexpr int64_t kSplitWholeRowsPerThread = 4;

// One block's share of its row's softmax.
struct BlockPartial {
  float max;
  float min;
  // exp(z_c - max) of the classes below the row's maximum, in double lanes (an array: a
  // std::vector does not keep a vector type's alignment everywhere)
  double others[kLanes];
  int64_t ties;
};

// One row's state between the phases.
struct SplitRow {
  int64_t label;  // -1: an ignored row
  float z_y;
  RowRange range;
  RowSoftmax softmax;
  float lp_y;
  float g_y;       // gradient_term(lp_y, w_y, gamma)
  float upstream;  // of the gradient (or the forward's row scale)
};

template <typename T>
struct SplitJob {
  const RowsArgs* args;
  int64_t num_classes;
  int64_t blocks;  // per row
  bool write_gradient;  // the gradient op, or a forward writing its scaled gradient
  bool stats_given;     // a gradient op given the forward's statistics: no phases 1 and 2
  const T* logits;
  T* gradient_rows;
  std::vector<BlockPartial> partials;  // [row][block]
  std::vector<SplitRow> rows;

  int64_t BlockBegin(int64_t block) const { return block * kSplitBlockClasses; }
  int64_t BlockLength(int64_t block) const {
    return std::min(kSplitBlockClasses, num_classes - BlockBegin(block));
  }
  bool Ignored(int64_t row) const { return rows[row].label < 0; }

  // Phase 1.
  void MaxAndMin(int64_t row, int64_t block) {
    if (Ignored(row)) return;
    const RowExtremes extremes =
        RowMaxAndMin(logits + row * num_classes + BlockBegin(block), BlockLength(block));
    BlockPartial& part = partials[row * blocks + block];
    part.max = extremes.max;
    part.min = extremes.min;
  }

  // Phase 1's results combined, in block order; z_y read before phase 2 may overwrite it.
  void StartRow(int64_t row) {
    SplitRow& state = rows[row];
    if (Ignored(row)) return;
    state.z_y = Load(logits[row * num_classes + state.label]);
    if (stats_given) return;
    float max = std::numeric_limits<float>::lowest();
    float min = std::numeric_limits<float>::max();
    for (int64_t b = 0; b < blocks; ++b) {
      const BlockPartial& part = partials[row * blocks + b];
      max = part.max > max ? part.max : max;
      min = part.min < min ? part.min : min;
    }
    state.range = RangeOf(max, min);
  }

  // Phase 2.
  void ExpSum(int64_t row, int64_t block) {
    if (Ignored(row)) return;
    const int64_t c0 = BlockBegin(block);
    const T* z = logits + row * num_classes + c0;
    // e_c into the gradient row (float only: see the top of this file).
    float* e = write_gradient
                   ? reinterpret_cast<float*>(gradient_rows + row * num_classes) + c0
                   : nullptr;
    const RowRange& range = rows[row].range;
    BlockPartial& part = partials[row * blocks + block];
    const auto walk = [&](auto store_e, auto any_range) {
      ExpSumOp<decltype(store_e)::value, T, decltype(any_range)::value> op{
          z, e, z + num_classes, Splat(range.max), SplatI(0)};
      const LaneSum sum = SumOfBlocks(BlockLength(block), op);
      const VD others = sum.folded + __builtin_convertvector(sum.part, VD);
      std::memcpy(part.others, &others, sizeof(others));
      int64_t ties = 0;
      for (int i = 0; i < kLanes; ++i) ties += op.ties[i];
      part.ties = ties;
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (e != nullptr) {
      range.plain_exp ? walk(Yes{}, No{}) : walk(Yes{}, Yes{});
    } else {
      range.plain_exp ? walk(No{}, No{}) : walk(No{}, Yes{});
    }
  }

  // Phase 2's sums combined in block order (the softmax as RowExpSum finishes it), then the
  // loss and the statistics.
  void FinishRow(int64_t row) {
    SplitRow& state = rows[row];
    const RowsArgs& a = *args;
    if (Ignored(row)) {
      if (a.forward) {
        Store(0.0f, &static_cast<T*>(a.out)[row]);
        if (a.stats_out != nullptr) WriteRowStats(a.stats_out, row, 0.0f, 0.0f, 0.0f);
      }
      return;
    }
    if (!stats_given) {
      VD others{};
      int64_t ties = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        VD block_others;
        std::memcpy(&block_others, partials[row * blocks + b].others, sizeof(block_others));
        others += block_others;
        ties += partials[row * blocks + b].ties;
      }
      state.softmax = SoftmaxOfSums(state.range.max, LaneSum{Splat(0.0f), others}.Total(),
                                    static_cast<float>(ties));
    }
    const float w_y = (a.class_weights ? a.class_weights[state.label] : 1.0f) *
                      (a.smoothing_share + a.target_share);
    state.lp_y = state.softmax.LogP(state.z_y);
    state.g_y = kernels::gradient_term(state.lp_y, w_y, a.gamma);
    if (!a.forward) return;
    Store(0.0f - kernels::loss_term(state.lp_y, w_y, a.gamma), &static_cast<T*>(a.out)[row]);
    if (a.stats_out != nullptr) {
      WriteRowStats(a.stats_out, row, state.softmax.max, state.softmax.log_sum,
                    state.softmax.inv_sum);
    }
  }

  // Phase 3: d/dz_j = p_j g_y, and -r_y g_y at the label (RowKernel::GradientLabelled).
  void Gradient(int64_t row, int64_t block) {
    const int64_t c0 = BlockBegin(block);
    const int64_t n = BlockLength(block);
    T* grad = gradient_rows + row * num_classes + c0;
    const SplitRow& state = rows[row];
    if (Ignored(row)) {
      std::memset(static_cast<void*>(grad), 0, sizeof(T) * static_cast<size_t>(n));  // +0
      return;
    }
    const RowSoftmax& sm = state.softmax;
    if (stats_given) {
      const T* z = logits + row * num_classes + c0;
      ScaleOp<T, FreshE<T>> op{FreshE<T>{z, z + num_classes, Splat(sm.max)}, grad,
                               Splat(sm.inv_sum), Splat(state.g_y), Splat(state.upstream)};
      ForEachBlock(n, op);
    } else {
      ScaleOp<T, StoredE> op{StoredE{reinterpret_cast<const float*>(grad)}, grad,
                             Splat(sm.inv_sum), Splat(state.g_y), Splat(state.upstream)};
      ForEachBlock(n, op);
    }
    const int64_t y = state.label - c0;
    if (y >= 0 && y < n) {
      Store(state.upstream * kernels::only_class_gradient(state.lp_y, state.g_y), &grad[y]);
    }
  }

  // A whole row, its phases in order: the task of a batch with many rows.
  void WholeRow(int64_t row) {
    if (!stats_given) {
      for (int64_t b = 0; b < blocks; ++b) MaxAndMin(row, b);
    }
    StartRow(row);
    if (!stats_given) {
      for (int64_t b = 0; b < blocks; ++b) ExpSum(row, b);
    }
    FinishRow(row);
    if (write_gradient) {
      for (int64_t b = 0; b < blocks; ++b) Gradient(row, b);
    }
  }
};

// Runs job.*phase(row, block) for every block of every row, on the pool.
template <typename T>
void EveryBlock(SplitJob<T>& job, void (SplitJob<T>::*phase)(int64_t, int64_t),
                ParallelTasks parallel) {
  struct Context {
    SplitJob<T>* job;
    void (SplitJob<T>::*phase)(int64_t, int64_t);
  } context{&job, phase};
  parallel(static_cast<int64_t>(job.rows.size()) * job.blocks, kSplitBlockClasses,
           [](void* p, int64_t task) {
             const Context& c = *static_cast<const Context*>(p);
             ((*c.job).*(c.phase))(task / c.job->blocks, task % c.job->blocks);
           },
           &context);
}

// Computes the whole batch split into blocks and returns true, or returns false (nothing done)
// where the batch's rows are not split (see the top of this file).
template <typename T, typename Label>
bool ComputeSplitRowsTyped(const RowsArgs& args, int64_t num_rows, int threads,
                           ParallelTasks parallel) {
  if constexpr (std::is_same_v<Label, T>) {  // dense targets
    return false;
  } else {
    const bool write_gradient = !args.forward || args.scaled_gradient != nullptr;
    const bool stats_given = !args.forward && args.stats_in != nullptr;
    if (args.num_classes < kSplitMinClasses || args.smoothing_share != 0.0f) return false;
    if (write_gradient && !stats_given && !std::is_same_v<T, float>) return false;

    SplitJob<T> job;
    job.args = &args;
    job.num_classes = args.num_classes;
    job.blocks = (args.num_classes + kSplitBlockClasses - 1) / kSplitBlockClasses;
    job.write_gradient = write_gradient;
    job.stats_given = stats_given;
    job.logits = static_cast<const T*>(args.logits);
    job.gradient_rows =
        write_gradient ? static_cast<T*>(args.forward ? args.scaled_gradient : args.out)
                       : nullptr;
    job.partials.resize(static_cast<size_t>(num_rows * job.blocks));
    job.rows.resize(static_cast<size_t>(num_rows));
    for (int64_t row = 0; row < num_rows; ++row) {
      SplitRow& state = job.rows[row];
      state.label = ReadLabelAt<Label>(args.labels, row);
      if (args.has_ignore_class && state.label == args.ignore_class) state.label = -1;
      state.upstream = write_gradient ? UpstreamAt<T>(args, row) : 0.0f;
      if (stats_given) state.softmax = ReadRowStats(args.stats_in, row);
    }

    if (num_rows >= kSplitWholeRowsPerThread * threads) {
      parallel(num_rows, args.num_classes,
               [](void* p, int64_t row) { static_cast<SplitJob<T>*>(p)->WholeRow(row); }, &job);
      return true;
    }
    if (!stats_given) EveryBlock(job, &SplitJob<T>::MaxAndMin, parallel);
    for (int64_t row = 0; row < num_rows; ++row) job.StartRow(row);
    if (!stats_given) EveryBlock(job, &SplitJob<T>::ExpSum, parallel);
    for (int64_t row = 0; row < num_rows; ++row) job.FinishRow(row);
    if (write_gradient) EveryBlock(job, &SplitJob<T>::Gradient, parallel);
    return true;
  }
}
