#include "lm/util/memory.h"

#include <malloc.h>

namespace lm {

void RetainFreedMemory() {
  // Blocks up to 1 GiB come from the heap instead of their own mapping...
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  // ...and the heap is never shrunk, so a freed buffer's pages stay mapped for the next one.
  mallopt(M_TRIM_THRESHOLD, -1);
  // Threads' own arenas are capped at 64 MiB each, so their larger blocks would be mmap()ed again
  // whatever the threshold; one arena keeps them all in the main heap. Contention is no concern:
  // a process here runs a handful of threads that allocate, each of them rarely.
  mallopt(M_ARENA_MAX, 1);
}

}  // namespace lm
