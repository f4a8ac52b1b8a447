#include "rpc/wire_tensor.h"

#include "absl/strings/str_cat.h"
#include "opd/v1/common.pb.h"
#include "opd/v1/rollout.pb.h"

namespace opd::rpc {
namespace {

// Every wire dtype, once: its enum on the wire, its name and its element size.
struct DtypeInfo {
  WireDtype dtype;
  opd::v1::WireDtype proto;
  const char* name;
  int64_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {WireDtype::kFloat32, opd::v1::WIRE_DTYPE_FLOAT32, "float32", 4},
    {WireDtype::kBFloat16, opd::v1::WIRE_DTYPE_BFLOAT16, "bfloat16", 2},
    {WireDtype::kFloat16, opd::v1::WIRE_DTYPE_FLOAT16, "float16", 2},
};

const DtypeInfo& Info(WireDtype dtype) {
  return kDtypes[static_cast<size_t>(dtype)];  // the enumerators are the table's order
}

// The enum when the sender set it, else the name: senders from before the enum set only that.
absl::StatusOr<WireDtype> DtypeOf(int value, std::string_view name) {
  if (value == opd::v1::WIRE_DTYPE_UNSPECIFIED) return WireDtypeFromName(name);
  for (const DtypeInfo& d : kDtypes)
    if (d.proto == value) return d.dtype;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown wire_dtype ", value, " (float32, bfloat16 or float16)"));
}

// The fields a manifest entry and a chunk share.
template <typename Message>
absl::StatusOr<WireTensor> Read(const Message& m) {
  WireTensor t;
  t.name = m.name();
  t.shape.assign(m.shape().begin(), m.shape().end());
  auto dtype = DtypeOf(m.wire_dtype(), m.dtype());
  if (!dtype.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "': ", dtype.status().message()));
  t.dtype = *dtype;
  return t;
}

template <typename Message>
void Write(const WireTensor& t, Message* m) {
  m->set_name(t.name);
  m->mutable_shape()->Add(t.shape.begin(), t.shape.end());
  m->set_wire_dtype(Info(t.dtype).proto);
  m->set_dtype(WireDtypeName(t.dtype));
}

}  // namespace

const char* WireDtypeName(WireDtype dtype) {
  return Info(dtype).name;
}

absl::StatusOr<WireDtype> WireDtypeFromName(std::string_view name) {
  for (const DtypeInfo& d : kDtypes)
    if (name == d.name) return d.dtype;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", std::string(name), "' (float32, bfloat16 or float16)"));
}

int64_t WireDtypeSize(WireDtype dtype) {
  return Info(dtype).size;
}

absl::StatusOr<WireTensor> FromProto(const opd::v1::ManifestTensor& m) {
  auto t = Read(m);
  if (t.ok() && m.has_checksum()) t->checksum = m.checksum();
  return t;
}

absl::StatusOr<WireTensor> FromProto(const opd::v1::WeightChunk& chunk) {
  auto t = Read(chunk);
  if (t.ok()) {
    t->offset = chunk.offset();
    t->data = chunk.data();
  }
  return t;
}

void ToProto(const WireTensor& t, opd::v1::ManifestTensor* m) {
  Write(t, m);
  if (t.checksum.has_value()) m->set_checksum(*t.checksum);
}

void ToProto(const WireTensor& t, opd::v1::WeightChunk* chunk) {
  Write(t, chunk);
  chunk->set_offset(t.offset);
  chunk->set_data(t.data.data(), t.data.size());
}

absl::StatusOr<WireDtype> ServedDtype(const opd::v1::ServiceInfo& info) {
  if (info.dtype().empty()) return WireDtype::kFloat32;
  return WireDtypeFromName(info.dtype());
}

}  // namespace opd::rpc
