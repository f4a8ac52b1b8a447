// The CPU kernels' way of spreading uneven tasks over LibTorch's intra-op threads.
#pragma once

#include <atomic>
#include <cstdint>

#include <ATen/Parallel.h>

namespace lm {

// Runs task(i, state) for i in [0, n) on the intra-op threads, handing out indices one at a time
// in order. Callers put the largest tasks first, so the threads finish together (a static split of
// uneven tasks left one thread waiting at the barrier). Each thread makes its `state` (buffers)
// once. The region always has every intra-op thread, even for a single task: inside it the library
// GEMM runs sequentially, so a task computes the same bits however many tasks there are (outside
// it the library would split a lone task's product across threads, rounding differently).
template <class MakeState, class Task>
void ParallelTasks(int64_t n, const MakeState& make_state, const Task& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    if (next >= n) return;
    auto state = make_state();
    for (int64_t i = next++; i < n; i = next++) task(i, state);
  });
}

}  // namespace lm
