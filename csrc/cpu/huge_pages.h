// Transparent huge pages for large, freshly allocated outputs (Linux).
//
// A gradient of 65536 x 1000 floats is 262 MB. TensorFlow's CPU allocator takes it from
// malloc, which maps blocks that large straight from the kernel (glibc: always above 32 MiB)
// and unmaps them when the tensor dies, so every training step faults the whole output in
// again, 4 KiB at a time: 64000 page faults, each zeroing its page. Measured on the CI machine
// that costs more than the kernel itself (a plain 262 MB fill of fresh memory: 160-210 ms with
// 4 KiB pages, 35-45 ms after madvise(MADV_HUGEPAGE); the gradient op alone at 65536 x 1000:
// about 150 ms before, 60 ms after). With the advice the kernel faults 2 MiB pages instead.
// NumPy gives the same advice for its own arrays of 4 MiB and more.
//
// Only the advice is given: where transparent huge pages are off ("never") or unsupported it is
// a no-op, and the memory behaves as before. Small outputs are left alone: they come from
// malloc's heap, are reused from step to step, and advising part of the heap would split its
// mapping. TF_METAL_OPS_CPU_HUGE_PAGES=0 in the environment (read once) turns the advice off.
#ifndef TF_METAL_OPS_CSRC_CPU_HUGE_PAGES_H_
#define TF_METAL_OPS_CSRC_CPU_HUGE_PAGES_H_

#include <cstddef>

namespace tf_metal_ops {

// Outputs from this size on are advised: glibc's largest mmap threshold (its dynamic threshold
// never grows past 32 MiB on 64-bit systems), so the block is a mapping of its own that dies with
// the tensor. (512 x 32000 floats, 62.5 MiB, is among the sizes this must cover.)
constexpr size_t kHugePageAdviceMinBytes = size_t{32} << 20;

// Advises huge pages for the whole 2 MiB pages inside [data, data + bytes), before the first
// write, when that memory is fresh (not resident yet); memory already in use is left as it is.
void AdviseHugePages(void* data, size_t bytes);

// False when TF_METAL_OPS_CPU_HUGE_PAGES=0, or on systems without the advice.
bool HugePageAdviceEnabled();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_HUGE_PAGES_H_
