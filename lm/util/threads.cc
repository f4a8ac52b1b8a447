#include "lm/util/threads.h"

#include <dlfcn.h>

#include <ATen/Parallel.h>

namespace lm {
namespace {

// Both live in libraries LibTorch has loaded already (its bundled libgomp, and MKL inside
// libtorch_cpu); looking them up keeps this project from linking either directly.
template <class Fn>
Fn Lookup(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

void SetThreadsForThisThread(int n) {
  using SetFn = void (*)(int);
  using MklSetLocalFn = int (*)(const int*);  // MKL's Fortran-style entry: the count by pointer
  static const SetFn omp_set = Lookup<SetFn>("omp_set_num_threads");
  static const MklSetLocalFn mkl_set_local = Lookup<MklSetLocalFn>("mkl_set_num_threads_local_");
  // LibTorch sets a thread's OpenMP count from its global setting the first time the thread asks
  // (lazily); make that happen now, so that it does not overwrite what is set here later. The
  // flag that records it lives in an inline function: libtorch has one copy and every binary
  // that calls at::parallel_for inline (kernels/cpu/cpu_inference.cc) another, so trigger both.
  at::get_num_threads();
  at::internal::lazy_init_num_threads();
  if (omp_set) omp_set(n);
  if (mkl_set_local) mkl_set_local(&n);
}

}  // namespace lm
