// How many threads LibTorch's CPU kernels use, set per calling thread.
//
// LibTorch's CPU parallelism is OpenMP (libgomp), and MKL runs on it. Every thread that runs a
// parallel kernel gets an OpenMP pool of its own, and libgomp counts the workers of every pool,
// idle or not: once the process holds more of them than it has CPUs, its barriers stop spinning
// and sleep, so every small kernel pays a futex wake-up. Measured: a rollout decode loop ran 1.6x
// slower on a service's worker thread than on the main thread of the same process, only because
// the main thread had loaded the model with a pool of its own. So processes that compute on
// worker threads give their bookkeeping threads (main, gRPC handlers) one thread, and only the
// threads that compute get the configured count (what a new thread inherits from
// torch::set_num_threads).
#pragma once

namespace lm {

// Kernels called from the current thread use `n` threads (OpenMP and MKL); other threads keep
// theirs.
void SetThreadsForThisThread(int n);

}  // namespace lm
