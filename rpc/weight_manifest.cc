#include "rpc/weight_manifest.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "opd/v1/rollout.pb.h"

namespace opd::rpc {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::StatusOr<WireDtype> WireDtypeFromName(std::string_view name) {
  if (name == "float32") return WireDtype::kFloat32;
  if (name == "bfloat16") return WireDtype::kBFloat16;
  if (name == "float16") return WireDtype::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", std::string(name), "' (float32, bfloat16 or float16)"));
}

int64_t WireDtypeSize(WireDtype dtype) {
  return dtype == WireDtype::kFloat32 ? 4 : 2;
}

std::vector<AnnouncedTensor> Announced(const opd::v1::WeightManifest& m) {
  std::vector<AnnouncedTensor> out;
  out.reserve(m.tensors_size());
  for (const auto& t : m.tensors())
    out.push_back({t.name(),
                   {t.shape().begin(), t.shape().end()},
                   t.dtype(),
                   t.has_checksum() ? std::optional<uint64_t>(t.checksum()) : std::nullopt});
  return out;
}

std::optional<int64_t> BaseVersion(const opd::v1::WeightManifest& m) {
  if (!m.has_base_version()) return std::nullopt;
  return m.base_version();
}

absl::StatusOr<int64_t> CheckAnnounced(const std::vector<AnnouncedTensor>& announced,
                                       const ParamShapes& params) {
  std::set<std::string_view> seen;
  int64_t bytes = 0;
  for (const AnnouncedTensor& a : announced) {
    auto it = params.find(a.name);
    if (it == params.end())
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: tensor '", a.name, "' is not a parameter of the model"));
    if (!seen.insert(it->first).second)
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: tensor '", a.name, "' is announced twice"));
    if (a.shape != it->second)
      return absl::InvalidArgumentError(absl::StrCat("manifest: tensor '", a.name, "': shape ",
                                                     ShapeString(a.shape), ", the model's is ",
                                                     ShapeString(it->second)));
    auto wire = WireDtypeFromName(a.dtype);
    if (!wire.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: tensor '", a.name, "': ", wire.status().message()));
    // The parameter's shape, not the announced one: the sizes of a real model cannot overflow.
    bytes += Numel(it->second) * WireDtypeSize(*wire);
  }
  return bytes;
}

}  // namespace opd::rpc
