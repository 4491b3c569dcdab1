// See memory_traffic.h.
#include "memory_traffic.h"

#include <atomic>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "msl_host_runtime.h"

namespace msl_host {
namespace {

struct Range {
  int role;
  uintptr_t begin;
  uintptr_t end;
};

struct AccessKey {
  uint64_t threadgroup;
  uintptr_t instruction;
  uintptr_t address;
  bool operator==(const AccessKey& o) const {
    return threadgroup == o.threadgroup && instruction == o.instruction && address == o.address;
  }
};

struct AccessKeyHash {
  size_t operator()(const AccessKey& k) const {
    uint64_t h = k.threadgroup * 0x9E3779B97F4A7C15ull;
    h ^= static_cast<uint64_t>(k.instruction) + 0x7F4A7C159E3779B9ull + (h << 6) + (h >> 2);
    h ^= static_cast<uint64_t>(k.address) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

std::atomic<bool> g_active{false};
std::atomic<uint64_t> g_hook_calls{0};
std::mutex g_mu;
std::vector<Range> g_ranges;  // written only while g_active is false
std::unordered_set<AccessKey, AccessKeyHash> g_seen;
TrafficCounts g_counts;

void record(const void* address, size_t size, bool store, void* instruction) {
  if (!g_active.load(std::memory_order_acquire)) return;
  g_hook_calls.fetch_add(1, std::memory_order_relaxed);
  const uintptr_t a = reinterpret_cast<uintptr_t>(address);
  for (const Range& r : g_ranges) {
    if (a < r.begin || a >= r.end) continue;
    const AccessKey key{current_threadgroup(), reinterpret_cast<uintptr_t>(instruction), a};
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_seen.insert(key).second) return;
    (store ? g_counts.bytes_written : g_counts.bytes_read)[r.role] += size;
    return;
  }
}

}  // namespace

void traffic_begin() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_ranges.clear();
  g_seen.clear();
  g_counts = TrafficCounts();
  g_hook_calls.store(0, std::memory_order_relaxed);
  g_active.store(true, std::memory_order_release);
}

void traffic_add_buffer(int role, const void* begin, size_t bytes) {
  if (begin == nullptr || bytes == 0 || role < 0 || role >= kTrafficRoles) return;
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin);
  std::lock_guard<std::mutex> lock(g_mu);
  g_ranges.push_back({role, b, b + bytes});
}

TrafficCounts traffic_end() {
  g_active.store(false, std::memory_order_release);
  std::lock_guard<std::mutex> lock(g_mu);
  TrafficCounts out = g_counts;
  out.instrumented = g_hook_calls.load(std::memory_order_relaxed) > 0;
  g_seen.clear();
  g_ranges.clear();
  return out;
}

}  // namespace msl_host

// The hooks of -fsanitize-coverage=trace-loads,trace-stores. Unused (never called) in a build
// whose kernels are not instrumented.
#define TFMO_TRAFFIC_HOOKS(bits, type)                                                  \
  extern "C" void __sanitizer_cov_load##bits(type* address) {                           \
    msl_host::record(address, sizeof(type), false, __builtin_return_address(0));        \
  }                                                                                     \
  extern "C" void __sanitizer_cov_store##bits(type* address) {                          \
    msl_host::record(address, sizeof(type), true, __builtin_return_address(0));         \
  }
TFMO_TRAFFIC_HOOKS(1, uint8_t)
TFMO_TRAFFIC_HOOKS(2, uint16_t)
TFMO_TRAFFIC_HOOKS(4, uint32_t)
TFMO_TRAFFIC_HOOKS(8, uint64_t)
TFMO_TRAFFIC_HOOKS(16, __int128)
