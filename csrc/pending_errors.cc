#include "csrc/pending_errors.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>

namespace tf_metal_ops {
namespace {

// `has_pending` mirrors "pending.ok() is false" so that the check every op makes takes no lock.
// It is set under the mutex after the error is stored and cleared under it when the error is
// taken, so a reader that sees true and then locks finds the error (or an OK one, if another
// thread took it in between, which TakePendingError reports as none).
// The lock and the error are never destroyed: completion handlers may still run during exit.
std::atomic<bool> has_pending{false};
std::mutex& PendingMutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
Error& Pending() {
  static auto* pending = new Error();
  return *pending;
}
int64_t dropped = 0;  // errors refused since the pending one was recorded; under PendingMutex()

constexpr char kDeferredNote[] =
    " (found by the GPU after the op had returned, so reported at the next op of tf_metal_ops "
    "(a CustomLoss or metal_kernel op) or tf_metal_ops.debug.check_errors(); commit-and-wait "
    "mode raises it at the op itself)";

// Records `error` (not OK) unless an error is already pending; returns true if it was kept.
bool RecordPendingError(const Error& error) {
  if (error.ok()) return false;
  std::lock_guard<std::mutex> lock(PendingMutex());
  Error& pending = Pending();
  if (!pending.ok()) {
    ++dropped;
    return false;
  }
  pending = error;
  dropped = 0;
  has_pending.store(true, std::memory_order_release);
  return true;
}

// The error a completed kernel's record describes, or OK when it saw no bad label. The text is
// BadLabelError's for the row and label the record holds, so it matches the CPU kernel's for a
// batch with one bad label; a note says when it was found and, when the record's claimed row is
// not the lowest bad one (several bad rows), which row that is and how many there were. Unlike
// commit-and-wait mode, no label is read back from the GPU: the handler runs after the plugin
// may have reused the labels' memory.
Error DeferredBadLabelError(const CustomLossProblem& problem, const CustomLossErrorRecord& record) {
  if (!CustomLossErrorRecordHasError(record)) return Error::Ok();
  const int64_t row = record.words[TFMO_ERROR_DETAIL_ROW];
  Error error = BadLabelError(problem, row, CustomLossErrorRecordLabel(record));
  const uint32_t count = record.words[TFMO_ERROR_BAD_LABEL_COUNT];
  const uint32_t lowest = record.words[TFMO_ERROR_MIN_BAD_ROW];
  if (lowest != TFMO_ERROR_NO_ROW && lowest != row) {
    // The CPU names the lowest bad row; its label is in the GPU's labels buffer only.
    error.message += "; " + std::to_string(count) + " rows have labels outside the class range, " +
                     "the first of them is " + RowIndexString(problem.row_dims, lowest);
  }
  error.message += kDeferredNote;
  return error;
}

// Outstanding launches: tickets handed out in order, so "begun before the wait" is "ticket below
// the next one at the start of the wait". Never destroyed, as above.
struct Outstanding {
  std::mutex mutex;
  std::condition_variable finished;
  std::set<uint64_t> tickets;
  uint64_t next_ticket = 0;
  CommandBufferFlush flush = nullptr;
};
Outstanding& Launches() {
  static auto* launches = new Outstanding();
  return *launches;
}

}  // namespace

bool ReportCompletedErrorRecord(const CustomLossProblem& problem, const void* bytes, size_t size) {
  if (bytes == nullptr || size != sizeof(CustomLossErrorRecord)) {
    RecordPendingError(Error::Internal(
        OpDescription(problem.attrs) + ": the GPU error record has " + std::to_string(size) +
        " bytes, expected " + std::to_string(sizeof(CustomLossErrorRecord)) +
        " (kernels/custom_loss_params.h)"));
    return true;
  }
  CustomLossErrorRecord record;
  std::memcpy(&record, bytes, sizeof(record));
  Error error = DeferredBadLabelError(problem, record);
  if (error.ok()) return false;
  RecordPendingError(error);
  return true;
}

bool RecordDeferredGpuError(Error error) {
  if (error.ok()) return false;
  error.message += kDeferredNote;
  return RecordPendingError(error);
}

bool HasPendingError() { return has_pending.load(std::memory_order_acquire); }

Error TakePendingError() {
  if (!HasPendingError()) return Error::Ok();
  std::lock_guard<std::mutex> lock(PendingMutex());
  Error taken = std::exchange(Pending(), Error::Ok());
  if (!taken.ok() && dropped > 0) {
    taken.message += "; " + std::to_string(dropped) + " later GPU error" +
                     (dropped == 1 ? " was" : "s were") + " dropped while this one was pending";
  }
  dropped = 0;
  has_pending.store(false, std::memory_order_release);
  return taken;
}

uint64_t BeginOutstandingLaunch() {
  Outstanding& launches = Launches();
  std::lock_guard<std::mutex> lock(launches.mutex);
  const uint64_t ticket = launches.next_ticket++;
  launches.tickets.insert(ticket);
  return ticket;
}

void FinishOutstandingLaunch(uint64_t ticket) {
  Outstanding& launches = Launches();
  {
    std::lock_guard<std::mutex> lock(launches.mutex);
    launches.tickets.erase(ticket);
  }
  launches.finished.notify_all();
}

int64_t OutstandingLaunches() {
  Outstanding& launches = Launches();
  std::lock_guard<std::mutex> lock(launches.mutex);
  return static_cast<int64_t>(launches.tickets.size());
}

CommandBufferFlush SetCommandBufferFlush(CommandBufferFlush flush) {
  Outstanding& launches = Launches();
  std::lock_guard<std::mutex> lock(launches.mutex);
  return std::exchange(launches.flush, flush);
}

Error WaitForOutstandingLaunches(double timeout_seconds) {
  Outstanding& launches = Launches();
  uint64_t end;  // tickets below it were begun before this call
  CommandBufferFlush flush;
  {
    std::lock_guard<std::mutex> lock(launches.mutex);
    end = launches.next_ticket;
    if (launches.tickets.empty() || *launches.tickets.begin() >= end) return Error::Ok();
    flush = launches.flush;
  }
  // Outside the lock: the flush waits for command buffers whose handlers take it.
  if (flush != nullptr) {
    if (Error e = flush(); !e.ok()) return e;
  }
  auto done = [&launches, end] {
    return launches.tickets.empty() || *launches.tickets.begin() >= end;
  };
  std::unique_lock<std::mutex> lock(launches.mutex);
  if (timeout_seconds < 0) {
    launches.finished.wait(lock, done);
    return Error::Ok();
  }
  if (launches.finished.wait_for(lock, std::chrono::duration<double>(timeout_seconds), done)) {
    return Error::Ok();
  }
  int64_t left = 0;
  for (uint64_t ticket : launches.tickets) left += ticket < end ? 1 : 0;
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%g", timeout_seconds);
  return {TF_DEADLINE_EXCEEDED,
          "tf_metal_ops.debug.check_errors: " + std::to_string(left) + " GPU launch" +
              (left == 1 ? " has" : "es have") + " not reported " + (left == 1 ? "its" : "their") +
              " error record after " + seconds + " s"};
}

}  // namespace tf_metal_ops
