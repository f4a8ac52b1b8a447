#include "lm/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "lm/util/file.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"

namespace lm {
namespace {

using json = nlohmann::json;

constexpr size_t kLengthPrefixBytes = 8;
// Same limit as the Python/Rust safetensors reader: a larger header is corruption, not a model.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr char kMetadataKey[] = "__metadata__";

absl::Status FileError(absl::StatusCode code, const std::string& label, absl::string_view msg) {
  return absl::Status(code, absl::StrCat(label, ": ", msg));
}

absl::Status TensorError(absl::StatusCode code, const std::string& label, const std::string& name,
                         absl::string_view msg) {
  return absl::Status(code, absl::StrCat(label, ": tensor '", name, "': ", msg));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Describes a JSON value for an error message without dumping it (dump can throw on bad UTF-8).
std::string Describe(const json& v) {
  if (v.is_number_unsigned()) return absl::StrCat(v.get<uint64_t>());
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    return x == 0 ? "-0" : absl::StrCat(x);  // a signed zero can only come from "-0"
  }
  if (v.is_number_float()) return absl::StrCat(v.get<double>());
  return absl::StrCat("a JSON ", v.type_name());
}

// A JSON number that must be a non-negative integer no larger than `max`. On failure returns the
// reason, for the caller to prefix with the file and tensor.
absl::StatusOr<uint64_t> NonNegativeInteger(const json& v, const std::string& what, uint64_t max) {
  // The parser stores non-negative integers as unsigned; anything else is rejected: negative
  // numbers, "-0" (Python's reader rejects it too), fractions, numbers beyond 2^64 (parsed as
  // floats) and non-numbers.
  if (!v.is_number_unsigned()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", Describe(v), ", expected a non-negative integer"));
  }
  const uint64_t x = v.get<uint64_t>();
  if (x > max) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", x, ", larger than ", max));
  }
  return x;
}

// Looks up a required field of a tensor entry.
absl::StatusOr<const json*> Field(const json& entry, const char* key) {
  auto it = entry.find(key);
  if (it == entry.end())
    return absl::InvalidArgumentError(absl::StrCat("missing field '", key, "'"));
  return &*it;
}

// Adds the file and tensor to an error produced by a helper that does not know them.
absl::Status InTensor(const absl::Status& s, const std::string& label, const std::string& name) {
  return TensorError(s.code(), label, name, s.message());
}

absl::StatusOr<std::vector<int64_t>> ParseShape(const json& v) {
  if (!v.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'shape' is ", Describe(v), ", expected an array of non-negative integers"));
  }
  std::vector<int64_t> shape;
  shape.reserve(v.size());
  for (const json& dim : v) {
    ASSIGN_OR_RETURN(uint64_t d, NonNegativeInteger(dim, absl::StrCat("shape[", shape.size(), "]"),
                                                    std::numeric_limits<int64_t>::max()));
    shape.push_back(static_cast<int64_t>(d));
  }
  return shape;
}

// Bytes of a tensor, or an error when numel or numel x dtype size does not fit (a hostile header
// must not wrap around into a small, "valid" size).
absl::StatusOr<uint64_t> ByteSize(const std::vector<int64_t>& shape, DType dtype) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has a negative dimension"));
    }
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has more elements than fit in int64"));
    }
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), DTypeSize(dtype), &nbytes)) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " x ",
                                                   DTypeName(dtype), " overflows a 64-bit size"));
  }
  return nbytes;
}

struct Range {
  uint64_t begin = 0;
  uint64_t end = 0;
};

absl::StatusOr<Range> ParseOffsets(const json& v, uint64_t data_size) {
  if (!v.is_array() || v.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("'data_offsets' is ", Describe(v),
                     v.is_array() ? absl::StrCat(" of ", v.size(), " elements") : "",
                     ", expected [begin, end]"));
  }
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  ASSIGN_OR_RETURN(uint64_t begin, NonNegativeInteger(v[0], "data_offsets[0]", kMax));
  ASSIGN_OR_RETURN(uint64_t end, NonNegativeInteger(v[1], "data_offsets[1]", kMax));
  const std::string offsets = absl::StrCat("data_offsets [", begin, ", ", end, "]");
  if (begin > end) {
    return absl::InvalidArgumentError(absl::StrCat(offsets, " are reversed (begin > end)"));
  }
  if (end > data_size) {
    return absl::DataLossError(absl::StrCat(offsets, " exceed the data block (", data_size,
                                            " bytes): file truncated or corrupted"));
  }
  return Range{begin, end};
}

