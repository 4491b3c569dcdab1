// The pybind11 face of the native library: build information and the process-wide runtime
// settings of runtime.h. The same shared object is also the TensorFlow op library, so the
// settings Python changes here are the ones the kernels read.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "csrc/cpu/parallel_for.h"
#include "csrc/runtime.h"

#ifndef TF_METAL_OPS_BUILT_AGAINST_TF
#define TF_METAL_OPS_BUILT_AGAINST_TF "unknown"
#endif
#ifndef TF_METAL_OPS_KERNEL_LIBRARY
#define TF_METAL_OPS_KERNEL_LIBRARY "none"
#endif

namespace py = pybind11;
namespace tmo = tf_metal_ops;

PYBIND11_MODULE(_tf_metal_ops, m) {
  m.doc() = "Native runtime of tf_metal_ops (settings shared with the TensorFlow kernels).";

  m.def("build_info", [] {
    py::dict info;
    info["built_against_tensorflow"] = TF_METAL_OPS_BUILT_AGAINST_TF;
    info["tensorflow_api"] = "C API only (tensorflow/c/ops.h, tensorflow/c/kernels.h)";
    info["metal_compiled_in"] = tmo::MetalCompiledIn();
    // "precompiled" (.metallib next to the library), "source" (compiled at first use from the
    // shipped .metal source) or "none" (no Metal in this build).
    info["metal_kernel_library"] = TF_METAL_OPS_KERNEL_LIBRARY;
#if defined(__clang__)
    info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return info;
  });

  m.def("get_commit_mode", [] {
    return tmo::GetCommitMode() == tmo::CommitMode::kCommitAndWait ? "commit_and_wait" : "commit";
  });
  m.def("set_commit_mode", [](const std::string& mode) {
    if (mode == "commit") {
      tmo::SetCommitMode(tmo::CommitMode::kCommit);
    } else if (mode == "commit_and_wait") {
      tmo::SetCommitMode(tmo::CommitMode::kCommitAndWait);
    } else {
      throw std::invalid_argument("mode must be 'commit' or 'commit_and_wait', got '" + mode +
                                  "'");
    }
  });

  m.def("kernel_timings", [] {
    py::list out;
    for (const tmo::KernelTiming& t : tmo::KernelTimings()) {
      py::dict row;
      row["op"] = t.op;
      row["kernel"] = t.kernel_name;
      row["shape"] = t.shape;
      row["gpu_seconds"] = t.gpu_seconds;
      out.append(row);
    }
    return out;
  });
  m.def("clear_kernel_timings", &tmo::ClearKernelTimings);

  m.def("get_cpu_threads", &tmo::CpuThreadLimit);
  m.def("set_cpu_threads", [](int threads) {
    if (threads < 0) {
      throw std::invalid_argument("threads must be >= 0 (0: all cores), got " +
                                  std::to_string(threads));
    }
    tmo::SetCpuThreadLimit(threads);
  });
}
