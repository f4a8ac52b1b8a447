#include "trainer/common/optimizer_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/io/safetensors.h"
#include "lm/util/status.h"
#include "trainer/common/optim.h"

namespace trainer {

std::string OptimizerShardFileName(int rank, int world) {
  return absl::StrFormat("optimizer-%05d-of-%05d.safetensors", rank, world);
}

namespace {

namespace fs = std::filesystem;

// A stored run of one moment: flat [begin, end) is element `first` on of tensor `tensor` in
// `file`.
struct Piece {
  int64_t begin, end;
  const float* data;
  const std::string* file;
  std::string tensor;
  int64_t first = 0;
};

// The parameter holding flat element `x`, and x's index in it.
std::string ElementName(const FlatLayout& layout, int64_t x) {
  for (const auto& e : layout.entries)
    if (x >= e.offset && x < e.offset + e.numel)
      return absl::StrCat("parameter ", e.name, " element ", x - e.offset);
  return absl::StrCat("flat element ", x);
}

// AdamW's moments are finite, and its second moment (an average of squares) is not negative.
absl::Status CheckMoment(const std::string& which, const float* v, int64_t n, const Piece& p,
                         int64_t begin, const FlatLayout& layout) {
  const bool second = which == kOptimizerMoments[1];
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    if (std::isfinite(x) && !(second && x < 0)) continue;
    const int64_t flat = begin + i;
    return absl::DataLossError(absl::StrFormat(
        "%s: tensor %s holds %g at element %d (%s): %s; this optimizer state cannot be resumed",
        *p.file, p.tensor, x, p.first + (flat - p.begin), ElementName(layout, flat),
        std::isfinite(x) ? "a second moment is a mean of squares and cannot be negative"
                         : "AdamW's moments are finite"));
  }
  return absl::OkStatus();
}

// Copies [begin, end) of the flat space from pieces that each cover [piece_begin, piece_end),
// checking what it copies.
absl::Status CopyRange(const std::vector<Piece>& pieces, const std::string& which, int64_t begin,
                       int64_t end, float* out, const std::string& what, const FlatLayout& layout) {
  int64_t covered = 0;
  for (const Piece& p : pieces) {
    const int64_t b = std::max(begin, p.begin), e = std::min(end, p.end);
    if (b >= e) continue;
    float* dst = out + (b - begin);
    std::memcpy(dst, p.data + (b - p.begin), static_cast<size_t>(e - b) * 4);
    RETURN_IF_ERROR(CheckMoment(which, dst, e - b, p, b, layout));
    covered += e - b;
  }
  if (covered != end - begin)
    return absl::DataLossError(absl::StrCat(what, ": the stored state covers ", covered, " of the ",
                                            end - begin, " elements of [", begin, ", ", end, ")"));
  return absl::OkStatus();
}

absl::StatusOr<const float*> F32Data(const lm::SafetensorsFile& f, const std::string& name,
                                     int64_t numel) {
  ASSIGN_OR_RETURN(lm::TensorView v, f.Get(name));
  if (v.dtype != lm::DType::kF32 || v.numel() != numel)
    return absl::DataLossError(absl::StrCat(f.path(), ": ", name, " is ", lm::DTypeName(v.dtype),
                                            " with ", v.numel(), " elements, expected F32 with ",
                                            numel));
  return reinterpret_cast<const float*>(v.data);
}

// optimizer.safetensors: the moments by parameter name (one rank wrote it).
class NamedReader : public OptimizerStateReader {
 public:
  static absl::StatusOr<std::unique_ptr<OptimizerStateReader>> Open(const std::string& path,
                                                                    const FlatLayout& layout) {
    auto r = std::unique_ptr<NamedReader>(new NamedReader());
    r->layout_ = layout;
    ASSIGN_OR_RETURN(r->file_, lm::SafetensorsFile::Open(path));
    for (const char* m : kOptimizerMoments) {
      for (const auto& e : layout.entries) {
        const std::string name = absl::StrCat(m, ".", e.name);
        ASSIGN_OR_RETURN(const float* data, F32Data(*r->file_, name, e.numel));
        r->pieces_[m].push_back({e.offset, e.offset + e.numel, data, &r->file_->path(), name});
      }
    }
    return std::unique_ptr<OptimizerStateReader>(std::move(r));
  }
  absl::Status Read(const std::string& which, int64_t begin, int64_t end,
                    float* out) const override {
    return CopyRange(pieces_.at(which), which, begin, end, out, file_->path(), layout_);
  }