absl::StatusOr<DType> ParseDTypeField(const json& v) {
  if (!v.is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'dtype' is ", Describe(v), ", expected a string"));
  }
  return ParseDType(v.get_ref<const std::string&>());
}

// One header entry -> a view into the data block, fully checked. Errors do not name the file or
// the tensor: the caller adds both.
absl::StatusOr<TensorView> ParseEntry(const std::string& name, const json& entry,
                                      const std::byte* data, uint64_t data_size) {
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entry is ", Describe(entry), ", expected an object with dtype, shape and data_offsets"));
  }
  TensorView view;
  view.name = name;
  ASSIGN_OR_RETURN(const json* dtype_json, Field(entry, "dtype"));
  ASSIGN_OR_RETURN(view.dtype, ParseDTypeField(*dtype_json));
  ASSIGN_OR_RETURN(const json* shape_json, Field(entry, "shape"));
  ASSIGN_OR_RETURN(view.shape, ParseShape(*shape_json));
  ASSIGN_OR_RETURN(const json* offsets_json, Field(entry, "data_offsets"));
  ASSIGN_OR_RETURN(Range range, ParseOffsets(*offsets_json, data_size));
  ASSIGN_OR_RETURN(uint64_t nbytes, ByteSize(view.shape, view.dtype));
  if (nbytes != range.end - range.begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(view.shape), " x ", DTypeName(view.dtype), " (",
                     DTypeSize(view.dtype), " bytes) = ", nbytes, " bytes, but data_offsets [",
                     range.begin, ", ", range.end, "] span ", range.end - range.begin, " bytes"));
  }
  view.data = data + range.begin;
  view.nbytes = static_cast<size_t>(nbytes);
  return view;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const json& v,
                                                                 const std::string& label) {
  if (!v.is_object()) {
    return FileError(
        absl::StatusCode::kInvalidArgument, label,
        absl::StrCat(kMetadataKey, " is ", Describe(v), ", expected an object of string values"));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : v.items()) {
    if (!value.is_string()) {
      return FileError(
          absl::StatusCode::kInvalidArgument, label,
          absl::StrCat(kMetadataKey, "['", key, "'] is ", Describe(value), ", expected a string"));
    }
    metadata.emplace(key, value.get<std::string>());
  }
  return metadata;
}

// Tensors may share no byte. Empty ranges hold no bytes, so they overlap nothing.
absl::Status CheckNoOverlap(const std::map<std::string, TensorView>& tensors, const std::byte* data,
                            const std::string& label) {
  std::vector<std::pair<Range, const std::string*>> ranges;
  for (const auto& [name, view] : tensors) {
    if (view.nbytes == 0) continue;
    const uint64_t begin = static_cast<uint64_t>(view.data - data);
    ranges.push_back({Range{begin, begin + view.nbytes}, &name});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
  // Sorted by begin, and no overlap so far means ends are increasing: neighbours suffice.
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& [prev, prev_name] = ranges[i - 1];
    const auto& [cur, cur_name] = ranges[i];
    if (cur.begin < prev.end) {
      return FileError(
          absl::StatusCode::kInvalidArgument, label,
          absl::StrCat("tensors '", *prev_name, "' [", prev.begin, ", ", prev.end, "] and '",
                       *cur_name, "' [", cur.begin, ", ", cur.end, "] overlap"));
    }
  }
  return absl::OkStatus();
}

uint64_t ReadU64LE(const std::byte* p) {
  uint64_t x = 0;
  for (int i = 7; i >= 0; --i) x = (x << 8) | static_cast<uint64_t>(p[i]);
  return x;
}

// Owns an fd; closes it on every path.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now so the caller can see the error (close can report a failed delayed write).
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "F8_E4M3") return DType::kF8E4M3;
  // Valid safetensors dtypes this project has no use for: say so, rather than "unknown".
  static const std::set<std::string> kOther = {
      "BOOL", "U8",  "I8",      "I16",     "U16", "I32",     "U32",     "I64",
      "U64",  "F64", "F8_E5M2", "F8_E8M0", "F4",  "F6_E2M3", "F6_E3M2", "C64"};
  if (kOther.count(s)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported dtype '", s, "' (supported: F32, F16, BF16, F8_E4M3)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", s, "' (supported: F32, F16, BF16, F8_E4M3)"));
}

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

