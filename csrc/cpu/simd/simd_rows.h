// The vectorized CustomLoss / CustomLossGrad of a range of rows (float, half, bfloat16 logits).
//
// DELIBERATELY NO INCLUDE GUARD: compiled once per instruction set inside a namespace, after
// simd_vector.h (see there and rows_dispatch.h). The formulas are those of
// kernels/custom_loss_math.h, which derives them; this file only arranges them into few passes
// over a row:
//
//   pass 1  max_c z_c                                       reads the row (from memory)
//   pass 2  e_c = exp(z_c - max), sums `others` and `ties`   reads the row again (from L1/L2)
//           (stores e_c when a later pass needs p_c)
//   then    lse pieces once per row: log_sum = log1p(others + ties - 1), 1 / (others + ties)
//   pass 3  the loss terms, or the gradient, from e_c and z_c
//
// A smoothed sparse cross-entropy row without class weights has no pass of loss terms: pass 2
// also sums z_c - max, and the loss follows from that sum (CrossEntropyFromSums), so the row
// reads its logits as often as an unsmoothed one; only its gradient pass subtracts w_c.
//
// A gradient given the forward op's row statistics (max, log_sum, 1 / sum; problem.h) skips
// passes 1 and 2: a cross-entropy row computes e_c where pass 3 uses it, one pass over the row
// with one read of it in place of three; a focal row, whose pass 3 is two passes, stores e_c
// first. The forward writes the statistics for every row.
//
// A forward given a reduced loss's row scales (problem.h) runs the gradient's passes on the row
// it has just summed: pass 2 stores e_c (into the scaled gradient row, for float), the loss is
// taken, then pass 3 writes the gradient with the row's scale as its upstream, as the gradient
// op without statistics would. A step then computes exp(z_c - max) once per element instead of
// twice, and the backward only scales what the forward wrote.
//
// p_c is e_c / (others + ties), which is exp(lp_c) with lp_c = (z_c - max) - log_sum as in
// custom_loss_math.h; reusing e_c saves the second exponential per element. The gradient is
// written in place: pass 2 stores e_c straight into the gradient row (float32), which pass 3
// turns into d loss / d z, so nothing of size N x C is allocated besides the output. Half and
// bfloat16 rows keep e_c (and g_c) in a per-thread float buffer of C elements instead, so
// nothing is rounded to 16 bits before the end; so do float rows whose gradient overwrites the
// logits themselves (args.in_place), since later passes still read z_c.
//
// r_c = 1 - p_c is exact to an ulp only for p_c <= 1/2. Lanes with p_c > 1/2 (at most one
// class per row, since the p_c sum to 1: in a trained model's rows, the labelled one) take
// r = -expm1(lp) instead, as the shared scalar math (custom_loss_math.h) does, which keeps a
// confident row's digits. For gamma 1 and 2 that r is computed in the vector
// (OneMinusExpNearZero) and the lane's terms follow from the vector formulas; for other gamma
// those lanes are recomputed by the scalar code, whose limits (gamma < 1 at p -> 1) the vector
// power does not have. tests/cpu_math/shared_math_check.cc checks the vector terms against the
// scalar ones. The labelled class's own terms in the sparse, unsmoothed case are scalar anyway.

#ifndef TF_METAL_OPS_SIMD_LANES
#error "include simd_vector.h (with TF_METAL_OPS_SIMD_LANES) before simd_rows.h"
#endif

// A row's sums (the softmax's `others`, the loss, G, a dense row's weights) have up to C terms.
// Added up in float lane by lane, their rounding error grows with C / kLanes; worse, where one lane
// holds a large term (the labelled class's weight 0.9 beside 0.1 / C for each smoothed class), the
// many small terms added to it all round the same way, so at vocabulary sizes G loses digits that
// the gradient needs. So SumOfBlocks keeps only the last kFoldVectors vectors of terms in float and
// folds them into double lanes: the error is that of kFoldVectors float additions plus one final
// rounding, whatever C (tests/test_vocabulary_scale.py). Folding costs two conversions and two
// additions per kFoldVectors vectors of terms, each of which took an Exp or more to make. The
// running sums are the walker's own locals, not members of the op, so they stay in registers.
constexpr int kFoldVectors = 16;
typedef double VD __attribute__((vector_size(kLanes * 8)));

// A sum of many terms lane by lane: the last terms in float, the rest folded in double.
struct LaneSum {
  VF part;
  VD folded;
  // All lanes, summed in double and rounded once (ReduceAdd's pairwise tree).
  TMO_SIMD_INLINE float Total() const {
    const VD all = folded + __builtin_convertvector(part, VD);
    double lanes[kLanes];
    std::memcpy(lanes, &all, sizeof(all));
    for (int width = kLanes / 2; width > 0; width /= 2) {
      for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    }
    return static_cast<float>(lanes[0]);
  }
};

// A row is walked as full vectors plus one shorter tail: Op::Block<true> for the full ones (no
// tail test inside the main loop), Op::Block<false> once for the last num_classes % kLanes.
template <typename Op>
TMO_SIMD_INLINE void ForEachBlock(int64_t num_classes, Op& op) {
  const int64_t full_end = num_classes - num_classes % kLanes;
  int64_t c = 0;
  for (; c < full_end; c += kLanes) op.template Block<true>(c, kLanes);
  if (c < num_classes) op.template Block<false>(c, num_classes - c);
}

// Two of a row's sums taken in the same walk (a focal row's loss and its G): an op's terms as
// a pair, summed and folded as two single sums would be, so each comes out bit for bit as it
// would alone.
struct TermPair {
  VF first, second;
};
struct LaneSumPair {
  LaneSum first, second;
};
TMO_SIMD_INLINE void AddTerms(VF& sum, VF term) { sum += term; }
TMO_SIMD_INLINE void AddTerms(TermPair& sum, const TermPair& term) {
  sum.first += term.first;
  sum.second += term.second;
}

// The folded lanes while a walk runs, as two vectors of half the lanes each: GCC moves a whole
// VD (two registers' worth on AVX2) through general registers in 8-byte pieces when it is spilled
// around a loop that needs every vector register (a focal pass); halves of one register each are
// spilled and reloaded whole. The same additions lane by lane, so the same sums bit for bit.
typedef double VDHalf __attribute__((vector_size(kLanes * 4)));
struct FoldedHalves {
  VDHalf low, high;
  TMO_SIMD_INLINE void Add(VF part) {
#if TF_METAL_OPS_SIMD_LANES == 8
    low += __builtin_convertvector(__builtin_shufflevector(part, part, 0, 1, 2, 3), VDHalf);
    high += __builtin_convertvector(__builtin_shufflevector(part, part, 4, 5, 6, 7), VDHalf);
#elif TF_METAL_OPS_SIMD_LANES == 4
    low += __builtin_convertvector(__builtin_shufflevector(part, part, 0, 1), VDHalf);
    high += __builtin_convertvector(__builtin_shufflevector(part, part, 2, 3), VDHalf);
#elif TF_METAL_OPS_SIMD_LANES == 16
    low += __builtin_convertvector(
        __builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7), VDHalf);
    high += __builtin_convertvector(
        __builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15), VDHalf);