 private:
  FlatLayout layout_;
  std::shared_ptr<const lm::SafetensorsFile> file_;
  std::map<std::string, std::vector<Piece>> pieces_;
};

// The flat ranges a shard file holds: "ranges" ([[begin, end], ...]), or the older format's one
// [begin, end), which must be that rank's chunk.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ShardRanges(
    const std::string& path, const std::map<std::string, std::string>& meta, int world, int rank,
    int64_t total) {
  auto field = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    return it == meta.end() ? std::string() : it->second;
  };
  const std::string format = field("format");
  if (format == kOptimizerContiguousShardFormat) {
    int64_t begin = 0, end = 0;
    if (!absl::SimpleAtoi(field("begin"), &begin) || !absl::SimpleAtoi(field("end"), &end))
      return absl::DataLossError(absl::StrCat(path, ": no begin/end"));
    const Shard expect = Shard::Of(total, world, rank);
    if (begin != expect.begin || end != expect.end)
      return absl::DataLossError(absl::StrCat(path, ": covers [", begin, ", ", end, "), expected [",
                                              expect.begin, ", ", expect.end, ")"));
    return std::vector<std::pair<int64_t, int64_t>>{{begin, end}};
  }
  if (format != kOptimizerShardFormat)
    return absl::DataLossError(absl::StrCat(path, ": not an ", kOptimizerShardFormat, " shard"));
  const nlohmann::json j = nlohmann::json::parse(field("ranges"), nullptr, false);
  std::vector<std::pair<int64_t, int64_t>> out;
  if (j.is_array()) {
    for (const auto& r : j) {
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !r[1].is_number_integer())
        break;
      out.emplace_back(r[0].get<int64_t>(), r[1].get<int64_t>());
      if (out.back().first < 0 || out.back().first >= out.back().second ||
          out.back().second > total)
        return absl::DataLossError(absl::StrCat(path, ": range [", out.back().first, ", ",
                                                out.back().second, ") is not inside [0, ", total,
                                                ")"));
    }
  }
  if (!j.is_array() || out.size() != j.size())
    return absl::DataLossError(absl::StrCat(path, ": \"ranges\" is not a list of [begin, end]"));
  return out;
}

// The same parameters (names and sizes), whatever their order.
bool SameParameters(const FlatLayout& a, const FlatLayout& b) {
  if (a.entries.size() != b.entries.size()) return false;
  std::map<std::string, int64_t> sizes;
  for (const auto& e : a.entries) sizes[e.name] = e.numel;
  for (const auto& e : b.entries) {
    auto it = sizes.find(e.name);
    if (it == sizes.end() || it->second != e.numel) return false;
  }
  return true;
}

