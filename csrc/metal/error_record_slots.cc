#include "csrc/metal/error_record_slots.h"

#include <cstring>

namespace tf_metal_ops {

ErrorRecordSlots::ErrorRecordSlots(int capacity)
    : capacity_(capacity > 0 ? capacity : 1), in_use_(capacity_, false) {
  free_.reserve(capacity_);
  for (int slot = capacity_; slot-- > 0;) free_.push_back(slot);  // slot 0 on top
}

int ErrorRecordSlots::Acquire(CustomLossErrorRecord* slab) {
  int slot;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) return -1;
    slot = free_.back();
    free_.pop_back();
    in_use_[slot] = true;
  }
  // Ours alone from here until Release: no lock needed to write it.
  InitCustomLossErrorRecord(&slab[slot]);
  return slot;
}

CustomLossErrorRecord ErrorRecordSlots::Release(const CustomLossErrorRecord* slab, int slot) {
  CustomLossErrorRecord record;
  InitCustomLossErrorRecord(&record);
  std::lock_guard<std::mutex> lock(mutex_);
  if (slot < 0 || slot >= capacity_ || !in_use_[slot]) return record;
  // Copied before the slot is free: once it is, the next Acquire may initialize it again.
  std::memcpy(&record, &slab[slot], sizeof(record));
  in_use_[slot] = false;
  free_.push_back(slot);
  return record;
}

int ErrorRecordSlots::InUse() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_ - static_cast<int>(free_.size());
}

}  // namespace tf_metal_ops
