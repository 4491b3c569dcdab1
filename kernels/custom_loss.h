// CustomLoss forward and gradient kernels, Metal Shading Language templates.
// Instantiated (one [[host_name]] per dtype x label kind x direction x variant, and for sparse
// labels a plain and a label-smoothed cross-entropy one each: KernelForm) in custom_loss.metal;
// launched with the geometry of csrc/metal/launch_plan.cc; run on Linux by the emulator in
// tests/msl_host/ (which compiles this file as C++).
//
// ---------------------------------------------------------------------------------------------
// What a row computes, and why each formula is written as it is, is derived in
// custom_loss_math.h, the scalar math these kernels share with the CPU's scalar paths. Here: how
// a row's threads share the work. The gradient kernel writes upstream[row] * dloss/dz_j: the
// incoming per-row gradient is folded in, and what it needs is recomputed from the logits (no
// N x C intermediate is saved), except the row's max and log-sum when the forward's row_stats
// are given. A forward given row_scales also writes row_scales[row] * dloss/dz_j (a reduced
// loss's gradient, csrc/problem.h) while the row's softmax is at hand. All arithmetic is in
// float, whatever T is; loads convert, stores round once.
//
// The two variants (chosen on the host by csrc/metal/launch_plan.cc from C):
// - rowtg   (C > 256): one row per threadgroup. Each thread strides over the row; partial
//   results are reduced inside each SIMD-group (simd_max / simd_sum), then across SIMD-groups
//   through threadgroup memory: every SIMD-group reads all partials and reduces them again,
//   so each thread ends with the row's value without a broadcast. Two barriers per row at most.
// - rowsimd (C <= 256): one row per group of threads_per_row lanes (a power of two that divides
//   the SIMD width); the group reduces with simd_shuffle_xor butterflies, registers only.
//   A butterfly leaves every lane of the group with the bitwise-same result (the combine
//   functions are commutative), so the lanes agree without a broadcast.
// Both: C need not be a multiple of anything (threads stride, idle threads reduce identities);
// rows past N (the last, partial threadgroup) return early, as whole lane groups or whole
// threadgroups, so every barrier and SIMD-group function is reached by all live threads.
// The gradient a kernel writes may be bound over its logits (TensorFlow forwards the logits'
// buffer to it when nothing else holds them), so a row's logits are read before the row's
// gradient is written over them: each thread reads only its own classes in every pass, writing
// each after reading it, except the label's logit z_y, which every thread of a sparse row needs;
// share_label_logit orders that read (rowtg: a barrier) or hands the value around (rowsimd: from
// the lane that walks class y, by butterfly) before pass 3; a row that is not valid is filled by
// the threads that walk it.
//
// Out-of-range sparse labels (not ignore_class): the row's loss / gradient is NaN and the first
// lane of the row reports it in the error record (custom_loss_params.h) with atomics; the host
// reads the record after commitAndWait, or from a completion handler once the GPU is done
// (csrc/pending_errors.h), and raises the CPU kernel's InvalidArgumentError.
// ---------------------------------------------------------------------------------------------
#ifndef TF_METAL_OPS_KERNELS_CUSTOM_LOSS_H_
#define TF_METAL_OPS_KERNELS_CUSTOM_LOSS_H_

#include <metal_stdlib>

#include "custom_loss_math.h"
#include "custom_loss_params.h"

// Hooks with a Metal default: the Linux shim (csrc/emulator/include/metal_stdlib) defines them
// first. Instantiation registers each kernel under its host_name there; the [[threadgroup(i)]]
// attribute is the one MSL spelling the C++ preprocessor cannot take, because the shim defines
// `threadgroup` as an address-space macro.
#ifndef TFMO_INSTANTIATE_KERNEL
#define TFMO_INSTANTIATE_KERNEL(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
#endif
#ifndef TFMO_THREADGROUP_ARG
#define TFMO_THREADGROUP_ARG(index) [[threadgroup(index)]]
#endif

// The thread-position arguments of every kernel, in this order (the emulator binds them by
// position). The 2-component ones must agree in dimension; the grid is folded into x and y.
#define TFMO_KERNEL_THREAD_ARGS                              \
  uint2 tg_pos [[threadgroup_position_in_grid]],             \
  uint2 tg_count [[threadgroups_per_grid]],                  \
  uint2 tg_size [[threads_per_threadgroup]],                 \
  uint tid [[thread_index_in_threadgroup]],                  \
  uint lane [[thread_index_in_simdgroup]],                   \
  uint simd_width [[threads_per_simdgroup]],                 \
  uint sg_index [[simdgroup_index_in_threadgroup]],          \
  uint sg_count [[simdgroups_per_threadgroup]]

#define TFMO_ROW_VALID 0u
#define TFMO_ROW_IGNORED 1u
#define TFMO_ROW_BAD_LABEL 2u