#else
#error "FoldedHalves takes 4, 8 or 16 lanes"
#endif
  }
  // Into a LaneSum's whole vector (written in place: a VD return value would take an ABI that
  // depends on the instruction set, which GCC warns of).
  TMO_SIMD_INLINE void CopyTo(VD* whole) const {
    std::memcpy(whole, &low, sizeof(low));
    std::memcpy(reinterpret_cast<char*>(whole) + sizeof(low), &high, sizeof(high));
  }
};
struct FoldedPair {
  FoldedHalves first, second;
};
TMO_SIMD_INLINE void Fold(FoldedHalves& folded, VF part) { folded.Add(part); }
TMO_SIMD_INLINE void Fold(FoldedPair& folded, const TermPair& part) {
  folded.first.Add(part.first);
  folded.second.Add(part.second);
}
TMO_SIMD_INLINE void ZeroTerms(VF& part) { part = Splat(0.0f); }
TMO_SIMD_INLINE void ZeroTerms(TermPair& part) { part = {Splat(0.0f), Splat(0.0f)}; }
TMO_SIMD_INLINE LaneSum SumOf(const VF& part, const FoldedHalves& folded) {
  LaneSum sum;
  sum.part = part;
  folded.CopyTo(&sum.folded);
  return sum;
}
TMO_SIMD_INLINE LaneSumPair SumOf(const TermPair& part, const FoldedPair& folded) {
  return {SumOf(part.first, folded.first), SumOf(part.second, folded.second)};
}

// The same walk for ops whose blocks give terms to sum (Op::Term, 0 in a tail's padding
// lanes; a VF, or a TermPair for two sums): their sum (LaneSum, or LaneSumPair), folded every
// kFoldVectors vectors (LaneSum above). Rows of few classes, kLanes at a time
// (simd_row_groups.h), sum at most kMaxGroupClasses terms per lane: kFold = false keeps them in
// float, which is accurate enough for so few terms and spares those short rows the folding's
// conversions.
template <bool kFold = true, typename Op>
TMO_SIMD_INLINE auto SumOfBlocks(int64_t num_classes, Op& op) {
  using Term = decltype(op.template Term<true>(int64_t{0}, int64_t{kLanes}));
  std::conditional_t<std::is_same_v<Term, VF>, FoldedHalves, FoldedPair> folded{};
  constexpr int64_t kGroup = kFoldVectors * kLanes;
  const int64_t groups_end = kFold ? num_classes - num_classes % kGroup : 0;
  int64_t c = 0;
  for (; c < groups_end; c += kGroup) {
    Term part = op.template Term<true>(c, kLanes);
    for (int k = 1; k < kFoldVectors; ++k) {
      AddTerms(part, op.template Term<true>(c + k * kLanes, kLanes));
    }
    Fold(folded, part);
  }
  Term part;
  ZeroTerms(part);
  const int64_t full_end = num_classes - num_classes % kLanes;
  for (; c < full_end; c += kLanes) AddTerms(part, op.template Term<true>(c, kLanes));
  if (c < num_classes) AddTerms(part, op.template Term<false>(c, num_classes - c));
  return SumOf(part, folded);
}

// A sparse row's class weights differ from one class to the next only at the label (without
// class weights every other class weighs eps / C), so only the vector holding the label needs
// the weights' label test. Ops that weigh classes take Term<kFull, kLabelBlock> (Block<...> for
// ForEachBlock): kLabelBlock = false promises the block holds no labelled class, so the weights
// skip the test (WeightsAt). The walks below call it so for every vector but the label's, which
// they reach by splitting their loops there, not by a test per vector: each vector's terms and
// their order of addition are those of SumOfBlocks and ForEachBlock, so the sums and the stores
// are the same bit for bit. `label` < 0: no vector holds a label (dense targets, groups of rows).
template <bool kFull, typename Op>
TMO_SIMD_INLINE auto TermOfBlock(Op& op, int64_t c, int64_t n, int64_t label_block) {
  return c == label_block ? op.template Term<kFull, true>(c, n)
                          : op.template Term<kFull, false>(c, n);
}

template <bool kFold = true, typename Op>
TMO_SIMD_INLINE auto SumOfBlocksAroundLabel(int64_t num_classes, Op& op, int64_t label) {
  using Term = decltype(op.template Term<true, false>(int64_t{0}, int64_t{kLanes}));
  const int64_t label_block = label < 0 ? -1 : label - label % kLanes;
  constexpr int64_t kGroup = kFoldVectors * kLanes;
  const int64_t groups_end = kFold ? num_classes - num_classes % kGroup : 0;
  std::conditional_t<std::is_same_v<Term, VF>, FoldedHalves, FoldedPair> folded{};
  int64_t c = 0;
  for (; c < groups_end; c += kGroup) {
    Term part;
    if (label_block >= c && label_block < c + kGroup) {  // one group of the row
      part = TermOfBlock<true>(op, c, kLanes, label_block);
      for (int k = 1; k < kFoldVectors; ++k) {
        AddTerms(part, TermOfBlock<true>(op, c + k * kLanes, kLanes, label_block));
      }
    } else {  // the loop of SumOfBlocks, without the label's test
      part = op.template Term<true, false>(c, kLanes);
      for (int k = 1; k < kFoldVectors; ++k) {
        AddTerms(part, op.template Term<true, false>(c + k * kLanes, kLanes));
      }
    }
    Fold(folded, part);
  }
  Term part;
  ZeroTerms(part);
  const int64_t full_end = num_classes - num_classes % kLanes;
  if (label_block >= c && label_block < full_end) {
    for (; c < label_block; c += kLanes) AddTerms(part, op.template Term<true, false>(c, kLanes));
    AddTerms(part, op.template Term<true, true>(c, kLanes));
    c += kLanes;
  }
  for (; c < full_end; c += kLanes) AddTerms(part, op.template Term<true, false>(c, kLanes));
  if (c < num_classes) AddTerms(part, TermOfBlock<false>(op, c, num_classes - c, label_block));
  return SumOf(part, folded);
}

template <typename Op>
TMO_SIMD_INLINE void ForEachBlockAroundLabel(int64_t num_classes, Op& op, int64_t label) {
  const int64_t label_block = label < 0 ? -1 : label - label % kLanes;
  const int64_t full_end = num_classes - num_classes % kLanes;
  int64_t c = 0;
  if (label_block >= 0 && label_block < full_end) {
    for (; c < label_block; c += kLanes) op.template Block<true, false>(c, kLanes);
    op.template Block<true, true>(c, kLanes);
    c += kLanes;
  }
  for (; c < full_end; c += kLanes) op.template Block<true, false>(c, kLanes);
  if (full_end < num_classes) {
    if (full_end == label_block) {
      op.template Block<false, true>(full_end, num_classes - full_end);
    } else {
      op.template Block<false, false>(full_end, num_classes - full_end);
    }
  }
}
template <bool kFull, typename T>
TMO_SIMD_INLINE VF LoadBlock(const T* p, int64_t n, float fill) {
  if constexpr (kFull) {
    return LoadFull(p);
  } else {
    return LoadN(p, n, fill);
  }
}
template <bool kFull, typename T>
TMO_SIMD_INLINE void StoreBlock(T* p, VF v, int64_t n) {
  if constexpr (kFull) {
    StoreFull(p, v);
  } else {
    StoreN(p, v, n);
  }
}
template <bool kFull>
TMO_SIMD_INLINE VF ZeroTail(VF v, int64_t n) {
  if constexpr (kFull) {
    return v;
  } else {
    return KeepIf(Iota() < SplatI(static_cast<int32_t>(n)), v);
  }
}

