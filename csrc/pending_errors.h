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

// True when an error is pending: one atomic load, cheap enough for every op execution.
bool HasPendingError();

// The pending error, which is cleared; OK when none is pending. When later errors were dropped
// (the first one wins), the message says how many.
Error TakePendingError();

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_PENDING_ERRORS_H_