namespace tf_metal_ops {
namespace kernels {

// ::metal, Metal's standard library: the host code has a tf_metal_ops::metal of its own.
using namespace ::metal;

// ---- a thread's running sums -----------------------------------------------------------------
// Each thread of a row adds up C / threads terms (512 at C = 262144 with 512 threads). Added
// plainly, the error grows with that count, and where one thread holds a large term (the
// labelled class's weight beside the smoothed classes' eps / C each) the small terms added to it
// all round the same way. Neumaier's compensated sum carries each addition's rounding error
// apart, so a thread's sum is accurate to about an ulp whatever C; the reductions across threads
// that follow are trees of depth log2(threads), whose error does not grow with C either.
struct CompensatedSum {
  float sum;
  float carry;  // the rounding errors of the additions so far
};

inline CompensatedSum compensated_zero() {
  CompensatedSum s;
  s.sum = 0.0f;
  s.carry = 0.0f;
  return s;
}

inline void compensated_add(thread CompensatedSum& s, float x) {
  const float t = s.sum + x;
  // The exact error of t = sum + x, from the larger operand (fast two-sum).
  s.carry += fabs(s.sum) >= fabs(x) ? (s.sum - t) + x : (x - t) + s.sum;
  s.sum = t;
}

// An infinite or NaN sum is the answer itself: its carry would be inf - inf = NaN.
inline float compensated_value(CompensatedSum s) {
  return isfinite(s.sum) ? s.sum + s.carry : s.sum;
}

// ---- the per-logit exponential ----------------------------------------------------------------
// e^x for the exponentials taken once per logit (the log-sum-exp walk's exp(z - max), pass 3's
// p = exp(lp)): 2^(x log2 e), one multiply and a precise exp2, where a precise exp spends a
// range reduction of its own around the same exp2. The rounded product moves the exponent by at most |x| 2^-24, a relative error of
// 6e-8 |x| in the result: 1e-6 for a term exp(-17) that adds 4e-8 of the largest to a sum, and
// 5e-6 for p = 1e-38 (|lp| = 87, the smallest normal float). Both sit far inside the kernels'
// tolerances, and the terms that carry a row's sum (x near 0) keep their digits.
inline float exp_per_logit(float x) { return math::exp2(x * 1.44269504088896341f); }

// ---- log-sum-exp state (custom_loss_math.h), walked and reduced by a row's threads -----------

typedef LogSumExp<float> LseState;
typedef RowLogSoftmax<float> RowLse;

// One thread's log-sum-exp state while it walks its classes: `others` summed compensated.
struct LogSumExpPartial {
  float max;
  float ties;
  CompensatedSum others;
};

inline LogSumExpPartial lse_partial_empty() {
  LogSumExpPartial s;
  s.max = math::lowest<float>();
  s.ties = 0.0f;
  s.others = compensated_zero();
  return s;
}

inline void lse_add(thread LogSumExpPartial& s, float z) {
  if (z > s.max) {  // the old maximum and its ties move into `others`, rescaled to the new one
    s.others.sum = (compensated_value(s.others) + s.ties) * math::exp(s.max - z);
    s.others.carry = 0.0f;
    s.ties = 1.0f;
    s.max = z;
  } else if (z == s.max) {
    s.ties += 1.0f;
  } else {
    compensated_add(s.others, math::exp(z - s.max));
  }
}

// A thread walks its classes in blocks of TFMO_LSE_BLOCK: the block's logits are loaded first
// (independent loads in flight together), its maximum found, the running state rescaled at most
// once, and the block's exp(z - max) summed plainly in a register before one compensated add.
// Per element that leaves a max, an exp and three adds, where lse_add spends two compares, a
// branch and Neumaier's five operations. The state is lse_add's up to rounding: each exp is
// taken against the block's final maximum (lse_add's intermediate maxima cost a rounding per
// rescale), a tie is a logit equal to that maximum, and NaN never becomes the maximum (fmax
// returns the other operand) and lands in `others`. A tie's term is exp2(0) = 1 exactly, so
// `others` takes e - t (t = 1 at a tie, else 0), which is exactly 0 at a tie and e elsewhere,
// without a select. The plain sum of the block's terms, each in [0, 1], adds at most
// TFMO_LSE_BLOCK - 1 roundings to it, however large C is.
#define TFMO_LSE_BLOCK 8u

struct LogitBlock {
  float z[TFMO_LSE_BLOCK];
};

// The block's terms, and with kSums (custom_loss_math.h's cross-entropy sums) the block's
// V += sum v_k and S_v += sum v_k (z_k - max) in the same loop, from the same z_k - max as the
// exponential. `shifted`, `weight` are only touched with kSums.
template <bool kSums>
inline void lse_add_block(thread LogSumExpPartial& s, const thread LogitBlock& b,
                          const thread float* v, thread CompensatedSum& weight,
                          thread CompensatedSum& shifted) {
  float block_max = s.max;
  for (uint k = 0u; k < TFMO_LSE_BLOCK; ++k) block_max = fmax(b.z[k], block_max);
  if (block_max > s.max) {  // as lse_add: the old maximum and its ties move into `others`
    s.others.sum = (compensated_value(s.others) + s.ties) * math::exp(s.max - block_max);
    s.others.carry = 0.0f;
    s.ties = 0.0f;
    if (kSums) {
      shifted.sum = shifted_sum_rebased(compensated_value(shifted), compensated_value(weight),
                                        s.max, block_max);
      shifted.carry = 0.0f;
    }
    s.max = block_max;
  }
  float ties = 0.0f;
  float others = 0.0f;
  float block_weight = 0.0f;
  float block_shifted = 0.0f;
  for (uint k = 0u; k < TFMO_LSE_BLOCK; ++k) {
    const float d = b.z[k] - s.max;
    const float e = exp_per_logit(d);
    const float t = b.z[k] == s.max ? 1.0f : 0.0f;
    ties += t;
    others += e - t;
    if (kSums) {
      block_weight += v[k];
      block_shifted += v[k] == 0.0f ? 0.0f : v[k] * d;  // shifted_term(z_k, max, v_k)
    }
  }
  s.ties += ties;
  compensated_add(s.others, others);
  if (kSums) {
    compensated_add(weight, block_weight);
    compensated_add(shifted, block_shifted);
  }
}

// Walks the classes first, first + stride, ... (< num_classes) of one row in blocks of
// TFMO_LSE_BLOCK: visitor.block(c, count) takes classes c, c + stride, ..., count of them (the
// whole block but for the row's last, partial one). Each pass below is such a visitor: it loads
// its block's inputs first (independent loads in flight together), then computes.
template <typename Visitor>
inline void for_each_block(thread Visitor& visitor, uint first, uint stride, uint num_classes) {
  const uint block_span = (TFMO_LSE_BLOCK - 1u) * stride;
  uint c = first;
  // c < num_classes inside the loop, so the subtraction cannot wrap.
  for (; c < num_classes && num_classes - c > block_span; c += block_span + stride) {
    visitor.block(c, TFMO_LSE_BLOCK);
  }
  if (c < num_classes) visitor.block(c, (num_classes - c - 1u) / stride + 1u);
}

// ---- rows read in vectors ----------------------------------------------------------------------
// The passes that run at every logit of plain and smoothed cross-entropy (the log-sum-exp walk,
// V alone, the sparse gradient) walk a row in chunks of TFMO_VEC consecutive classes, each read
// (and in the gradient written) with one vector access instead of TFMO_VEC scalar ones: one
// address and one load or store per chunk. Every buffer starts aligned to 16 bytes (each tensor
// is its own MTLBuffer at offset 0), so a chunk that starts at an element index that is a
// multiple of TFMO_VEC is aligned to its size, as MSL's vector types need. A row starts at
// element row * C: its classes before the first such index (fewer than TFMO_VEC, when C is not a
// multiple of TFMO_VEC) and after its last whole chunk are taken one at a time, visitor.one(c).
// Chunk q of the aligned part holds TFMO_VEC consecutive classes; a row's threads take chunks
// first, first + threads, ... (a SIMD-group's lanes read one contiguous span per access), and a
// block is TFMO_BLOCK_CHUNKS of a thread's chunks, TFMO_LSE_BLOCK classes.
#define TFMO_VEC 4u
#define TFMO_BLOCK_CHUNKS (TFMO_LSE_BLOCK / TFMO_VEC)

// Chunk `at / TFMO_VEC` of a block, from p (aligned to TFMO_VEC elements).
template <typename T>
inline void load_chunk(thread LogitBlock& b, uint at, const device T* p) {
  const vec<T, 4> v = *reinterpret_cast<const device vec<T, 4>*>(p);
  for (uint i = 0u; i < TFMO_VEC; ++i) b.z[at + i] = float(v[i]);
}

template <typename T>
inline void store_chunk(device T* p, const thread LogitBlock& b, uint at) {
  vec<T, 4> v;
  for (uint i = 0u; i < TFMO_VEC; ++i) v[i] = T(b.z[at + i]);
  *reinterpret_cast<device vec<T, 4>*>(p) = v;
}

// The chunks of classes [begin, end) (begin aligned, end - begin a multiple of TFMO_VEC):
// visitor.chunk_block(c, stride, chunks) takes the chunks starting at classes c, c + stride, ...
// (stride = threads * TFMO_VEC), `chunks` of them (all TFMO_BLOCK_CHUNKS but in the last,
// partial block).
template <typename Visitor>
inline void for_each_chunk_block(thread Visitor& visitor, uint begin, uint end, uint first,
                                 uint threads) {
  const uint stride = threads * TFMO_VEC;
  const uint block_span = (TFMO_BLOCK_CHUNKS - 1u) * stride;
  uint c = begin + first * TFMO_VEC;
  // c < end and both are begin plus a multiple of TFMO_VEC: a chunk that starts there ends there.
  for (; c < end && end - c > block_span; c += block_span + stride) {
    visitor.chunk_block(c, stride, TFMO_BLOCK_CHUNKS);
  }
  if (c < end) visitor.chunk_block(c, stride, (end - c - 1u) / stride + 1u);
}

// One pass over the row that starts at element `base`: its unaligned head, its chunks, its tail.
// Every pass that sums something another pass must reproduce bitwise (V) walks this way in both.
// The row's split: classes [0, head) before the first aligned element, whole chunks in
// [head, tail), the rest one at a time.
struct RowSplit {
  uint head;
  uint tail;
};

inline RowSplit split_row(ulong base, uint num_classes) {
  const uint misaligned = uint(base % ulong(TFMO_VEC));
  const uint to_aligned = misaligned == 0u ? 0u : TFMO_VEC - misaligned;
  RowSplit split;
  split.head = to_aligned < num_classes ? to_aligned : num_classes;
  split.tail = split.head + (num_classes - split.head) / TFMO_VEC * TFMO_VEC;
  return split;
}

template <typename Visitor>
inline void walk_row(thread Visitor& visitor, ulong base, uint first, uint threads,
                     uint num_classes) {
  const RowSplit split = split_row(base, num_classes);
  for (uint c = first; c < split.head; c += threads) visitor.one(c);
  for_each_chunk_block(visitor, split.head, split.tail, first, threads);
  for (uint c = split.tail + first; c < num_classes; c += threads) visitor.one(c);
}

// The chunks of the block at class c of [begin, end) (for_each_chunk_block_ahead):
// TFMO_BLOCK_CHUNKS but in the last, partial block (the only one that divides); 0 past the end.
inline uint chunks_from(uint c, uint end, uint stride) {
  if (c >= end) return 0u;
  const uint left = end - c;
  if (left > (TFMO_BLOCK_CHUNKS - 1u) * stride) return TFMO_BLOCK_CHUNKS;
  return (left - 1u) / stride + 1u;
}

// The chunks of classes [begin, end) as for_each_chunk_block, for a visitor that reads a block
// with visitor.load(b, c, stride, chunks) (padding the chunks past `chunks`) and computes with
// visitor.use(b, c, stride, chunks): the next block's loads are issued before the current block
// is used, so a thread's loads stay in flight while it computes, where for_each_chunk_block
// waits for each block's own. At C = 1000 (two blocks a thread) a walk then waits for memory
// once instead of twice. The blocks are used in the same order with the same values, so every
// sum is bitwise what for_each_chunk_block gives. A thread reads and writes only its own
// classes, so reading the next block before writing the current one reads no logit that a write
// replaces.
template <typename Visitor>
inline void for_each_chunk_block_ahead(thread Visitor& visitor, uint begin, uint end, uint first,
                                       uint threads) {
  const uint stride = threads * TFMO_VEC;
  const uint step = TFMO_BLOCK_CHUNKS * stride;
  // end < 2^31 and step <= 2^13: no class index below wraps.
  uint c = begin + first * TFMO_VEC;
  uint chunks = chunks_from(c, end, stride);
  if (chunks == 0u) return;
  LogitBlock current;
  visitor.load(current, c, stride, chunks);
  for (;;) {
    const uint next_chunks = chunks_from(c + step, end, stride);
    LogitBlock ahead;
    if (next_chunks != 0u) visitor.load(ahead, c + step, stride, next_chunks);
    visitor.use(current, c, stride, chunks);
    if (next_chunks == 0u) return;
    current = ahead;
    c += step;
    chunks = next_chunks;
  }
}

// walk_row, with the chunks read a block ahead (for_each_chunk_block_ahead) when kAhead: in the
// forward's row-per-threadgroup kernels over 32-bit logits. The others read a block at a time:
// a lane of a lane group walks about one block of its row, so reading ahead gains it nothing;
// the gradient kernels' passes hold more at once and would spill at 64 registers; and a block
// of 16-bit logits is converted to float as it is read, so read ahead, those conversions wait
// for the loads before the current block's work (on the H200, through tests/msl_cuda, the
// bfloat16 reduced step at 8192 x 128256 took 7% longer so).
template <bool kAhead, typename Visitor>
inline void walk_row_as(thread Visitor& visitor, ulong base, uint first, uint threads,
                        uint num_classes) {
  const RowSplit split = split_row(base, num_classes);
  for (uint c = first; c < split.head; c += threads) visitor.one(c);
  if (kAhead) {
    for_each_chunk_block_ahead(visitor, split.head, split.tail, first, threads);
  } else {
    for_each_chunk_block(visitor, split.head, split.tail, first, threads);
  }
  for (uint c = split.tail + first; c < num_classes; c += threads) visitor.one(c);
}

// The thread (`first` of walk_row) that visits class c: the one that writes c's gradient.
inline uint class_walker(ulong base, uint c, uint threads, uint num_classes) {
  const RowSplit split = split_row(base, num_classes);
  if (c < split.head) return c % threads;
  if (c < split.tail) return (c - split.head) / TFMO_VEC % threads;
  return (c - split.tail) % threads;
}

inline LseState lse_settle(LogSumExpPartial s) {
  LseState out;
  out.max = s.max;
  out.ties = s.ties;
  out.others = compensated_value(s.others);
  return out;
}

// The whole SIMD-group's state, in every lane.
inline LseState lse_simd_reduce(LseState s) {
  const float m = simd_max(s.max);  // never NaN: max only takes values that compared greater
  const bool top = s.max == m;
  LseState out;
  out.max = m;
  out.ties = simd_sum(top ? s.ties : 0.0f);
  out.others = simd_sum(top ? s.others : (s.others + s.ties) * math::exp(s.max - m));
  return out;
}

// The state of a group of `lanes` consecutive lanes (power of two), in each of them; the
// butterfly leaves them bitwise equal because lse_combine is commutative.
inline LseState lse_group_reduce(LseState s, uint lanes) {
  for (uint offset = lanes / 2; offset > 0; offset /= 2) {
    LseState other;
    other.max = simd_shuffle_xor(s.max, ushort(offset));
    other.ties = simd_shuffle_xor(s.ties, ushort(offset));
    other.others = simd_shuffle_xor(s.others, ushort(offset));
    s = lse_combine(s, other);
  }
  return s;
}

inline float group_sum(float x, uint lanes) {
  for (uint offset = lanes / 2; offset > 0; offset /= 2) x += simd_shuffle_xor(x, ushort(offset));
  return x;
}


// ---- labels ---------------------------------------------------------------------------------

inline long read_sparse_label(const device int* labels, uint row) { return long(labels[row]); }
inline long read_sparse_label(const device long* labels, uint row) { return labels[row]; }
template <typename D>
inline long read_sparse_label(const device D*, uint) { return 0; }  // dense: never called

// Row status, uniform over the row's threads. `label` is the sparse label (0 for dense).
template <typename LabelT, bool kDense>
inline uint row_status(const device LabelT* labels, uint row, constant CustomLossParams& params,
                       thread long& label) {
  label = 0;
  if (kDense) return TFMO_ROW_VALID;
  label = read_sparse_label(labels, row);
  if (params.has_ignore_class != 0u && label == params.ignore_class) return TFMO_ROW_IGNORED;
  if (label < 0 || label >= long(params.num_classes)) return TFMO_ROW_BAD_LABEL;
  return TFMO_ROW_VALID;
}

// w_c = a_c q_c, q_c = (1 - eps) t_c + eps / C. a_c is read only where q_c != 0 (one class of a
// sparse row without smoothing): a_c * 0 = 0 for the finite, non-negative weights the op
// accepts, and the other classes' weights stay unread.
template <typename LabelT, bool kDense>
inline float class_weight(const device LabelT* labels, ulong row_base, long label, uint c,
                          const device float* class_weights, constant CustomLossParams& params) {
  float q;
  if (kDense) {
    q = params.smooth_on * float(labels[row_base + c]) + params.smooth_off;
  } else {
    q = (long(c) == label ? params.smooth_on : 0.0f) + params.smooth_off;
  }
  if (params.has_class_weights == 0u || q == 0.0f) return q;
  return class_weights[c] * q;
}

// What a kernel is compiled for (the suffix of its host name, chosen on the host from the loss
// options alone by csrc/metal/launch_plan.cc, KernelName):
// - kFormGeneral: every option.
// - kFormPlain ("_plain"): cross-entropy on sparse labels with gamma == 0, no label smoothing and
//   no class weights.
// - kFormSmoothed ("_smoothed"): the same with label smoothing.
// The two cross-entropy forms have the focal terms and the class weights compiled out, and the
// plain one the smoothing walk's sums too (see the entry points).
enum KernelForm : int { kFormGeneral = 0, kFormPlain = 1, kFormSmoothed = 2 };

// Whether the class weights are read: never in a cross-entropy kernel. Read from the params where
// it is used (a bool held across the whole row would cost the general kernels a register).
template <int kForm>
inline bool class_weighted(constant CustomLossParams& params) {
  return kForm == kFormGeneral && params.has_class_weights != 0u;
}

// class_weight at the label of a sparse row without class weights, q_y = (1 - eps) + eps / C:
// the same sum, so a cross-entropy kernel's w_y is bitwise the general kernel's.
inline float plain_label_weight(constant CustomLossParams& params) {
  return params.smooth_on + params.smooth_off;
}

// Only class y carries weight (sparse labels, eps == 0): the row's sum is one term, and no
// second reduction over C is needed. Uniform over the whole dispatch.
template <bool kDense>
inline bool single_weighted_class(constant CustomLossParams& params) {
  return !kDense && params.smooth_off == 0.0f;
}

inline void record_bad_label(device atomic_uint* record, uint row, long label) {
  atomic_fetch_add_explicit(&record[TFMO_ERROR_BAD_LABEL_COUNT], 1u, memory_order_relaxed);
  atomic_fetch_min_explicit(&record[TFMO_ERROR_MIN_BAD_ROW], row, memory_order_relaxed);
  uint expected = 0u;
  while (!atomic_compare_exchange_weak_explicit(&record[TFMO_ERROR_CLAIMED], &expected, 1u,
                                                memory_order_relaxed, memory_order_relaxed)) {
    if (expected != 0u) return;  // another bad row holds the detail slot (else: spurious failure)
  }
  const ulong bits = ulong(label);  // two's complement, modulo 2^64
  atomic_store_explicit(&record[TFMO_ERROR_DETAIL_ROW], row, memory_order_relaxed);
  atomic_store_explicit(&record[TFMO_ERROR_DETAIL_LABEL_LO], uint(bits & 0xFFFFFFFFul),
                        memory_order_relaxed);
  atomic_store_explicit(&record[TFMO_ERROR_DETAIL_LABEL_HI], uint(bits >> 32), memory_order_relaxed);
}

// ---- one row, either variant ----------------------------------------------------------------
//
// `first`, `stride`: this thread's classes are first, first + stride, ... (< C).
// `leader`: the one thread of the row that writes the forward output and reports errors.
// Reduce: how the row's threads combine (threadgroup or lane group); see the two below.

struct ThreadgroupReduce {
  enum { kWalkAhead = 1 };  // walk_row_as
  threadgroup float* scratch;  // 5 floats per SIMD-group (see csrc/metal/launch_plan.cc)
  uint lane;
  uint sg_index;
  uint sg_count;

