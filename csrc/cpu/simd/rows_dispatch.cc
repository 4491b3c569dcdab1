// The choice between the row kernels' instruction-set variants (rows_dispatch.h), made once per
// process from the CPU's feature bits.
#include "csrc/cpu/simd/rows_dispatch.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tf_metal_ops {
namespace {

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

#if defined(__x86_64__)
// CPUID leaf 1 ECX and leaf 7 EBX bits, and XCR0's state components (Intel SDM vol. 1, 13.1
// and vol. 2A, CPUID and XGETBV), read here rather than through __builtin_cpu_supports: clang 16
// does not know "f16c" there, and the OS's saving of the AVX-512 state is checked explicitly
// instead of relying on how each compiler's runtime decides a feature is usable.
constexpr unsigned kLeaf1EcxFma = 1u << 12;
constexpr unsigned kLeaf1EcxOsxsave = 1u << 27;
constexpr unsigned kLeaf1EcxF16c = 1u << 29;
constexpr unsigned kLeaf1EcxAvx = 1u << 28;
constexpr unsigned kLeaf7EbxAvx2 = 1u << 5;
constexpr unsigned kLeaf7EbxAvx512f = 1u << 16;
constexpr unsigned kLeaf7EbxAvx512dq = 1u << 17;
constexpr unsigned kLeaf7EbxAvx512bw = 1u << 30;
constexpr unsigned kLeaf7EbxAvx512vl = 1u << 31;
constexpr unsigned long long kXcr0SseAvx = 0x6;          // XMM and YMM state
constexpr unsigned long long kXcr0Avx512 = 0xe0;         // opmask, ZMM0-15 upper halves, ZMM16-31

unsigned long long ReadXcr0() {
  unsigned int low = 0, high = 0;
  __asm__("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
  return (static_cast<unsigned long long>(high) << 32) | low;
}

// The widest variant this CPU and OS run.
Isa WidestIsa() {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return Isa::kPortable;
  const unsigned leaf1_needed = kLeaf1EcxFma | kLeaf1EcxOsxsave | kLeaf1EcxF16c | kLeaf1EcxAvx;
  if ((ecx & leaf1_needed) != leaf1_needed) return Isa::kPortable;
  const unsigned long long xcr0 = ReadXcr0();  // readable: OSXSAVE is set
  if ((xcr0 & kXcr0SseAvx) != kXcr0SseAvx) return Isa::kPortable;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return Isa::kPortable;
  if ((ebx & kLeaf7EbxAvx2) == 0) return Isa::kPortable;
  // A build without the AVX-512 variant (setup.py's TF_METAL_OPS_ROW_VARIANTS=host, on a CPU
  // without it) stops at AVX2.
#if !defined(TF_METAL_OPS_WITHOUT_AVX512)
  const unsigned avx512_needed =
      kLeaf7EbxAvx512f | kLeaf7EbxAvx512dq | kLeaf7EbxAvx512bw | kLeaf7EbxAvx512vl;
  if ((ebx & avx512_needed) == avx512_needed && (xcr0 & kXcr0Avx512) == kXcr0Avx512) {
    return Isa::kAvx512;
  }
#endif
  return Isa::kAvx2;
}
#else
Isa WidestIsa() { return Isa::kPortable; }
#endif

// TF_METAL_OPS_CPU_ISA caps the variant (for tests: the numerics of a narrower one on a wider
// CPU); it never selects one the CPU lacks.
Isa IsaCap() {
  const char* forced = std::getenv("TF_METAL_OPS_CPU_ISA");
  if (forced == nullptr || forced[0] == '\0') return Isa::kAvx512;
  if (std::strcmp(forced, "portable") == 0) return Isa::kPortable;
  if (std::strcmp(forced, "avx2") == 0) return Isa::kAvx2;
  if (std::strcmp(forced, "avx512") == 0) return Isa::kAvx512;
  std::fprintf(stderr,
               "tf_metal_ops: TF_METAL_OPS_CPU_ISA=%s is not one of portable, avx2, avx512; "
               "ignoring it\n",
               forced);
  return Isa::kAvx512;
}

// One variant's entry points, indexed by StorageType.
struct VariantKernels {
  const char* isa;
  RowsKernel rows[3];
  SplitRowsKernel split[3];
};
static_assert(static_cast<int>(StorageType::kFloat) == 0 &&
                  static_cast<int>(StorageType::kHalf) == 1 &&
                  static_cast<int>(StorageType::kBFloat16) == 2,
              "VariantKernels is indexed by StorageType");
// The VariantKernels of the variant in namespace `isa` (portable, avx2 or avx512).
#define TF_METAL_OPS_VARIANT_KERNELS(isa)                                                    \
  VariantKernels {                                                                          \
    #isa,                                                                                   \
        {&isa::ComputeRows<StorageType::kFloat>, &isa::ComputeRows<StorageType::kHalf>,     \
         &isa::ComputeRows<StorageType::kBFloat16>},                                        \
        {&isa::ComputeSplitRows<StorageType::kFloat>,                                       \
         &isa::ComputeSplitRows<StorageType::kHalf>,                                        \
         &isa::ComputeSplitRows<StorageType::kBFloat16>},                                   \
  }

// Read once: the CPU does not change, and an environment override is for tests only.
VariantKernels ChooseVariant() {
  const Isa widest = WidestIsa();
  const Isa cap = IsaCap();
  const Isa chosen = static_cast<int>(widest) < static_cast<int>(cap) ? widest : cap;
  (void)chosen;
#if defined(__x86_64__) && !defined(TF_METAL_OPS_WITHOUT_AVX512)
  if (chosen == Isa::kAvx512) return TF_METAL_OPS_VARIANT_KERNELS(avx512);
#endif
#if defined(__x86_64__)
  if (chosen == Isa::kAvx2) return TF_METAL_OPS_VARIANT_KERNELS(avx2);
#endif
  return TF_METAL_OPS_VARIANT_KERNELS(portable);
}
#undef TF_METAL_OPS_VARIANT_KERNELS
const VariantKernels& Chosen() {
  static const VariantKernels chosen = ChooseVariant();
  return chosen;
}

// The chosen variant's instance for the batch's storage type.
void ComputeRowsOfChosenVariant(const RowsArgs& args, int64_t begin, int64_t end) {
  Chosen().rows[static_cast<int>(args.type)](args, begin, end);
}
bool ComputeSplitRowsOfChosenVariant(const RowsArgs& args, int64_t num_rows, int threads,
                                     ParallelTasks parallel) {
  return Chosen().split[static_cast<int>(args.type)](args, num_rows, threads, parallel);
}
}  // namespace

RowsKernel SelectRowsKernel() { return &ComputeRowsOfChosenVariant; }
SplitRowsKernel SelectSplitRowsKernel() { return &ComputeSplitRowsOfChosenVariant; }
const char* SelectedRowsIsa() { return Chosen().isa; }

}  // namespace tf_metal_ops