// optimizer-RRRRR-of-NNNNN.safetensors: flat ranges (N ranks wrote them) of the flat space the
// files' "layout" describes, which may order the parameters otherwise than this model's: a read
// is translated parameter by parameter.
class ShardReader : public OptimizerStateReader {
 public:
  static absl::StatusOr<std::unique_ptr<OptimizerStateReader>> Open(const std::string& dir,
                                                                    int world,
                                                                    const FlatLayout& layout) {
    auto r = std::unique_ptr<ShardReader>(new ShardReader());
    r->layout_ = layout;
    r->paths_.reserve(static_cast<size_t>(world));  // the pieces point at these strings
    std::string file_layout;  // as the first shard has it; every shard must agree
    for (int rank = 0; rank < world; ++rank) {
      const std::string& path =
          r->paths_.emplace_back(dir + "/" + OptimizerShardFileName(rank, world));
      ASSIGN_OR_RETURN(auto file, lm::SafetensorsFile::Open(path));
      const auto& meta = file->metadata();
      auto it = meta.find("total");
      int64_t total = 0;
      if (it == meta.end() || !absl::SimpleAtoi(it->second, &total))
        return absl::DataLossError(
            absl::StrCat(path, ": not an ", kOptimizerShardFormat, " shard"));
      it = meta.find("layout");
      if (it == meta.end()) return absl::DataLossError(absl::StrCat(path, ": no layout"));
      if (rank == 0) {
        file_layout = it->second;
        absl::StatusOr<FlatLayout> parsed = FlatLayout::FromJson(file_layout);
        if (!parsed.ok())
          return absl::DataLossError(absl::StrCat(path, ": ", parsed.status().message()));
        r->file_layout_ = *parsed;
        for (const auto& e : r->file_layout_.entries) r->file_offset_[e.name] = e.offset;
      } else if (it->second != file_layout) {
        return absl::DataLossError(absl::StrCat(path, ": its layout differs from ", r->paths_[0],
                                                "'s (shards of two runs?)"));
      }
      if (total != r->file_layout_.total || !SameParameters(r->file_layout_, layout))
        return absl::FailedPreconditionError(absl::StrCat(path, ": written for other parameters (",
                                                          total, " elements; this model has ",
                                                          layout.total, ", or other names)"));
      ASSIGN_OR_RETURN(auto ranges, ShardRanges(path, meta, world, rank, total));
      int64_t n = 0;
      for (const auto& [b, e] : ranges) n += e - b;
      for (const char* m : kOptimizerMoments) {
        ASSIGN_OR_RETURN(const float* data, F32Data(*file, m, n));
        int64_t at = 0;
        for (const auto& [b, e] : ranges) {
          r->pieces_[m].push_back({b, e, data + at, &path, m, at});
          at += e - b;
        }
      }
      r->files_.push_back(std::move(file));
    }
    RETURN_IF_ERROR(r->CheckCoverage(dir));
    r->dir_ = dir;
    return std::unique_ptr<OptimizerStateReader>(std::move(r));
  }
  absl::Status Read(const std::string& which, int64_t begin, int64_t end,
                    float* out) const override {
    for (const auto& e : layout_.entries) {
      const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
      if (lo >= hi) continue;
      const int64_t from = file_offset_.at(e.name) + (lo - e.offset);
      RETURN_IF_ERROR(CopyRange(pieces_.at(which), which, from, from + (hi - lo),
                                out + (lo - begin), dir_ + "/optimizer-*", file_layout_));
    }
    return absl::OkStatus();
  }

 private:
  // The files' ranges together cover [0, total) once.
  absl::Status CheckCoverage(const std::string& dir) const {
    std::vector<Piece> sorted = pieces_.at(kOptimizerMoments[0]);
    std::sort(sorted.begin(), sorted.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (const Piece& p : sorted) {
      if (p.begin != next)
        return absl::DataLossError(absl::StrCat(
            dir, "/optimizer-*: ", p.begin < next ? "two shards both hold" : "no shard holds",
            " flat elements from ", std::min(p.begin, next), " (", *p.file, ")"));
      next = p.end;
    }
    if (next != file_layout_.total)
      return absl::DataLossError(absl::StrCat(dir, "/optimizer-*: the shards end at element ", next,
                                              " of ", file_layout_.total));
    return absl::OkStatus();
  }

  FlatLayout layout_, file_layout_;  // this model's flat space, the files'
  std::map<std::string, int64_t> file_offset_;
  std::string dir_;
  std::vector<std::string> paths_;
  std::vector<std::shared_ptr<const lm::SafetensorsFile>> files_;
  std::map<std::string, std::vector<Piece>> pieces_;
};

// The world size of the optimizer shards in `dir` (0: none).
absl::StatusOr<int> ShardWorld(const std::string& dir) {
  static const std::regex re("optimizer-([0-9]{5})-of-([0-9]{5})\\.safetensors");
  int world = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, re)) continue;
    const int w = std::stoi(m[2].str());
    if (world != 0 && w != world)
      return absl::DataLossError(
          absl::StrCat(dir, ": optimizer shards of two world sizes (", world, " and ", w, ")"));
    world = w;
  }
  return world;
}

}  // namespace

