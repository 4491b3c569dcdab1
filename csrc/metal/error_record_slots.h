// Where commit-mode launches write their error records: slots of one shared-storage slab per
// device, reused, instead of a fresh Metal buffer per op.
//
// A launch takes a free slot when it is encoded (Acquire initializes the record, on the CPU,
// before the command buffer is committed), the kernel writes only that slot, and the command
// buffer's completion handler copies the record out and frees the slot (Release) once the GPU is
// done. So a slot is never shared by two launches in flight, and the slab needs no hazard
// tracking. Launches that find every slot in use (more than kCapacity ops encoded and not yet
// completed) get a buffer of their own, as commit-and-wait mode does.
//
// Plain C++ and thread-safe: Acquire runs on the stream's queue, Release on Metal's threads.
#ifndef TF_METAL_OPS_CSRC_METAL_ERROR_RECORD_SLOTS_H_
#define TF_METAL_OPS_CSRC_METAL_ERROR_RECORD_SLOTS_H_

#include <mutex>
#include <vector>

#include "kernels/custom_loss_params.h"

namespace tf_metal_ops {

class ErrorRecordSlots {
 public:
  // The slab size of the Metal path: 256 records, 8 KB per device.
  static constexpr int kCapacity = 256;

  explicit ErrorRecordSlots(int capacity = kCapacity);
  ErrorRecordSlots(const ErrorRecordSlots&) = delete;
  ErrorRecordSlots& operator=(const ErrorRecordSlots&) = delete;

  // A free slot of `slab` (capacity() records), now in use, its record initialized for a
  // launch; -1 when every slot is in use.
  int Acquire(CustomLossErrorRecord* slab);
  // The record of `slot`, copied out of `slab` before the slot is freed for the next launch. A
  // slot that is not in use (out of range, or freed already) is left alone and reads as a
  // record without an error, so a mistake cannot hand one slot to two launches.
  CustomLossErrorRecord Release(const CustomLossErrorRecord* slab, int slot);

  int capacity() const { return capacity_; }
  int InUse() const;

 private:
  const int capacity_;
  mutable std::mutex mutex_;
  std::vector<int> free_;  // a stack: the most recently freed slot is reused first
  std::vector<bool> in_use_;
};

}  // namespace tf_metal_ops

#endif  // TF_METAL_OPS_CSRC_METAL_ERROR_RECORD_SLOTS_H_
