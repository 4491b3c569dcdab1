// The pybind11 face of the native library: build information and the process-wide runtime
// settings of runtime.h. The same shared object is also the TensorFlow op library, so the
// settings Python changes here are the ones the kernels read.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "csrc/cpu/gemm.h"
#include "csrc/cpu/memory_floor.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/cpu/simd/rows_dispatch.h"
#include "csrc/metal/error_record_slots.h"
#include "csrc/kernel_compiler.h"
#include "csrc/linear_cross_entropy.h"
#include "csrc/msl_source.h"
#include "csrc/pending_errors.h"
#include "csrc/problem.h"
#include "csrc/runtime.h"
#if defined(TF_METAL_OPS_WITH_METAL)
#include "csrc/metal/custom_loss_metal.h"
#endif

#ifndef TF_METAL_OPS_BUILT_AGAINST_TF
#define TF_METAL_OPS_BUILT_AGAINST_TF "unknown"
#endif
// setup.py defines it for Metal builds; without it a Metal build compiles the shipped source at
// first use, as csrc/metal/kernel_library.mm assumes, and a build without Metal has none.
#ifndef TF_METAL_OPS_KERNEL_LIBRARY
#if defined(TF_METAL_OPS_WITH_METAL)
#define TF_METAL_OPS_KERNEL_LIBRARY "source"
#else
#define TF_METAL_OPS_KERNEL_LIBRARY "none"
#endif
#endif

namespace py = pybind11;

namespace tf_metal_ops {
namespace {

// The host-memory slab behind the host_slab_* test hooks.
struct HostErrorRecordSlab {
  explicit HostErrorRecordSlab(int capacity)
      : slots(capacity), records(static_cast<size_t>(slots.capacity())) {}
  ErrorRecordSlots slots;
  std::vector<CustomLossErrorRecord> records;
};

std::unique_ptr<HostErrorRecordSlab>& HostSlab() {
  static auto* slab = new std::unique_ptr<HostErrorRecordSlab>();
  return *slab;
}

HostErrorRecordSlab& TestSlab() {
  if (!HostSlab()) throw std::invalid_argument("call host_slab_reset(capacity) first");
  return *HostSlab();
}

size_t SlotIndex(const HostErrorRecordSlab& slab, int slot) {
  if (slot < 0 || slot >= slab.slots.capacity()) {
    throw std::invalid_argument("slot must be in [0, " + std::to_string(slab.slots.capacity()) +
                                "), got " + std::to_string(slot));
  }
  return static_cast<size_t>(slot);
}

// The op a record is for, from the hooks' arguments (node, direction, row_dims, num_classes,
// ignore_class), as the Metal path copies it into its completion handler.
CustomLossProblem HookProblem(const std::string& node_name, const std::string& direction,
                              std::vector<int64_t> row_dims, int64_t num_classes,
                              bool has_ignore_class, int64_t ignore_class) {
  CustomLossProblem problem;
  if (direction == "forward") {
    problem.attrs.direction = Direction::kForward;
  } else if (direction == "gradient") {
    problem.attrs.direction = Direction::kGradient;
  } else {
    throw std::invalid_argument("direction must be 'forward' or 'gradient', got '" + direction +
                                "'");
  }
  if (num_classes < 1) {
    throw std::invalid_argument("num_classes must be >= 1, got " + std::to_string(num_classes));
  }
  problem.attrs.node_name = node_name;
  problem.attrs.has_ignore_class = has_ignore_class;
  problem.attrs.ignore_class = ignore_class;
  problem.num_classes = num_classes;
  problem.row_dims = std::move(row_dims);
  problem.num_rows = 1;
  for (int64_t d : problem.row_dims) problem.num_rows *= d;
  return problem;
}

// A stand-in for a tensorflow-metal stream and the GPU behind it, for the tests of
// check_errors()'s wait (host_stream_* hooks). A commit-mode launch leaves a completion handler
// in the stream's current command buffer, which runs only once the buffer is committed (the
// plugin's batching, or check_errors()'s flush) and finished. Here the GPU is a detached thread
// per committed buffer: it completes the buffer after `gpu_seconds` and runs its handlers
// `handler_seconds` later, as Metal runs them on its own threads, possibly after the buffer's
// waiters have returned. The handlers do what the Metal path's do: report, then finish. One
// stream, never destroyed (its threads may outlive a test); plain mutexes and condition
// variables only, so the macOS build binds no more of libc++ than pending_errors.cc does.
struct HostLaunch {
  CustomLossProblem problem;
  std::string record;
  uint64_t ticket;
};

class HostStream {
 public:
  void Configure(double gpu_seconds, double handler_seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    gpu_seconds_ = gpu_seconds;
    handler_seconds_ = handler_seconds;
  }

