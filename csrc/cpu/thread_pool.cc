#include "csrc/cpu/thread_pool.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace tf_metal_ops {
namespace {

class ThreadPool {
 public:
  void Run(int threads, int64_t num_tasks, void (*task)(void*, int64_t), void* context) {
    if (threads <= 1 || num_tasks <= 1 || !job_mutex_.try_lock()) {
      for (int64_t i = 0; i < num_tasks; ++i) task(context, i);
      return;
    }
    const int helpers = static_cast<int>(std::min<int64_t>(threads, num_tasks)) - 1;
    StartWorkers(helpers);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = task;
      context_ = context;
      num_tasks_ = num_tasks;
      next_task_.store(0, std::memory_order_relaxed);
      helpers_wanted_ = helpers;
      job_open_ = true;
      ++generation_;
    }
    wake_.notify_all();
    RunTasks(task, context, num_tasks);
    {
      // Close the job, then wait only for the helpers that joined it: one that wakes late
      // (the OS gave its core to someone else) finds the job closed and goes back to sleep,
      // instead of making the caller wait for its wake-up when there is nothing left to do.
      std::unique_lock<std::mutex> lock(mutex_);
      job_open_ = false;
      done_.wait(lock, [this] { return helpers_running_ == 0; });
    }
    job_mutex_.unlock();
  }

 private:
  void RunTasks(void (*task)(void*, int64_t), void* context, int64_t num_tasks) {
    for (;;) {
      const int64_t i = next_task_.fetch_add(1, std::memory_order_relaxed);
      if (i >= num_tasks) return;
      task(context, i);
    }
  }

  // Called with job_mutex_ held, so workers_ changes under one owner only.
  void StartWorkers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { WorkerLoop(index); });
      workers_.back().detach();  // never joined: see thread_pool.h
    }
  }

  void WorkerLoop(int index) {
    uint64_t seen = 0;
    for (;;) {
      void (*task)(void*, int64_t);
      void* context;
      int64_t num_tasks;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        // Too late (the job is done), or beyond this job's cap (it may have been lowered).
        if (!job_open_ || index >= helpers_wanted_) continue;
        ++helpers_running_;
        task = task_;
        context = context_;
        num_tasks = num_tasks_;
      }
      RunTasks(task, context, num_tasks);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--helpers_running_ == 0 && !job_open_) done_.notify_one();
    }
  }

  std::mutex job_mutex_;  // held by the one op execution that uses the workers
  std::mutex mutex_;      // guards the job description below and the counters
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  void (*task_)(void*, int64_t) = nullptr;
  void* context_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  int helpers_wanted_ = 0;
  int helpers_running_ = 0;  // helpers inside RunTasks for the current job
  bool job_open_ = false;    // a late helper may still join
};

ThreadPool& Pool() {
  static std::mutex instance_mutex;
  static ThreadPool* instance = nullptr;  // leaked on purpose, see thread_pool.h
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(instance_mutex);
  if (instance == nullptr || owner != getpid()) {
    instance = new ThreadPool();  // after fork(): the old one's workers are not in this process
    owner = getpid();
  }
  return *instance;
}

}  // namespace

void RunOnPool(int threads, int64_t num_tasks, void (*task)(void*, int64_t), void* context) {
  Pool().Run(threads, num_tasks, task, context);
}

}  // namespace tf_metal_ops