size_t DTypeSize(DType d) {
  switch (d) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated at load: cannot overflow
  return n;
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot open"));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(st.st_mode)) {
    return FileError(absl::StatusCode::kInvalidArgument, path, "not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  // mmap of 0 bytes fails; let the validator report the short file instead.
  if (size < kLengthPrefixBytes) {
    return FileError(
        absl::StatusCode::kDataLoss, path,
        absl::StrCat("file is ", size,
                     " bytes, too short for the 8-byte header length: file truncated"));
  }
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (addr == MAP_FAILED) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot mmap ", size, " bytes"));
  }
  // The mapping outlives the fd, so the fd closes here and only the mapping is owned.
  std::shared_ptr<const void> owner(
      addr, [size](const void* p) { ::munmap(const_cast<void*>(p), size); });
  return Parse(std::move(owner), static_cast<const std::byte*>(addr), size, path,
               /*mapped=*/true);
}

void SafetensorsFile::ReleasePages(const TensorView& view) const {
  if (!mapped_ || view.nbytes == 0) return;
  static const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(view.data) & ~(kPage - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(view.data) + view.nbytes + kPage - 1) & ~(kPage - 1);
  // Best effort: on failure the pages merely stay resident until the file is closed.
  (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::FromBuffer(
    std::shared_ptr<const void> owner, const std::byte* bytes, size_t size,
    const std::string& label) {
  return Parse(std::move(owner), bytes, size, label, /*mapped=*/false);
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::Parse(
    std::shared_ptr<const void> owner, const std::byte* bytes, size_t size,
    const std::string& label, bool mapped) {
  if (size < kLengthPrefixBytes || bytes == nullptr) {
    return FileError(
        absl::StatusCode::kDataLoss, label,
        absl::StrCat("file is ", size,
                     " bytes, too short for the 8-byte header length: file truncated"));
  }
  const uint64_t header_size = ReadU64LE(bytes);
  if (header_size > size - kLengthPrefixBytes) {
    return FileError(
        absl::StatusCode::kDataLoss, label,
        absl::StrCat("header length ", header_size, " exceeds the ", size - kLengthPrefixBytes,
                     " bytes after the length prefix: file truncated or corrupted"));
  }
  if (header_size > kMaxHeaderBytes) {
    return FileError(absl::StatusCode::kInvalidArgument, label,
                     absl::StrCat("header length ", header_size, " exceeds the limit of ",
                                  kMaxHeaderBytes, " bytes"));
  }
  const char* header = reinterpret_cast<const char*>(bytes + kLengthPrefixBytes);
  const json root = json::parse(header, header + header_size, /*cb=*/nullptr,
                                /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return FileError(absl::StatusCode::kInvalidArgument, label, "header is not valid JSON");
  }
  if (!root.is_object()) {
    return FileError(absl::StatusCode::kInvalidArgument, label,
                     absl::StrCat("header is ", Describe(root), ", expected an object"));
  }

  SafetensorsFile file;
  file.path_ = label;
  const std::byte* data = bytes + kLengthPrefixBytes + header_size;
  const uint64_t data_size = size - kLengthPrefixBytes - header_size;
  for (const auto& [name, entry] : root.items()) {
    if (name == kMetadataKey) {
      ASSIGN_OR_RETURN(file.metadata_, ParseMetadata(entry, label));
      continue;
    }
    auto view = ParseEntry(name, entry, data, data_size);
    if (!view.ok()) return InTensor(view.status(), label, name);
    file.tensors_.emplace(name, *std::move(view));
  }
  RETURN_IF_ERROR(CheckNoOverlap(file.tensors_, data, label));
  file.owner_ = std::move(owner);
  file.mapped_ = mapped;
  // The views point into the buffer, not into `file`, so moving it keeps them valid.
  return std::make_shared<const SafetensorsFile>(std::move(file));
}

absl::StatusOr<TensorView> SafetensorsFile::Get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(path_, ": no tensor '", name, "' (file has ", tensors_.size(), " tensors)"));
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// Writer

namespace {

// nlohmann's dump() throws on invalid UTF-8; check each string up front so the error names it.
absl::Status CheckUtf8(const std::string& s, absl::string_view what) {
  try {
    (void)json(s).dump();
  } catch (const json::exception&) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const TensorToWrite& t) {
  RETURN_IF_ERROR(CheckUtf8(t.name, "tensor name"));
  if (t.name == kMetadataKey) {
    return absl::InvalidArgumentError(absl::StrCat("'", kMetadataKey, "' is reserved"));
  }
  auto nbytes = ByteSize(t.shape, t.dtype);
  if (!nbytes.ok()) return absl::InvalidArgumentError(nbytes.status().message());
  if (*nbytes != t.nbytes) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(t.shape), " x ",
                                                   DTypeName(t.dtype), " needs ", *nbytes,
                                                   " bytes, but ", t.nbytes, " were given"));
  }
  if (t.nbytes > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(t.nbytes, " bytes given with a null pointer"));
  }
  return absl::OkStatus();
}

