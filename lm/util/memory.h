// How the process's heap treats the large, short-lived buffers of tensor code.
//
// A forward pass allocates and frees buffers of tens to hundreds of MiB (a layer's gathered MoE
// rows, a chunk of [rows, vocab] logits) many times per step. glibc serves those from fresh
// mmap()s and munmap()s them on free, so every use pays page faults that zero the whole buffer
// again: measured, a third of a 4096-token scoring forward was the kernel zeroing pages. Keeping
// freed memory in the heap for reuse removes that; the price is a process that keeps its
// high-water mark (it would reach it again on the next step anyway).
#pragma once

namespace lm {

// Call at the top of main, before any thread starts (the arena setting only holds then).
// Every large allocation then comes from one heap that is never trimmed back to the OS.
void RetainFreedMemory();

}  // namespace lm
