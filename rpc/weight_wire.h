// Weight updates on the wire, shared by the learner (which sends them) and the rollout worker
// (which checks them): the per-tensor checksum (XXH64), the cast of a parameter into its wire
// dtype a slice at a time, and the packing of several tensors' wire bytes into fixed-size buckets.
//
// The learner never builds a wire-dtype copy of the model: it casts slices of each parameter into
// one reused buffer (a bucket), hashes or sends the bucket, and moves on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "rpc/wire_tensor.h"

namespace opd::rpc {

// XXH64 with seed 0 (the reference algorithm, so that any xxhash implementation agrees), fed in
// pieces of any size.
class Xxh64 {
 public:
  Xxh64();
  void Update(const void* data, size_t n);
  uint64_t Digest() const;
  static uint64_t Of(const void* data, size_t n);

 private:
  uint64_t v_[4];
  uint64_t total_ = 0;
  unsigned char buf_[32];
  size_t buffered_ = 0;
};

// A parameter on its way out: the tensor on the wire (name, shape, wire dtype; its checksum once
// ComputeChecksums ran) and the parameter its bytes are cast from.
struct OutgoingTensor : WireTensor {
  torch::Tensor source;  // the parameter itself (any dtype and device)
  int64_t bytes = 0;     // numel x the wire dtype's size
};

// The named parameters of `params` in `dtype`, without their checksums.
std::vector<OutgoingTensor> OutgoingTensorsOf(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, WireDtype dtype);

// One piece of a bucket: bytes [offset, offset + bytes) of tensor `tensor` (an index into the
// list given to PackBuckets), at `bucket_offset` in the bucket.
struct BucketSegment {
  size_t tensor = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
  int64_t bucket_offset = 0;
};

// Fills `bucket` (a contiguous uint8 tensor on any device; its size a multiple of 8) with the
// consecutive wire bytes of tensors[which[0]], tensors[which[1]], ... (cast from their sources)
// and calls on_bucket(bytes filled, segments) each time it is full and once at the end if
// anything is left. Stops at the first error on_bucket returns. Zero-byte tensors appear as
// zero-byte segments.
using BucketFn = std::function<absl::Status(int64_t, const std::vector<BucketSegment>&)>;
absl::Status PackBuckets(const std::vector<OutgoingTensor>& tensors,
                         const std::vector<size_t>& which, torch::Tensor& bucket,
                         const BucketFn& on_bucket);

// The checksums of every tensor (cast through `staging`, a CPU uint8 buffer, where the source is
// not already a CPU tensor of the wire dtype).
void ComputeChecksums(std::vector<OutgoingTensor>* tensors, torch::Tensor& staging);

// ---- The parallel push (SyncWeightsRequest.sender_bytes in rollout.proto) ----
//
// The concatenated wire bytes of an update (its tensors in manifest order) are split among the
// learner ranks: sender r sends the r-th share, in buckets, as the root of a broadcast to the whole
// weight group. Every member computes the same bucket sizes (a sender's share in pieces of
// min(bucket, what is left)), so no frame header travels.

// The shares of `total` bytes among `senders`: as equal as a multiple of 8 allows, the last one
// taking the rest. With one wire dtype for every tensor, each share starts on an element.
std::vector<int64_t> SenderShares(int64_t total, int senders);

// Fills `bucket` (a contiguous uint8 tensor on any device) with bytes [begin, end) of the
// concatenated wire stream of `tensors` (cast from their sources, a slice at a time) and calls
// on_bucket(n) each time it holds min(bucket size, end - position) bytes. INVALID_ARGUMENT when
// [begin, end) does not start and end on elements of the tensors it covers, or a bucket boundary
// would split an element (the bucket size must be a multiple of every element size).
absl::Status PackRange(const std::vector<OutgoingTensor>& tensors, int64_t begin, int64_t end,
                       torch::Tensor& bucket,
                       const std::function<absl::Status(int64_t)>& on_bucket);

// What each member of a parallel push contributes to the closing all-gather, in a fixed record
// of kVerdictBytes: a worker its outcome (present), a learner rank nothing.
inline constexpr int64_t kVerdictBytes = 512;
struct SyncVerdict {
  bool present = false;
  int32_t code = 0;  // absl::StatusCode
  int64_t version = 0, tensors = 0, bytes = 0;
  std::string message;  // cut to what the record holds
};
void EncodeVerdict(const SyncVerdict& v, uint8_t* out);
SyncVerdict DecodeVerdict(const uint8_t* in);

}  // namespace opd::rpc
