// Builds without the CUDA toolkit: no NCCL backend, a clear error for whoever asks for it.
#include "absl/strings/str_cat.h"
#include "lm/dist/backends.h"

namespace lm::dist {

absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> MakeNcclBackend(
    const c10::intrusive_ptr<c10d::Store>&, int rank, int size, std::chrono::milliseconds,
    const c10::Device&) {
  return absl::UnimplementedError(absl::StrCat(
      "rank ", rank, " of ", size,
      ": this build has no NCCL backend (it was configured without the CUDA toolkit)"));
}

}  // namespace lm::dist
