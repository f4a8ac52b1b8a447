// UpdateWeights manifests: any byte string is a serialized opd.v1.WeightChunk, the first chunk of
// an UpdateWeights stream as the rollout worker receives it, whose manifest is checked against a
// small model before anything is staged (rollout/weights.cc, StageAnnounced). CheckAnnounced must
// refuse it with INVALID_ARGUMENT naming the tensor, at the first bad one in manifest order, or
// accept only parameters of the model, each once, with the model's shape and a known dtype, and
// count their wire bytes exactly.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_util.h"
#include "opd/v1/rollout.pb.h"
#include "rpc/weight_manifest.h"

namespace {

using opd::rpc::AnnouncedTensor;
using opd::rpc::ParamShapes;

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

void CheckCarriedOver(const opd::v1::WeightManifest& m, const std::vector<AnnouncedTensor>& a) {
  FUZZ_CHECK(a.size() == static_cast<size_t>(m.tensors_size()), "tensor count");
  for (int i = 0; i < m.tensors_size(); ++i) {
    const auto& t = m.tensors(i);
    const std::optional<uint64_t> checksum =
        t.has_checksum() ? std::optional<uint64_t>(t.checksum()) : std::nullopt;
    FUZZ_CHECK(a[i].name == t.name() && a[i].dtype == t.dtype() && a[i].checksum == checksum,
               absl::StrCat("tensor ", i));
    FUZZ_CHECK(a[i].shape == std::vector<int64_t>(t.shape().begin(), t.shape().end()),
               absl::StrCat("shape of tensor ", i));
  }
  const auto base = opd::rpc::BaseVersion(m);
  FUZZ_CHECK(base.has_value() == m.has_base_version(), "base_version");
  FUZZ_CHECK(!base.has_value() || *base == m.base_version(), "base_version");
}

// What staging relies on for an accepted manifest, and the byte count it announces back.
void CheckAccepted(const std::vector<AnnouncedTensor>& announced, int64_t bytes) {
  std::set<std::string> seen;
  int64_t total = 0;
  for (const AnnouncedTensor& a : announced) {
    const auto it = Params().find(a.name);
    FUZZ_CHECK(it != Params().end(), a.name);
    FUZZ_CHECK(seen.insert(a.name).second, absl::StrCat(a.name, " twice"));
    FUZZ_CHECK(a.shape == it->second, a.name);
    const auto dtype = opd::rpc::WireDtypeFromName(a.dtype);
    FUZZ_CHECK(dtype.ok(), a.dtype);
    total += Numel(a.shape) * opd::rpc::WireDtypeSize(*dtype);
  }
  FUZZ_CHECK(bytes == total, absl::StrCat(bytes, " bytes announced, ", total, " expected"));
}

absl::Status CheckPrefix(const std::vector<AnnouncedTensor>& announced, size_t n) {
  const std::vector<AnnouncedTensor> prefix(announced.begin(), announced.begin() + n);
  return opd::rpc::CheckAnnounced(prefix, Params()).status();
}

// The error is the first bad tensor's: the manifest cut just before it passes, and cut just
// after it fails with the same error (found by bisection: once a prefix fails, longer ones do).
void CheckRefused(const std::vector<AnnouncedTensor>& announced, const absl::Status& st) {
  FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument, st.ToString());
  const std::string_view message(st.message().data(), st.message().size());
  FUZZ_CHECK(message.substr(0, 17) == "manifest: tensor ", st.ToString());
  FUZZ_CHECK(!announced.empty(), "an empty manifest was refused");
  size_t lo = 0, hi = announced.size();  // prefix lo passes, prefix hi fails
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    (CheckPrefix(announced, mid).ok() ? lo : hi) = mid;
  }
  FUZZ_CHECK(CheckPrefix(announced, lo).ok(), absl::StrCat("the first ", lo, " tensors"));
  const absl::Status first = CheckPrefix(announced, hi);
  FUZZ_CHECK(first == st, absl::StrCat(first.ToString(), " vs ", st.ToString()));
  const std::string quoted = absl::StrCat("'", announced[lo].name, "'");
  FUZZ_CHECK(message.find(quoted) != std::string_view::npos,
             absl::StrCat(st.ToString(), " does not name ", quoted));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  opd::v1::WeightChunk chunk;
  if (!chunk.ParseFromArray(data, static_cast<int>(size))) return 0;
  const std::vector<AnnouncedTensor> announced = opd::rpc::Announced(chunk.manifest());
  CheckCarriedOver(chunk.manifest(), announced);
  const auto bytes = opd::rpc::CheckAnnounced(announced, Params());
  if (bytes.ok()) {
    CheckAccepted(announced, *bytes);
  } else {
    CheckRefused(announced, bytes.status());
  }
  return 0;
}
