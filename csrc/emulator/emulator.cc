// See emulator.h. Why two executors: fibers are what a GPU's lockstep looks like from one core
// (cheap switches, deterministic order); OS threads are what ThreadSanitizer can reason about.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
// macOS declares its (deprecated, still working) ucontext functions only under X/Open.
#define _XOPEN_SOURCE 700
#endif

#include "emulator.h"

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

// ---- ThreadSanitizer: only Metal's own ordering counts ------------------------------------------
//
// The OS-thread executor synchronizes with a mutex per threadgroup. Left visible to TSan, every
// lock would order memory between all GPU threads at every SIMD-group function, which Metal does
// not do (only threadgroup_barrier orders threadgroup memory), and would hide exactly the races
// we look for (e.g. one SIMD-group reading a partial another has not written yet). So the
// executor's internals are hidden from TSan (sync, reads and writes), and the only
// happens-before edges between GPU threads are the ones a barrier promises: every thread
// releases before arriving and acquires after leaving, on a sync object per barrier generation
// (two alternate: a fast thread can be one barrier ahead of a slow one, never two).
#if defined(__SANITIZE_THREAD__)
#define TFMO_EMULATOR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TFMO_EMULATOR_TSAN 1
#endif
#endif

#if defined(TFMO_EMULATOR_TSAN)
extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#endif

namespace msl_host {
namespace {

// While alive, TSan ignores this thread's synchronization and memory accesses.
class HiddenFromTsan {
 public:
#if defined(TFMO_EMULATOR_TSAN)
  HiddenFromTsan() {
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~HiddenFromTsan() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  }
#else
  HiddenFromTsan() {}  // user-provided: no unused-variable warning at the call sites
#endif
  HiddenFromTsan(const HiddenFromTsan&) = delete;
  HiddenFromTsan& operator=(const HiddenFromTsan&) = delete;
};

inline void tsan_release(void* addr) {
#if defined(TFMO_EMULATOR_TSAN)
  __tsan_release(addr);
#else
  (void)addr;
#endif
}
inline void tsan_acquire(void* addr) {
#if defined(TFMO_EMULATOR_TSAN)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}

}  // namespace

// ---- registry --------------------------------------------------------------------------------

namespace {
std::map<std::string, KernelEntry>& registry() {
  static std::map<std::string, KernelEntry> kernels;  // filled by static initializers
  return kernels;
}
}  // namespace

bool register_kernel(const char* name, KernelInvoker invoke, size_t num_pointer_params,
                     GroupRunner run_group) {
  registry()[name] = KernelEntry{name, invoke, num_pointer_params, run_group};
  return true;
}

const KernelEntry* find_kernel(const std::string& name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : &it->second;
}

// ---- what every executor does for a collective -------------------------------------------------

namespace {

// One lane's part in a SIMD-group collective (msl_host_runtime.h's simd_gather).
struct Deposit {
  const char* op;
  uint32_t uniform;
  uint32_t read_lane;
  uint32_t size;
  const void* value;
  void* lanes;        // width * size bytes, the lane's own
  uint64_t* active;   // the lane's own
  uint64_t sequence;  // how many collectives this lane executed before: lockstep means equal
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual void barrier(uint32_t tid) = 0;
  virtual void simd(uint32_t tid, const Deposit& deposit) = 0;
};

thread_local Executor* t_executor = nullptr;
thread_local uint32_t t_tid = 0;
thread_local uint32_t t_simd_width = 32;
// The running thread's threadgroup (linear), for current_threadgroup().
thread_local uint64_t t_group = 0;

bool same_call(const Deposit& a, const Deposit& b) {
  return std::strcmp(a.op, b.op) == 0 && a.uniform == b.uniform && a.size == b.size &&
         a.sequence == b.sequence;
}

// Completes a collective of the lanes `live[i]` of one SIMD-group: copies every live lane's
// value to every live lane. Returns an error message or "".
std::string complete_simd(uint32_t sg, const std::vector<bool>& live,
                          const std::vector<Deposit>& d) {
  const size_t width = live.size();
  size_t first = width;
  uint64_t mask = 0;
  for (size_t i = 0; i < width; ++i) {
    if (!live[i]) continue;
    if (first == width) first = i;
    mask |= uint64_t{1} << i;
  }
  if (first == width) return "";
  const std::string group = "SIMD-group " + std::to_string(sg) + ": lane ";
  for (size_t i = first + 1; i < width; ++i) {
    if (!live[i] || same_call(d[i], d[first])) continue;
    return group + std::to_string(i) + " is at " + d[i].op + " #" +
           std::to_string(d[i].sequence) + " while lane " + std::to_string(first) + " is at " +
           d[first].op + " #" + std::to_string(d[first].sequence) +
           " (divergent SIMD-group function" +
           (std::strcmp(d[i].op, d[first].op) == 0 ? ", or an argument that must be the same in "
                                                      "every lane differs"
                                                    : "") +
           ")";
  }
  for (size_t i = 0; i < width; ++i) {
    if (!live[i] || d[i].read_lane == kNoLane) continue;
    const uint32_t src = d[i].read_lane;
    if (src >= width || !live[src]) {
      return group + std::to_string(i) + " " + d[i].op + " reads lane " + std::to_string(src) +
             (src >= width ? ", outside the SIMD-group of " + std::to_string(width)
                           : ", which is inactive");
    }
  }
  const size_t size = d[first].size;
  for (size_t i = 0; i < width; ++i) {
    if (!live[i]) continue;
    auto* out = static_cast<unsigned char*>(d[i].lanes);
    for (size_t j = 0; j < width; ++j) {
      if (live[j] && size > 0) std::memcpy(out + j * size, d[j].value, size);
    }
    *d[i].active = mask;
  }
  return "";
}

// ---- fibers ----------------------------------------------------------------------------------

constexpr size_t kFiberStackBytes = 128 * 1024;

class FiberExecutor final : public Executor {
 public:
  enum class State { kRunnable, kAtBarrier, kAtSimd, kDone };

