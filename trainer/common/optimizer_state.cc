#include "trainer/common/optimizer_state.h"

#include <algorithm>
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

// Copies [begin, end) of the flat space from pieces that each cover [piece_begin, piece_end).
struct Piece {
  int64_t begin, end;
  const float* data;
};
absl::Status CopyRange(const std::vector<Piece>& pieces, int64_t begin, int64_t end, float* out,
                       const std::string& what) {
  int64_t covered = 0;
  for (const Piece& p : pieces) {
    const int64_t b = std::max(begin, p.begin), e = std::min(end, p.end);
    if (b >= e) continue;
    std::memcpy(out + (b - begin), p.data + (b - p.begin), static_cast<size_t>(e - b) * 4);
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
    ASSIGN_OR_RETURN(r->file_, lm::SafetensorsFile::Open(path));
    for (const char* m : kOptimizerMoments) {
      for (const auto& e : layout.entries) {
        ASSIGN_OR_RETURN(const float* data,
                         F32Data(*r->file_, absl::StrCat(m, ".", e.name), e.numel));
        r->pieces_[m].push_back({e.offset, e.offset + e.numel, data});
      }
    }
    return std::unique_ptr<OptimizerStateReader>(std::move(r));
  }
  absl::Status Read(const std::string& which, int64_t begin, int64_t end,
                    float* out) const override {
    return CopyRange(pieces_.at(which), begin, end, out, file_->path());
  }

 private:
  std::shared_ptr<const lm::SafetensorsFile> file_;
  std::map<std::string, std::vector<Piece>> pieces_;
};

// optimizer-RRRRR-of-NNNNN.safetensors: flat ranges (N ranks wrote them).
class ShardReader : public OptimizerStateReader {
 public:
  static absl::StatusOr<std::unique_ptr<OptimizerStateReader>> Open(const std::string& dir,
                                                                    int world,
                                                                    const FlatLayout& layout) {
    auto r = std::unique_ptr<ShardReader>(new ShardReader());
    const std::string want_layout = layout.ToJson().dump();
    for (int rank = 0; rank < world; ++rank) {
      const std::string path = dir + "/" + OptimizerShardFileName(rank, world);
      ASSIGN_OR_RETURN(auto file, lm::SafetensorsFile::Open(path));
      const auto& meta = file->metadata();
      auto field = [&](const char* key) -> std::string {
        auto it = meta.find(key);
        return it == meta.end() ? std::string() : it->second;
      };
      int64_t begin = 0, end = 0, total = 0;
      if (field("format") != kOptimizerShardFormat || !absl::SimpleAtoi(field("begin"), &begin) ||
          !absl::SimpleAtoi(field("end"), &end) || !absl::SimpleAtoi(field("total"), &total))
        return absl::DataLossError(
            absl::StrCat(path, ": not an ", kOptimizerShardFormat, " shard"));
      if (total != layout.total || field("layout") != want_layout)
        return absl::FailedPreconditionError(absl::StrCat(path, ": written for other parameters (",
                                                          total, " elements; this model has ",
                                                          layout.total, ") or in another order"));
      const Shard expect = Shard::Of(total, world, rank);
      if (begin != expect.begin || end != expect.end)
        return absl::DataLossError(absl::StrCat(path, ": covers [", begin, ", ", end,
                                                "), expected [", expect.begin, ", ", expect.end,
                                                ")"));
      for (const char* m : kOptimizerMoments) {
        ASSIGN_OR_RETURN(const float* data, F32Data(*file, m, end - begin));
        r->pieces_[m].push_back({begin, end, data});
      }
      r->files_.push_back(std::move(file));
    }
    r->dir_ = dir;
    return std::unique_ptr<OptimizerStateReader>(std::move(r));
  }
  absl::Status Read(const std::string& which, int64_t begin, int64_t end,
                    float* out) const override {
    return CopyRange(pieces_.at(which), begin, end, out, dir_ + "/optimizer-*");
  }

 private:
  std::string dir_;
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

FlatLayout FlatLayout::Of(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  FlatLayout l;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    l.entries.push_back(
        {it->first, l.total, it->second.numel(), UsesWeightDecay(it->first, it->second)});
    l.total += it->second.numel();
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