// The header (padded) and the tensors in the order their bytes follow it.
struct Layout {
  std::string header;
  std::vector<const TensorToWrite*> order;
};

absl::StatusOr<Layout> BuildLayout(const std::string& path,
                                   const std::vector<TensorToWrite>& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  std::map<std::string, const TensorToWrite*> by_name;
  for (const TensorToWrite& t : tensors) {
    absl::Status s = CheckTensor(t);
    if (!s.ok()) return TensorError(s.code(), path, t.name, s.message());
    if (!by_name.emplace(t.name, &t).second) {
      return TensorError(absl::StatusCode::kInvalidArgument, path, t.name, "duplicate name");
    }
  }
  // ordered_json: __metadata__ first and fields in the order Python writes them.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) {
      absl::Status s = CheckUtf8(key, "metadata key");
      if (s.ok()) s = CheckUtf8(value, absl::StrCat("metadata value of '", key, "'"));
      if (!s.ok()) return FileError(s.code(), path, s.message());
      md[key] = value;
    }
    header[kMetadataKey] = std::move(md);
  }
  Layout layout;
  uint64_t offset = 0;
  for (const auto& [name, t] : by_name) {
    header[name] = {{"dtype", DTypeName(t->dtype)},
                    {"shape", t->shape},
                    {"data_offsets", {offset, offset + t->nbytes}}};
    offset += t->nbytes;
    layout.order.push_back(t);
  }
  layout.header = header.dump();
  // Pad so the data block starts 8-byte aligned, as Python safetensors does.
  layout.header.append((8 - layout.header.size() % 8) % 8, ' ');
  return layout;
}

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      return absl::ErrnoToStatus(err, absl::StrCat(path, ": write failed"));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

// Removes the temporary file unless the write completed.
class TmpFileGuard {
 public:
  explicit TmpFileGuard(std::string path) : path_(std::move(path)) {}
  TmpFileGuard(const TmpFileGuard&) = delete;
  TmpFileGuard& operator=(const TmpFileGuard&) = delete;
  ~TmpFileGuard() {
    if (!committed_) ::unlink(path_.c_str());
  }
  void Commit() { committed_ = true; }

 private:
  std::string path_;
  bool committed_ = false;
};

absl::Status WriteFile(const std::string& tmp, const Layout& layout) {
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(tmp, ": cannot create"));
  }
  unsigned char prefix[kLengthPrefixBytes];
  uint64_t n = layout.header.size();
  for (unsigned char& b : prefix) {
    b = static_cast<unsigned char>(n & 0xff);
    n >>= 8;
  }
  RETURN_IF_ERROR(WriteAll(fd.get(), prefix, sizeof(prefix), tmp));
  RETURN_IF_ERROR(WriteAll(fd.get(), layout.header.data(), layout.header.size(), tmp));
  for (const TensorToWrite* t : layout.order) {
    RETURN_IF_ERROR(WriteAll(fd.get(), t->data, t->nbytes, tmp));
  }
  if (::fsync(fd.get()) != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(tmp, ": fsync failed"));
  }
  if (fd.Close() != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(tmp, ": close failed"));
  }
  return absl::OkStatus();
}

// Makes the rename durable. Best effort: some file systems refuse fsync on a directory, and the
// file itself is already complete and synced.
void SyncParentDir(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() >= 0) (void)::fsync(fd.get());
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(Layout layout, BuildLayout(path, tensors, metadata));
  const std::string tmp = path + ".tmp";
  TmpFileGuard guard(tmp);
  RETURN_IF_ERROR(WriteFile(tmp, layout));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot rename ", tmp, " into place"));
  }
  guard.Commit();
  SyncParentDir(path);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints: model.safetensors.index.json

