// Rows with few classes, kLanes rows at a time.
//
// DELIBERATELY NO INCLUDE GUARD: compiled once per instruction set, after simd_rows.h (see
// there and rows_dispatch.h).
//
// With C = 10 a row is one vector plus a tail, and simd_rows.h's per-row work (three horizontal
// reductions, the scalar log1p of the sum, the labelled element's expm1, loop and tail
// bookkeeping) costs several times the arithmetic on the row, much of it in libm's scalar
// log1pf and expm1f. Here a group of kLanes rows is copied
// transposed into a tile, tile[c * kLanes + i] = z[row i][c], so that one vector holds class c
// of every row of the group. The per-row quantities (max, sum, log_sum, the loss, G) are then
// vectors with one lane per row: no horizontal reduction is left, and log1p and expm1 are the
// vector ones of simd_vector.h.
//
// The formulas and passes are simd_rows.h's, and so are its block operations: walked as one
// "row" of C * kLanes elements, the tile's block k is class k of all rows. Only the class
// weights differ (one class per block, one label per lane): GroupSparseWeights and
// GroupDenseWeights. Padding lanes (a last group with fewer than kLanes rows) compute on zeros
// and are never written; ignored rows compute on their logits and are written as +0.

#ifndef TF_METAL_OPS_SIMD_LANES
#error "include simd_vector.h and simd_rows.h before simd_row_groups.h"
#endif

// w_c for the sparse rows of a group.
struct GroupSparseWeights {
  const RowsArgs* args;
  VI labels;          // -1 in lanes of ignored and padding rows: no class matches
  VF label_weights;   // a_y, 0 in those lanes
  // Each lane is tested for w_c = 0 (rows of few classes spend little on it).
  bool NeverZero() const { return false; }
  template <bool kFull>
  TMO_SIMD_INLINE VF Get(int64_t offset, int64_t) const {
    const int64_t c = offset / kLanes;
    const VF q = Splat(args->smoothing_share) +
                 KeepIf(labels == SplatI(static_cast<int32_t>(c)), Splat(args->target_share));
    return args->class_weights ? Splat(args->class_weights[c]) * q : q;
  }
  // sum_c w_c per row, as SparseWeights::Sum.
  VF Sum(int64_t) const {
    return Splat(args->smoothing_share * args->sum_class_weights) +
           Splat(args->target_share) * label_weights;
  }
};

// w_c for the dense rows of a group; `targets` is the group's tile of targets.
struct GroupDenseWeights {
  const RowsArgs* args;
  const float* targets;
  // Each lane is tested for w_c = 0 (rows of few classes spend little on it).
  bool NeverZero() const { return false; }
  template <bool kFull>
  TMO_SIMD_INLINE VF Get(int64_t offset, int64_t) const {
    const int64_t c = offset / kLanes;
    const VF q = Splat(args->target_share) * LoadFull(targets + offset) +
                 Splat(args->smoothing_share);
    return args->class_weights ? Splat(args->class_weights[c]) * q : q;
  }
  VF Sum(int64_t num_classes) const {
    VF sum = Splat(0.0f);
    for (int64_t c = 0; c < num_classes; ++c) sum += Get<true>(c * kLanes, kLanes);
    return sum;
  }
};

// A mask of the lanes not marked in `marked`, made in memory and loaded whole: a vector set
// lane by lane costs a round trip through memory per lane.
TMO_SIMD_INLINE VI LanesKept(const bool* marked) {
  alignas(64) int32_t lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = marked[i] ? 0 : -1;
  VI kept;
  std::memcpy(&kept, lanes, sizeof(kept));
  return kept;
}

