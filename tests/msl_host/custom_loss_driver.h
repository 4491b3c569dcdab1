// The test driver: one CustomLoss forward or gradient, planned by csrc/metal/launch_plan.cc exactly
// as the macOS encoder plans it, then executed by the emulator with the plan's kernel name, grid,
// threadgroup memory and buffer bindings. A C ABI, so Python (ctypes) and the stand-alone
// ThreadSanitizer program (custom_loss_driver_main.cc) share it. Field order is mirrored by
// tests/msl_host/msl_build.py: change both together.
#ifndef TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_DRIVER_H_
#define TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_DRIVER_H_

#include <cstdint>

extern "C" {

struct TfmoEmuCase {
  int64_t num_rows;
  int64_t num_classes;
  int32_t dtype;       // gpu::LogitsDtype
  int32_t label_kind;  // tf_metal_ops::LabelKind
  int32_t direction;   // tf_metal_ops::Direction
  int32_t variant;     // gpu::KernelVariant (-1 = auto)
  float gamma;
  float label_smoothing;
  int32_t has_class_weights;
  int32_t has_ignore_class;
  int64_t ignore_class;
  uint32_t max_total_threads_per_threadgroup;
  uint32_t thread_execution_width;
  int32_t executor;        // 0 fibers, 1 OS threads
  int32_t plan_only;       // 1: fill the result's plan fields, run nothing
  uint32_t max_concurrent_threadgroups;  // OS-thread executor
  // 1: the gradient the launch writes (a forward's scaled_gradient, a gradient's output) is
  // bound to the logits' memory, as the encoder binds a logits buffer TensorFlow forwarded to
  // that output: the kernel writes over its own input. `logits` must then be writable.
  uint32_t alias_gradient;
  const void* logits;          // T[N, C]
  const void* labels;          // int32/int64 [N] or T[N, C]
  const float* class_weights;  // float[C] or null
  const void* upstream;        // T[N] (gradient)
  void* output;                // T[N] or T[N, C]
  uint32_t* error_record;      // 8 words, initialized here as the encoder would
  int32_t has_row_stats;       // forward: write row_stats; gradient: read them
  int32_t has_row_scales;      // forward: read row_scales, write scaled_gradient
  float* row_stats;            // float[N, 3]
  const float* row_scales;     // float[N]
  void* scaled_gradient;       // T[N, C]
};

#define TFMO_EMU_MAX_BINDINGS 12
#define TFMO_EMU_NUM_ROLES 10  // gpu::kNumBufferRoles

struct TfmoEmuResult {
  int32_t ok;          // 1: planned (and run, unless plan_only) without error
  int32_t dispatched;  // 1: the plan asked for a dispatch (N > 0) and it ran
  int32_t variant;
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t threadgroup_memory_length;
  uint32_t threads_per_row;
  uint32_t rows_per_threadgroup;
  uint32_t num_bindings;
  int32_t binding_roles[TFMO_EMU_MAX_BINDINGS];  // role at index i (-1 past num_bindings)
  char kernel_name[96];
  char error[512];
  // Device-memory traffic of the launch per gpu::BufferRole (memory_traffic.h), when the
  // kernels were compiled with access hooks (memory_counted == 1); else zeros.
  int32_t memory_counted;
  int32_t reserved2;
  uint64_t bytes_read[TFMO_EMU_NUM_ROLES];
  uint64_t bytes_written[TFMO_EMU_NUM_ROLES];
};

int tfmo_emu_run(const TfmoEmuCase* c, TfmoEmuResult* result);

// Runs any registered kernel whose only buffer is [[buffer(0)]] = `buffer` on a 1-D grid of
// `groups` threadgroups of `threads` threads with `threadgroup_bytes` of threadgroup memory
// (tests/msl_host/sync_examples.metal). executor: 0 fibers, 1 OS threads (all groups at once).
// Returns 1, or 0 with the message in `error`.
int tfmo_emu_run_raw(const char* kernel, uint32_t threads, uint32_t groups,
                     uint32_t threadgroup_bytes, float* buffer, int32_t executor, char* error,
                     uint32_t error_size);

}  // extern "C"

#endif  // TF_METAL_OPS_TESTS_MSL_HOST_CUSTOM_LOSS_DRIVER_H_
