// Reference-counted blocks of the paged KV cache (lm/model/paged_kv.h), host-side bookkeeping
// only: block 0 is the null block and never handed out. A block shared by several sequences (the
// samples of one prompt share the prompt's blocks) is freed when its last holder releases it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace rollout {

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks) : refs_(std::max<int64_t>(num_blocks, 1), 0) {
    // Handed out lowest id first (the back of the free list).
    for (int64_t b = num_blocks - 1; b >= 1; --b) free_.push_back(static_cast<int32_t>(b));
  }

  int64_t usable() const { return static_cast<int64_t>(refs_.size()) - 1; }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t used() const { return usable() - free(); }
  int64_t peak_used() const { return peak_; }
  int refs(int32_t b) const { return refs_[b]; }

  // A block with one reference, or none when the pool is full.
  std::optional<int32_t> Allocate() {
    if (free_.empty()) return std::nullopt;
    const int32_t b = free_.back();
    free_.pop_back();
    refs_[b] = 1;
    peak_ = std::max(peak_, used());
    return b;
  }
  void Share(int32_t b) { ++refs_[b]; }
  void Release(int32_t b) {
    if (--refs_[b] == 0) free_.push_back(b);
  }

 private:
  std::vector<int> refs_;
  std::vector<int32_t> free_;
  int64_t peak_ = 0;
};

}  // namespace rollout