// w_c = a_c q_c of a sparse row, for the lanes [c, c + n); lanes past n are 0. The options are
// copied in, not read through RowsArgs: a pass that stores floats (the build has no strict
// aliasing) would otherwise load them again for every vector.
struct SparseWeights {
  const float* class_weights;  // null: all ones
  float smoothing_share;
  float target_share;
  float sum_class_weights;
  int64_t label;
  static SparseWeights Of(const RowsArgs& args, int64_t label) {
    return {args.class_weights, args.smoothing_share, args.target_share, args.sum_class_weights,
            label};
  }
  // kLabelBlock = false: the caller knows [c, c + n) does not hold the label (WeightsAt).
  template <bool kFull, bool kLabelBlock = true>
  TMO_SIMD_INLINE VF Get(int64_t c, int64_t n) const {
    VF q = Splat(smoothing_share);
    if constexpr (kLabelBlock) {
      const int64_t d = label - c;
      if (d >= 0 && d < kLanes) {
        q = q + KeepIf(Iota() == SplatI(static_cast<int32_t>(d)), Splat(target_share));
      }
    }
    q = ZeroTail<kFull>(q, n);
    return class_weights ? LoadBlock<kFull>(class_weights + c, n, 0.0f) * q : q;
  }
  float ClassWeight(int64_t c) const { return class_weights ? class_weights[c] : 1.0f; }
  // Whether every class's w_c is nonzero: smoothed, without class weights (which may be 0).
  bool NeverZero() const { return class_weights == nullptr && smoothing_share > 0.0f; }
  // sum_c w_c without a pass over the classes.
  float Sum(int64_t) const {
    return smoothing_share * sum_class_weights + target_share * ClassWeight(label);
  }
};

// w_c of the lanes [c, c + n), for an op's Term<kFull, kLabelBlock> (SumOfBlocksAroundLabel):
// only sparse rows have a label to skip; every other kind of weights reads its lanes alike.
template <bool kFull, bool kLabelBlock, typename Weights>
TMO_SIMD_INLINE VF WeightsAt(const Weights& weights, int64_t c, int64_t n) {
  return weights.template Get<kFull>(c, n);
}
template <bool kFull, bool kLabelBlock>
TMO_SIMD_INLINE VF WeightsAt(const SparseWeights& weights, int64_t c, int64_t n) {
  return weights.template Get<kFull, kLabelBlock>(c, n);
}
// The class whose weight differs from the rest: a sparse row's label, none (-1) for others.
template <typename Weights>
TMO_SIMD_INLINE int64_t LabelOf(const Weights&) {
  return -1;
}
TMO_SIMD_INLINE int64_t LabelOf(const SparseWeights& weights) { return weights.label; }

// w_c = a_c ((1 - eps) t_c + eps / C) of a dense row.
template <typename T>
struct DenseWeights {
  const RowsArgs* args;
  const T* targets;
  template <bool kFull>
  TMO_SIMD_INLINE VF Get(int64_t c, int64_t n) const {
    const VF t = LoadBlock<kFull>(targets + c, n, 0.0f);
    VF q = ZeroTail<kFull>(Splat(args->target_share) * t + Splat(args->smoothing_share), n);
    return args->class_weights ? LoadBlock<kFull>(args->class_weights + c, n, 0.0f) * q : q;
  }
  // Targets may be 0 where nothing is smoothed: each lane is tested.
  bool NeverZero() const { return false; }
  struct SumOp {
    const DenseWeights* weights;
    template <bool kFull>
    TMO_SIMD_INLINE VF Term(int64_t c, int64_t n) {
      return weights->template Get<kFull>(c, n);
    }
  };
  float Sum(int64_t num_classes) const {
    SumOp op{this};
    return SumOfBlocks(num_classes, op).Total();
  }
};

// How r^gamma is computed, fixed per op execution so the inner loops carry no test for it.
enum class GammaKind { kOne, kTwo, kGeneral };
inline GammaKind KindOf(float gamma) {
  return gamma == 1.0f ? GammaKind::kOne : gamma == 2.0f ? GammaKind::kTwo : GammaKind::kGeneral;
}

// r^gamma for r in [1/2, 1] (the vector lanes), NaN passing through.
template <GammaKind kGamma>
TMO_SIMD_INLINE VF PowVector(VF r, float gamma) {
  if constexpr (kGamma == GammaKind::kOne) {
    return r;
  } else if constexpr (kGamma == GammaKind::kTwo) {
    return r * r;  // pow(r, 2) is r * r correctly rounded: the same value
  } else {
    return Exp(Splat(gamma) * Log(r));
  }
}

// The softmax of one row, as custom_loss_math.h's RowLogSoftmax plus the reciprocal of the sum.
struct RowSoftmax {
  float max;
  float log_sum;  // log sum_c exp(z_c - max), via log1p(others + ties - 1)
  float inv_sum;  // 1 / sum_c exp(z_c - max): p_c = e_c * inv_sum
  float LogP(float z) const { return (z - max) - log_sum; }
};

// Pass 1: the row's maximum, and whether every z_c - max lies within Exp's plain range
// (kExpPlainRange), so that pass 2 may call Exp<false>. The minimum this needs costs one more
// instruction per vector of a pass that waits for memory anyway. Neither takes a NaN.
struct RowRange {
  float max;
  bool plain_exp;
};
struct RowExtremes {
  float max;
  float min;
};
template <typename T>
TMO_SIMD_INLINE RowExtremes RowMaxAndMin(const T* z, int64_t num_classes) {
  const float lowest = std::numeric_limits<float>::lowest();
  const float highest = std::numeric_limits<float>::max();
  VF max0 = Splat(lowest);
  VF max1 = max0;
  VF min0 = Splat(highest);
  VF min1 = min0;
  int64_t c = 0;
  for (; c + 2 * kLanes <= num_classes; c += 2 * kLanes) {  // two chains hide the latency
    const VF v0 = LoadFull(z + c);
    const VF v1 = LoadFull(z + c + kLanes);
    max0 = MaxKeep(max0, v0);
    max1 = MaxKeep(max1, v1);
    min0 = MinKeep(min0, v0);
    min1 = MinKeep(min1, v1);
  }
  for (; c < num_classes; c += kLanes) {
    max0 = MaxKeep(max0, LoadN(z + c, num_classes - c, lowest));
    min0 = MinKeep(min0, LoadN(z + c, num_classes - c, highest));
  }
  const VF maxima = MaxKeep(max0, max1);
  const VF minima = MinKeep(min0, min1);
  RowExtremes extremes;
  extremes.max = ReduceMaxKeep(maxima, lowest);
  extremes.min = highest;
  for (int i = 0; i < kLanes; ++i) extremes.min = minima[i] < extremes.min ? minima[i] : extremes.min;
  return extremes;
}
TMO_SIMD_INLINE RowRange RangeOf(float max, float min) {
  // Rounded, max - min still bounds every rounded z_c - max from below. An infinite logit
  // makes it inf (or NaN for +inf alone): not plain.
  return {max, max - min <= kExpPlainRange};
}
template <typename T>
TMO_SIMD_INLINE RowRange RowMaxAndRange(const T* z, int64_t num_classes) {
  const RowExtremes extremes = RowMaxAndMin(z, num_classes);
  return RangeOf(extremes.max, extremes.min);
}