  void Encode(HostLaunch launch) {
    std::lock_guard<std::mutex> lock(mutex_);
    current_.push_back(std::move(launch));
  }

  // Commits the current command buffer; returns its number, for WaitCompleted.
  uint64_t Commit() {
    std::vector<HostLaunch> launches;
    uint64_t buffer;
    double gpu, handler;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      launches.swap(current_);
      buffer = committed_++;
      gpu = gpu_seconds_;
      handler = handler_seconds_;
    }
    std::thread([this, launches = std::move(launches), buffer, gpu, handler] {
      Pause(gpu);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        completed_.insert(buffer);
      }
      completed_changed_.notify_all();
      Pause(handler);
      for (const HostLaunch& launch : launches) {
        ReportCompletedErrorRecord(launch.problem, launch.record.data(), launch.record.size());
        FinishOutstandingLaunch(launch.ticket);
      }
    }).detach();
    return buffer;
  }

  // The protocol's commitAndWait: returns once the buffer has completed (not its handlers).
  void CommitAndWait() {
    const uint64_t buffer = Commit();
    std::unique_lock<std::mutex> lock(mutex_);
    completed_changed_.wait(lock, [&] { return completed_.count(buffer) > 0; });
    ++flushes_;
  }

  int flushes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return flushes_;
  }

  void ResetFlushes() {
    std::lock_guard<std::mutex> lock(mutex_);
    flushes_ = 0;
  }

 private:
  // A timed wait on a condition variable nobody notifies (the stream's, never destroyed).
  void Pause(double seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    never_notified_.wait_for(lock, std::chrono::duration<double>(seconds), [] { return false; });
  }

  std::mutex mutex_;
  std::condition_variable completed_changed_;
  std::condition_variable never_notified_;
  double gpu_seconds_ = 0.0;
  double handler_seconds_ = 0.0;
  std::vector<HostLaunch> current_;
  uint64_t committed_ = 0;
  std::set<uint64_t> completed_;
  int flushes_ = 0;
};

HostStream& TheHostStream() {
  static auto* stream = new HostStream();
  return *stream;
}

// Whether the host stream's flush is registered, and the flush it replaced.
struct HostFlushSlot {
  std::mutex mutex;
  bool installed = false;
  CommandBufferFlush replaced = nullptr;
};
HostFlushSlot& HostFlush() {
  static auto* slot = new HostFlushSlot();
  return *slot;
}

Error HostStreamFlush() {
  TheHostStream().CommitAndWait();
  return Error::Ok();
}

py::object ErrorOrNone(const Error& error) {
  if (error.ok()) return py::none();
  py::tuple taken(2);
  taken[0] = py::int_(static_cast<int>(error.code));
  taken[1] = py::str(error.message);
  return std::move(taken);
}

