// UpdateWeights manifests: any byte string is a serialized opd.v1.WeightChunk, the first chunk of
// an UpdateWeights stream as the rollout worker receives it, whose manifest is checked against a
// small model before anything is staged (rollout/weights.cc, StageAnnounced). ReadManifest must
// refuse it with INVALID_ARGUMENT naming the tensor, at the first bad one in manifest order, or
// accept only parameters of the model, each once, with the model's shape and a known dtype (the
// enum when set, else the name), carry every field over, and count their wire bytes exactly.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_util.h"
#include "opd/v1/rollout.pb.h"
#include "rpc/weight_manifest.h"

namespace {

using opd::rpc::Announcement;
using opd::rpc::ParamShapes;
using opd::rpc::WireDtype;

// A tiny model's parameters, with a scalar and an empty tensor among them.
const ParamShapes& Params() {
  static const ParamShapes* params = new ParamShapes{
      {"model.embed_tokens.weight", {64, 8}},
      {"model.layers.0.self_attn.q_proj.weight", {8, 8}},
      {"model.layers.0.mlp.experts.gate_up_proj", {2, 16, 8}},
      {"model.norm.weight", {8}},
      {"lm_head.weight", {64, 8}},
      {"scale", {}},
      {"empty", {0, 8}},
  };
  return *params;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The dtype an entry names, by the rule of opd.v1.WireDtype: the enum when set, else the name.
std::optional<WireDtype> NamedDtype(const opd::v1::ManifestTensor& t) {
  switch (t.wire_dtype()) {
    case opd::v1::WIRE_DTYPE_FLOAT32:
      return WireDtype::kFloat32;
    case opd::v1::WIRE_DTYPE_BFLOAT16:
      return WireDtype::kBFloat16;
    case opd::v1::WIRE_DTYPE_FLOAT16:
      return WireDtype::kFloat16;
    case opd::v1::WIRE_DTYPE_UNSPECIFIED:
      if (t.dtype() == "float32") return WireDtype::kFloat32;
      if (t.dtype() == "bfloat16") return WireDtype::kBFloat16;
      if (t.dtype() == "float16") return WireDtype::kFloat16;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

// What staging relies on for an accepted manifest: every field carried over, each tensor a
// parameter of the model, once, in its shape, and the byte count it announces back.
void CheckAccepted(const opd::v1::WeightManifest& m, const Announcement& a) {
  FUZZ_CHECK(a.tensors.size() == static_cast<size_t>(m.tensors_size()), "tensor count");
  std::set<std::string> seen;
  int64_t total = 0;
  for (int i = 0; i < m.tensors_size(); ++i) {
    const opd::v1::ManifestTensor& t = m.tensors(i);
    const opd::rpc::WireTensor& got = a.tensors[static_cast<size_t>(i)];
    const std::optional<uint64_t> checksum =
        t.has_checksum() ? std::optional<uint64_t>(t.checksum()) : std::nullopt;
    const std::optional<WireDtype> dtype = NamedDtype(t);
    FUZZ_CHECK(got.name == t.name() && dtype == got.dtype && got.checksum == checksum,
               absl::StrCat("tensor ", i));
    FUZZ_CHECK(got.shape == std::vector<int64_t>(t.shape().begin(), t.shape().end()),
               absl::StrCat("shape of tensor ", i));
    FUZZ_CHECK(got.offset == 0 && got.data.empty(), absl::StrCat("bytes of tensor ", i));
    const auto it = Params().find(got.name);
    FUZZ_CHECK(it != Params().end(), got.name);
    FUZZ_CHECK(seen.insert(got.name).second, absl::StrCat(got.name, " twice"));
    FUZZ_CHECK(got.shape == it->second, got.name);
    total += Numel(got.shape) * opd::rpc::WireDtypeSize(got.dtype);
  }
  FUZZ_CHECK(a.base_version.has_value() == m.has_base_version(), "base_version");
  FUZZ_CHECK(!a.base_version.has_value() || *a.base_version == m.base_version(), "base_version");
  FUZZ_CHECK(a.bytes == total, absl::StrCat(a.bytes, " bytes announced, ", total, " expected"));
}

absl::Status CheckPrefix(const opd::v1::WeightManifest& m, int n) {
  opd::v1::WeightManifest prefix;
  for (int i = 0; i < n; ++i) *prefix.add_tensors() = m.tensors(i);
  return opd::rpc::ReadManifest(prefix, Params()).status();
}

// The error is the first bad tensor's: the manifest cut just before it passes, and cut just
// after it fails with the same error (found by bisection: once a prefix fails, longer ones do).
void CheckRefused(const opd::v1::WeightManifest& m, const absl::Status& st) {
  FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument, st.ToString());
  const std::string_view message(st.message().data(), st.message().size());
  FUZZ_CHECK(message.substr(0, 17) == "manifest: tensor ", st.ToString());
  FUZZ_CHECK(m.tensors_size() > 0, "an empty manifest was refused");
  int lo = 0, hi = m.tensors_size();  // prefix lo passes, prefix hi fails
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (CheckPrefix(m, mid).ok() ? lo : hi) = mid;
  }
  FUZZ_CHECK(CheckPrefix(m, lo).ok(), absl::StrCat("the first ", lo, " tensors"));
  const absl::Status first = CheckPrefix(m, hi);
  FUZZ_CHECK(first == st, absl::StrCat(first.ToString(), " vs ", st.ToString()));
  const std::string quoted = absl::StrCat("'", m.tensors(lo).name(), "'");
  FUZZ_CHECK(message.find(quoted) != std::string_view::npos,
             absl::StrCat(st.ToString(), " does not name ", quoted));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  opd::v1::WeightChunk chunk;
  if (!chunk.ParseFromArray(data, static_cast<int>(size))) return 0;
  const auto read = opd::rpc::ReadManifest(chunk.manifest(), Params());
  if (read.ok()) {
    CheckAccepted(chunk.manifest(), *read);
  } else {
    CheckRefused(chunk.manifest(), read.status());
  }
  return 0;
}