// tile[c * kLanes + i] = rows[i][c] for the first `num_rows` rows; the other lanes are 0. A full
// group is moved kLanes classes at a time, as square blocks transposed in registers: copied
// element by element, the transposition cost more than all the arithmetic on the tile. The
// classes past the last whole block are one more block of masked loads where those are cheap
// (AVX-512: at 16 lanes, rows of fewer than 16 classes are all tail); elsewhere they are copied
// element by element, which on AVX2 took less time than a block ending at the row's end
// (overlapping the one before it) and its transposition.
template <typename T>
TMO_SIMD_INLINE void LoadTile(const T* rows, int64_t num_rows, int64_t num_classes, float* tile) {
  if (num_rows == kLanes) {
    int64_t c = 0;
    for (; c + kLanes <= num_classes; c += kLanes) {
      VF block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = LoadFull(rows + i * num_classes + c);
      Transpose(block);
      for (int j = 0; j < kLanes; ++j) StoreFull(tile + (c + j) * kLanes, block[j]);
    }
#if defined(TMO_SIMD_AVX512)
    if (c < num_classes) {
      const int64_t rest = num_classes - c;
      VF block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = LoadN(rows + i * num_classes + c, rest, 0.0f);
      Transpose(block);
      for (int64_t j = 0; j < rest; ++j) StoreFull(tile + (c + j) * kLanes, block[j]);
    }
#else
    for (; c < num_classes; ++c) {
      VF v;
      for (int i = 0; i < kLanes; ++i) v[i] = Load(rows[i * num_classes + c]);
      StoreFull(tile + c * kLanes, v);
    }
#endif
    return;
  }
  for (int64_t i = 0; i < kLanes; ++i) {
    const T* row = rows + i * num_classes;
    for (int64_t c = 0; c < num_classes; ++c) {
      tile[c * kLanes + i] = i < num_rows ? Load(row[c]) : 0.0f;
    }
  }
}

// rows[i][c] = tile[c * kLanes + i] for the first `num_rows` rows, +0 for the rows marked in
// `zeroed` (ignored rows): LoadTile's transposition backwards, its last block too.
template <typename T>
TMO_SIMD_INLINE void StoreTile(const float* tile, int64_t num_rows, int64_t num_classes,
                               const bool* zeroed, T* rows) {
  if (num_rows == kLanes) {
    // lane i is row i: zeroed before the transposition, it is a row of zeros after
    const VI keep = LanesKept(zeroed);
    int64_t c = 0;
    for (; c + kLanes <= num_classes; c += kLanes) {
      VF block[kLanes];
      for (int j = 0; j < kLanes; ++j) block[j] = KeepIf(keep, LoadFull(tile + (c + j) * kLanes));
      Transpose(block);
      for (int i = 0; i < kLanes; ++i) StoreFull(rows + i * num_classes + c, block[i]);
    }
#if defined(TMO_SIMD_AVX512)
    if (c < num_classes) {
      const int64_t rest = num_classes - c;
      VF block[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        block[j] = j < rest ? KeepIf(keep, LoadFull(tile + (c + j) * kLanes)) : Splat(0.0f);
      }
      Transpose(block);
      for (int i = 0; i < kLanes; ++i) StoreN(rows + i * num_classes + c, block[i], rest);
    }
#else
    for (; c < num_classes; ++c) {
      const VF v = KeepIf(keep, LoadFull(tile + c * kLanes));
      for (int i = 0; i < kLanes; ++i) Store(v[i], &rows[i * num_classes + c]);
    }
#endif
    return;
  }
  for (int64_t i = 0; i < num_rows; ++i) {
    T* row = rows + i * num_classes;
    for (int64_t c = 0; c < num_classes; ++c) {
      Store(zeroed[i] ? 0.0f : tile[c * kLanes + i], &row[c]);
    }
  }
}

// The group's softmax, lane by lane, as RowExpSum computes it for one row. `e` receives e_c.
TMO_SIMD_INLINE SoftmaxLanes GroupSoftmax(const float* tile, int64_t num_classes, float* e) {
  VF max = Splat(std::numeric_limits<float>::lowest());
  VF min = Splat(std::numeric_limits<float>::max());
  for (int64_t c = 0; c < num_classes; ++c) {
    const VF v = LoadFull(tile + c * kLanes);
    max = MaxKeep(max, v);
    min = MinKeep(min, v);
  }
  // Nothing to prefetch: the tile is in L1, and the next group's rows follow this one's.
  // Exp<false> where every row of the group spans less than its plain range (RowMaxAndRange).
  VF others;
  VI ties_count;
  if (!Any(max - min > Splat(kExpPlainRange))) {
    ExpSumOp<true, float, false> op{tile, e, tile, max, SplatI(0)};
    others = SumOfBlocks<false>(num_classes * kLanes, op).part;  // never folded
    ties_count = op.ties;
  } else {
    ExpSumOp<true, float> op{tile, e, tile, max, SplatI(0)};
    others = SumOfBlocks<false>(num_classes * kLanes, op).part;
    ties_count = op.ties;
  }
  const VF ties = __builtin_convertvector(ties_count, VF);
  SoftmaxLanes sm;
  sm.max = max;
  // No logit reached the maximum (all -inf or NaN): log(0) = -inf makes every lp NaN.
  sm.log_sum = Select(ties == Splat(0.0f), Log(others), Log1p(others + (ties - Splat(1.0f))));
  sm.inv_sum = Splat(1.0f) / (others + ties);
  // A +inf logit: the row is NaN (see RowExpSum).
  const VI plus_inf = max == Splat(std::numeric_limits<float>::infinity());
  sm.log_sum = Select(plus_inf, Splat(std::numeric_limits<float>::quiet_NaN()), sm.log_sum);
  sm.inv_sum = Select(plus_inf, Splat(std::numeric_limits<float>::quiet_NaN()), sm.inv_sum);
  return sm;
}