void DefineModule(py::module_& m) {
  m.doc() = "Native runtime of tf_metal_ops (settings shared with the TensorFlow kernels).";

  m.def("build_info", [] {
    py::dict info;
    info["built_against_tensorflow"] = TF_METAL_OPS_BUILT_AGAINST_TF;
    info["tensorflow_api"] = "C API only (tensorflow/c/ops.h, tensorflow/c/kernels.h)";
    info["metal_compiled_in"] = MetalCompiledIn();
    // The BLAS of linear_cross_entropy's products (csrc/cpu/gemm.h), and its own description.
    info["blas"] = GemmLibrary();
    info["blas_config"] = GemmConfig();
    info["blas_available"] = GemmAvailable();
    // "precompiled" (.metallib next to the library), "source" (compiled at first use from the
    // shipped .metal source) or "none" (no Metal in this build).
    info["metal_kernel_library"] = TF_METAL_OPS_KERNEL_LIBRARY;
#if defined(TF_METAL_OPS_WITH_METAL)
    // A GPU kernel that failed to register leaves its dtype to the CPU: say so, and why.
    info["gpu_kernel_dtypes"] = metal::RegisteredGpuDtypes();
    info["gpu_kernel_registration_errors"] = metal::KernelRegistrationErrors();
#endif
#if defined(__clang__)
    info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return info;
  });

  // Registers the Metal kernels for the "GPU" device type; _native.load calls it only when
  // tf_metal_ops/gpu_plugin.py found Apple's tensorflow-metal to be the GPU's only plugin (see
  // csrc/metal/custom_loss_metal.h). Returns whether kernels are registered: false in a build
  // without Metal, which has none.
  m.def("register_metal_kernels", [] {
#if defined(TF_METAL_OPS_WITH_METAL)
    metal::RegisterGpuKernelsForAppleStream();
    return metal::GpuKernelsRegistered();
#else
    return false;
#endif
  });

  // metal_kernel's CPU path (csrc/kernel_compiler.h); tf_metal_ops/kernels.py calls these.
  m.def(
      "set_kernel_toolchain",
      [](std::vector<std::string> compiler, std::string missing_reason, std::string emulator_dir,
         std::string cache_dir) {
        SetKernelToolchain(KernelToolchain{std::move(compiler), std::move(missing_reason),
                                           std::move(emulator_dir), std::move(cache_dir)});
      },
      py::arg("compiler"), py::arg("missing_reason"), py::arg("emulator_dir"),
      py::arg("cache_dir"));
  m.def("kernel_cache_stats", [] {
    const KernelCacheStats stats = GetKernelCacheStats();
    py::dict out;
    out["compiled"] = stats.compiled;
    out["from_disk"] = stats.from_disk;
    out["in_memory"] = stats.in_memory;
    out["compiler"] = stats.compiler;
    return out;
  });
  m.def("kernel_host_source", &HostSource, py::arg("msl_source"));

  m.def("get_commit_mode", [] {
    return GetCommitMode() == CommitMode::kCommitAndWait ? "commit_and_wait" : "commit";
  });
  m.def("set_commit_mode", [](const std::string& mode) {
    if (mode == "commit") {
      SetCommitMode(CommitMode::kCommit);
    } else if (mode == "commit_and_wait") {
      SetCommitMode(CommitMode::kCommitAndWait);
    } else {
      throw std::invalid_argument("mode must be 'commit' or 'commit_and_wait', got '" + mode +
                                  "'");
    }
  });

  m.def("kernel_timings", [] {
    py::list out;
    for (const KernelTiming& t : KernelTimings()) {
      py::dict row;
      row["op"] = t.op;
      row["kernel"] = t.kernel_name;
      row["shape"] = t.shape;
      row["gpu_seconds"] = t.gpu_seconds;
      out.append(row);
    }
    return out;
  });
  m.def("clear_kernel_timings", &ClearKernelTimings);

  // GPU errors found after their op returned (csrc/pending_errors.h); tf_metal_ops.debug raises
  // them as TensorFlow errors. (These hooks build their Python values by hand, without
  // py::class_, py::cast or py::make_tuple, whose failure paths would bind the macOS build to
  // more of libc++'s run-time type information: tests/cross/macos_stubs/libc++.tbd.)
  m.def("has_pending_error", [] { return py::bool_(HasPendingError()); });
  m.def("take_pending_error", []() -> py::object { return ErrorOrNone(TakePendingError()); });
  // check_errors()'s wait for the launches that may still report (WaitForOutstandingLaunches):
  // None, or (code, message) when it failed or timed out. timeout_seconds < 0: no limit.
  m.def(
      "wait_for_outstanding_launches",
      [](double timeout_seconds) -> py::object {
        Error error;
        {
          py::gil_scoped_release release;  // the handlers and the flush never need the GIL
          error = WaitForOutstandingLaunches(timeout_seconds);
        }
        return ErrorOrNone(error);
      },
      py::arg("timeout_seconds"));
  m.def("outstanding_launches", &OutstandingLaunches);
  // What the Metal completion handler does with a finished kernel's error record, callable with
  // a record from anywhere (the Linux emulator's, in the tests): `record` is the record's bytes
  // and the rest describes the op the kernel ran for. Returns whether the record held an error.
  m.def(
      "report_completed_error_record",
      [](py::bytes record, const std::string& node_name, const std::string& direction,
         std::vector<int64_t> row_dims, int64_t num_classes, bool has_ignore_class,
         int64_t ignore_class) {
        const CustomLossProblem problem = HookProblem(node_name, direction, std::move(row_dims),
                                                      num_classes, has_ignore_class, ignore_class);
        const std::string bytes = record;  // a copy: the GIL is released below
        bool held;
        {
          py::gil_scoped_release release;
          held = ReportCompletedErrorRecord(problem, bytes.data(), bytes.size());
        }
        return py::bool_(held);
      },
      py::arg("record"), py::arg("node_name"), py::arg("direction"), py::arg("row_dims"),
      py::arg("num_classes"), py::arg("has_ignore_class"), py::arg("ignore_class"));

  // The host stand-in for a tensorflow-metal stream (HostStream above). install registers its
  // flush in check_errors()'s wait, as the Metal path registers its streams'; uninstall puts back
  // the one it replaced. encode takes the arguments of report_completed_error_record and leaves
  // the launch outstanding in the stream's current command buffer; commit is the plugin's
  // batching commit, without a wait.
  m.def(
      "host_stream_install",
      [](double gpu_seconds, double handler_seconds, bool flush) {
        if (!(gpu_seconds >= 0) || !(handler_seconds >= 0)) {
          throw std::invalid_argument("gpu_seconds and handler_seconds must be >= 0");
        }
        TheHostStream().Configure(gpu_seconds, handler_seconds);
        TheHostStream().ResetFlushes();
        HostFlushSlot& slot = HostFlush();
        std::lock_guard<std::mutex> lock(slot.mutex);
        if (flush && !slot.installed) {
          slot.replaced = SetCommandBufferFlush(&HostStreamFlush);
          slot.installed = true;
        } else if (!flush && slot.installed) {
          SetCommandBufferFlush(slot.replaced);
          slot.installed = false;
        }
      },
      py::arg("gpu_seconds"), py::arg("handler_seconds"), py::arg("flush"));
  m.def("host_stream_uninstall", [] {
    HostFlushSlot& slot = HostFlush();
    std::lock_guard<std::mutex> lock(slot.mutex);
    if (slot.installed) SetCommandBufferFlush(slot.replaced);
    slot.installed = false;
  });
  m.def(
      "host_stream_encode",
      [](py::bytes record, const std::string& node_name, const std::string& direction,
         std::vector<int64_t> row_dims, int64_t num_classes, bool has_ignore_class,
         int64_t ignore_class) {
        HostLaunch launch{HookProblem(node_name, direction, std::move(row_dims), num_classes,
                                      has_ignore_class, ignore_class),
                          std::string(record), 0};
        launch.ticket = BeginOutstandingLaunch();
        TheHostStream().Encode(std::move(launch));
      },
      py::arg("record"), py::arg("node_name"), py::arg("direction"), py::arg("row_dims"),
      py::arg("num_classes"), py::arg("has_ignore_class"), py::arg("ignore_class"));
  m.def("host_stream_commit", [] { TheHostStream().Commit(); });
  m.def("host_stream_flushes", [] { return TheHostStream().flushes(); });

  // The slot bookkeeping of the Metal path's error-record slab (csrc/metal/error_record_slots.h),
  // over one slab in host memory, for tests: host_slab_write stands in for the kernel's writes.
  m.def("host_slab_reset", [](int capacity) {
    if (capacity < 1) {
      throw std::invalid_argument("capacity must be >= 1, got " + std::to_string(capacity));
    }
    HostSlab() = std::make_unique<HostErrorRecordSlab>(capacity);
  });
  m.def("host_slab_capacity", [] { return TestSlab().slots.capacity(); });
  m.def("host_slab_in_use", [] { return TestSlab().slots.InUse(); });
  m.def("host_slab_acquire", [] {
    HostErrorRecordSlab& slab = TestSlab();
    py::gil_scoped_release release;
    return slab.slots.Acquire(slab.records.data());
  });
  m.def("host_slab_read", [](int slot) {
    HostErrorRecordSlab& slab = TestSlab();
    const CustomLossErrorRecord& r = slab.records[SlotIndex(slab, slot)];
    return py::bytes(reinterpret_cast<const char*>(&r), sizeof(r));
  });
  m.def("host_slab_write", [](int slot, py::bytes record) {
    HostErrorRecordSlab& slab = TestSlab();
    const std::string bytes = record;
    if (bytes.size() != sizeof(CustomLossErrorRecord)) {
      throw std::invalid_argument("record must have " +
                                  std::to_string(sizeof(CustomLossErrorRecord)) + " bytes, got " +
                                  std::to_string(bytes.size()));
    }
    std::memcpy(&slab.records[SlotIndex(slab, slot)], bytes.data(), bytes.size());
  });
  m.def("host_slab_release", [](int slot) {
    HostErrorRecordSlab& slab = TestSlab();
    CustomLossErrorRecord r;
    {
      py::gil_scoped_release release;
      r = slab.slots.Release(slab.records.data(), slot);
    }
    return py::bytes(reinterpret_cast<const char*>(&r), sizeof(r));
  });

  // The native linear_cross_entropy's rows per chunk (csrc/linear_cross_entropy.h), for tests
  // and benchmarks.
  m.def("linear_chunk_rows", &LinearChunkRows, py::arg("requested"), py::arg("rows"),
        py::arg("width"), py::arg("classes"));
  // The BLAS's column blocks (csrc/cpu/gemm.h) of a product `columns` wide: (width, count).
  m.def("gemm_column_blocks", [](int64_t columns) {
    if (columns < 0) {
      throw std::invalid_argument("columns must be >= 0, got " + std::to_string(columns));
    }
    const GemmColumnBlocks blocks = GemmColumnBlocks::For(columns);
    // As Python ints: a tuple of int64_t would name long long's typeinfo, which the macOS
    // link check's libc++ stub does not list.
    return py::make_tuple(py::int_(blocks.width), py::int_(blocks.count));
  }, py::arg("columns"));
  m.def("get_cpu_threads", &CpuThreadLimit);
  m.def("set_cpu_threads", [](int threads) {
    if (threads < 0) {
      throw std::invalid_argument("threads must be >= 0 (0: all cores), got " +
                                  std::to_string(threads));
    }
    SetCpuThreadLimit(threads);
  });

  // ---- Benchmark support (python -m tf_metal_ops bench; the kernels are in csrc/cpu/) --------
  // Which vectorized variant the CPU kernels picked for this machine ("avx2" or "portable").
  m.def("cpu_kernel_isa", [] { return std::string(SelectedRowsIsa()); });
  // One pass of the memory floor (csrc/cpu/memory_floor.h) over a C-contiguous float32 matrix:
  // with `dst` None it only reads `src` (the forward op's traffic), otherwise it also writes
  // `dst` (the gradient op's). Runs without the GIL, on the kernels' threads and thread cap.
  // C = alpha op(A) op(B) + beta C on the native op's BLAS (csrc/cpu/gemm.h), for the products'
  // speed figures (tests/perf/gemm_rate.py) and the interface's tests. 2-D C-contiguous float32
  // arrays; C is written in place. Runs without the GIL, on the kernels' thread cap.
  m.def(
      "sgemm",
      [](py::array_t<float, py::array::c_style> a, py::array_t<float, py::array::c_style> b,
         py::object c_object, bool trans_a, bool trans_b, float alpha, float beta) {
        if (!py::isinstance<py::array_t<float, py::array::c_style>>(c_object)) {
          throw std::invalid_argument("c must be a C-contiguous float32 array");
        }
        auto c = c_object.cast<py::array_t<float, py::array::c_style>>();
        if (a.ndim() != 2 || b.ndim() != 2 || c.ndim() != 2 || !c.writeable()) {
          throw std::invalid_argument("a, b and c must be 2-D float32 arrays, c writable");
        }
        const int64_t m = trans_a ? a.shape(1) : a.shape(0);
        const int64_t k = trans_a ? a.shape(0) : a.shape(1);
        const int64_t k_b = trans_b ? b.shape(1) : b.shape(0);
        const int64_t n = trans_b ? b.shape(0) : b.shape(1);
        if (k != k_b || c.shape(0) != m || c.shape(1) != n || !GemmFits(m, n, k)) {
          throw std::invalid_argument("sgemm: shapes do not fit: op(a) " + std::to_string(m) +
                                      "x" + std::to_string(k) + ", op(b) " +
                                      std::to_string(k_b) + "x" + std::to_string(n) + ", c " +
                                      std::to_string(c.shape(0)) + "x" +
                                      std::to_string(c.shape(1)));
        }
        if (!GemmAvailable()) throw std::runtime_error("sgemm: no BLAS in this process");
        float* out = c.mutable_data();
        py::gil_scoped_release release;
        SetGemmThreads(CpuThreadLimit());
        Sgemm(trans_a ? Transpose::kYes : Transpose::kNo, trans_b ? Transpose::kYes : Transpose::kNo,
              m, n, k, alpha, a.data(), a.shape(1), b.data(), b.shape(1), beta, out, n);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("trans_a") = false,
      py::arg("trans_b") = false, py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f);
  m.def(
      "memory_floor_pass",
      [](py::array_t<float, py::array::c_style> src, py::object dst) {
        if (src.ndim() != 2) throw std::invalid_argument("src must be a 2-D float32 array");
        const int64_t rows = src.shape(0);
        const int64_t cols = src.shape(1);
        if (dst.is_none()) {
          py::gil_scoped_release release;
          return StreamReadPass(src.data(), rows, cols);
        }
        // No conversion: a converted copy would be written instead of the caller's array.
        if (!py::isinstance<py::array_t<float, py::array::c_style>>(dst)) {
          throw std::invalid_argument("dst must be a C-contiguous float32 array");
        }
        auto out = dst.cast<py::array_t<float, py::array::c_style>>();
        if (out.ndim() != 2 || out.shape(0) != rows || out.shape(1) != cols || !out.writeable()) {
          throw std::invalid_argument("dst must be a writable float32 array shaped like src");
        }
        float* out_data = out.mutable_data();
        py::gil_scoped_release release;
        StreamCopyPass(src.data(), out_data, rows, cols);
        return 0.0;
      },
      py::arg("src"), py::arg("dst") = py::none());
}

}  // namespace
}  // namespace tf_metal_ops

PYBIND11_MODULE(_tf_metal_ops, m) { tf_metal_ops::DefineModule(m); }
