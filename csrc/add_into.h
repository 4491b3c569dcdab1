// AddInto: `sum[row_offset : row_offset + rows of addend] += addend`, written into the sum's
// own buffer.
//
// A chunked loss (tf_metal_ops/linear_cross_entropy.py) sums one d x V matrix per chunk into the kernel's
// gradient, and writes each chunk's rows of the hidden states' gradient. With TensorFlow's
// AddV2 the sum is a new d x V tensor each chunk: inside a while loop AddV2 cannot take over
// its input, which the loop's own frame still holds, so the old sum, the chunk's product and
// the new sum live side by side. The hidden states' gradient goes the same way, chunk by chunk
// into one [N, d] sum, in place of a TensorArray of the chunks' rows. PyTorch
// writes the product straight into the sum (torch.addmm's `out=`, as Liger-Kernel's fused
// linear cross-entropy does); TensorFlow's own InplaceAdd op adds into its input's buffer as
// this op does, but one row at a time.
//
// The contract, which makes writing into an input safe: on the first call of a loop (`first`
// true) the op ignores `accumulator` and makes a new sum of shape `shape`: the addend itself
// when it has that shape and the offset is 0 (its buffer taken over when TensorFlow allows,
// else copied), otherwise zeros with the addend added at its rows. On every later call
// `accumulator` must be the op's own previous output, which nothing else reads. The op is
// stateful, so graph optimizations never fold, merge or reorder it.
#ifndef TF_METAL_OPS_CSRC_ADD_INTO_H_
#define TF_METAL_OPS_CSRC_ADD_INTO_H_

namespace tf_metal_ops {

inline constexpr const char kAddIntoOpName[] = "TfMetalOps>AddInto";

enum AddIntoIndex : int {
  kAddIntoAccumulator = 0,
  kAddIntoAddend = 1,
  kAddIntoFirst = 2,
  kAddIntoRowOffset = 3,
  kAddIntoShape = 4,
};

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_ADD_INTO_H_
