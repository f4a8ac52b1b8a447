#include "rpc/weight_wire.h"

#include <algorithm>
#include <cstring>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "rpc/tensor_codec.h"

namespace opd::rpc {
namespace {

constexpr uint64_t kP1 = 11400714785074694791ULL;
constexpr uint64_t kP2 = 14029467366897019727ULL;
constexpr uint64_t kP3 = 1609587929392839161ULL;
constexpr uint64_t kP4 = 9650029242287828579ULL;
constexpr uint64_t kP5 = 2870177450012600261ULL;

inline uint64_t Rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
inline uint64_t Read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian hosts only (x86-64, aarch64)
}
inline uint32_t Read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t Round(uint64_t acc, uint64_t lane) {
  acc += lane * kP2;
  acc = Rotl(acc, 31);
  return acc * kP1;
}
inline uint64_t Merge(uint64_t acc, uint64_t v) {
  acc ^= Round(0, v);
  return acc * kP1 + kP4;
}

bool IsDirect(const OutgoingTensor& t) {
  return t.source.device().is_cpu() && t.source.scalar_type() == TorchDtype(t.dtype) &&
         t.source.is_contiguous();
}

}  // namespace

Xxh64::Xxh64() : v_{kP1 + kP2, kP2, 0, 0ULL - kP1} {}

void Xxh64::Update(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (buffered_ + n < 32) {
    if (n > 0) std::memcpy(buf_ + buffered_, p, n);
    buffered_ += n;
    return;
  }
  if (buffered_ > 0) {
    const size_t fill = 32 - buffered_;
    std::memcpy(buf_ + buffered_, p, fill);
    for (int i = 0; i < 4; ++i) v_[i] = Round(v_[i], Read64(buf_ + 8 * i));
    p += fill;
    n -= fill;
    buffered_ = 0;
  }
  uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
  for (; n >= 32; p += 32, n -= 32) {
    v0 = Round(v0, Read64(p));
    v1 = Round(v1, Read64(p + 8));
    v2 = Round(v2, Read64(p + 16));
    v3 = Round(v3, Read64(p + 24));
  }
  v_[0] = v0, v_[1] = v1, v_[2] = v2, v_[3] = v3;
  if (n > 0) std::memcpy(buf_, p, n);
  buffered_ = n;
}