  FiberExecutor(uint32_t threads, uint32_t width) : width_(width), fibers_(threads) {
    for (Fiber& f : fibers_) f.stack.reset(new char[kFiberStackBytes]);
  }

  // Runs body(tid) for every thread of one threadgroup; "" or the error.
  template <class Body>
  std::string run(const Body& body) {
    body_ = [&body](uint32_t tid) { body(tid); };
    for (uint32_t t = 0; t < fibers_.size(); ++t) {
      Fiber& f = fibers_[t];
      f.state = State::kRunnable;
      f.sequence = 0;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.get();
      f.context.uc_stack.ss_size = kFiberStackBytes;
      f.context.uc_link = &scheduler_;
      makecontext(&f.context, reinterpret_cast<void (*)()>(&FiberExecutor::entry), 1,
                  static_cast<int>(t));
    }
    Executor* saved = t_executor;
    t_executor = this;
    current_ = this;
    std::string error = schedule();
    t_executor = saved;
    return error;
  }

  void barrier(uint32_t tid) override { park(tid, State::kAtBarrier); }

  void simd(uint32_t tid, const Deposit& deposit) override {
    Fiber& f = fibers_[tid];
    f.deposit = deposit;
    f.deposit.sequence = f.sequence++;
    park(tid, State::kAtSimd);
  }

 private:
  struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    State state = State::kDone;
    Deposit deposit{};
    uint64_t sequence = 0;
  };

  static thread_local FiberExecutor* current_;

  static void entry(int tid) {
    FiberExecutor* self = current_;
    t_tid = static_cast<uint32_t>(tid);
    self->body_(static_cast<uint32_t>(tid));
    self->fibers_[tid].state = State::kDone;
    // returning resumes uc_link: the scheduler
  }

  void park(uint32_t tid, State state) {
    fibers_[tid].state = state;
    swapcontext(&fibers_[tid].context, &scheduler_);
    t_tid = tid;
  }

