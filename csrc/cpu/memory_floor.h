// The memory floor of a fused loss step, measured on this machine for the benchmark.
//
// Forward + backward of any loss that is fused per row must at least read the logits once in
// the forward op, read them again in the gradient op and write the gradient: 12 bytes per
// float32 element. These two passes do exactly that and nothing else (a sum, a scaled copy),
// on the same thread pool and thread cap as the kernels, so the benchmark can report how close
// a kernel comes to what the memory system allows in the same run.
#ifndef TF_METAL_OPS_CSRC_CPU_MEMORY_FLOOR_H_
#define TF_METAL_OPS_CSRC_CPU_MEMORY_FLOOR_H_

#include <cstdint>

namespace tf_metal_ops {

// Reads rows x cols floats once (the forward op's traffic); returns their sum, so the reads
// cannot be optimized away.
double StreamReadPass(const float* src, int64_t rows, int64_t cols);

// Reads src and writes dst = 0.5 * src (the gradient op's traffic).
void StreamCopyPass(const float* src, float* dst, int64_t rows, int64_t cols);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_MEMORY_FLOOR_H_
