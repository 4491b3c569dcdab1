// The choice between the row kernels' instruction-set variants (rows_dispatch.h), made once per
// process from the CPU's feature bits.
#include "csrc/cpu/simd/rows_dispatch.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tf_metal_ops {
namespace {
#if defined(__x86_64__)
// F16C (the half <-> float conversions) from CPUID leaf 1, ECX bit 29 (Intel SDM vol. 2A, CPUID):
// clang 16 does not know "f16c" as a __builtin_cpu_supports feature. The AVX2 test beside it
// covers the OS's saving of the YMM state that these instructions also need.
bool CpuHasF16c() {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

// Read once: the CPU does not change, and an environment override is for tests only.
RowsKernel ChooseRowsKernel(const char** isa, SplitRowsKernel* split) {
  const char* forced = std::getenv("TF_METAL_OPS_CPU_ISA");
  const bool force_portable = forced != nullptr && std::strcmp(forced, "portable") == 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!force_portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      CpuHasF16c()) {
    *isa = "avx2";
    *split = &avx2::ComputeSplitRows;
    return &avx2::ComputeRows;
  }
#endif
  (void)force_portable;
  *isa = "portable";
  *split = &portable::ComputeSplitRows;
  return &portable::ComputeRows;
}
struct RowsKernelChoice {
  const char* isa = nullptr;
  SplitRowsKernel split = nullptr;
  RowsKernel kernel = ChooseRowsKernel(&isa, &split);
};
const RowsKernelChoice& Choice() {
  static const RowsKernelChoice choice;
  return choice;
}
}  // namespace

RowsKernel SelectRowsKernel() { return Choice().kernel; }
SplitRowsKernel SelectSplitRowsKernel() { return Choice().split; }
const char* SelectedRowsIsa() { return Choice().isa; }

}  // namespace tf_metal_ops