// Pass 2. Each logit equal to the maximum adds exactly 1 (counted in `ties`), the others'
// share is summed apart so a confident row keeps its digits (custom_loss_math.h). The tail's
// padding lanes hold the maximum itself (exp(0): Exp's fast path) and are then masked out of e
// and of the ties.
//
// This pass reads the row from the cache and spends its time on Exp, while pass 1 of the next
// row waits for memory; so it also asks for the next row (`next_z`, into L2: a row of 32000
// classes would not fit L1 beside the current one). The next row's memory latency is then
// hidden behind this row's Exp. A prefetch never faults, so the last row of a range may name
// memory past the tensor.
//
// kShifted: the walk also sums z_c - max, the shifted sum S of custom_loss_math.h from which a
// smoothed cross-entropy row takes its loss without a pass of its own (CrossEntropyFromSums).
// Its terms are the Exp's own argument, one addition per vector; the padding lanes hold
// max - max = 0. Its sum is a second LaneSum beside `others`, which stays the same bit for bit.
template <bool kStoreE, typename T, bool kAnyRange = true, bool kShifted = false>
struct ExpSumOp {
  const T* z;
  float* e_out;
  const T* next_z;
  VF max;
  VI ties;
  // exp(z_c - max) of the classes below the maximum (the term of `others`), and z_c - max.
  template <bool kFull>
  TMO_SIMD_INLINE auto Term(int64_t c, int64_t n) {
    __builtin_prefetch(next_z + c, /*rw=*/0, /*locality=*/2);
    const VF v = LoadBlock<kFull>(z + c, n, max[0]);
    VI tie = v == max;
    VF e = Exp<kAnyRange>(v - max);
    if constexpr (!kFull) {
      const VI valid = Iota() < SplatI(static_cast<int32_t>(n));
      tie &= valid;
      e = KeepIf(valid, e);
    }
    ties -= tie;  // tie lanes are -1
    if constexpr (kStoreE) StoreBlock<kFull>(e_out + c, e, n);
    if constexpr (kShifted) {
      return TermPair{DropIf(tie, e), v - max};
    } else {
      return DropIf(tie, e);
    }
  }
};

// Pass 2's sums: `others`, `ties` and (kShifted) S = sum_c (z_c - max).
struct ExpSums {
  float others;
  float ties;
  float shifted;
};
template <bool kStoreE, bool kAnyRange, bool kShifted, typename T>
TMO_SIMD_INLINE ExpSums OthersAndTies(const T* z, int64_t num_classes, float max, float* e_out) {
  ExpSumOp<kStoreE, T, kAnyRange, kShifted> op{z, e_out, z + num_classes, Splat(max), SplatI(0)};
  ExpSums sums{};
  if constexpr (kShifted) {
    const LaneSumPair both = SumOfBlocks(num_classes, op);
    sums.others = both.first.Total();
    sums.shifted = both.second.Total();
  } else {
    sums.others = SumOfBlocks(num_classes, op).Total();
  }
  sums.ties = ReduceAdd(__builtin_convertvector(op.ties, VF));
  return sums;
}

// The row's softmax from pass 2's sums.
TMO_SIMD_INLINE RowSoftmax SoftmaxOfSums(float max, float others_sum, float ties_sum) {
  kernels::LogSumExp<float> state;
  state.max = max;
  state.ties = ties_sum;
  state.others = others_sum;
  RowSoftmax softmax;
  softmax.max = max;
  // No logit reached the maximum (all -inf or NaN): log(0) = -inf makes every lp NaN. A +inf
  // logit: NaN (custom_loss_math.h's lse_finish).
  softmax.log_sum = kernels::lse_finish(state).log_sum;
  softmax.inv_sum = 1.0f / (others_sum + ties_sum);
  if (max == std::numeric_limits<float>::infinity()) {
    // The softmax is inf / inf, undefined in floating point. The whole row is NaN, as in the
    // reference (computed literally, the loss could come out inf beside a NaN gradient).
    softmax.inv_sum = std::numeric_limits<float>::quiet_NaN();
  }
  return softmax;
}

// kShifted: S = sum_c (z_c - max) into *shifted (ExpSumOp).
template <bool kStoreE, bool kShifted = false, typename T>
TMO_SIMD_INLINE RowSoftmax RowExpSum(const T* z, int64_t num_classes, RowRange range,
                                     float* e_out, float* shifted = nullptr) {
  const ExpSums sums =
      range.plain_exp ? OthersAndTies<kStoreE, false, kShifted>(z, num_classes, range.max, e_out)
                      : OthersAndTies<kStoreE, true, kShifted>(z, num_classes, range.max, e_out);
  if constexpr (kShifted) *shifted = sums.shifted;
  return SoftmaxOfSums(range.max, sums.others, sums.ties);
}

// The loss of a sparse, smoothed cross-entropy row without class weights (gamma = 0, every
// w_c = eps / C but the label's) from pass 2's S: custom_loss_math.h's cross-entropy sums, as
// the Metal kernels take them, -loss = S' - W log_sum with W = (1 - eps) + (eps / C) C and
// S' = (eps / C) S + (1 - eps) (z_y - max). Both parts are <= 0, so nothing cancels; the sums'
// error is that of SumOfBlocks, as the loss terms' was (tests/test_vocabulary_scale.py).
TMO_SIMD_INLINE float CrossEntropyFromSums(const RowsArgs& args, const RowSoftmax& sm, float z_y,
                                           float shifted) {
  const float label_weight = args.target_share;  // (1 - eps) a_y with a_y = 1
  const float total = kernels::sparse_total_weight(label_weight, args.smoothing_share,
                                                   args.sum_class_weights);
  const float row_shifted =
      args.smoothing_share * shifted + kernels::shifted_term(z_y, sm.max, label_weight);
  kernels::RowLogSoftmax<float> ls;
  ls.max = sm.max;
  ls.log_sum = sm.log_sum;
  return 0.0f - kernels::cross_entropy_neg_loss(ls, total, row_shifted);  // 0 - x: +0
}

// Where the gradient passes take e_c from: pass 2's stored values, or (rows whose statistics
// came from the forward op, which skip pass 2) computed in the same pass from z_c and the
// row's max, exactly as ExpSumOp computes them, so the gradient is the same bit for bit. The
// fresh source also prefetches the next row, as ExpSumOp does.
struct StoredE {
  const float* e;
  template <bool kFull>
  TMO_SIMD_INLINE VF Get(int64_t c, int64_t n) const {
    return LoadBlock<kFull>(e + c, n, 0.0f);
  }
};
template <typename T>
struct FreshE {
  const T* z;
  const T* next_z;
  VF max;
  template <bool kFull>
  TMO_SIMD_INLINE VF Get(int64_t c, int64_t n) const {
    __builtin_prefetch(next_z + c, /*rw=*/0, /*locality=*/2);
    return Exp(LoadBlock<kFull>(z + c, n, 0.0f) - max);
  }
};

// e_c into `e_out` for a row whose statistics are known (the focal gradient's passes read
// them twice).
template <typename T>
struct ExpOp {
  FreshE<T> source;
  float* e_out;
  template <bool kFull>
  TMO_SIMD_INLINE void Block(int64_t c, int64_t n) {
    StoreBlock<kFull>(e_out + c, source.template Get<kFull>(c, n), n);
  }
};

// The forward's row statistics (problem.h's row_stats) of one row.
TMO_SIMD_INLINE void WriteRowStats(float* stats, int64_t row, float max, float log_sum,
                                   float inv_sum) {
  float* at = stats + row * kRowStatsWidth;
  at[0] = max;
  at[1] = log_sum;
  at[2] = inv_sum;
}
TMO_SIMD_INLINE RowSoftmax ReadRowStats(const float* stats, int64_t row) {
  const float* at = stats + row * kRowStatsWidth;
  RowSoftmax softmax;
  softmax.max = at[0];
  softmax.log_sum = at[1];
  softmax.inv_sum = at[2];
  return softmax;
}