FlatLayout FlatLayout::Of(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                          const std::vector<std::string>& order) {
  FlatLayout l;
  std::map<std::string, const torch::Tensor*> left;
  for (const auto& [name, t] : params) left[name] = &t;
  auto add = [&](const std::string& name) {
    auto it = left.find(name);
    if (it == left.end()) return;  // not a parameter, or placed already
    l.entries.push_back({name, l.total, it->second->numel(), UsesWeightDecay(name, *it->second)});
    l.total += it->second->numel();
    left.erase(it);
  };
  for (const std::string& name : order) add(name);
  for (auto it = params.rbegin(); it != params.rend(); ++it) add(it->first);
  return l;
}

absl::StatusOr<FlatLayout> FlatLayout::FromJson(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  FlatLayout l;
  if (!j.is_array()) return absl::DataLossError("the layout is not a list of [name, size]");
  for (const auto& e : j) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_number_integer() ||
        e[1].get<int64_t>() < 0)
      return absl::DataLossError("the layout is not a list of [name, size]");
    l.entries.push_back({e[0].get<std::string>(), l.total, e[1].get<int64_t>(), false});
    l.total += l.entries.back().numel;
  }
  return l;
}

nlohmann::json FlatLayout::ToJson() const {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& e : entries) j.push_back({e.name, e.numel});
  return j;
}

Shard Shard::Of(int64_t total, int world, int rank) {
  Shard s;
  s.chunk = (total + world - 1) / world;
  s.begin = std::min(total, s.chunk * rank);
  s.end = std::min(total, s.begin + s.chunk);
  return s;
}

BucketSharding BucketSharding::Of(int64_t total, int64_t bucket_elements, int world, int rank) {
  BucketSharding s;
  s.world = world;
  s.rank = rank;
  s.total = total;
  const int64_t w = world;
  const int64_t length = (std::max<int64_t>(bucket_elements, 1) + w - 1) / w * w;
  for (int64_t begin = 0; begin < total; begin += length) {
    Bucket b;
    b.begin = begin;
    b.end = std::min(total, begin + length);
    b.piece = (b.end - b.begin + w - 1) / w;
    b.slice_begin = s.slice;
    b.own_begin = std::min(b.end, b.begin + rank * b.piece);
    b.own_end = std::min(b.end, b.own_begin + b.piece);
    s.slice += b.piece;
    s.padded_total = b.begin + b.piece * w;
    s.buckets.push_back(b);
  }
  return s;
}

std::pair<size_t, size_t> BucketSharding::BucketsOf(int64_t begin, int64_t end) const {
  if (buckets.empty() || end <= begin) return {0, 0};
  const int64_t length = buckets.front().end - buckets.front().begin;
  return {static_cast<size_t>(begin / length), static_cast<size_t>((end - 1) / length)};
}

std::vector<std::pair<int64_t, int64_t>> BucketSharding::OwnedRanges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Bucket& b : buckets)
    if (b.own_begin < b.own_end) out.emplace_back(b.own_begin, b.own_end);
  return out;
}

absl::StatusOr<std::unique_ptr<OptimizerStateReader>> OptimizerStateReader::Open(
    const std::string& dir, const FlatLayout& layout) {
  ASSIGN_OR_RETURN(const int world, ShardWorld(dir));
  if (world > 0) return ShardReader::Open(dir, world, layout);
  if (!fs::exists(fs::path(dir) / kOptimizerNamedFile))
    return absl::NotFoundError(
        absl::StrCat(dir, ": no optimizer state (", kOptimizerNamedFile, " or optimizer-*-of-*)"));
  return NamedReader::Open(dir + "/" + kOptimizerNamedFile, layout);
}

}  // namespace trainer
