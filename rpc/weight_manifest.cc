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

absl::Status Refuse(const std::string& name, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("manifest: tensor '", name, "'", what));
}

}  // namespace

absl::StatusOr<Announcement> ReadManifest(const opd::v1::WeightManifest& m,
                                          const ParamShapes& params) {
  Announcement a;
  if (m.has_base_version()) a.base_version = m.base_version();
  a.tensors.reserve(static_cast<size_t>(m.tensors_size()));
  std::set<std::string_view> seen;
  for (const opd::v1::ManifestTensor& entry : m.tensors()) {
    auto it = params.find(entry.name());
    if (it == params.end()) return Refuse(entry.name(), " is not a parameter of the model");
    if (!seen.insert(it->first).second) return Refuse(entry.name(), " is announced twice");
    const std::vector<int64_t> shape(entry.shape().begin(), entry.shape().end());
    if (shape != it->second)
      return Refuse(entry.name(), absl::StrCat(": shape ", ShapeString(shape), ", the model's is ",
                                               ShapeString(it->second)));
    auto t = FromProto(entry);  // its error names the tensor already
    if (!t.ok())
      return absl::InvalidArgumentError(absl::StrCat("manifest: ", t.status().message()));
    // The parameter's shape, not the announced one: the sizes of a real model cannot overflow.
    a.bytes += Numel(it->second) * WireDtypeSize(t->dtype);
    a.tensors.push_back(*std::move(t));
  }
  return a;
}

}  // namespace opd::rpc
