// A small persistent pool of worker threads for the CPU kernels.
//
// The C API gives a kernel no access to TensorFlow's intra-op thread pool, so the kernels bring
// their own. Starting threads on every op execution (tens of microseconds each, plus the cold
// caches of a new thread) can cost more than the work of a moderate batch, so the workers are
// started once, on first need, and then sleep on a condition variable between jobs.
//
// - At most `threads` threads (the caller included) work on one job: the cap of
//   tf_metal_ops.set_cpu_threads, read at every call.
// - One job at a time: if another op execution (TensorFlow runs independent ops concurrently)
//   already holds the pool, the caller runs its whole job itself. That never waits and never
//   puts more of our threads than the cap on the cores.
// - Tasks are claimed dynamically (an atomic counter), so a worker that the OS descheduled in
//   favour of TensorFlow's own threads does not hold the others up at the end.
// - The pool is never destroyed (workers would have to be joined during static destruction,
//   when the interpreter may be gone); a child process after fork() gets a fresh pool, as the
//   parent's workers do not exist there.
#ifndef TF_METAL_OPS_CSRC_CPU_THREAD_POOL_H_
#define TF_METAL_OPS_CSRC_CPU_THREAD_POOL_H_

#include <cstdint>

namespace tf_metal_ops {

// Calls task(context, i) once for every i in [0, num_tasks), on up to `threads` threads (the
// calling thread is one of them), and returns when all calls have returned. `task` must not
// throw.
void RunOnPool(int threads, int64_t num_tasks, void (*task)(void* context, int64_t index),
               void* context);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_CPU_THREAD_POOL_H_
