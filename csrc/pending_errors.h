// Errors the GPU finds after the op that caused them has returned, reported at the next
// synchronization point (the pattern of PyTorch's MPS backend).
//
// In the default commit mode the Metal kernels are only encoded when the op returns; a sparse
// label outside [0, C) is seen by the GPU later, when it writes the op's error record
// (kernels/custom_loss_params.h). A completion handler on the plugin's command buffer
// (csrc/metal/custom_loss_metal.mm) hands those bytes to ReportCompletedErrorRecord once the GPU
// is done with them (the record's slot is then freed: error_record_slots.h says where records
// live and for how long); the error then waits here until the next execution of a CustomLoss or
// CustomLossGrad op, on any device (DescribeProblem raises it), or until
// tf_metal_ops.debug.check_errors() takes it.
//
// check_errors() first waits for the launches that may still hold an error: a commit-mode
// launch with a record is outstanding from its encoding (BeginOutstandingLaunch) until its
// handler has reported the record (FinishOutstandingLaunch). Its command buffer may not even be
// committed yet (the plugin batches commits), so the wait first has the registered flush commit
// it (the Metal path: [stream commitAndWait] on each stream it encoded on), then waits for the
// handlers themselves, which Metal may run after the command buffer's waiters have returned.
//
// One error is pending at a time and the first one wins: a bad batch usually fails every op of
// its step, and the first report names the op that saw it first. Later ones are counted, not
// kept, until the pending one is taken. Everything here is plain C++ and thread-safe: completion
// handlers run on Metal's threads, ops on TensorFlow's, check_errors on Python's.
#ifndef TF_METAL_OPS_CSRC_PENDING_ERRORS_H_
#define TF_METAL_OPS_CSRC_PENDING_ERRORS_H_

#include <cstddef>
#include <cstdint>

#include "csrc/problem.h"
#include "csrc/tf_c.h"
#include "kernels/custom_loss_params.h"

namespace tf_metal_ops {

// The completion handler's work: reads `size` bytes of a record (sizeof(CustomLossErrorRecord),
// else an Internal error is recorded: a layout mismatch must not pass silently) for the op
// described by `problem`, and records the error it holds, if any. Returns true when it held one.
bool ReportCompletedErrorRecord(const CustomLossProblem& problem, const void* bytes, size_t size);

// Records `error` (when not OK) with a note saying that the GPU found it after the op had
// returned: what a completion handler calls for a command buffer that failed. Returns true when
// it was kept (no error was pending).
bool RecordDeferredGpuError(Error error);

// True when an error is pending: one atomic load, cheap enough for every op execution.
bool HasPendingError();

// The pending error, which is cleared; OK when none is pending. When later errors were dropped
// (the first one wins), the message says how many.
Error TakePendingError();

// A commit-mode launch with an error record is being encoded: its ticket, for
// FinishOutstandingLaunch. Called before the completion handler is added.
uint64_t BeginOutstandingLaunch();

// The launch's handler is done with its record (reported or not): called last in the handler,
// on every path, so that a wait never outlives its command buffer by more than the handler.
void FinishOutstandingLaunch(uint64_t ticket);

// How many launches are outstanding.
int64_t OutstandingLaunches();

// Commits every command buffer that may hold an outstanding launch, and may wait for it; OK, or
// why it could not. The Metal path registers one (csrc/metal/custom_loss_metal.mm); without one
// (CPU-only builds) nothing is ever outstanding. Returns the flush it replaces.
using CommandBufferFlush = Error (*)();
CommandBufferFlush SetCommandBufferFlush(CommandBufferFlush flush);

// What check_errors() does before it takes the pending error: when launches begun before this
// call are outstanding, runs the flush once, then waits until each of them has finished. Later
// launches are not waited for. OK when they have finished; the flush's error if it failed; a
// DEADLINE_EXCEEDED error naming how many are left after `timeout_seconds` (< 0: no limit).
Error WaitForOutstandingLaunches(double timeout_seconds);

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_PENDING_ERRORS_H_
