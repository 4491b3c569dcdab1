// Reading the MSL source of a tf_metal_ops.metal_kernel on its way to the CPU path's host
// compiler (csrc/kernel_compiler.h): what the CPU path refuses in it, and its host form.
#ifndef TF_METAL_OPS_CSRC_MSL_SOURCE_H_
#define TF_METAL_OPS_CSRC_MSL_SOURCE_H_

#include <string>

namespace tf_metal_ops {

// Empty, or why the CPU path refuses this source. Two kinds of source are refused:
// - MSL the emulator does not have: textures, simdgroup_matrix, ray tracing, ... named with
//   their feature, and the headers of those features.
// - C and C++ the host compiler takes and the Metal compiler does not, so that a kernel that
//   passes off the Mac also compiles on it: a call of a C library function (erf, expf, printf,
//   memcpy, ...) the source does not define itself; the C++ the MSL specification leaves out
//   (std::, new, exceptions, double, a derived class, ...); a header that is not Metal's.
// Comments and string literals are skipped; a name is only refused where it is used as the
// feature (a type, a function call, a namespace), so a variable of the same name is left alone.
std::string UnsupportedFeature(const std::string& msl_source);

// The host form of MSL source: function-scope `threadgroup` declarations become
// TFMO_THREADGROUP_STATIC (shared by the threadgroup's fibers); pointer and reference
// declarations keep the plain qualifier. Exposed for the tests.
std::string HostSource(const std::string& msl_source);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_MSL_SOURCE_H_