// The lanes whose p > 1/2, where r = 1 - p is not exact enough (see the top of this file).
TMO_SIMD_INLINE VI Confident(VF p) { return p > Splat(0.5f); }

// The focal loss terms (into `loss`, unless null) and factors (into `factor`, unless null) of
// the lanes in `fix`, in scalar (gamma other than 1 and 2). A function of its own, called for
// at most one class of a row (p > 1/2): inlined into each unrolled vector of every focal
// variant, the scalar functions were most of the variants' code and compile time, for no speed.
__attribute__((noinline, cold)) inline void RecomputeInScalar(const VI& fix, const VF& lp,
                                                             const VF& w, float gamma, VF* loss,
                                                             VF* factor) {
  for (int i = 0; i < kLanes; ++i) {
    if (!fix[i]) continue;
    if (loss != nullptr) (*loss)[i] = kernels::loss_term(lp[i], w[i], gamma);
    if (factor != nullptr) (*factor)[i] = kernels::focal_gradient_factor(lp[i], gamma);
  }
}

// The softmax quantities as vectors: one row's RowSoftmax in every lane, or one row per lane
// for a group of rows with few classes (simd_row_groups.h), which the passes below serve alike.
struct SoftmaxLanes {
  VF max, log_sum, inv_sum;
  static SoftmaxLanes Of(const RowSoftmax& sm) {
    return {Splat(sm.max), Splat(sm.log_sum), Splat(sm.inv_sum)};
  }
  // Whether any p_c = e_c * inv_sum of these rows can exceed 1/2, so that a pass must test its
  // lanes for Confident. Every e_c = exp(z_c - max) is at most 1 (z_c <= max, and Exp
  // never rounds above 1 below 0), so p_c <= inv_sum: a row whose inv_sum is at most 1/2 (its
  // largest p is) has no such lane, and its passes skip the test. (A NaN inv_sum makes every
  // p NaN, which the test lets through anyway.)
  bool MayBeConfident() const { return Any(inv_sum > Splat(0.5f)); }
};

// Forward of a general row with gamma = 0 (smoothing, dense targets or class weights all
// allowed): the loss terms w_c lp_c, summed by the caller; -loss is their sum.
template <typename T, typename Weights>
struct CrossEntropyLossOp {
  const T* z;
  const Weights* weights;
  VF max, log_sum;
  template <bool kFull, bool kLabelBlock = true>
  TMO_SIMD_INLINE VF Term(int64_t c, int64_t n) {
    const VF w = WeightsAt<kFull, kLabelBlock>(*weights, c, n);
    const VF lp = (LoadBlock<kFull>(z + c, n, 0.0f) - max) - log_sum;
    return KeepIf(w != Splat(0.0f), w * lp);  // w = 0: 0, not 0 * inf
  }
};

// What a focal pass (gamma > 0) computes from each class's lp, p = e_c * inv_sum and r = 1 - p:
// the loss terms w_c r^gamma lp_c (-loss is their sum), the gradient's
// g_c = w_c r^gamma (1 - gamma p lp / r) (stored into `g`; G is their sum), or both. A forward
// that also writes the gradient takes both in one pass over z_c and e_c: the same values as
// the two passes alone, bit for bit.
enum class FocalOutputs { kLoss, kFactor, kBoth };

// One class's focal quantities, vector by vector. For gamma = 1 and 2 the factor is
// r - p lp and r (r - 2 p lp), the same quantity without a division: r >= 0 and p lp <= 0, so
// nothing cancels. kCheckConfident: some lane may have p > 1/2 (SoftmaxLanes::MayBeConfident),
// whose r comes from lp (gamma 1 and 2) or whose terms are recomputed in scalar (other gamma).
// kWeightsNonzero: no class of a full vector has w_c = 0 (Weights::NeverZero), so no lane needs
// the w = 0 rule there.
// kFiniteLp: every lp_c of the row is finite (its logits span less than Exp's plain range,
// RowRange::plain_exp), so where p = 0, p lp is a zero already and needs no test: its sign
// cannot matter, since the factor only subtracts it from r or 1 (r - (-0) = r - 0 = r).
template <FocalOutputs kOutputs, GammaKind kGamma, bool kCheckConfident, bool kWeightsNonzero,
          bool kFiniteLp, typename T, typename Weights>
struct FocalTermsOp {
  static constexpr bool kLoss = kOutputs != FocalOutputs::kFactor;
  static constexpr bool kFactor = kOutputs != FocalOutputs::kLoss;
  const T* z;
  const float* e;
  Weights weights;  // a copy: its fields stay in registers across the stores to `g`
  float* g;
  float gamma;
  VF max, log_sum, inv_sum;
  template <bool kFull, bool kLabelBlock = true>
  TMO_SIMD_INLINE auto Term(int64_t c, int64_t n) {
    const VF w = WeightsAt<kFull, kLabelBlock>(weights, c, n);
    const VF lp = (LoadBlock<kFull>(z + c, n, 0.0f) - max) - log_sum;
    const VF p = LoadBlock<kFull>(e + c, n, 0.0f) * inv_sum;
    VF r = Splat(1.0f) - p;
    if constexpr (kCheckConfident && kGamma != GammaKind::kGeneral) {
      // r = -expm1(lp) where p > 1/2, as the scalar code takes it, in the vector: for gamma 1
      // and 2 the terms below then hold for those lanes too (r^gamma is r or r * r, and
      // r - gamma p lp adds two terms of one sign).
      const VI confident = Confident(p);
      if (Any(confident)) r = Select(confident, OneMinusExpNearZero(lp), r);
    }
    const VF power = PowVector<kGamma>(r, gamma);
    VF loss{};
    VF factor{};
    if constexpr (kLoss) loss = w * (power * lp);
    if constexpr (kFactor) {
      // lim p lp = 0 as p -> 0, also where lp = -inf (a masked class).
      const VF p_lp = kFiniteLp ? p * lp : KeepIf(p != Splat(0.0f), p * lp);
      if constexpr (kGamma == GammaKind::kOne) {
        factor = r - p_lp;
      } else if constexpr (kGamma == GammaKind::kTwo) {
        factor = r * Fma(Splat(-2.0f), p_lp, r);  // 2 p lp is exact: r - 2 p lp rounded once
      } else {
        factor = power * (Splat(1.0f) - Splat(gamma) * (p_lp / r));
      }
    }
    if constexpr (kCheckConfident && kGamma == GammaKind::kGeneral) {
      const VI fix = Confident(p);
      if (Any(fix)) {
        RecomputeInScalar(fix, lp, w, gamma, kLoss ? &loss : nullptr,
                          kFactor ? &factor : nullptr);
      }
    }
    if constexpr (kFactor) factor = w * factor;
    if constexpr (!(kFull && kWeightsNonzero)) {
      const VI weighted = w != Splat(0.0f);  // w = 0: 0, not 0 * inf
      if constexpr (kLoss) loss = KeepIf(weighted, loss);
      if constexpr (kFactor) factor = KeepIf(weighted, factor);
    }
    if constexpr (kFactor) StoreBlock<kFull>(g + c, factor, n);
    if constexpr (kOutputs == FocalOutputs::kBoth) {
      return TermPair{loss, factor};
    } else if constexpr (kLoss) {
      return loss;
    } else {
      return factor;
    }
  }
};

