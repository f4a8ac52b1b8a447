// Safetensors files: a memory-mapped, validating reader and a writer.
//
// Format: 8-byte little-endian header length N, then N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__":
//   {..}}
// then the data block; offsets are relative to the data block start.
// This file has no LibTorch dependency: tensors are byte views into the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace lm {

// kF8E4M3: float8_e4m3fn, the weights of block-wise FP8 checkpoints (lm/model/fp8_format.h), which
// are only valid together with their scales: lm/io/fp8_checkpoint.h pairs and checks them.
enum class DType { kF32, kF16, kBF16, kF8E4M3 };

// "F32" -> kF32, "F8_E4M3" -> kF8E4M3 etc.; any other dtype string is an error naming it.
absl::StatusOr<DType> ParseDType(const std::string& s);
const char* DTypeName(DType d);
size_t DTypeSize(DType d);

// A read-only view of one tensor's bytes inside a mapped file.
struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // points into the mapping; valid while the file is alive
  size_t nbytes = 0;
  int64_t numel() const;
};

// An open, memory-mapped safetensors file. Immutable after Open; safe to share across threads.
class SafetensorsFile {
 public:
  // Maps `path` and validates the header: JSON well-formed, each entry has a known dtype, a shape
  // of non-negative dims, offsets with begin <= end inside the data block, shape x dtype size equal
  // to the byte range, and no two tensors overlapping. Errors name the file and the tensor.
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Open(const std::string& path);
  // Validates an in-memory image of a file (used by Open and by the header fuzz test).
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> FromBuffer(
      std::shared_ptr<const void> owner, const std::byte* bytes, size_t size,
      const std::string& label);

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor or NotFound naming the file.
  absl::StatusOr<TensorView> Get(const std::string& name) const;
  // Hands the pages under `view` back to the kernel (madvise MADV_DONTNEED) so that they stop
  // counting towards this process's resident memory: a loader that has copied a tensor out calls
  // it, and a whole shard is then never resident at once. The mapping is read-only and private,
  // so a later read of the view simply faults the bytes in from the file again: nothing is lost.
  // A no-op for in-memory images (FromBuffer), whose bytes are the only copy.
  void ReleasePages(const TensorView& view) const;

 private:
  SafetensorsFile() = default;
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Parse(
      std::shared_ptr<const void> owner, const std::byte* bytes, size_t size,
      const std::string& label, bool mapped);
  bool mapped_ = false;  // Open()ed: the bytes are a read-only file mapping
  std::string path_;
  std::shared_ptr<const void> owner_;  // keeps the mapping (or buffer) alive
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to be written: name, dtype, shape and the raw little-endian bytes.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
};

// Writes a safetensors file readable by Python `safetensors` (header padded to 8 bytes, tensors in
// name order). Writes to `path + ".tmp"` then renames, so a crash never leaves a half file.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// model.safetensors.index.json of a sharded checkpoint: which shard file holds each tensor.
struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;  // tensor -> shard file, relative to the directory
  std::vector<std::string> shards;                // the distinct shard files, sorted
};

// Parses the text of an index ({"weight_map": {tensor: file}, "metadata": {...}}). A shard name
// comes from a file anyone can edit, so it must be a relative path that stays inside the model
// directory: not empty, no NUL byte, not absolute, no ".." component. Errors name `label` and
// the offending entry.
absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view text,
                                                       const std::string& label);

// The safetensors files of the model directory `dir`, in the order to open them: the shards of
// model.safetensors.index.json, or model.safetensors. A shard that resolves outside `dir` (through
// a symbolic link) is refused like a ".." name, with an error naming the entry.
absl::StatusOr<std::vector<std::string>> CheckpointFilePaths(const std::string& dir);

}  // namespace lm