  std::string schedule() {
    const uint32_t n = static_cast<uint32_t>(fibers_.size());
    const uint32_t groups = (n + width_ - 1) / width_;
    std::vector<bool> live(width_);
    std::vector<Deposit> deposits(width_);
    for (;;) {
      for (uint32_t t = 0; t < n; ++t) {
        if (fibers_[t].state != State::kRunnable) continue;
        t_tid = t;
        swapcontext(&scheduler_, &fibers_[t].context);
      }
      // Everyone is parked or done.
      bool released = false;
      uint32_t done = 0, at_barrier = 0;
      for (uint32_t t = 0; t < n; ++t) {
        done += fibers_[t].state == State::kDone;
        at_barrier += fibers_[t].state == State::kAtBarrier;
      }
      if (done == n) return "";
      for (uint32_t sg = 0; sg < groups; ++sg) {
        bool any_simd = false, all_simd = true;
        for (uint32_t i = 0; i < width_; ++i) {
          const uint32_t t = sg * width_ + i;
          const bool alive = t < n && fibers_[t].state != State::kDone;
          live[i] = alive;
          if (!alive) continue;
          if (fibers_[t].state == State::kAtSimd) {
            any_simd = true;
            deposits[i] = fibers_[t].deposit;
          } else {
            all_simd = false;
          }
        }
        if (!any_simd) continue;
        if (!all_simd) continue;  // some lanes still at a barrier: decided below
        std::string error = complete_simd(sg, live, deposits);
        if (!error.empty()) return error;
        for (uint32_t i = 0; i < width_; ++i) {
          if (live[i]) fibers_[sg * width_ + i].state = State::kRunnable;
        }
        released = true;
      }
      if (released) continue;
      if (at_barrier == n - done) {
        if (done > 0) {
          return "threadgroup_barrier: " + std::to_string(done) + " of " + std::to_string(n) +
                 " threads returned before reaching it";
        }
        for (Fiber& f : fibers_) f.state = State::kRunnable;
        continue;
      }
      return "deadlock: some threads wait at threadgroup_barrier while others of their "
             "SIMD-group wait at a SIMD-group function";
    }
  }

  uint32_t width_;
  std::vector<Fiber> fibers_;
  ucontext_t scheduler_;
  std::function<void(uint32_t)> body_;
};

thread_local FiberExecutor* FiberExecutor::current_ = nullptr;

// ---- plain calls -------------------------------------------------------------------------------

struct LockstepNeeded {
  const char* what;
};

class DirectExecutor final : public Executor {
 public:
  void barrier(uint32_t) override { throw LockstepNeeded{"threadgroup_barrier"}; }
  void simd(uint32_t, const Deposit& deposit) override { throw LockstepNeeded{deposit.op}; }
};

// ---- OS threads ------------------------------------------------------------------------------

struct Abort {};  // unwinds a GPU thread when its threadgroup failed

class ThreadExecutor final : public Executor {
 public:
  ThreadExecutor(uint32_t threads, uint32_t width)
      : n_(threads), width_(width), live_(threads), state_(threads, State::kRunning),
        groups_((threads + width - 1) / width) {
    for (uint32_t sg = 0; sg < groups_.size(); ++sg) {
      SimdGroup& g = groups_[sg];
      const uint32_t lanes = std::min(width, threads - sg * width);
      g.live = lanes;
      g.deposits.resize(width);
      g.sequence.assign(width, 0);
    }
  }

  void barrier(uint32_t tid) override {
    uint64_t generation;
    {
      HiddenFromTsan hidden;
      std::lock_guard<std::mutex> lock(mu_);
      generation = barrier_generation_;  // cannot change before this thread arrives
    }
    char* sync = &barrier_sync_[generation & 1];
    tsan_release(sync);  // everything this thread did before the barrier ...
    bool aborted;
    {
      HiddenFromTsan hidden;
      std::unique_lock<std::mutex> lock(mu_);
      if (!error_.empty()) throw Abort();
      state_[tid] = State::kAtBarrier;
      ++barrier_arrived_;
      progress_locked();
      cv_.wait(lock, [&] { return barrier_generation_ != generation || !error_.empty(); });
      aborted = barrier_generation_ == generation;
    }
    if (aborted) throw Abort();
    tsan_acquire(sync);  // ... happens before what every thread does after it
  }