// Each variant is a function of its own: inlined together into FocalTerms, GCC kept the op's
// pointers and constants on the stack and reloaded them in every vector of the loop.
template <FocalOutputs kOutputs, bool kFold, GammaKind kGamma, bool kCheckConfident,
          bool kWeightsNonzero, bool kFiniteLp, typename T, typename Weights>
__attribute__((noinline)) auto FocalTermsOf(const T* z, const Weights& weights, const SoftmaxLanes& sm,
                             const float* e, float* g, float gamma, int64_t length) {
  FocalTermsOp<kOutputs, kGamma, kCheckConfident, kWeightsNonzero, kFiniteLp, T, Weights> op{
      z, e, weights, g, gamma, sm.max, sm.log_sum, sm.inv_sum};
  return SumOfBlocksAroundLabel<kFold>(length, op, LabelOf(weights));
}

// kFiniteLp is taken only where a pass computes both outputs (a forward writing the gradient,
// which alone knows the row's range): elsewhere it would only multiply the variants compiled.
template <FocalOutputs kOutputs, bool kFold, GammaKind kGamma, bool kCheckConfident,
          bool kWeightsNonzero, typename T, typename Weights>
TMO_SIMD_INLINE auto FocalTermsOfRange(const T* z, const Weights& weights,
                                       const SoftmaxLanes& sm, const float* e, float* g,
                                       float gamma, int64_t length, bool finite_lp) {
  if constexpr (kOutputs == FocalOutputs::kBoth) {
    if (finite_lp) {
      return FocalTermsOf<kOutputs, kFold, kGamma, kCheckConfident, kWeightsNonzero, true>(
          z, weights, sm, e, g, gamma, length);
    }
  }
  return FocalTermsOf<kOutputs, kFold, kGamma, kCheckConfident, kWeightsNonzero, false>(
      z, weights, sm, e, g, gamma, length);
}

template <FocalOutputs kOutputs, bool kFold, GammaKind kGamma, typename T, typename Weights>
TMO_SIMD_INLINE auto FocalTermsChecked(const T* z, const Weights& weights,
                                       const SoftmaxLanes& sm, const float* e, float* g,
                                       float gamma, int64_t length, bool finite_lp) {
  const bool nonzero = weights.NeverZero();
  if (sm.MayBeConfident()) {
    return nonzero ? FocalTermsOfRange<kOutputs, kFold, kGamma, true, true>(
                         z, weights, sm, e, g, gamma, length, finite_lp)
                   : FocalTermsOfRange<kOutputs, kFold, kGamma, true, false>(
                         z, weights, sm, e, g, gamma, length, finite_lp);
  }
  return nonzero ? FocalTermsOfRange<kOutputs, kFold, kGamma, false, true>(
                       z, weights, sm, e, g, gamma, length, finite_lp)
                 : FocalTermsOfRange<kOutputs, kFold, kGamma, false, false>(
                       z, weights, sm, e, g, gamma, length, finite_lp);
}

// A focal pass over `length` elements (gamma > 0; `e` holds e_c), by the kind of gamma: the
// loss terms' sum (LaneSum), G's (LaneSum, g_c into `g`), or both (LaneSumPair: loss, G).
// `finite_lp`: the row's logits span less than Exp's plain range (FocalTermsOp's kFiniteLp).
template <FocalOutputs kOutputs, bool kFold = true, typename T, typename Weights>
auto FocalTerms(const T* z, const Weights& weights, const SoftmaxLanes& sm, const float* e,
                float* g, float gamma, int64_t length, bool finite_lp = false) {
  switch (KindOf(gamma)) {
    case GammaKind::kOne:
      return FocalTermsChecked<kOutputs, kFold, GammaKind::kOne>(z, weights, sm, e, g, gamma,
                                                                 length, finite_lp);
    case GammaKind::kTwo:
      return FocalTermsChecked<kOutputs, kFold, GammaKind::kTwo>(z, weights, sm, e, g, gamma,
                                                                 length, finite_lp);
    case GammaKind::kGeneral:
      break;
  }
  return FocalTermsChecked<kOutputs, kFold, GammaKind::kGeneral>(z, weights, sm, e, g, gamma,
                                                                 length, finite_lp);
}

// sum_{c: w_c != 0} w_c r_c^gamma lp_c lane by lane, over `length` elements: a row's loss is
// 0 - the sum of the lanes. `e` holds pass 2's e_c when gamma > 0.
template <bool kFold = true, typename T, typename Weights>
LaneSum LossTerms(const T* z, const Weights& weights, const SoftmaxLanes& sm, const float* e,
                  float gamma, int64_t length) {
  if (gamma == 0.0f) {
    CrossEntropyLossOp<T, Weights> op{z, &weights, sm.max, sm.log_sum};
    return SumOfBlocksAroundLabel<kFold>(length, op, LabelOf(weights));
  }
  return FocalTerms<FocalOutputs::kLoss, kFold>(z, weights, sm, e, nullptr, gamma, length);
}

// g_c into `g` over `length` elements (gamma > 0), and their sums lane by lane: a row's G is
// the sum of the lanes.
template <bool kFold = true, typename T, typename Weights>
LaneSum FocalFactorTerms(const T* z, const Weights& weights, const SoftmaxLanes& sm,
                         const float* e, float* g, float gamma, int64_t length) {
  return FocalTerms<FocalOutputs::kFactor, kFold>(z, weights, sm, e, g, gamma, length);
}

// Both in one pass (gamma > 0): the loss terms' sum and G's, g_c into `g`.
template <bool kFold = true, typename T, typename Weights>
LaneSumPair FocalLossAndFactorTerms(const T* z, const Weights& weights, const SoftmaxLanes& sm,
                                    const float* e, float* g, float gamma, int64_t length,
                                    bool finite_lp = false) {
  return FocalTerms<FocalOutputs::kBoth, kFold>(z, weights, sm, e, g, gamma, length, finite_lp);
}

// grad_c = upstream * (p_c * scale), p_c = e_c / sum: the gradient of a sparse, unsmoothed row
// (scale = g_y) before its labelled element is set. A stored `e` may be `grad` itself.
template <typename T, typename ESource>
struct ScaleOp {
  ESource e;
  T* grad;
  VF inv_sum, scale, upstream;
  template <bool kFull>
  TMO_SIMD_INLINE void Block(int64_t c, int64_t n) {
    StoreBlock<kFull>(grad + c, upstream * ((e.template Get<kFull>(c, n) * inv_sum) * scale), n);
  }
};

// grad_c = upstream * (p_c * total - w_c): gamma = 0, where g_c = w_c.
template <typename T, typename Weights, typename ESource>
struct CrossEntropyGradOp {
  ESource e;
  Weights weights;  // a copy: its fields stay in registers across the stores to `grad`
  T* grad;
  VF inv_sum, total, upstream;
  template <bool kFull, bool kLabelBlock = true>
  TMO_SIMD_INLINE void Block(int64_t c, int64_t n) {
    const VF p = e.template Get<kFull>(c, n) * inv_sum;
    StoreBlock<kFull>(grad + c,
                      upstream * (p * total - WeightsAt<kFull, kLabelBlock>(weights, c, n)), n);
  }
};

