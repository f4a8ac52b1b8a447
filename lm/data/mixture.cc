#include "lm/data/mixture.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "lm/util/splitmix.h"
#include "nlohmann/json.hpp"

namespace lm {
namespace {

// The streams below are pure functions of their inputs (lm/util/splitmix.h's MixSeed). The
// second value is spread by an odd constant first: that is how these streams were defined when
// checkpoints first recorded a data cursor, and a resume must replay the same draws and order.
constexpr uint64_t kSpread = 0xD6E8FEB86659FD93ULL;

uint64_t Mix(uint64_t a, uint64_t b) {
  return MixSeed(a, b * kSpread);
}

double UnitInterval(uint64_t bits) {
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// A uniform integer in [0, n) from 64 random bits (multiply-shift; the bias is < n / 2^64).
uint64_t Below(uint64_t bits, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(bits) * n) >> 64);
}

constexpr uint64_t kSourceStream = 0x736F75726365ULL;   // "source"
constexpr uint64_t kShuffleStream = 0x73687566666CULL;  // "shuffl"

}  // namespace

std::string DataCursor::ToJson() const {
  return nlohmann::json{{"step", step}, {"consumed", consumed}}.dump();
}

absl::StatusOr<DataCursor> DataCursor::FromJson(std::string_view text) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    DataCursor c;
    c.step = j.at("step").get<uint64_t>();
    c.consumed = j.at("consumed").get<std::vector<uint64_t>>();
    return c;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad data cursor: ", e.what()));
  }
}

absl::StatusOr<MixtureSampler> MixtureSampler::Create(std::vector<size_t> sizes,
                                                      std::vector<double> weights, uint64_t seed,
                                                      bool shuffle) {
  if (sizes.empty() || sizes.size() != weights.size())
    return absl::InvalidArgumentError("mixture: need one weight per source");
  double total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0 || sizes[i] > std::numeric_limits<uint32_t>::max())
      return absl::InvalidArgumentError(
          absl::StrCat("mixture: source ", i, " has ", sizes[i], " items"));
    if (!(weights[i] > 0) || !std::isfinite(weights[i]))
      return absl::InvalidArgumentError(absl::StrCat("mixture: bad weight ", weights[i]));
    total += weights[i];
  }
  MixtureSampler m;
  m.sizes_ = std::move(sizes);
  double sum = 0;
  for (double w : weights) m.cumulative_.push_back((sum += w) / total);
  m.cumulative_.back() = 1.0;
  m.seed_ = seed;
  m.shuffle_ = shuffle;
  m.cursor_.consumed.assign(m.sizes_.size(), 0);
  m.perm_.resize(m.sizes_.size());
  m.perm_epoch_.assign(m.sizes_.size(), std::numeric_limits<uint64_t>::max());
  return m;
}

size_t MixtureSampler::PickSource(uint64_t step) const {
  if (sizes_.size() == 1) return 0;
  const double u = UnitInterval(Mix(Mix(seed_, kSourceStream), step));
  const auto it = std::upper_bound(cumulative_.begin(), cumulative_.end(), u);
  return std::min<size_t>(it - cumulative_.begin(), sizes_.size() - 1);
}

size_t MixtureSampler::IndexIn(size_t source, uint64_t k) const {
  const uint64_t n = sizes_[source];
  if (!shuffle_) return static_cast<size_t>(k % n);
  const uint64_t epoch = k / n;
  if (perm_epoch_[source] != epoch) {
    // Fisher-Yates driven by a counter-based stream for (seed, source, epoch).
    std::vector<uint32_t>& p = perm_[source];
    p.resize(n);
    std::iota(p.begin(), p.end(), 0u);
    const uint64_t key = Mix(Mix(Mix(seed_, kShuffleStream), source), epoch);
    for (uint64_t i = n - 1; i > 0; --i) std::swap(p[i], p[Below(Mix(key, i), i + 1)]);
    perm_epoch_[source] = epoch;
  }
  return perm_[source][k % n];
}

MixtureSampler::Draw MixtureSampler::Peek() const {
  const size_t source = PickSource(cursor_.step);
  return {source, IndexIn(source, cursor_.consumed[source])};
}

MixtureSampler::Draw MixtureSampler::Next() {
  const Draw d = Peek();
  ++cursor_.step;
  ++cursor_.consumed[d.source];
  return d;
}

absl::Status MixtureSampler::Seek(const DataCursor& cursor) {
  if (cursor.consumed.size() != sizes_.size())
    return absl::InvalidArgumentError(absl::StrCat("data cursor has ", cursor.consumed.size(),
                                                   " sources; this stream has ", sizes_.size()));
  const uint64_t drawn =
      std::accumulate(cursor.consumed.begin(), cursor.consumed.end(), uint64_t{0});
  if (drawn != cursor.step)
    return absl::InvalidArgumentError("data cursor is inconsistent (step != sum of consumed)");
  cursor_ = cursor;
  return absl::OkStatus();
}

}  // namespace lm