  // No happens-before edge: SIMD-group functions exchange values, they do not order memory.
  void simd(uint32_t tid, const Deposit& deposit) override {
    HiddenFromTsan hidden;
    std::unique_lock<std::mutex> lock(mu_);
    if (!error_.empty()) throw Abort();
    SimdGroup& g = groups_[tid / width_];
    const uint32_t lane = tid % width_;
    g.deposits[lane] = deposit;
    g.deposits[lane].sequence = g.sequence[lane]++;
    const uint64_t generation = g.generation;
    state_[tid] = State::kAtSimd;
    ++g.arrived;
    progress_locked();
    cv_.wait(lock, [&] { return g.generation != generation || !error_.empty(); });
    if (g.generation == generation) throw Abort();
  }

  void exit(uint32_t tid) {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mu_);
    state_[tid] = State::kDone;
    --live_;
    ++exited_;
    --groups_[tid / width_].live;
    progress_locked();
  }

  std::string error() {
    HiddenFromTsan hidden;
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  enum class State { kRunning, kAtBarrier, kAtSimd, kDone };
  struct SimdGroup {
    uint32_t live = 0;
    uint32_t arrived = 0;
    uint64_t generation = 0;
    std::vector<Deposit> deposits;
    std::vector<uint64_t> sequence;
  };

  void fail_locked(const std::string& message) {
    if (error_.empty()) error_ = message;
    cv_.notify_all();
  }

  // Completes whatever collective every participant has reached.
  void progress_locked() {
    if (!error_.empty()) return;
    bool released = false;
    for (uint32_t sg = 0; sg < groups_.size(); ++sg) {
      SimdGroup& g = groups_[sg];
      if (g.arrived == 0 || g.arrived != g.live) continue;
      std::vector<bool> live(width_, false);
      for (uint32_t i = 0; i < width_; ++i) {
        const uint32_t t = sg * width_ + i;
        live[i] = t < n_ && state_[t] != State::kDone;
      }
      std::string message = complete_simd(sg, live, g.deposits);
      if (!message.empty()) return fail_locked(message);
      for (uint32_t i = 0; i < width_; ++i) {
        if (live[i]) state_[sg * width_ + i] = State::kRunning;
      }
      g.arrived = 0;
      ++g.generation;
      released = true;
    }
    if (barrier_arrived_ > 0 && barrier_arrived_ == live_) {
      if (exited_ > 0) {
        return fail_locked("threadgroup_barrier: " + std::to_string(exited_) + " of " +
                           std::to_string(n_) + " threads returned before reaching it");
      }
      for (State& s : state_) {
        if (s == State::kAtBarrier) s = State::kRunning;
      }
      barrier_arrived_ = 0;
      ++barrier_generation_;
      released = true;
    }
    if (released) {
      cv_.notify_all();
      return;
    }
    // Nobody running and nothing completed: the threads wait for each other in different places.
    uint32_t waiting = barrier_arrived_;
    for (const SimdGroup& g : groups_) waiting += g.arrived;
    if (live_ > 0 && waiting == live_) {
      fail_locked("deadlock: some threads wait at threadgroup_barrier while others of their "
                  "SIMD-group wait at a SIMD-group function");
    }
  }

  const uint32_t n_;
  const uint32_t width_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t live_;
  uint32_t exited_ = 0;
  std::vector<State> state_;
  uint32_t barrier_arrived_ = 0;
  uint64_t barrier_generation_ = 0;
  std::vector<SimdGroup> groups_;
  std::string error_;
  char barrier_sync_[2] = {0, 0};  // addresses for TSan's acquire / release only
};

// Where one threadgroup sits in the dispatch, and how many threads it has on each axis.
struct Group {
  uint32_t position[3];
  uint32_t threads[3];
  uint32_t count() const { return threads[0] * threads[1] * threads[2]; }
};

ThreadIds make_ids(const Dispatch& d, const uint32_t groups[3], const Group& g, uint32_t tid) {
  ThreadIds ids;
  ids.tg_pos[0] = g.position[0];
  ids.tg_pos[1] = g.position[1];
  ids.tg_count[0] = groups[0];
  ids.tg_count[1] = groups[1];
  ids.tg_size[0] = d.threads_per_threadgroup[0];
  ids.tg_size[1] = d.threads_per_threadgroup[1];
  ids.tid = tid;
  ids.lane = tid % d.simd_width;
  ids.simd_width = d.simd_width;
  ids.sg_index = tid / d.simd_width;
  ids.sg_count = (g.count() + d.simd_width - 1) / d.simd_width;
  const uint32_t local[3] = {tid % g.threads[0], (tid / g.threads[0]) % g.threads[1],
                             tid / (g.threads[0] * g.threads[1])};
  const bool by_threads = d.threads_per_grid[0] != 0;
  for (int a = 0; a < 3; ++a) {
    ids.thread_position[a] = local[a];
    ids.group_position[a] = g.position[a];
    ids.group_count[a] = groups[a];
    ids.group_threads[a] = g.threads[a];
    ids.grid_position[a] = g.position[a] * d.threads_per_threadgroup[a] + local[a];
    ids.grid_threads[a] =
        by_threads ? d.threads_per_grid[a] : groups[a] * d.threads_per_threadgroup[a];
  }
  return ids;
}

// Threadgroup `linear` of the dispatch (x fastest), cut at the grid's edge under dispatchThreads.
Group group_at(const Dispatch& d, const uint32_t groups[3], uint64_t linear) {
  Group g;
  g.position[0] = static_cast<uint32_t>(linear % groups[0]);
  g.position[1] = static_cast<uint32_t>((linear / groups[0]) % groups[1]);
  g.position[2] = static_cast<uint32_t>(linear / (uint64_t{groups[0]} * groups[1]));
  for (int a = 0; a < 3; ++a) {
    g.threads[a] = d.threads_per_threadgroup[a];
    if (d.threads_per_grid[0] != 0) {
      const uint64_t first = uint64_t{g.position[a]} * d.threads_per_threadgroup[a];
      g.threads[a] = static_cast<uint32_t>(
          std::min<uint64_t>(g.threads[a], d.threads_per_grid[a] - first));
    }
  }
  return g;
}

// Fresh threadgroup memory is filled with NaN bytes: a kernel that reads scratch it did not
// write gets NaN, not a plausible zero.
std::vector<float> fresh_threadgroup_memory(uint32_t bytes) {
  std::vector<float> memory((bytes + 3) / 4 + 1);
  std::memset(memory.data(), 0xFF, memory.size() * sizeof(float));
  return memory;
}

}  // namespace

void threadgroup_barrier() { t_executor->barrier(t_tid); }

uint64_t current_threadgroup() { return t_group; }

uint64_t simd_gather(const char* op, uint32_t uniform, uint32_t read_lane, const void* value,
                     size_t size, void* lanes) {
  uint64_t active = 0;
  t_executor->simd(t_tid, Deposit{op, uniform, read_lane, static_cast<uint32_t>(size), value,
                                  lanes, &active, 0});
  return active;
}

uint32_t simd_lane() { return t_tid & (t_simd_width - 1); }

uint32_t simd_width() { return t_simd_width; }

void threadgroup_grid(const Dispatch& d, uint32_t groups[3]) {
  for (int a = 0; a < 3; ++a) {
    groups[a] = d.threads_per_grid[0] == 0
                    ? d.threadgroups_per_grid[a]
                    : static_cast<uint32_t>((uint64_t{d.threads_per_grid[a]} +
                                             d.threads_per_threadgroup[a] - 1) /
                                            d.threads_per_threadgroup[a]);
  }
}

std::string run_dispatch(const std::string& kernel_name, const Dispatch& d) {
  const KernelEntry* kernel = find_kernel(kernel_name);
  if (kernel == nullptr) return "no kernel registered as '" + kernel_name + "'";
  const size_t expected = d.buffers.size() + (d.threadgroup_memory_length > 0 ? 1 : 0);
  if (kernel->num_pointer_params != expected) {
    return "kernel '" + kernel_name + "' takes " + std::to_string(kernel->num_pointer_params) +
           " buffer/threadgroup arguments but the dispatch binds " +
           std::to_string(d.buffers.size()) + " buffers and " +
           (d.threadgroup_memory_length > 0 ? "threadgroup memory" : "no threadgroup memory");
  }
  const uint32_t* tg = d.threads_per_threadgroup;
  if (tg[0] == 0 || tg[1] == 0 || tg[2] == 0 || uint64_t{tg[0]} * tg[1] * tg[2] > 1024) {
    return "a threadgroup must have 1 to 1024 threads";
  }
  if (d.simd_width == 0 || (d.simd_width & (d.simd_width - 1)) != 0 ||
      d.simd_width > kMaxSimdWidth) {
    return "SIMD width must be a power of two, at most " + std::to_string(kMaxSimdWidth);
  }
  uint32_t groups[3];
  threadgroup_grid(d, groups);
  const uint64_t total =
      std::min<uint64_t>(uint64_t{groups[0]} * groups[1] * groups[2], d.end_group);
  if (d.first_group >= total) return "";
  t_simd_width = d.simd_width;

  if (d.executor == ExecutorKind::kDirect) {
    if (kernel->run_group == nullptr || d.threadgroup_memory_length > 0) {
      return "kernel '" + kernel_name + "' cannot run without lockstep: only a generated kernel "
             "(tf_metal_ops.metal_kernel) without a threadgroup argument has a threadgroup loop";
    }
    DirectExecutor direct;
    Executor* saved = t_executor;
    t_executor = &direct;
    std::string error;
    try {
      for (uint64_t linear = d.first_group; linear < total; ++linear) {
        t_group = linear;
        kernel->run_group(d.buffers.data(), make_ids(d, groups, group_at(d, groups, linear), 0));
      }
    } catch (const LockstepNeeded& needed) {
      error = std::string(needed.what) +
              " called by a kernel run without lockstep (its source names no barrier or "
              "SIMD-group function; a macro may hide one)";
    }
    t_executor = saved;
    return error;
  }

  if (d.executor == ExecutorKind::kFibers) {
    // One executor per threadgroup size: the edge threadgroups of dispatchThreads are smaller.
    std::map<uint32_t, std::unique_ptr<FiberExecutor>> executors;
    for (uint64_t linear = d.first_group; linear < total; ++linear) {
      const Group g = group_at(d, groups, linear);
      std::unique_ptr<FiberExecutor>& executor = executors[g.count()];
      if (!executor) executor.reset(new FiberExecutor(g.count(), d.simd_width));
      std::vector<float> memory = fresh_threadgroup_memory(d.threadgroup_memory_length);
      t_group = linear;
      std::string error = executor->run([&](uint32_t tid) {
        kernel->invoke(d.buffers.data(), d.buffers.size(), memory.data(),
                       make_ids(d, groups, g, tid));
      });
      if (!error.empty()) {
        return "threadgroup (" + std::to_string(g.position[0]) + ", " +
               std::to_string(g.position[1]) + ", " + std::to_string(g.position[2]) +
               "): " + error;
      }
    }
    return "";
  }

  // kThreads: batches of threadgroups, all their threads at once.
  const uint32_t batch = d.max_concurrent_threadgroups == 0 ? 1 : d.max_concurrent_threadgroups;
  for (uint64_t start = d.first_group; start < total; start += batch) {
    const uint64_t end = std::min<uint64_t>(total, start + batch);
    std::vector<std::unique_ptr<ThreadExecutor>> executors;
    std::vector<std::vector<float>> memories;
    std::vector<std::thread> workers;
    for (uint64_t linear = start; linear < end; ++linear) {
      executors.emplace_back(new ThreadExecutor(group_at(d, groups, linear).count(),
                                                d.simd_width));
      memories.push_back(fresh_threadgroup_memory(d.threadgroup_memory_length));
    }
    for (uint64_t linear = start; linear < end; ++linear) {
      ThreadExecutor* executor = executors[linear - start].get();
      float* memory = memories[linear - start].data();
      const Group g = group_at(d, groups, linear);
      for (uint32_t tid = 0; tid < g.count(); ++tid) {
        workers.emplace_back([&d, &groups, kernel, executor, memory, g, linear, tid] {
          t_executor = executor;
          t_tid = tid;
          t_simd_width = d.simd_width;
          t_group = linear;
          try {
            kernel->invoke(d.buffers.data(), d.buffers.size(), memory,
                           make_ids(d, groups, g, tid));
          } catch (const Abort&) {
          }
          executor->exit(tid);
        });
      }
    }
    for (std::thread& w : workers) w.join();
    for (uint64_t linear = start; linear < end; ++linear) {
      std::string error = executors[linear - start]->error();
      if (!error.empty()) {
        return "threadgroup " + std::to_string(linear) + ": " + error;
      }
    }
  }
  return "";
}

}  // namespace msl_host
