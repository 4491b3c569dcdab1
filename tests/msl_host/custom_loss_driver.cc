// See custom_loss_driver.h. This file does, on Linux, what csrc/metal's encoder does on a Mac:
// plan, bind by role at the plan's indices, send the params bytes, size the threadgroup memory,
// dispatch. The only difference is that "dispatch" is the emulator.
#include "custom_loss_driver.h"
#include "custom_loss_case.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/launch_plan.h"
#include "emulator.h"

namespace {

using tf_metal_ops::gpu::BufferRole;

void copy_text(char* dst, size_t size, const std::string& text) {
  std::snprintf(dst, size, "%s", text.c_str());
}

}  // namespace

extern "C" int tfmo_emu_run(const TfmoEmuCase* c, TfmoEmuResult* result) {
  namespace gpu = tf_metal_ops::gpu;
  std::memset(result, 0, sizeof(*result));
  for (int32_t& role : result->binding_roles) role = -1;

  const gpu::LaunchDesc desc = msl_host::LaunchDescOf(*c);

  gpu::PipelineLimits limits;
  limits.max_total_threads_per_threadgroup = c->max_total_threads_per_threadgroup;
  limits.thread_execution_width = c->thread_execution_width;

  const gpu::LaunchPlan plan = gpu::PlanLaunch(desc, limits);
  if (!plan.ok) {
    copy_text(result->error, sizeof(result->error), "plan: " + plan.error);
    return 0;
  }
  if (plan.kernel_name != gpu::KernelName(desc)) {
    copy_text(result->error, sizeof(result->error), "plan: KernelName() != plan.kernel_name");
    return 0;
  }
  msl_host::ReportPlan(plan, result);

  // Bind by role at the plan's indices, as the encoder does.
  CustomLossParams params = plan.params;  // what setBytes would copy
  CustomLossErrorRecord* record = reinterpret_cast<CustomLossErrorRecord*>(c->error_record);
  std::vector<void*> buffers(plan.bindings.size(), nullptr);
  for (const gpu::BufferBinding& b : plan.bindings) {
    if (b.index >= buffers.size() || buffers[b.index] != nullptr) {
      copy_text(result->error, sizeof(result->error), "plan: binding indices are not 0..n-1");
      return 0;
    }
    if (b.index < 8) result->binding_roles[b.index] = static_cast<int32_t>(b.role);
    void* pointer = nullptr;
    switch (b.role) {
      case BufferRole::kLogits: pointer = const_cast<void*>(c->logits); break;
      case BufferRole::kLabels: pointer = const_cast<void*>(c->labels); break;
      // Null when absent: a kernel that read it anyway would crash the test.
      case BufferRole::kClassWeights:
        pointer = const_cast<float*>(c->has_class_weights ? c->class_weights : nullptr);
        break;
      case BufferRole::kParams:
        if (!b.inline_bytes || b.length != sizeof(CustomLossParams)) {
          copy_text(result->error, sizeof(result->error), "plan: params binding is not inline");
          return 0;
        }
        pointer = &params;
        break;
      case BufferRole::kErrorRecord: pointer = record; break;
      case BufferRole::kOutput: pointer = c->output; break;
      case BufferRole::kUpstream: pointer = const_cast<void*>(c->upstream); break;
    }
    buffers[b.index] = pointer;
  }
  if (c->plan_only) {
    result->ok = 1;
    return 1;
  }
  if (record != nullptr) InitCustomLossErrorRecord(record);
  if (!plan.dispatch) {  // N == 0: the encoder encodes nothing
    result->ok = 1;
    return 1;
  }

  msl_host::Dispatch dispatch;
  for (int i = 0; i < 3; ++i) {
    dispatch.threadgroups_per_grid[i] = plan.threadgroups_per_grid[i];
    dispatch.threads_per_threadgroup[i] = plan.threads_per_threadgroup[i];
  }
  dispatch.threadgroup_memory_length = plan.threadgroup_memory_length;
  dispatch.simd_width = limits.thread_execution_width;
  dispatch.buffers = buffers;
  dispatch.executor =
      c->executor == 1 ? msl_host::ExecutorKind::kThreads : msl_host::ExecutorKind::kFibers;
  dispatch.max_concurrent_threadgroups =
      c->max_concurrent_threadgroups == 0 ? 4 : c->max_concurrent_threadgroups;
  const std::string error = msl_host::run_dispatch(plan.kernel_name, dispatch);
  if (!error.empty()) {
    copy_text(result->error, sizeof(result->error), "emulator: " + error);
    return 0;
  }
  result->dispatched = 1;
  result->ok = 1;
  return 1;
}

extern "C" int tfmo_emu_run_raw(const char* kernel, uint32_t threads, uint32_t groups,
                                uint32_t threadgroup_bytes, float* buffer, int32_t executor,
                                char* error, uint32_t error_size) {
  msl_host::Dispatch d;
  d.threadgroups_per_grid[0] = groups;
  d.threadgroups_per_grid[1] = 1;
  d.threadgroups_per_grid[2] = 1;
  d.threads_per_threadgroup[0] = threads;
  d.threads_per_threadgroup[1] = 1;
  d.threads_per_threadgroup[2] = 1;
  d.threadgroup_memory_length = threadgroup_bytes;
  d.simd_width = 32;
  d.buffers = {buffer};
  d.executor = executor == 1 ? msl_host::ExecutorKind::kThreads : msl_host::ExecutorKind::kFibers;
  d.max_concurrent_threadgroups = groups;
  const std::string message = msl_host::run_dispatch(kernel, d);
  if (error != nullptr && error_size > 0) copy_text(error, error_size, message);
  return message.empty() ? 1 : 0;
}