// grad_c = upstream * (p_c * total - g_c).
template <typename T>
struct FocalGradOp {
  const float* e;
  const float* g;
  T* grad;
  VF inv_sum, total, upstream;
  template <bool kFull>
  TMO_SIMD_INLINE void Block(int64_t c, int64_t n) {
    const VF p = LoadBlock<kFull>(e + c, n, 0.0f) * inv_sum;
    StoreBlock<kFull>(grad + c, upstream * (p * total - LoadBlock<kFull>(g + c, n, 0.0f)), n);
  }
};

template <typename T, typename Weights>
struct RowKernel {
  const RowsArgs& args;
  int64_t num_classes;

  float Loss(const T* z, const Weights& weights, const RowSoftmax& sm, const float* e) const {
    // 0 - x: a zero loss is +0
    return 0.0f - LossTerms(z, weights, SoftmaxLanes::Of(sm), e, args.gamma, num_classes).Total();
  }

  // Gradient of a sparse, unsmoothed row: only the label carries weight, G = g_y, and
  // d/dz_j = p_j g_y (j != y), -r_y g_y (j = y, custom_loss_math.h's only_class_gradient).
  // `e` gives e_c; stored, it may be `grad`.
  template <typename ESource>
  void GradientLabelled(const T* z, int64_t label, float w_y, const RowSoftmax& sm,
                        const ESource& e, float upstream, T* grad) const {
    const float lp_y = sm.LogP(Load(z[label]));  // read before the pass may overwrite z (in place)
    const float g = kernels::gradient_term(lp_y, w_y, args.gamma);
    ScaleOp<T, ESource> op{e, grad, Splat(sm.inv_sum), Splat(g), Splat(upstream)};
    ForEachBlock(num_classes, op);
    Store(upstream * kernels::only_class_gradient(lp_y, g), &grad[label]);
  }

  // Gradient of a general row with gamma = 0: g_c = w_c, so d/dz_j = p_j W - w_j.
  template <typename ESource>
  void GradientCrossEntropy(const Weights& weights, const RowSoftmax& sm, const ESource& e,
                            float upstream, T* grad) const {
    CrossEntropyGradOp<T, Weights, ESource> op{e, weights, grad, Splat(sm.inv_sum),
                                               Splat(weights.Sum(num_classes)), Splat(upstream)};
    ForEachBlockAroundLabel(num_classes, op, LabelOf(weights));
  }

  // Gradient of a general focal row: g_c into `g`, G = sum, then d/dz_j = p_j G - g_j.
  void GradientFocal(const T* z, const Weights& weights, const RowSoftmax& sm, const float* e,
                     float* g, float upstream, T* grad) const {
    const float total =
        FocalFactorTerms(z, weights, SoftmaxLanes::Of(sm), e, g, args.gamma, num_classes).Total();
    FocalGradWithTotal(sm, e, g, total, upstream, grad);
  }

  // The loss of a general focal row and its gradient, with g_c and the loss terms taken in one
  // pass: the same loss as Loss() and the same gradient as GradientFocal(), bit for bit.
  // `range` is the row's from pass 1.
  float LossAndGradientFocal(const T* z, const Weights& weights, const RowSoftmax& sm,
                             const RowRange& range, const float* e, float* g, float upstream,
                             T* grad) const {
    const LaneSumPair sums = FocalLossAndFactorTerms(z, weights, SoftmaxLanes::Of(sm), e, g,
                                                     args.gamma, num_classes, range.plain_exp);
    FocalGradWithTotal(sm, e, g, sums.second.Total(), upstream, grad);
    return 0.0f - sums.first.Total();  // 0 - x: a zero loss is +0
  }

  void FocalGradWithTotal(const RowSoftmax& sm, const float* e, const float* g, float total,
                          float upstream, T* grad) const {
    FocalGradOp<T> grads{e, g, grad, Splat(sm.inv_sum), Splat(total), Splat(upstream)};
    ForEachBlock(num_classes, grads);
  }

  // The gradient of one row, by kind: sparse and unsmoothed (`label` >= 0 only then), plain
  // cross-entropy, or general focal. The first two take e_c from `source`; the focal passes read
  // e_c twice, so they need it stored in `e` already.
  template <typename ESource>
  void Gradient(const T* z, int64_t label, float w_y, const Weights& weights,
                const RowSoftmax& sm, const ESource& source, const float* e, float* g,
                float upstream, T* grad) const {
    if (label >= 0) {
      GradientLabelled(z, label, w_y, sm, source, upstream, grad);
    } else if (args.gamma == 0.0f) {
      GradientCrossEntropy(weights, sm, source, upstream, grad);
    } else {
      GradientFocal(z, weights, sm, e, g, upstream, grad);
    }
  }
};

// The upstream gradient of one row: the gradient op's, or a reduced loss's row scale.
template <typename T>
TMO_SIMD_INLINE float UpstreamAt(const RowsArgs& args, int64_t row) {
  return args.upstream != nullptr ? Load(static_cast<const T*>(args.upstream)[row])
                                  : args.row_scales[row];
}

// The gradient op's arguments for the rows whose forward (`args`) also writes the scaled
// gradient: its upstream is the row scales, its statistics are the forward's.
inline RowsArgs GradientAfterForward(const RowsArgs& args) {
  RowsArgs gradient = args;
  gradient.forward = false;
  gradient.out = args.scaled_gradient;
  gradient.scaled_gradient = nullptr;
  gradient.upstream = nullptr;
  gradient.stats_in = args.stats_out;
  gradient.stats_out = nullptr;
  gradient.in_place = args.in_place;  // the scaled gradient may be over the logits
  return gradient;
}

template <typename Label>
TMO_SIMD_INLINE int64_t ReadLabelAt(const void* labels, int64_t row) {
  return static_cast<int64_t>(static_cast<const Label*>(labels)[row]);
}

// Rows of few classes, kLanes rows at a time: simd_row_groups.h, included after this file.
// The limits are where groups stop paying on x86-64 (one thread, every mode of the loss): the
// forward gains from them up to 48 classes at 8 lanes and 32 at 4 (by 64 classes a row alone
// fills its vectors); the gradient, which also transposes its output back, up to 32 at 8 lanes
// and 24 at 4 (past that, smoothed rows lose). NEON, whose crossover has not been timed, takes
// the 4-lane limits.
constexpr int64_t kMaxGroupClassesForward = kLanes >= 8 ? 48 : 32;
constexpr int64_t kMaxGroupClassesGradient = kLanes >= 8 ? 32 : 24;
constexpr int64_t kMaxGroupClasses =
    kMaxGroupClassesForward > kMaxGroupClassesGradient ? kMaxGroupClassesForward
                                                       : kMaxGroupClassesGradient;
template <typename T, typename Label>
void ComputeRowGroupsTyped(const RowsArgs& args, int64_t begin, int64_t end);