uint64_t Xxh64::Digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = Rotl(v_[0], 1) + Rotl(v_[1], 7) + Rotl(v_[2], 12) + Rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = Merge(h, v_[i]);
  } else {
    h = v_[2] + kP5;
  }
  h += total_;
  const unsigned char* p = buf_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = Rotl(h ^ Round(0, Read64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    h = Rotl(h ^ (static_cast<uint64_t>(Read32(p)) * kP1), 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = Rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t Xxh64::Of(const void* data, size_t n) {
  Xxh64 x;
  x.Update(data, n);
  return x.Digest();
}

std::vector<OutgoingTensor> OutgoingTensorsOf(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, WireDtype dtype) {
  std::vector<OutgoingTensor> out;
  out.reserve(params.size());
  const int64_t es = WireDtypeSize(dtype);
  for (const auto& [name, t] : params) {
    OutgoingTensor w;
    w.name = name;
    w.shape = t.sizes().vec();
    w.dtype = dtype;
    w.bytes = t.numel() * es;
    w.source = t.detach();
    out.push_back(std::move(w));
  }
  return out;
}

absl::Status PackBuckets(const std::vector<OutgoingTensor>& tensors,
                         const std::vector<size_t>& which, torch::Tensor& bucket,
                         const BucketFn& on_bucket) {
  const int64_t capacity = bucket.numel();
  std::vector<BucketSegment> segments;
  int64_t used = 0;
  auto flush = [&]() -> absl::Status {
    absl::Status st = on_bucket(used, segments);
    segments.clear();
    used = 0;
    return st;
  };
  for (size_t idx : which) {
    const OutgoingTensor& t = tensors[idx];
    const int64_t es = WireDtypeSize(t.dtype);
    torch::Tensor flat = t.source.reshape({-1});
    if (t.bytes == 0) segments.push_back({idx, 0, 0, used});
    for (int64_t off = 0; off < t.bytes;) {
      if (used == capacity) {
        if (absl::Status st = flush(); !st.ok()) return st;
      }
      const int64_t n = std::min(t.bytes - off, (capacity - used) / es * es);
      torch::Tensor dst = bucket.narrow(0, used, n).view(TorchDtype(t.dtype));
      dst.copy_(flat.narrow(0, off / es, n / es));
      segments.push_back({idx, off, n, used});
      used += n;
      off += n;
    }
  }
  if (used > 0 || !segments.empty()) return flush();
  return absl::OkStatus();
}

void ComputeChecksums(std::vector<OutgoingTensor>* tensors, torch::Tensor& staging) {
  torch::NoGradGuard no_grad;
  // Tensors already in their wire form are hashed where they lie, several at once.
  std::vector<size_t> direct, cast;
  for (size_t i = 0; i < tensors->size(); ++i)
    (IsDirect((*tensors)[i]) ? direct : cast).push_back(i);
  at::parallel_for(0, static_cast<int64_t>(direct.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      OutgoingTensor& t = (*tensors)[direct[i]];
      t.checksum = Xxh64::Of(t.source.data_ptr(), static_cast<size_t>(t.bytes));
    }
  });
  for (size_t i : cast) {
    OutgoingTensor& t = (*tensors)[i];
    Xxh64 h;
    PackBuckets(*tensors, {i}, staging, [&](int64_t n, const std::vector<BucketSegment>&) {
      h.Update(staging.data_ptr(), static_cast<size_t>(n));
      return absl::OkStatus();
    }).IgnoreError();
    t.checksum = h.Digest();
  }
}

std::vector<int64_t> SenderShares(int64_t total, int senders) {
  std::vector<int64_t> out(static_cast<size_t>(std::max(senders, 1)));
  int64_t begin = 0;
  for (size_t r = 0; r < out.size(); ++r) {
    const int64_t end = r + 1 == out.size() ? total
                                            : total / static_cast<int64_t>(out.size()) *
                                                  static_cast<int64_t>(r + 1) / 8 * 8;
    out[r] = std::max<int64_t>(end - begin, 0);
    begin += out[r];
  }
  return out;
}

absl::Status PackRange(const std::vector<OutgoingTensor>& tensors, int64_t begin, int64_t end,
                       torch::Tensor& bucket,
                       const std::function<absl::Status(int64_t)>& on_bucket) {
  torch::NoGradGuard no_grad;
  const int64_t capacity = bucket.numel();
  int64_t used = 0, start = 0;  // start: the stream offset of tensor i
  auto misaligned = [&](const OutgoingTensor& t, int64_t at) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': byte ", at,
                                                   " of the push is not on one of its elements"));
  };
  for (const OutgoingTensor& t : tensors) {
    const int64_t lo = std::max(begin, start), hi = std::min(end, start + t.bytes);
    const int64_t es = WireDtypeSize(t.dtype);
    if (lo < hi) {
      if ((lo - start) % es != 0) return misaligned(t, lo);
      if ((hi - start) % es != 0) return misaligned(t, hi);
      torch::Tensor flat = t.source.reshape({-1});
      for (int64_t off = lo - start; off < hi - start;) {
        const int64_t n = std::min(hi - start - off, capacity - used);
        if (n % es != 0 || used % es != 0) return misaligned(t, start + off + n);
        bucket.narrow(0, used, n).view(TorchDtype(t.dtype)).copy_(flat.narrow(0, off / es, n / es));
        used += n;
        off += n;
        if (used == capacity || start + off == end) {
          RETURN_IF_ERROR(on_bucket(used));
          used = 0;
        }
      }
    }
    start += t.bytes;
  }
  if (used > 0) return on_bucket(used);
  return absl::OkStatus();
}

void EncodeVerdict(const SyncVerdict& v, uint8_t* out) {
  std::memset(out, 0, kVerdictBytes);
  uint8_t* p = out;
  auto put = [&p](const void* x, size_t n) {
    std::memcpy(p, x, n);
    p += n;
  };
  const uint8_t present = v.present ? 1 : 0;
  put(&present, 1);
  put(&v.code, 4);
  put(&v.version, 8);
  put(&v.tensors, 8);
  put(&v.bytes, 8);
  const uint16_t len = static_cast<uint16_t>(
      std::min<size_t>(v.message.size(), kVerdictBytes - static_cast<size_t>(p - out) - 2));
  put(&len, 2);
  put(v.message.data(), len);
}

SyncVerdict DecodeVerdict(const uint8_t* in) {
  SyncVerdict v;
  const uint8_t* p = in;
  auto get = [&p](void* x, size_t n) {
    std::memcpy(x, p, n);
    p += n;
  };
  uint8_t present = 0;
  get(&present, 1);
  v.present = present == 1;
  get(&v.code, 4);
  get(&v.version, 8);
  get(&v.tensors, 8);
  get(&v.bytes, 8);
  uint16_t len = 0;
  get(&len, 2);
  len = static_cast<uint16_t>(
      std::min<size_t>(len, kVerdictBytes - static_cast<size_t>(p - in)));  // a bad record
  v.message.assign(reinterpret_cast<const char*>(p), len);
  return v;
}

}  // namespace opd::rpc
