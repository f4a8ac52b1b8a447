#include "rpc/weight_stream.h"

#include <algorithm>
#include <numeric>

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "rpc/status.h"

namespace opd::rpc {

absl::StatusOr<StreamReport> StreamWeights(opd::v1::Rollout::StubInterface& stub,
                                           const ClientOptions& options, int64_t version,
                                           const std::vector<OutgoingTensor>& tensors,
                                           const std::vector<size_t>& which,
                                           const opd::v1::WeightManifest* manifest,
                                           torch::Tensor& bucket, const StreamOptions& stream) {
  if (stream.chunk_bytes == 0) return absl::InvalidArgumentError("weight chunks of 0 bytes");
  if (!bucket.defined() || !bucket.device().is_cpu() || bucket.numel() < 8 ||
      bucket.numel() % 8 != 0)
    return absl::InvalidArgumentError(
        "the weight stream's cast buffer must be a CPU tensor of a multiple of 8 bytes");
  grpc::ClientContext ctx;
  PrepareContext(options, &ctx);
  CallCanceller::Scope cancel(options.canceller.get(), &ctx);
  StreamReport report;
  auto writer = stub.UpdateWeights(&ctx, &report.applied);
  bool open = true, first = true;
  int64_t buckets = 0;
  auto write = [&](opd::v1::WeightChunk& chunk) {
    if (first && manifest) *chunk.mutable_manifest() = *manifest;
    first = false;
    chunk.set_version(version);
    // A failed write means the server already ended the call; Finish says why.
    open = writer->Write(chunk);
    return open;
  };
  const int64_t chunk_bytes = static_cast<int64_t>(std::min<size_t>(stream.chunk_bytes, INT64_MAX));
  absl::Status packed = PackBuckets(
      tensors, which, bucket, [&](int64_t n, const std::vector<BucketSegment>& segments) {
        const char* base = static_cast<const char*>(bucket.data_ptr());
        for (const auto& s : segments) {
          const OutgoingTensor& t = tensors[s.tensor];
          for (int64_t off = 0; off < s.bytes || (s.bytes == 0 && off == 0);) {
            const int64_t take = std::min(s.bytes - off, chunk_bytes);
            WireTensor piece = static_cast<const WireTensor&>(t);
            piece.offset = s.offset + off;
            piece.data = std::string_view(base + s.bucket_offset + off, static_cast<size_t>(take));
            opd::v1::WeightChunk chunk;
            ToProto(piece, &chunk);
            if (!write(chunk)) return absl::CancelledError("stream closed by the worker");
            if (s.bytes == 0) break;
            off += take;
          }
        }
        report.bytes += n;
        if (stream.on_bucket) stream.on_bucket(buckets);
        ++buckets;
        return absl::OkStatus();
      });
  if (open && first && manifest) {  // nothing changed: the manifest alone moves the version on
    opd::v1::WeightChunk chunk;
    write(chunk);
  }
  (void)packed;  // only a closed stream stops the packing: Finish below has the worker's reason
  if (open) writer->WritesDone();
  RETURN_IF_ERROR(FromGrpc(writer->Finish(), options.address));
  return report;
}

absl::StatusOr<StreamReport> StreamWeights(const ClientOptions& options, int64_t version,
                                           const std::vector<OutgoingTensor>& tensors,
                                           const StreamOptions& stream) {
  ASSIGN_OR_RETURN(auto channel, MakeChannel(options));
  auto stub = opd::v1::Rollout::NewStub(channel);
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), size_t{0});
  int64_t total = 0;
  for (const OutgoingTensor& t : tensors) total += t.bytes;
  const int64_t bucket_bytes = std::clamp<int64_t>((total + 7) / 8 * 8, 8, int64_t{64} << 20);
  torch::Tensor bucket = torch::empty({bucket_bytes}, torch::kUInt8);
  return StreamWeights(*stub, options, version, tensors, all, nullptr, bucket, stream);
}

}  // namespace opd::rpc