  LseState lse(LseState s) const {
    s = lse_simd_reduce(s);
    if (lane == 0u) {
      scratch[sg_index] = s.max;
      scratch[sg_count + sg_index] = s.ties;
      scratch[2u * sg_count + sg_index] = s.others;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // sg_count <= SIMD width (the plan guarantees it): one lane per partial, in every SIMD-group.
    LseState part = lse_empty<float>();
    if (lane < sg_count) {
      part.max = scratch[lane];
      part.ties = scratch[sg_count + lane];
      part.others = scratch[2u * sg_count + lane];
    }
    return lse_simd_reduce(part);
  }

  // lse() with pass 1's V and S_v (custom_loss_math.h) behind the same barrier: each thread's S_v
  // is moved to its SIMD-group's maximum, then each SIMD-group's to the row's. V is bitwise what
  // sum() gives it (a gradient given row_stats sums V alone).
  LseState lse_sums(LseState s, float shifted, float weight, thread float& shifted_total,
                    thread float& weight_total) const {
    const LseState group = lse_simd_reduce(s);
    shifted = simd_sum(shifted_sum_rebased(shifted, weight, s.max, group.max));
    weight = simd_sum(weight);
    if (lane == 0u) {
      scratch[sg_index] = group.max;
      scratch[sg_count + sg_index] = group.ties;
      scratch[2u * sg_count + sg_index] = group.others;
      scratch[3u * sg_count + sg_index] = weight;
      scratch[4u * sg_count + sg_index] = shifted;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    LseState part = lse_empty<float>();
    float part_weight = 0.0f;
    float part_shifted = 0.0f;
    if (lane < sg_count) {
      part.max = scratch[lane];
      part.ties = scratch[sg_count + lane];
      part.others = scratch[2u * sg_count + lane];
      part_weight = scratch[3u * sg_count + lane];
      part_shifted = scratch[4u * sg_count + lane];
    }
    const LseState row = lse_simd_reduce(part);
    shifted_total = simd_sum(shifted_sum_rebased(part_shifted, part_weight, part.max, row.max));
    weight_total = simd_sum(part_weight);
    return row;
  }

  float sum(float x) const {  // its own part of the scratch: no barrier needed before it
    x = simd_sum(x);
    if (lane == 0u) scratch[3u * sg_count + sg_index] = x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return simd_sum(lane < sg_count ? scratch[3u * sg_count + lane] : 0.0f);
  }

  // Two sums behind one barrier (a forward that writes the gradient too); each is bitwise what
  // sum() gives it.
  void sum2(float x, float y, thread float& x_total, thread float& y_total) const {
    x = simd_sum(x);
    y = simd_sum(y);
    if (lane == 0u) {
      scratch[3u * sg_count + sg_index] = x;
      scratch[4u * sg_count + sg_index] = y;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    x_total = simd_sum(lane < sg_count ? scratch[3u * sg_count + lane] : 0.0f);
    y_total = simd_sum(lane < sg_count ? scratch[4u * sg_count + lane] : 0.0f);
  }
  // The label's logit z_y of a sparse row (LabelLogit): every thread of the row reads it. With
  // `writes_follow` (pass 3 writes the row's gradient, which may be bound over the logits:
  // csrc/metal/custom_loss_metal.mm) the barrier puts every thread's read before the write of
  // the thread that walks class y, which the reductions' threadgroup-memory barriers do not
  // order.
  template <typename Y>
  void restrict_label_read(thread Y& y, ulong base, uint first, uint threads, uint num_classes,
                           bool writes_follow) const {}
  float share_label_logit(float z, bool read_here, bool writes_follow) const {
    if (writes_follow) threadgroup_barrier(mem_flags::mem_device);
    return z;
  }
};

struct LaneGroupReduce {
  enum { kWalkAhead = 0 };  // walk_row_as
  uint lanes;
  // The label's logit z_y of a sparse row (LabelLogit). With `writes_follow` (pass 3 may write
  // over the logits) only the lane that walks class y (class_walker) reads it, before its own
  // writes in program order, and the butterfly hands its bits to the others through registers:
  // no lane reads memory another lane writes, so no barrier is needed (a simdgroup_barrier
  // would have to be reached by the SIMD-group's other lane groups too, whose rows may have
  // returned early).
  template <typename Y>
  void restrict_label_read(thread Y& y, ulong base, uint first, uint threads, uint num_classes,
                           bool writes_follow) const {
    if (writes_follow && y.valid) {
      y.valid = class_walker(base, y.label, threads, num_classes) == first;
    }
  }
  float share_label_logit(float z, bool read_here, bool writes_follow) const {
    if (!writes_follow) return z;
    float has = read_here ? 1.0f : 0.0f;
    for (uint offset = lanes / 2; offset > 0; offset /= 2) {
      const float other_z = simd_shuffle_xor(z, ushort(offset));
      const float other_has = simd_shuffle_xor(has, ushort(offset));
      if (has == 0.0f && other_has != 0.0f) {
        z = other_z;
        has = 1.0f;
      }
    }
    return z;
  }
  LseState lse(LseState s) const { return lse_group_reduce(s, lanes); }
  // The butterfly of lse_group_reduce with V and S_v: both sides of each step are moved to the
  // combined maximum before they are added, so the lanes stay bitwise equal.
  LseState lse_sums(LseState s, float shifted, float weight, thread float& shifted_total,
                    thread float& weight_total) const {
    for (uint offset = lanes / 2; offset > 0; offset /= 2) {
      LseState other;
      other.max = simd_shuffle_xor(s.max, ushort(offset));
      other.ties = simd_shuffle_xor(s.ties, ushort(offset));
      other.others = simd_shuffle_xor(s.others, ushort(offset));
      const float other_weight = simd_shuffle_xor(weight, ushort(offset));
      const float other_shifted = simd_shuffle_xor(shifted, ushort(offset));
      const LseState both = lse_combine(s, other);
      shifted = shifted_sum_rebased(shifted, weight, s.max, both.max) +
                shifted_sum_rebased(other_shifted, other_weight, other.max, both.max);
      weight += other_weight;
      s = both;
    }
    shifted_total = shifted;
    weight_total = weight;
    return s;
  }
  float sum(float x) const { return group_sum(x, lanes); }
  void sum2(float x, float y, thread float& x_total, thread float& y_total) const {
    x_total = group_sum(x, lanes);
    y_total = group_sum(y, lanes);
  }
};

// The per-row state handed from a forward to a gradient (csrc/problem.h's row_stats): the
// row's log-softmax and 1 / sum_c exp(z_c - max), as the CPU kernels write them. An ignored or
// bad row has (0, 0, 0).
inline void write_row_stats(device float* stats, uint row, LseState s, RowLse ls) {
  const ulong at = ulong(row) * 3ul;
  float inv_sum = 1.0f / (s.ties + s.others);
  if (s.max == INFINITY) inv_sum = NAN;  // no softmax (lse_finish's log_sum is NaN too)
  stats[at] = ls.max;
  stats[at + 1ul] = ls.log_sum;
  stats[at + 2ul] = inv_sum;
}

inline RowLse read_row_stats(const device float* stats, uint row) {
  const ulong at = ulong(row) * 3ul;
  RowLse ls;
  ls.max = stats[at];
  ls.log_sum = stats[at + 1ul];
  return ls;
}

// One class's d loss / d z_j from its log-probability, weight and the row's G. A class without
// weight has g_j = 0, where p_j (G - g_j) - g_j r_j is p_j G (up to the sign of a zero): r_j,
// an exp, a log and a division (expm1_nonpositive), is only computed where it counts, which for
// sparse labels without smoothing is one class of the row.
// With gamma == 0, g_j = w_j holds no r_j, and r_j only matters in g_j r_j: where p_j <= 1/2,
// 1 - p_j is that r_j to within p_j's own rounding (r_j >= 1/2, so the subtraction adds at
// most half an ulp), as the CPU's vector rows do (csrc/cpu/simd/simd_rows.h); the expm1 (a log and
// a division) is kept for p_j > 1/2, where 1 - p_j would lose r_j's digits, and for NaN.
// gradient_parts(lp, w, 0) has g = w * 1 = w, bitwise the g used here.
inline float class_gradient(float lp, float w, float gamma, float big_g) {
  if (w == 0.0f) return exp_per_logit(lp) * big_g;
  if (gamma == 0.0f) {
    GradientParts<float> t;
    t.p = exp_per_logit(lp);
    t.r = t.p <= 0.5f ? 1.0f - t.p : one_minus_p_given_p(lp, t.p);
    t.g = w;
    return gradient_value(t, big_g);
  }
  return gradient_value(gradient_parts(lp, w, gamma), big_g);
}

// ---- the passes over a row, as block visitors ---------------------------------------------

// What a row's classes weigh: class_weight, and v_c, what pass 1 sums when it carries the
// cross-entropy sums (custom_loss_math.h): w_c for dense targets, a_c for sparse labels (whose
// labelled class's (1 - eps) a_y is added once per row).
template <typename LabelT, bool kDense>
struct RowWeights {
  const device LabelT* labels;
  ulong base;
  long label;
  const device float* class_weights;
  constant CustomLossParams* params;

  float full(uint c) const {
    return class_weight<LabelT, kDense>(labels, base, label, c, class_weights, *params);
  }
  float walked(uint c) const {
    if (kDense) return full(c);
    return params->has_class_weights != 0u ? class_weights[c] : 1.0f;
  }
};

// Pass 1: the log-sum-exp, and with kSums the sums V = sum v_c and S_v = sum v_c (z_c - max)
// relative to this thread's running maximum. The last, partial block is padded with -inf,
// which changes nothing: it is never a maximum nor a tie (the maximum starts at the lowest
// finite value), exp(-inf - max) adds exactly 0 to `others`, and its weight is 0.
// kUnitWeights: every v_c is 1 (sparse labels, no class weights), read from nowhere.
struct WeightBlock {
  float v[TFMO_LSE_BLOCK];
};

template <typename LabelT, bool kDense, bool kUnitWeights>
inline float walked_weight_of(const thread RowWeights<LabelT, kDense>& weights, uint c) {
  return kUnitWeights ? 1.0f : weights.walked(c);
}

template <typename T, typename LabelT, bool kDense, bool kSums, bool kUnitWeights>
struct LogSumExpPass {
  const device T* row;
  uint stride;
  RowWeights<LabelT, kDense> weights;
  LogSumExpPartial lse;
  CompensatedSum weight;   // V
  CompensatedSum shifted;  // S_v, relative to lse.max

  void one(uint c) {
    LogitBlock b;
    WeightBlock w;
    for (uint k = 0u; k < TFMO_LSE_BLOCK; ++k) {
      b.z[k] = k == 0u ? float(row[c]) : -math::infinity<float>();
      w.v[k] = kSums && k == 0u ? walked_weight_of<LabelT, kDense, kUnitWeights>(weights, c) : 0.0f;
    }
    add(b, w);
  }

  void load(thread LogitBlock& b, uint c, uint chunk_stride, uint chunks) const {
    for (uint j = 0u; j < TFMO_BLOCK_CHUNKS; ++j) {
      if (j < chunks) {
        load_chunk(b, j * TFMO_VEC, row + (c + j * chunk_stride));
      } else {
        for (uint i = 0u; i < TFMO_VEC; ++i) b.z[j * TFMO_VEC + i] = -math::infinity<float>();
      }
    }
  }

  void chunk_block(uint c, uint chunk_stride, uint chunks) {
    LogitBlock b;
    load(b, c, chunk_stride, chunks);
    use(b, c, chunk_stride, chunks);
  }

  void use(const thread LogitBlock& b, uint c, uint chunk_stride, uint chunks) {
    WeightBlock w;
    if (kSums) {
      for (uint j = 0u; j < TFMO_BLOCK_CHUNKS; ++j) {
        for (uint i = 0u; i < TFMO_VEC; ++i) {
          w.v[j * TFMO_VEC + i] =
              j < chunks ? walked_weight_of<LabelT, kDense, kUnitWeights>(
                               weights, c + j * chunk_stride + i)
                         : 0.0f;
        }
      }
    }
    add(b, w);
  }

  void add(const thread LogitBlock& b, const thread WeightBlock& w) {
    lse_add_block<kSums>(lse, b, w.v, weight, shifted);
  }
};

// V alone, bitwise as LogSumExpPass<..., true> sums it (a gradient given row_stats).
template <typename LabelT, bool kDense>
struct WeightSumPass {
  uint stride;
  RowWeights<LabelT, kDense> weights;
  CompensatedSum weight;

  void one(uint c) {
    float v[TFMO_LSE_BLOCK];
    for (uint k = 0u; k < TFMO_LSE_BLOCK; ++k) v[k] = k == 0u ? weights.walked(c) : 0.0f;
    float block_weight = 0.0f;
    for (uint k = 0u; k < TFMO_LSE_BLOCK; ++k) block_weight += v[k];
    compensated_add(weight, block_weight);
  }

  void chunk_block(uint c, uint chunk_stride, uint chunks) {
    float v[TFMO_LSE_BLOCK];
    for (uint j = 0u; j < TFMO_BLOCK_CHUNKS; ++j) {
      for (uint i = 0u; i < TFMO_VEC; ++i) {
        v[j * TFMO_VEC + i] = j < chunks ? weights.walked(c + j * chunk_stride + i) : 0.0f;
      }
    }
    float block_weight = 0.0f;
    for (uint k = 0u; k < TFMO_LSE_BLOCK; ++k) block_weight += v[k];
    compensated_add(weight, block_weight);
  }
};

// Pass 2 (gamma > 0, several weighted classes): -loss = sum_c w_c r_c^gamma lp_c and
// G = sum_c g_c, term by term. A logit at a time: each term's pow, exp and expm1 outweigh the
// wait for its load, and a body this large is not unrolled, so block arrays would live in
// local memory.
template <typename T, typename LabelT, bool kDense>
struct FocalSumsPass {
  const device T* row;
  uint stride;
  RowWeights<LabelT, kDense> weights;
  RowLse ls;
  float gamma;
  bool want_loss;
  bool want_gradient;
  CompensatedSum loss;
  CompensatedSum big_g;

  void block(uint c, uint count) {
    for (uint k = 0u; k < count; ++k) {
      const uint ck = c + k * stride;
      const float w = weights.full(ck);
      if (w == 0.0f) continue;
      const float lp = log_prob(ls, float(row[ck]));
      if (want_loss) compensated_add(loss, loss_term(lp, w, gamma));
      if (want_gradient) compensated_add(big_g, gradient_term(lp, w, gamma));
    }
  }
};

// Pass 3 of a sparse row whose g_j off the label is a_j eps / C (0 without smoothing):
// out_j = scale * (p_j G - g_j), and at_label at y (see process_row). Per logit that is
//   p_j = 2^((z_j - max) log2 e - log_sum log2 e)    one subtract, one fma, one exp2
//   out_j = p_j (scale G) - scale g_j                one fma (a multiply more with class weights)
// with scale G, scale eps / C and log_sum log2 e taken once per row. The fma rounds once where
// exp_per_logit(log_prob(...)) rounds lp and then its product with log2 e: the exponent is off
// by at most the rounding of log_sum log2 e beside that of the result (|log_sum| <= log 2C), so
// p_j keeps the accuracy of exp_per_logit. A NaN or infinite log_sum (no softmax) still makes
// every p_j NaN.
// kWeightedOff: g_j = a_j eps / C (smoothing and class weights), else eps / C: a template
// argument, so that a row without class weights spends nothing on them per logit.
template <typename T, bool kWeightedOff>
struct SparseGradientPass {
  const device T* row;
  device T* out;
  const device float* class_weights;
  uint stride;
  uint label;
  float max;
  float log_sum_log2e;  // log_sum log2 e
  float scaled_g;       // scale G
  float scaled_off;     // scale eps / C
  float at_label;       // the value at y, as float (T(at_label) is the stored value)

  float value(float z, float g_off) const {
    const float p = math::exp2(fma(z - max, 1.44269504088896341f, -log_sum_log2e));
    return fma(p, scaled_g, -g_off);
  }

  void one(uint c) {
    const float v = value(float(row[c]), kWeightedOff ? class_weights[c] * scaled_off : scaled_off);
    out[c] = T(c == label ? at_label : v);
  }

  void load(thread LogitBlock& b, uint c, uint chunk_stride, uint chunks) const {
    for (uint j = 0u; j < TFMO_BLOCK_CHUNKS; ++j) {
      if (j < chunks) {
        load_chunk(b, j * TFMO_VEC, row + (c + j * chunk_stride));
      } else {
        for (uint i = 0u; i < TFMO_VEC; ++i) b.z[j * TFMO_VEC + i] = 0.0f;
      }
    }
  }

  void chunk_block(uint c, uint chunk_stride, uint chunks) {
    LogitBlock b;
    load(b, c, chunk_stride, chunks);
    use(b, c, chunk_stride, chunks);
  }

  // The label's value replaces the computed one by a select against its offset in the chunk
  // (one subtraction per chunk); a store to b.z[offset] would put the block in thread memory.
  void use(LogitBlock b, uint c, uint chunk_stride, uint chunks) {
    for (uint j = 0u; j < TFMO_BLOCK_CHUNKS; ++j) {
      const uint cj = c + j * chunk_stride;
      const uint at = label - cj;  // wraps for a label below the chunk
      for (uint i = 0u; i < TFMO_VEC; ++i) {
        const uint k = j * TFMO_VEC + i;
        const float g = kWeightedOff && j < chunks ? class_weights[cj + i] * scaled_off
                                                   : scaled_off;
        const float v = value(b.z[k], g);
        b.z[k] = at == i ? at_label : v;
      }
    }
    for (uint j = 0u; j < TFMO_BLOCK_CHUNKS; ++j) {
      if (j < chunks) store_chunk(out + (c + j * chunk_stride), b, j * TFMO_VEC);
    }
  }
};

// Pass 3 of a row with several weighted classes (dense targets, focal loss): out_j =
// scale * (p_j G - g_j), a logit at a time, as FocalSumsPass: class_gradient's exp, log and
// division outweigh the wait for one load, and eight of them side by side would hold more
// registers than the rest of the kernel (which every row pays for in occupancy).
template <typename T, typename LabelT, bool kDense>
struct GradientPass {
  const device T* row;
  device T* out;
  uint stride;
  RowWeights<LabelT, kDense> weights;
  RowLse ls;
  float gamma;
  float big_g;
  float scale;

  void block(uint c, uint count) {
    for (uint k = 0u; k < count; ++k) {
      const uint ck = c + k * stride;
      const float lp = log_prob(ls, float(row[ck]));
      out[ck] = T(scale * class_gradient(lp, weights.full(ck), gamma, big_g));
    }
  }
};

// Pass 3 of a sparse row (SparseGradientPass).
template <typename T, bool kWeightedOff, bool kAhead>
inline void walk_sparse_gradient(const device T* row, device T* out,
                                 const device float* class_weights, uint label, RowLse ls,
                                 float scaled_g, float scaled_off, float at_label, ulong base,
                                 uint first, uint stride, uint num_classes) {
  SparseGradientPass<T, kWeightedOff> pass;
  pass.row = row;
  pass.out = out;
  pass.class_weights = class_weights;
  pass.stride = stride;
  pass.label = label;
  pass.max = ls.max;
  pass.log_sum_log2e = ls.log_sum * 1.44269504088896341f;
  pass.scaled_g = scaled_g;
  pass.scaled_off = scaled_off;
  pass.at_label = at_label;
  walk_row_as<kAhead>(pass, base, first, stride, num_classes);
}

// The gradient of a row that is not valid: one value, each class written by the thread that
// walks it in pass 1 (walk_row), so over the logits no thread writes a logit another read.
template <typename T>
struct FillPass {
  device T* row;
  T value;
  void one(uint c) { row[c] = value; }
  void chunk_block(uint c, uint chunk_stride, uint chunks) {
    for (uint j = 0u; j < chunks; ++j) {
      for (uint i = 0u; i < TFMO_VEC; ++i) row[c + j * chunk_stride + i] = value;
    }
  }
};

// The labelled logit z_y of a valid sparse row (0 otherwise), read where the kernels call this:
// after pass 1's loads and before its reduction, whose barrier then covers the load's wait
// instead of pass 2 waiting for it alone.
struct LabelLogit {
  bool valid;   // a sparse row whose label is in [0, C)
  uint label;
  float value;  // z_y once read
};

template <typename T>
inline void read_label_logit(thread LabelLogit& y, const device T* row) {
  y.value = y.valid ? float(row[y.label]) : 0.0f;
}

// Pass 1 with V and S_v, reduced over the row's threads.
template <typename T, typename LabelT, bool kDense, bool kUnitWeights, bool kAhead,
          typename Reduce>
inline LseState walk_lse_sums(const device T* row, RowWeights<LabelT, kDense> weights, ulong base,
                              uint first, uint stride, uint num_classes, Reduce reduce,
                              thread LabelLogit& y, thread float& shifted_total,
                              thread float& weight_total) {
  LogSumExpPass<T, LabelT, kDense, true, kUnitWeights> pass;
  pass.row = row;
  pass.stride = stride;
  pass.weights = weights;
  pass.lse = lse_partial_empty();
  pass.weight = compensated_zero();
  pass.shifted = compensated_zero();
  walk_row_as<kAhead>(pass, base, first, stride, num_classes);
  read_label_logit(y, row);
  return reduce.lse_sums(lse_settle(pass.lse), compensated_value(pass.shifted),
                         compensated_value(pass.weight), shifted_total, weight_total);
}

// The passes over a row, each reading its logits once:
//   1. log-sum-exp (skipped by a gradient given row_stats),
//   2. the row's sums: -loss (forward) and G (gradient, or a forward that writes the scaled
//      gradient); one element when a single class carries weight,
//   3. the gradient (gradient kernel; forward given row_scales: the scaled gradient).
// Plain cross-entropy thus reads each logit once in the forward and once (plus one write) in a
// gradient given row_stats; a forward given row_scales reads it twice and writes the gradient.
// `grad_scales` holds the per-row factor of pass 3: upstream (T, gradient) or row_scales (float).
template <typename T, typename LabelT, bool kDense, int kForm, bool kGradient, typename ScaleT,
          typename Reduce>
inline void process_row(const device T* logits, const device LabelT* labels,
                        const device float* class_weights, constant CustomLossParams& params,
                        device atomic_uint* error_record, device T* out,
                        const device ScaleT* grad_scales, device float* stats_out,
                        const device float* stats_in, device T* grad_out, uint row, uint first,
                        uint stride, bool leader, Reduce reduce) {
  static_assert(kForm == kFormGeneral || !kDense, "cross-entropy kernels take sparse labels only");
  constexpr bool kPlain = kForm == kFormPlain;
  constexpr bool kCrossEntropy = kForm != kFormGeneral;
  const uint num_classes = params.num_classes;
  const ulong base = ulong(row) * ulong(num_classes);
  // Uniform over the dispatch, so every branch on them is taken by all of a row's threads.
  const bool with_stats = params.has_row_stats != 0u;
  const bool want_loss = !kGradient;
  const bool want_gradient = kGradient || params.has_row_scales != 0u;
  // Whether the passes over the logits read a block ahead (walk_row_as).
  constexpr bool kAhead = !kGradient && Reduce::kWalkAhead != 0 && sizeof(T) == 4;
  long label;
  const uint status = row_status<LabelT, kDense>(labels, row, params, label);
  // A cross-entropy form: the host chose this kernel for gamma == 0 and no class weights, and
  // for eps / C == 0 (kPlain) or != 0 (smoothed) as the params hold it (see KernelForm), so those
  // are constants here and the passes they select are compiled out. (A smoothed kernel handed
  // eps / C == 0 would turn a masked class's 0 * -inf into NaN: the host never does so.)
  const float gamma = kCrossEntropy ? 0.0f : params.gamma;
  const bool single =
      kPlain || (kForm == kFormGeneral && single_weighted_class<kDense>(params));
  // Cross-entropy with several weighted classes: W and S come from pass 1 (custom_loss_math.h),
  // and there is no pass 2.
  const bool sums_in_walk = !single && gamma == 0.0f;
  RowWeights<LabelT, kDense> weights;
  weights.labels = labels;
  weights.base = base;
  weights.label = label;
  weights.class_weights = class_weights;
  weights.params = &params;

  // Pass 1: log-sum-exp of the row (and V, S_v).
  RowLse ls;
  LseState state = lse_empty<float>();
  float walked_weight = 0.0f;   // V: sum_c a_c (sparse) or sum_c w_c (dense)
  float walked_shifted = 0.0f;  // S_v: sum_c v_c (z_c - max)
  LabelLogit label_logit;
  label_logit.valid = !kDense && status == TFMO_ROW_VALID;
  label_logit.label = uint(label);
  label_logit.value = 0.0f;
  reduce.restrict_label_read(label_logit, base, first, stride, num_classes, want_gradient);
  if (kGradient && with_stats) {
    ls = read_row_stats(stats_in, row);
    read_label_logit(label_logit, logits + base);
    if (sums_in_walk) {
      if (!kDense && !class_weighted<kForm>(params)) {
        walked_weight = float(num_classes);  // the walk's sum of ones, exact below 2^24
      } else {
        WeightSumPass<LabelT, kDense> pass;
        pass.stride = stride;
        pass.weights = weights;
        pass.weight = compensated_zero();
        walk_row(pass, base, first, stride, num_classes);
        walked_weight = reduce.sum(compensated_value(pass.weight));
      }
    }
  } else {
    if (sums_in_walk && !kDense && !class_weighted<kForm>(params)) {
      state = walk_lse_sums<T, LabelT, kDense, true, kAhead>(
          logits + base, weights, base, first, stride, num_classes, reduce, label_logit,
          walked_shifted, walked_weight);
    } else if (sums_in_walk) {
      state = walk_lse_sums<T, LabelT, kDense, false, kAhead>(
          logits + base, weights, base, first, stride, num_classes, reduce, label_logit,
          walked_shifted, walked_weight);
    } else {
      LogSumExpPass<T, LabelT, kDense, false, false> pass;
      pass.row = logits + base;
      pass.stride = stride;
      pass.lse = lse_partial_empty();
      walk_row_as<kAhead>(pass, base, first, stride, num_classes);
      read_label_logit(label_logit, logits + base);
      state = reduce.lse(lse_settle(pass.lse));
    }
    ls = lse_finish(state);
  }

  // The row's status is known only once its label has arrived: pass 1 does not wait for it (its
  // loads are in flight together with the label's), and a row that is not valid discards it.
  if (status != TFMO_ROW_VALID) {  // uniform over the row: its threads leave together
    const float fill = status == TFMO_ROW_IGNORED ? 0.0f : NAN;
    if (status == TFMO_ROW_BAD_LABEL && leader) record_bad_label(error_record, row, label);
    if (want_gradient) {
      FillPass<T> pass;
      pass.row = grad_out + base;
      pass.value = T(fill);
      walk_row(pass, base, first, stride, num_classes);
    }
    if (want_loss && leader) {
      out[row] = T(fill);
      if (with_stats) {
        const ulong at = ulong(row) * 3ul;
        stats_out[at] = 0.0f;
        stats_out[at + 1ul] = 0.0f;
        stats_out[at + 2ul] = 0.0f;
      }
    }
    return;
  }

  if (!kGradient && with_stats && leader) write_row_stats(stats_out, row, state, ls);

  // Pass 2: the row's sums, -loss = sum_c w_c r_c^gamma lp_c and G = sum_c g_c, as needed.
  float loss_total = 0.0f;
  float big_g = 0.0f;
  float lp_label = 0.0f;  // lp_y of a sparse row, for pass 3
  if (single) {
    const uint y = uint(label);
    const float w = kCrossEntropy
                        ? plain_label_weight(params)
                        : class_weight<LabelT, kDense>(labels, base, label, y, class_weights,
                                                       params);
    lp_label = log_prob(ls, reduce.share_label_logit(label_logit.value, label_logit.valid,
                                                     want_gradient));
    if (want_loss) loss_total = loss_term(lp_label, w, gamma);
    if (want_gradient) big_g = gradient_term(lp_label, w, gamma);
  } else if (sums_in_walk) {
    float total_weight = walked_weight;
    float shifted = walked_shifted;
    if (!kDense) {  // add the labelled class's (1 - eps) a_y
      const uint y = uint(label);
      const float a_y = class_weighted<kForm>(params) ? class_weights[y] : 1.0f;
      const float label_weight = params.smooth_on * a_y;
      total_weight = sparse_total_weight(label_weight, params.smooth_off, walked_weight);
      const float z_y =
          reduce.share_label_logit(label_logit.value, label_logit.valid, want_gradient);
      lp_label = log_prob(ls, z_y);
      if (want_loss) {
        shifted = params.smooth_off * walked_shifted + shifted_term(z_y, ls.max, label_weight);
      }
    }
    if (want_loss) loss_total = cross_entropy_neg_loss(ls, total_weight, shifted);
    big_g = total_weight;
  } else {
    FocalSumsPass<T, LabelT, kDense> pass;
    pass.row = logits + base;
    pass.stride = stride;
    pass.weights = weights;
    pass.ls = ls;
    pass.gamma = gamma;
    pass.want_loss = want_loss;
    pass.want_gradient = want_gradient;
    pass.loss = compensated_zero();
    pass.big_g = compensated_zero();
    for_each_block(pass, first, stride, num_classes);
    if (want_loss && want_gradient) {
      reduce.sum2(compensated_value(pass.loss), compensated_value(pass.big_g), loss_total, big_g);
    } else if (want_loss) {
      loss_total = reduce.sum(compensated_value(pass.loss));
    } else {
      big_g = reduce.sum(compensated_value(pass.big_g));
    }
  }

  if (want_loss && leader) out[row] = T(0.0f - loss_total);  // 0 - 0 = +0: no -0 loss
  if (!want_gradient) return;

  // Pass 3: d logits_j = scale * (p_j G - g_j), scale = upstream[row] or row_scales[row].
  const float scale = float(grad_scales[row]);
  if (!kDense && (single || sums_in_walk)) {
    // Sparse labels with one weighted class, or cross-entropy (g_j = w_j): off y, g_j is
    // a_j eps / C (0 without smoothing), where the gradient is p_j G - g_j. Without smoothing
    // that is p_j G bitwise (class_gradient's w == 0 case; minus 0 changes no bit of a
    // non-negative product); with it, p_j G - g_j keeps its digits where p_j (G - g_j) - g_j r_j
    // is needed, which is at y alone (off y g_j <= eps / C max a, so g_j r_j is negligible
    // beside p_j G when p_j is large, and 1 - p_j is not needed). At y it is class_gradient of
    // lp_y and w_y, once per thread. The loop then needs no 64-bit compare with the label.
    const uint y = uint(label);
    const float w_y = kCrossEntropy
                          ? plain_label_weight(params)
                          : class_weight<LabelT, kDense>(labels, base, label, y, class_weights,
                                                         params);
    const float off = params.smooth_off;
    const float at_label = float(T(scale * class_gradient(lp_label, w_y, gamma, big_g)));
    if (off != 0.0f && class_weighted<kForm>(params)) {  // uniform
      walk_sparse_gradient<T, true, kAhead>(logits + base, grad_out + base, class_weights, y,
                                            ls, scale * big_g, scale * off, at_label, base,
                                            first, stride, num_classes);
    } else {
      walk_sparse_gradient<T, false, kAhead>(logits + base, grad_out + base, class_weights, y,
                                             ls, scale * big_g, scale * off, at_label, base,
                                             first, stride, num_classes);
    }
    return;
  }
  GradientPass<T, LabelT, kDense> pass;
  pass.row = logits + base;
  pass.out = grad_out + base;
  pass.stride = stride;
  pass.weights = weights;
  pass.ls = ls;
  pass.gamma = gamma;
  pass.big_g = big_g;
  pass.scale = scale;
  for_each_block(pass, first, stride, num_classes);
}

// ---- entry points ---------------------------------------------------------------------------
// Buffer arguments in index order (custom_loss_params.h); then the threadgroup scratch (rowtg
// only); then TFMO_KERNEL_THREAD_ARGS.
//
// The cross-entropy forms (KernelForm; sparse labels only, gamma == 0, no class weights), which
// csrc/metal/launch_plan.cc (KernelName) launches for those options: the focal sums, the
// class-weighted walk and gradient pass are compiled out, and in the plain form (no smoothing)
// the smoothing walk's V and S_v too; the smoothed form walks with unit weights (V = C). What is
// left is the same code on the same values as the general kernel's without class weights (with
// class weights of exactly 1, a_c x = x and the compensated sum of C ones is C, exact below
// 2^24), so each output is bitwise the general kernel's. Each kernel is one function whose
// largest pass sets its register count; without those passes it needs fewer, which leaves room
// for more threads on a GPU whose occupancy is set by registers.

// The buffers of one launch, as process_row takes them. Forward: `out` is the loss, `scales` the
// row_scales, `stats_out` the row_stats it writes, `grad_out` the scaled gradient. Gradient:
// `out` = `grad_out` is d logits, `scales` the upstream, `stats_in` the row_stats it reads.
template <typename T, typename LabelT, typename ScaleT>
struct RowBuffers {
  const device T* logits;
  const device LabelT* labels;
  const device float* class_weights;
  device atomic_uint* error_record;
  device T* out;
  const device ScaleT* scales;
  device float* stats_out;
  const device float* stats_in;
  device T* grad_out;
};

template <typename T, typename LabelT, bool kDense, int kForm, bool kGradient, typename ScaleT>
inline void row_per_threadgroup(RowBuffers<T, LabelT, ScaleT> b, constant CustomLossParams& params,
                                threadgroup float* scratch, uint2 tg_pos, uint2 tg_count,
                                uint2 tg_size, uint tid, uint lane, uint sg_index, uint sg_count) {
  const uint row = tg_pos.y * tg_count.x + tg_pos.x;
  if (row >= params.num_rows) return;  // padding of a folded grid: the whole threadgroup
  ThreadgroupReduce reduce;
  reduce.scratch = scratch;
  reduce.lane = lane;
  reduce.sg_index = sg_index;
  reduce.sg_count = sg_count;
  process_row<T, LabelT, kDense, kForm, kGradient>(b.logits, b.labels, b.class_weights, params,
                                                   b.error_record, b.out, b.scales, b.stats_out,
                                                   b.stats_in, b.grad_out, row, tid, tg_size.x,
                                                   tid == 0u, reduce);
}

template <typename T, typename LabelT, bool kDense, int kForm, bool kGradient, typename ScaleT>
inline void row_per_lane_group(RowBuffers<T, LabelT, ScaleT> b, constant CustomLossParams& params,
                               uint2 tg_pos, uint2 tg_count, uint tid) {
  const uint lanes = params.threads_per_row;  // power of two dividing the SIMD width
  const uint group = tid / lanes;
  const uint sub = tid % lanes;
  const uint row = (tg_pos.y * tg_count.x + tg_pos.x) * params.rows_per_threadgroup + group;
  if (row >= params.num_rows) return;  // the whole lane group: its shuffles stay inside it
  LaneGroupReduce reduce;
  reduce.lanes = lanes;
  process_row<T, LabelT, kDense, kForm, kGradient>(b.logits, b.labels, b.class_weights, params,
                                                   b.error_record, b.out, b.scales, b.stats_out,
                                                   b.stats_in, b.grad_out, row, sub, lanes,
                                                   sub == 0u, reduce);
}

template <typename T, typename LabelT>
inline RowBuffers<T, LabelT, float> forward_buffers(
    const device T* logits, const device LabelT* labels, const device float* class_weights,
    device atomic_uint* error_record, device T* loss, const device float* row_scales,
    device float* row_stats, device T* scaled_gradient) {
  RowBuffers<T, LabelT, float> b;
  b.logits = logits;
  b.labels = labels;
  b.class_weights = class_weights;
  b.error_record = error_record;
  b.out = loss;
  b.scales = row_scales;
  b.stats_out = row_stats;
  b.stats_in = row_stats;  // not read by a forward
  b.grad_out = scaled_gradient;
  return b;
}

template <typename T, typename LabelT>
inline RowBuffers<T, LabelT, T> gradient_buffers(
    const device T* logits, const device LabelT* labels, const device float* class_weights,
    device atomic_uint* error_record, device T* grad_logits, const device T* upstream,
    const device float* row_stats) {
  RowBuffers<T, LabelT, T> b;
  b.logits = logits;
  b.labels = labels;
  b.class_weights = class_weights;
  b.error_record = error_record;
  b.out = grad_logits;
  b.scales = upstream;
  b.stats_out = nullptr;  // a gradient writes no row_stats
  b.stats_in = row_stats;
  b.grad_out = grad_logits;
  return b;
}

template <typename T, typename LabelT, bool kDense, int kForm>
[[kernel]] void custom_loss_forward_rowtg(
    const device T* logits [[buffer(TFMO_BUFFER_LOGITS)]],
    const device LabelT* labels [[buffer(TFMO_BUFFER_LABELS)]],
    const device float* class_weights [[buffer(TFMO_BUFFER_CLASS_WEIGHTS)]],
    constant CustomLossParams& params [[buffer(TFMO_BUFFER_PARAMS)]],
    device atomic_uint* error_record [[buffer(TFMO_BUFFER_ERROR_RECORD)]],
    device T* loss [[buffer(TFMO_BUFFER_OUTPUT)]],
    const device float* row_scales [[buffer(TFMO_BUFFER_ROW_SCALES)]],
    device float* row_stats [[buffer(TFMO_BUFFER_ROW_STATS)]],
    device T* scaled_gradient [[buffer(TFMO_BUFFER_SCALED_GRADIENT)]],
    threadgroup float* scratch TFMO_THREADGROUP_ARG(TFMO_THREADGROUP_SCRATCH),
    TFMO_KERNEL_THREAD_ARGS) {
  row_per_threadgroup<T, LabelT, kDense, kForm, false>(
      forward_buffers(logits, labels, class_weights, error_record, loss, row_scales, row_stats,
                      scaled_gradient),
      params, scratch, tg_pos, tg_count, tg_size, tid, lane, sg_index, sg_count);
}

template <typename T, typename LabelT, bool kDense, int kForm>
[[kernel]] void custom_loss_gradient_rowtg(
    const device T* logits [[buffer(TFMO_BUFFER_LOGITS)]],
    const device LabelT* labels [[buffer(TFMO_BUFFER_LABELS)]],
    const device float* class_weights [[buffer(TFMO_BUFFER_CLASS_WEIGHTS)]],
    constant CustomLossParams& params [[buffer(TFMO_BUFFER_PARAMS)]],
    device atomic_uint* error_record [[buffer(TFMO_BUFFER_ERROR_RECORD)]],
    device T* grad_logits [[buffer(TFMO_BUFFER_OUTPUT)]],
    const device T* upstream [[buffer(TFMO_BUFFER_UPSTREAM)]],
    const device float* row_stats [[buffer(TFMO_BUFFER_ROW_STATS)]],
    threadgroup float* scratch TFMO_THREADGROUP_ARG(TFMO_THREADGROUP_SCRATCH),
    TFMO_KERNEL_THREAD_ARGS) {
  row_per_threadgroup<T, LabelT, kDense, kForm, true>(
      gradient_buffers(logits, labels, class_weights, error_record, grad_logits, upstream,
                       row_stats),
      params, scratch, tg_pos, tg_count, tg_size, tid, lane, sg_index, sg_count);
}

template <typename T, typename LabelT, bool kDense, int kForm>
[[kernel]] void custom_loss_forward_rowsimd(
    const device T* logits [[buffer(TFMO_BUFFER_LOGITS)]],
    const device LabelT* labels [[buffer(TFMO_BUFFER_LABELS)]],
    const device float* class_weights [[buffer(TFMO_BUFFER_CLASS_WEIGHTS)]],
    constant CustomLossParams& params [[buffer(TFMO_BUFFER_PARAMS)]],
    device atomic_uint* error_record [[buffer(TFMO_BUFFER_ERROR_RECORD)]],
    device T* loss [[buffer(TFMO_BUFFER_OUTPUT)]],
    const device float* row_scales [[buffer(TFMO_BUFFER_ROW_SCALES)]],
    device float* row_stats [[buffer(TFMO_BUFFER_ROW_STATS)]],
    device T* scaled_gradient [[buffer(TFMO_BUFFER_SCALED_GRADIENT)]],
    TFMO_KERNEL_THREAD_ARGS) {
  row_per_lane_group<T, LabelT, kDense, kForm, false>(
      forward_buffers(logits, labels, class_weights, error_record, loss, row_scales, row_stats,
                      scaled_gradient),
      params, tg_pos, tg_count, tid);
}

template <typename T, typename LabelT, bool kDense, int kForm>
[[kernel]] void custom_loss_gradient_rowsimd(
    const device T* logits [[buffer(TFMO_BUFFER_LOGITS)]],
    const device LabelT* labels [[buffer(TFMO_BUFFER_LABELS)]],
    const device float* class_weights [[buffer(TFMO_BUFFER_CLASS_WEIGHTS)]],
    constant CustomLossParams& params [[buffer(TFMO_BUFFER_PARAMS)]],
    device atomic_uint* error_record [[buffer(TFMO_BUFFER_ERROR_RECORD)]],
    device T* grad_logits [[buffer(TFMO_BUFFER_OUTPUT)]],
    const device T* upstream [[buffer(TFMO_BUFFER_UPSTREAM)]],
    const device float* row_stats [[buffer(TFMO_BUFFER_ROW_STATS)]],
    TFMO_KERNEL_THREAD_ARGS) {
  row_per_lane_group<T, LabelT, kDense, kForm, true>(
      gradient_buffers(logits, labels, class_weights, error_record, grad_logits, upstream,
                       row_stats),
      params, tg_pos, tg_count, tid);
}

}  // namespace kernels
}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_KERNELS_CUSTOM_LOSS_H_
