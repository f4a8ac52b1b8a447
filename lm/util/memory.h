// How the process's heap treats the large, short-lived buffers of tensor code, and how much
// memory the system can still give it.
//
// A forward pass allocates and frees buffers of tens to hundreds of MiB (a layer's gathered MoE
// rows, a chunk of [rows, vocab] logits) many times per step. glibc serves those from fresh
// mmap()s and munmap()s them on free, so every use pays page faults that zero the whole buffer
// again: measured, a third of a 4096-token scoring forward was the kernel zeroing pages. Keeping
// freed memory in the heap for reuse removes that; the price is a process that keeps its
// high-water mark (it would reach it again on the next step anyway).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lm {

// Call at the top of main, before any thread starts (the arena setting only holds then).
// Every large allocation then comes from one heap that is never trimmed back to the OS.
void RetainFreedMemory();

// MemAvailable of a /proc/meminfo text ("MemAvailable:  22143260 kB"), in bytes; NOT_FOUND when
// the line is absent or unreadable.
absl::StatusOr<int64_t> ParseMemAvailable(const std::string& meminfo);

// The memory the kernel estimates it can give this process without swapping: /proc/meminfo's
// MemAvailable (free pages plus the reclaimable page cache), in bytes.
absl::StatusOr<int64_t> AvailableMemoryBytes();

// "1.5 GiB": a byte count for messages.
std::string HumanBytes(int64_t bytes);

// OK when `needed` bytes fit in `available`; else RESOURCE_EXHAUSTED naming `what` (the model
// directory, say) and both counts.
absl::Status CheckMemoryBudget(const std::string& what, int64_t needed, int64_t available);

// CheckMemoryBudget against AvailableMemoryBytes(). A system without /proc/meminfo is not refused:
// the budget is a guard against absurd sizes, not a requirement on the platform.
absl::Status CheckHostMemory(const std::string& what, int64_t needed);

}  // namespace lm
