#include "csrc/cpu/gradient_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "csrc/cpu/huge_pages.h"

namespace tf_metal_ops {
namespace {

// 2 MiB: a multiple of every alignment TensorFlow asks of tensor data (64 bytes), and the size
// of a transparent huge page, so the whole buffer can be backed by them.
constexpr size_t kBufferAlignment = size_t{2} << 20;

struct Buffer {
  void* data = nullptr;
  size_t capacity = 0;
};

bool ReadEnabled() {
  const char* setting = std::getenv("TF_METAL_OPS_CPU_GRADIENT_CACHE");
  return setting == nullptr || std::strcmp(setting, "0") != 0;
}

// A buffer fits a request when it is large enough and not more than twice as large: a cached
// 262 MB buffer may serve a shorter last batch, not a gradient a tenth its size.
bool Fits(const Buffer& buffer, size_t bytes) {
  return buffer.capacity >= bytes && buffer.capacity / 2 <= bytes;
}

class GradientCache {
 public:
  // Never destroyed: TensorFlow may drop a cached tensor during static destruction at exit.
  static GradientCache& Get() {
    static auto* cache = new GradientCache();
    return *cache;
  }

  bool Take(size_t bytes, Buffer* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    // The smallest that fits.
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      if (!Fits(idle_[i], bytes)) continue;
      if (best == idle_.size() || idle_[i].capacity < idle_[best].capacity) best = i;
    }
    if (best == idle_.size()) return false;
    *out = idle_[best];
    idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
    in_use_.push_back(*out);
    ++stats_.reuses;
    return true;
  }

  // A buffer handed out by Take comes back (TensorFlow's deallocator, or a failed TF_NewTensor
  // that did not call it); false if `data` is not out, so each is returned once.
  bool GiveBack(void* data) {
    Buffer buffer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = std::find_if(in_use_.begin(), in_use_.end(),
                             [data](const Buffer& b) { return b.data == data; });
      if (it == in_use_.end()) return false;
      buffer = *it;
      in_use_.erase(it);
    }
    AddIdle(buffer);
    return true;
  }

  void Reserve(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Buffer& buffer : idle_) {
        if (Fits(buffer, bytes)) return;
      }
    }
    Buffer buffer;
    buffer.capacity = (bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
    buffer.data = std::aligned_alloc(kBufferAlignment, buffer.capacity);
    if (buffer.data == nullptr) return;
    AdviseHugePages(buffer.data, buffer.capacity);  // fresh: before its first write
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.reservations;
    }
    AddIdle(buffer);
  }

  // The newest idle buffer goes to the back; past kMaxIdleBuffers the oldest is freed.
  void AddIdle(Buffer buffer) {
    Buffer evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(buffer);
      if (idle_.size() > kMaxIdleBuffers) {
        evicted = idle_.front();
        idle_.erase(idle_.begin());
      }
    }
    std::free(evicted.data);  // outside the lock: unmapping 262 MB takes a while
  }

  size_t Release() {
    std::vector<Buffer> freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      freed.swap(idle_);
    }
    size_t bytes = 0;
    for (const Buffer& buffer : freed) {
      bytes += buffer.capacity;
      std::free(buffer.data);
    }
    return bytes;
  }

  GradientCacheStats Stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    GradientCacheStats stats = stats_;
    stats.idle_buffers = static_cast<int64_t>(idle_.size());
    for (const Buffer& buffer : idle_) stats.idle_bytes += buffer.capacity;
    return stats;
  }

 private:
  GradientCache() = default;

  std::mutex mutex_;
  std::vector<Buffer> idle_;    // oldest first
  std::vector<Buffer> in_use_;  // handed out, not yet given back
  GradientCacheStats stats_;
};

// TensorFlow's deallocator of a cached tensor: runs on whichever thread drops the last
// reference.
void ReturnToCache(void* data, size_t /*len*/, void* /*arg*/) {
  GradientCache::Get().GiveBack(data);
}

}  // namespace

bool GradientCacheEnabled() {
  static const bool enabled = ReadEnabled();
  return enabled;
}

bool UsesGradientCache(size_t bytes) {
  return bytes >= kGradientCacheMinBytes && GradientCacheEnabled();
}

TensorPtr TakeCachedGradient(TF_DataType dtype, const std::vector<int64_t>& dims, size_t bytes) {
  Buffer buffer;
  if (!UsesGradientCache(bytes) || !GradientCache::Get().Take(bytes, &buffer)) return nullptr;
  TensorPtr tensor(TF_NewTensor(dtype, dims.data(), static_cast<int>(dims.size()), buffer.data,
                                bytes, &ReturnToCache, nullptr));
  // Some TensorFlow versions call the deallocator when they refuse the memory, some do not:
  // GiveBack returns the buffer once either way.
  if (tensor == nullptr) GradientCache::Get().GiveBack(buffer.data);
  return tensor;
}

void ReserveCachedGradient(size_t bytes) {
  if (UsesGradientCache(bytes)) GradientCache::Get().Reserve(bytes);
}

GradientCacheStats GetGradientCacheStats() { return GradientCache::Get().Stats(); }

size_t ReleaseGradientCache() { return GradientCache::Get().Release(); }

}  // namespace tf_metal_ops
