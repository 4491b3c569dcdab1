#include "csrc/pending_errors.h"

#include <atomic>
#include <cstring>
#include <mutex>
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
    " (found by the GPU after the op had returned, so reported at the next CustomLoss op or "
    "tf_metal_ops.debug.check_errors(); commit-and-wait mode raises it at the op itself)";

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

}  // namespace tf_metal_ops