namespace {

namespace fs = std::filesystem;

constexpr char kIndexFile[] = "model.safetensors.index.json";

// A name for an error message: JSON-quoted (so control bytes show) and shortened.
std::string QuoteName(const std::string& s) {
  constexpr size_t kShown = 200;
  std::string shown =
      json(s.substr(0, kShown)).dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > kShown ? shown + "..." : shown;
}

// Why `file` may not name a shard, or "" when it may.
std::string BadShardName(const std::string& file) {
  if (file.empty()) return "an empty file name";
  if (file.find('\0') != std::string::npos) return "a NUL byte in the file name";
  if (file[0] == '/') return "an absolute path (shards must be inside the model directory)";
  for (absl::string_view part : absl::StrSplit(file, '/')) {
    if (part == "..") return "a '..' component (shards must be inside the model directory)";
  }
  return "";
}

// `path` with every symbolic link resolved, and whether that worked.
absl::StatusOr<fs::path> Resolved(const fs::path& path) {
  std::error_code ec;
  fs::path real = fs::weakly_canonical(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path.string(), ": ", ec.message()));
  return real;
}

// True when `path` is `dir` or below it (both already resolved).
bool IsInside(const fs::path& path, const fs::path& dir) {
  auto p = path.begin();
  for (auto d = dir.begin(); d != dir.end(); ++d, ++p) {
    if (d->empty()) continue;  // a trailing separator
    if (p == path.end() || *p != *d) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view text,
                                                       const std::string& label) {
  const json root = json::parse(text.begin(), text.end(), /*cb=*/nullptr,
                                /*allow_exceptions=*/false);
  if (root.is_discarded())
    return FileError(absl::StatusCode::kInvalidArgument, label, "not valid JSON");
  if (!root.is_object())
    return FileError(absl::StatusCode::kInvalidArgument, label,
                     absl::StrCat("the index is ", Describe(root), ", expected an object"));
  const auto map = root.find("weight_map");
  if (map == root.end() || !map->is_object())
    return FileError(absl::StatusCode::kInvalidArgument, label,
                     "not a valid index (no weight_map object)");
  SafetensorsIndex index;
  std::set<std::string> shards;
  for (const auto& [tensor, file] : map->items()) {
    const std::string entry = absl::StrCat("weight_map entry ", QuoteName(tensor));
    if (!file.is_string())
      return FileError(absl::StatusCode::kInvalidArgument, label,
                       absl::StrCat(entry, " is ", Describe(file), ", expected a file name"));
    const std::string& name = file.get_ref<const std::string&>();
    const std::string bad = BadShardName(name);
    if (!bad.empty())
      return FileError(absl::StatusCode::kInvalidArgument, label,
                       absl::StrCat(entry, " names shard ", QuoteName(name), ": ", bad));
    index.weight_map.emplace(tensor, name);
    shards.insert(name);
  }
  index.shards.assign(shards.begin(), shards.end());
  return index;
}

absl::StatusOr<std::vector<std::string>> CheckpointFilePaths(const std::string& dir) {
  const std::string index_path = (fs::path(dir) / kIndexFile).string();
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    const std::string single = (fs::path(dir) / "model.safetensors").string();
    if (fs::exists(single, ec)) return std::vector<std::string>{single};
    return absl::NotFoundError(absl::StrCat(dir, ": no model.safetensors or ", kIndexFile));
  }
  ASSIGN_OR_RETURN(const std::string text, ReadFile(index_path));
  ASSIGN_OR_RETURN(const SafetensorsIndex index, ParseSafetensorsIndex(text, index_path));
  ASSIGN_OR_RETURN(const fs::path root, Resolved(dir));
  // A Hugging Face cache snapshot (<repo>/snapshots/<revision>/) holds its shards as links into
  // <repo>/blobs/: that folder is the model's too.
  std::vector<fs::path> allowed = {root};
  if (root.parent_path().filename() == "snapshots")
    allowed.push_back(root.parent_path().parent_path() / "blobs");
  std::vector<std::string> paths;
  for (const std::string& shard : index.shards) {
    const fs::path path = fs::path(dir) / shard;
    ASSIGN_OR_RETURN(const fs::path real, Resolved(path));
    if (std::none_of(allowed.begin(), allowed.end(),
                     [&](const fs::path& a) { return IsInside(real, a); })) {
      // Name one tensor that lives there, so the entry can be found in the index.
      std::string tensor;
      for (const auto& [t, f] : index.weight_map) {
        if (f == shard) {
          tensor = t;
          break;
        }
      }
      return FileError(absl::StatusCode::kInvalidArgument, index_path,
                       absl::StrCat("weight_map entry ", QuoteName(tensor), " names shard ",
                                    QuoteName(shard), ", which resolves to ", real.string(),
                                    ", outside the model directory ", root.string()));
    }
    paths.push_back(path.string());
  }
  return paths;
}

}  // namespace lm