// Rows [begin, end) in groups of kLanes. A forward that also writes the scaled gradient
// (args.scaled_gradient) writes it from the group's softmax at hand: the gradient op given the
// forward's statistics would compute the same softmax from the same tile, so the values are
// the same bit for bit, without reading and transposing the rows a second time.
template <typename T, typename Label>
void ComputeRowGroupsTyped(const RowsArgs& args, int64_t begin, int64_t end) {
  constexpr bool kDense = std::is_same_v<Label, T>;
  const int64_t num_classes = args.num_classes;
  const int64_t width = num_classes * kLanes;
  const T* logits = static_cast<const T*>(args.logits);
  T* out = static_cast<T*>(args.out);
  const bool forward = args.forward;
  // The gradient rows: the gradient op's output, or the forward's scaled gradient (null when
  // the forward writes none).
  T* gradient_rows = forward ? static_cast<T*>(args.scaled_gradient) : out;
  const float gamma = args.gamma;
  const bool only_labelled = !kDense && args.smoothing_share == 0.0f;

  alignas(64) float z[kMaxGroupClasses * kLanes];
  alignas(64) float e[kMaxGroupClasses * kLanes];
  alignas(64) float g[kMaxGroupClasses * kLanes];      // g_c of focal gradients
  alignas(64) float grad[kMaxGroupClasses * kLanes];   // the gradient, before it is scattered
  alignas(64) float targets[kDense ? kMaxGroupClasses * kLanes : 1];

  for (int64_t first = begin; first < end; first += kLanes) {
    const int64_t rows = std::min<int64_t>(kLanes, end - first);
    LoadTile(logits + first * num_classes, rows, num_classes, z);
    bool ignored[kLanes] = {};
    VI labels = SplatI(-1);
    VF label_weights = Splat(0.0f);
    if constexpr (kDense) {
      LoadTile(static_cast<const T*>(args.labels) + first * num_classes, rows, num_classes,
               targets);
    } else if (rows == kLanes && !args.has_ignore_class && args.class_weights == nullptr) {
      // A full group of labelled rows without class weights (the common case): the labels
      // alone, without the per-row tests and defaults below (at 65536 x 10, three quarters of
      // what loading the lanes from an array saved; docs/performance.md). Both paths fill an
      // array and load it as one vector: set lane by lane, a vector costs a round trip through
      // memory per lane.
      alignas(64) int32_t lanes[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        lanes[i] = static_cast<int32_t>(ReadLabelAt<Label>(args.labels, first + i));
      }
      std::memcpy(&labels, lanes, sizeof(labels));
      label_weights = Splat(1.0f);
    } else {
      alignas(64) int32_t lanes[kLanes];
      alignas(64) float lane_weights[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        lanes[i] = -1;
        lane_weights[i] = 0.0f;
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t label = ReadLabelAt<Label>(args.labels, first + i);
        ignored[i] = args.has_ignore_class && label == args.ignore_class;
        if (ignored[i]) continue;
        lanes[i] = static_cast<int32_t>(label);
        lane_weights[i] = args.class_weights ? args.class_weights[label] : 1.0f;
      }
      std::memcpy(&labels, lanes, sizeof(labels));
      std::memcpy(&label_weights, lane_weights, sizeof(label_weights));
    }
    const SoftmaxLanes sm = GroupSoftmax(z, num_classes, e);

    // Sparse, unsmoothed rows: only the labelled class carries weight (see RowKernel).
    VF lp_y = Splat(0.0f);
    VF w_y = Splat(0.0f);
    if (only_labelled) {
      VF z_y = Splat(0.0f);  // lanes without a label keep 0
      VI class_id = SplatI(0);
      for (int64_t c = 0; c < num_classes; ++c, class_id += SplatI(1)) {
        z_y = Select(labels == class_id, LoadFull(z + c * kLanes), z_y);
      }
      lp_y = (z_y - sm.max) - sm.log_sum;
      w_y = label_weights * Splat(args.smoothing_share + args.target_share);
    }
    std::conditional_t<kDense, GroupDenseWeights, GroupSparseWeights> weights;
    if constexpr (kDense) {
      weights = GroupDenseWeights{&args, targets};
    } else {
      weights = GroupSparseWeights{&args, labels, label_weights};
    }

    // A forward writing a focal gradient takes the loss terms and g_c in one pass (G here).
    const bool focal_with_gradient =
        forward && !only_labelled && gamma != 0.0f && gradient_rows != nullptr;
    VF focal_total = Splat(0.0f);
    if (forward) {
      VF loss;
      if (focal_with_gradient) {
        const LaneSumPair sums =
            FocalLossAndFactorTerms<false>(z, weights, sm, e, g, gamma, width);
        loss = Splat(0.0f) - sums.first.part;
        focal_total = sums.second.part;
      } else if (only_labelled) {
        VF term = lp_y;  // gamma = 0: r^0 lp
        if (gamma != 0.0f) {
          for (int64_t i = 0; i < rows; ++i) term[i] = kernels::focal_loss_factor(lp_y[i], gamma);
        }
        loss = KeepIf(w_y != Splat(0.0f), Splat(0.0f) - w_y * term);
      } else {
        loss = Splat(0.0f) - LossTerms<false>(z, weights, sm, e, gamma, width).part;
      }
      const VI kept = LanesKept(ignored);  // ignored rows write +0 everywhere
      StoreN(out + first, KeepIf(kept, loss), rows);
      if (args.stats_out != nullptr) {
        alignas(64) float stats[3][kLanes];
        StoreFull(stats[0], KeepIf(kept, sm.max));
        StoreFull(stats[1], KeepIf(kept, sm.log_sum));
        StoreFull(stats[2], KeepIf(kept, sm.inv_sum));
        for (int64_t i = 0; i < rows; ++i) {
          WriteRowStats(args.stats_out, first + i, stats[0][i], stats[1][i], stats[2][i]);
        }
      }
      if (gradient_rows == nullptr) continue;
    }

    const VF upstream =
        args.upstream != nullptr
            ? LoadN(static_cast<const T*>(args.upstream) + first, rows, 0.0f)
            : LoadN(args.row_scales + first, rows, 0.0f);
    if (only_labelled) {
      VF scale = w_y;  // g_y for gamma = 0
      if (gamma != 0.0f) {
        for (int64_t i = 0; i < rows; ++i) {
          scale[i] = kernels::gradient_term(lp_y[i], w_y[i], gamma);
        }
      }
      // ScaleOp's p_c g_y, with each row's labelled class (-r_y g_y) put in as it passes.
      const VF at_label = upstream * (Expm1(lp_y) * scale);
      VI class_id = SplatI(0);
      for (int64_t c = 0; c < num_classes; ++c, class_id += SplatI(1)) {
        const VF p = LoadFull(e + c * kLanes) * sm.inv_sum;
        StoreFull(grad + c * kLanes, Select(labels == class_id, at_label, upstream * (p * scale)));
      }
    } else if (gamma == 0.0f) {
      CrossEntropyGradOp<float, decltype(weights), StoredE> op{
          StoredE{e}, weights, grad, sm.inv_sum, weights.Sum(num_classes), upstream};
      ForEachBlock(width, op);
    } else {
      const VF total = focal_with_gradient
                           ? focal_total
                           : FocalFactorTerms<false>(z, weights, sm, e, g, gamma, width).part;
      FocalGradOp<float> op{e, g, grad, sm.inv_sum, total, upstream};
      ForEachBlock(width, op);
    }
    StoreTile(grad, rows, num_classes, ignored, gradient_rows + first * num_classes);
  }
}
