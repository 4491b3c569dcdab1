// See custom_loss_driver.h. This file does, on Linux, what csrc/metal's encoder does on a Mac:
// plan, bind by role at the plan's indices, send the params bytes, size the threadgroup memory,
// dispatch. The only difference is that "dispatch" is the emulator.
#include "custom_loss_driver.h"
#include "custom_loss_case.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/metal/launch_plan.h"
#include "emulator.h"
#include "memory_traffic.h"

static_assert(TFMO_EMU_NUM_ROLES == tf_metal_ops::gpu::kNumBufferRoles &&
                  msl_host::kTrafficRoles == tf_metal_ops::gpu::kNumBufferRoles,
              "a buffer role was added: widen TfmoEmuResult and memory_traffic.h");

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
    if (b.index < TFMO_EMU_MAX_BINDINGS) {
      result->binding_roles[b.index] = static_cast<int32_t>(b.role);
    }
    if (b.role == BufferRole::kParams && (!b.inline_bytes || b.length != sizeof(CustomLossParams))) {
      copy_text(result->error, sizeof(result->error), "plan: params binding is not inline");
      return 0;
    }
    buffers[b.index] = b.role == BufferRole::kParams ? &params : msl_host::CaseBuffer(*c, b.role);
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
  // Every buffer's extent, for the traffic counter (which counts only when the kernels were
  // compiled with access hooks).
  const size_t n = static_cast<size_t>(c->num_rows);
  const size_t nc = n * static_cast<size_t>(c->num_classes);
  const size_t t_bytes = msl_host::DtypeBytes(c->dtype);
  const bool gradient = c->direction == 1;
  auto extent = [&](BufferRole role) -> size_t {
    switch (role) {
      case BufferRole::kLogits: return nc * t_bytes;
      case BufferRole::kLabels:
        return c->label_kind == 2 ? nc * t_bytes : n * (c->label_kind == 1 ? 8 : 4);
      case BufferRole::kClassWeights: return static_cast<size_t>(c->num_classes) * 4;
      case BufferRole::kParams: return sizeof(CustomLossParams);
      case BufferRole::kErrorRecord: return sizeof(CustomLossErrorRecord);
      case BufferRole::kOutput: return (gradient ? nc : n) * t_bytes;
      case BufferRole::kUpstream: return n * t_bytes;
      case BufferRole::kRowScales: return n * 4;
      case BufferRole::kRowStats: return n * 3 * 4;
      case BufferRole::kScaledGradient: return nc * t_bytes;
    }
    return 0;
  };
  msl_host::traffic_begin();
  for (const gpu::BufferBinding& b : plan.bindings) {
    msl_host::traffic_add_buffer(static_cast<int>(b.role), buffers[b.index], extent(b.role));
  }
  const std::string error = msl_host::run_dispatch(plan.kernel_name, dispatch);
  const msl_host::TrafficCounts traffic = msl_host::traffic_end();
  result->memory_counted = traffic.instrumented ? 1 : 0;
  for (int role = 0; role < TFMO_EMU_NUM_ROLES; ++role) {
    result->bytes_read[role] = traffic.bytes_read[role];
    result->bytes_written[role] = traffic.bytes_written[role];
  }
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