// Rows [begin, end) of one storage type and label kind (Label = T for dense targets).
template <typename T, typename Label>
void ComputeRowsTyped(const RowsArgs& args, int64_t begin, int64_t end) {
  const bool scaled_gradient = args.forward && args.scaled_gradient != nullptr;
  if (args.num_classes <=
      (args.forward ? kMaxGroupClassesForward : kMaxGroupClassesGradient)) {
    // The scaled gradient must be what the gradient op would compute from the forward's
    // statistics. Where the gradient op groups its rows too, the groups write it from the
    // softmax at hand; where it takes the rows one by one, so does the scaled gradient.
    if (!scaled_gradient || args.num_classes <= kMaxGroupClassesGradient) {
      ComputeRowGroupsTyped<T, Label>(args, begin, end);
      return;
    }
    RowsArgs forward_only = args;
    forward_only.scaled_gradient = nullptr;
    ComputeRowGroupsTyped<T, Label>(forward_only, begin, end);
    ComputeRowsTyped<T, Label>(GradientAfterForward(args), begin, end);
    return;
  }
  constexpr bool kDense = std::is_same_v<Label, T>;
  const int64_t num_classes = args.num_classes;
  const T* logits = static_cast<const T*>(args.logits);
  T* out = static_cast<T*>(args.out);
  const bool forward = args.forward;
  const bool gamma_zero = args.gamma == 0.0f;
  // Sparse rows without smoothing have a single weighted class, handled in scalar.
  const bool only_labelled = !kDense && args.smoothing_share == 0.0f;
  // Focal rows weighing more than the labelled class: their passes read e_c twice (forward:
  // the sum, then the loss terms; gradient: g_c, then d/dz), so e_c is stored.
  const bool general_focal = !only_labelled && !gamma_zero;
  // Smoothed sparse cross-entropy rows without class weights take their loss from a sum that
  // pass 2 carries (CrossEntropyFromSums), not from a pass of loss terms.
  const bool loss_from_sums =
      !kDense && !only_labelled && gamma_zero && args.class_weights == nullptr;

  // Float gradients keep e_c in the output row itself; the rest needs float buffers of C.
  bool need_e = false;
  bool need_g = false;
  if (scaled_gradient) {
    // Over the logits (args.in_place), e_c must not overwrite z_c, which the loss still reads.
    need_e = !std::is_same_v<T, float> || args.in_place;
    need_g = general_focal;
  } else if (forward) {
    need_e = general_focal;
  } else {
    // In place, e_c must not overwrite z_c, which later passes still read.
    need_e = !std::is_same_v<T, float> || args.in_place;
    need_g = general_focal;
  }
  // Kept per thread between calls (a pool worker serves many): O(C) per thread, no N x C.
  static thread_local std::vector<float> buffers;
  const size_t buffer_size =
      static_cast<size_t>(num_classes) * ((need_e ? 1 : 0) + (need_g ? 1 : 0));
  if (buffers.size() < buffer_size) buffers.resize(buffer_size);
  float* e_buffer = need_e ? buffers.data() : nullptr;
  float* g_buffer = need_g ? buffers.data() + (need_e ? num_classes : 0) : nullptr;

  RowKernel<T, std::conditional_t<kDense, DenseWeights<T>, SparseWeights>> kernel{args,
                                                                                  num_classes};
  // The gradient rows: the gradient op's output, or the forward's scaled gradient (null when
  // the forward writes none).
  T* gradient_rows = forward ? static_cast<T*>(args.scaled_gradient) : out;
  for (int64_t row = begin; row < end; ++row) {
    const T* z = logits + row * num_classes;
    T* grad = gradient_rows != nullptr ? gradient_rows + row * num_classes : nullptr;
    int64_t label = -1;
    if constexpr (!kDense) {
      label = ReadLabelAt<Label>(args.labels, row);
      if (args.has_ignore_class && label == args.ignore_class) {
        if (forward) {
          Store(0.0f, &out[row]);
          if (args.stats_out != nullptr) WriteRowStats(args.stats_out, row, 0.0f, 0.0f, 0.0f);
        }
        if (grad != nullptr) {
          std::memset(static_cast<void*>(grad), 0,
                      sizeof(T) * static_cast<size_t>(num_classes));  // +0 in every type
        }
        continue;
      }
    }
    std::conditional_t<kDense, DenseWeights<T>, SparseWeights> weights;
    if constexpr (kDense) {
      weights = DenseWeights<T>{&args, static_cast<const T*>(args.labels) + row * num_classes};
    } else {
      weights = SparseWeights::Of(args, label);
    }

    float w_y = 0.0f;            // w_c of the labelled class
    int64_t labelled_only = -1;  // the label of a sparse, unsmoothed row
    if constexpr (!kDense) {
      w_y = weights.ClassWeight(label) * (args.smoothing_share + args.target_share);
      if (only_labelled) labelled_only = label;
    }
    // Where e_c is kept: float gradients keep it in the gradient row itself, which the last
    // pass turns into grad_c.
    float* e = e_buffer;
    if constexpr (std::is_same_v<T, float>) {
      if (grad != nullptr && !args.in_place) e = grad;
    }

    if (forward) {
      const RowRange range = RowMaxAndRange(z, num_classes);
      // The scaled gradient's last pass reads e_c, as a focal row's loss terms do.
      const bool store_e = general_focal || scaled_gradient;
      float shifted = 0.0f;  // S of a row whose loss comes from sums
      float z_y = 0.0f;
      RowSoftmax sm;
      if (loss_from_sums) {
        z_y = Load(z[label]);  // read before pass 2 may store e_c
        sm = store_e ? RowExpSum<true, true>(z, num_classes, range, e, &shifted)
                     : RowExpSum<false, true>(z, num_classes, range, nullptr, &shifted);
      } else {
        sm = store_e ? RowExpSum<true>(z, num_classes, range, e)
                     : RowExpSum<false>(z, num_classes, range, nullptr);
      }
      float loss = 0.0f;
      // A focal row's loss terms and g_c come from one pass over z_c and e_c (both need the
      // same lp_c, p_c and r_c); only the gradient pass after it writes (over the logits, in
      // place).
      const bool loss_with_gradient = scaled_gradient && general_focal;
      if (only_labelled) {
        loss = 0.0f - kernels::loss_term(sm.LogP(Load(z[labelled_only])), w_y, args.gamma);
      } else if (loss_from_sums) {
        loss = CrossEntropyFromSums(args, sm, z_y, shifted);
      } else if (loss_with_gradient) {
        loss = kernel.LossAndGradientFocal(z, weights, sm, range, e, g_buffer,
                                           args.row_scales[row], grad);
      } else {
        loss = kernel.Loss(z, weights, sm, general_focal ? e : nullptr);
      }
      Store(loss, &out[row]);
      if (args.stats_out != nullptr) {
        WriteRowStats(args.stats_out, row, sm.max, sm.log_sum, sm.inv_sum);
      }
      if (scaled_gradient && !loss_with_gradient) {
        // The gradient op's computation without statistics, from this row's e_c, with the
        // row's scale as its upstream.
        kernel.Gradient(z, labelled_only, w_y, weights, sm, StoredE{e}, e, g_buffer,
                        args.row_scales[row], grad);
      }
      continue;
    }

    const float upstream = UpstreamAt<T>(args, row);
    if (args.stats_in != nullptr) {
      // The forward op's statistics: no pass to find them. Cross-entropy rows are then one
      // pass (e_c computed where p_c is used); focal rows store e_c for their two passes.
      const RowSoftmax sm = ReadRowStats(args.stats_in, row);
      const FreshE<T> fresh{z, z + num_classes, Splat(sm.max)};
      if (general_focal) {
        ExpOp<T> exps{fresh, e};
        ForEachBlock(num_classes, exps);
      }
      kernel.Gradient(z, labelled_only, w_y, weights, sm, fresh, e, g_buffer, upstream, grad);
      continue;
    }
    const RowSoftmax sm = RowExpSum<true>(z, num_classes, RowMaxAndRange(z, num_classes), e);
    kernel.Gradient(z, labelled_only, w_y, weights, sm, StoredE{e}, e, g_buffer, upstream, grad);
  }
}
