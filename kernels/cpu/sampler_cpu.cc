// The keyed token draw on the CPU (see sampler_cpu.h). Compiled with -fopenmp (at::parallel_for's
// region is inline here) and -ffp-contract=off (draw_math.h's operations must stay the ones
// written, as on the device).
#include "kernels/cpu/sampler_cpu.h"

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/draw_math.h"

namespace lm {
namespace {

struct RowOut {
  int64_t token = 0;
  float logprob = std::numeric_limits<float>::quiet_NaN();
};

struct RowIn {
  const float* x;
  int64_t vocab;
  uint64_t key, position;
  double temperature;
  int64_t top_k;
  double top_p;
};

// The index of the n-th (1-based) i in [0, V) with pred(i).
template <class Pred>
int64_t NthIndex(int64_t V, uint64_t n, const Pred& pred) {
  uint64_t seen = 0;
  for (int64_t i = 0; i < V; ++i)
    if (pred(i) && ++seen == n) return i;
  return V - 1;  // unreachable when n <= the count
}

// The top-k cut: the k largest logits, the lower index first among equal ones. Four passes of
// an 8-bit histogram of the keys still in the running find the k-th largest key tau; `greater`
// counts the keys above it, so the first k - greater keys equal to tau (in token order) are kept.
draw::Cut TopKCut(const std::vector<uint32_t>& keys, uint64_t k) {
  const int64_t V = static_cast<int64_t>(keys.size());
  uint32_t prefix = 0, mask = 0;
  uint64_t greater = 0, equal = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    std::array<uint64_t, 256> hist{};
    for (uint32_t key : keys)
      if ((key & mask) == prefix) ++hist[(key >> shift) & 0xff];
    int b = 255;
    while (b > 0 && greater + hist[b] < k) greater += hist[b--];
    prefix |= static_cast<uint32_t>(b) << shift;
    mask |= 0xffu << shift;
    equal = hist[b];
  }
  const uint64_t ties = k - greater;
  draw::Cut cut{prefix, V - 1};
  if (ties < equal) cut.last_tie = NthIndex(V, ties, [&](int64_t i) { return keys[i] == prefix; });
  return cut;
}

// The top-p cut within `kept`: in the order most likely first (larger logit, then lower index),
// the shortest prefix whose weight reaches need = ceil(top_p * total): keys above tau hold
// `greater` < need, then the first ceil((need - greater) / q_tau) of the kept keys equal to tau.
draw::Cut TopPCut(const RowIn& in, const std::vector<uint32_t>& keys,
                  const std::vector<uint64_t>& q, const draw::Cut& kept, float max, int S) {
  const int64_t V = in.vocab;
  uint64_t total = 0;
  for (int64_t i = 0; i < V; ++i)
    if (draw::Kept(kept, keys[i], i)) total += q[i];
  const uint64_t need = draw::CeilFraction(in.top_p, total);
  uint32_t prefix = 0, mask = 0;
  uint64_t greater = 0, equal = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    std::array<uint64_t, 256> mass{}, count{};
    for (int64_t i = 0; i < V; ++i) {
      if ((keys[i] & mask) != prefix || !draw::Kept(kept, keys[i], i)) continue;
      mass[(keys[i] >> shift) & 0xff] += q[i];
      ++count[(keys[i] >> shift) & 0xff];
    }
    int b = 255;
    while (b > 0 && greater + mass[b] < need) greater += mass[b--];
    prefix |= static_cast<uint32_t>(b) << shift;
    mask |= 0xffu << shift;
    equal = count[b];
  }
  const double d = draw::Div(draw::Sub(draw::FromOrderKey(prefix), max), in.temperature);
  const uint64_t q_tau = draw::Weight(d, S);  // > 0: the keys at tau hold need - greater > 0
  const uint64_t ties = (need - greater + q_tau - 1) / q_tau;
  draw::Cut cut{prefix, prefix == kept.tau ? kept.last_tie : V - 1};
  if (ties < equal) {
    cut.last_tie = NthIndex(
        V, ties, [&](int64_t i) { return keys[i] == prefix && draw::Kept(kept, keys[i], i); });
  }
  return cut;
}

inline __attribute__((always_inline)) RowOut SampleRow(const RowIn& in) {
  const int64_t V = in.vocab;
  float max = -std::numeric_limits<float>::infinity();
  int64_t argmax = 0;
  bool bad = !(in.temperature >= 0);  // NaN or negative
  for (int64_t i = 0; i < V; ++i) {
    const float v = in.x[i];
    bad = bad || std::isnan(v) || v == std::numeric_limits<float>::infinity();
    if (v > max) max = v, argmax = i;
  }
  RowOut out;
  if (bad || max == -std::numeric_limits<float>::infinity()) return out;  // NaN log-prob
  if (in.temperature == 0) {
    out.token = argmax;
    out.logprob = 0.0f;
    return out;
  }
  const int S = draw::WeightBits(V);
  std::vector<uint64_t> q(V);
  std::vector<uint32_t> keys(V);
  for (int64_t i = 0; i < V; ++i) {
    q[i] = draw::Weight(draw::Div(draw::Sub(in.x[i], max), in.temperature), S);
    keys[i] = draw::OrderKey(in.x[i]);
  }
  draw::Cut cut{0, V - 1};  // everything
  if (in.top_k > 0 && in.top_k < V) cut = TopKCut(keys, static_cast<uint64_t>(in.top_k));
  if (in.top_p > 0 && in.top_p < 1) cut = TopPCut(in, keys, q, cut, max, S);
  uint64_t total = 0;
  for (int64_t i = 0; i < V; ++i)
    if (draw::Kept(cut, keys[i], i)) total += q[i];
  const uint64_t target = draw::Target(draw::Uniform53(in.key, in.position), total);
  uint64_t acc = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!draw::Kept(cut, keys[i], i)) continue;
    acc += q[i];
    if (acc > target) {
      out.token = i;
      break;
    }
  }
  const double d = draw::Div(draw::Sub(in.x[out.token], max), in.temperature);
  const double scale = draw::FromBits(static_cast<uint64_t>(1023 - S) << 52);  // 2^-S
  out.logprob =
      static_cast<float>(draw::Sub(d, draw::Log64(draw::Mul(static_cast<double>(total), scale))));
  return out;
}

// The same code with the FMA instructions inlined where the CPU has them (std::fma is otherwise
// a libm call); both round each fma once, so the bits are the same.
__attribute__((target("avx2,fma"), flatten)) RowOut SampleRowFma(const RowIn& in) {
  return SampleRow(in);
}
__attribute__((flatten)) RowOut SampleRowPlain(const RowIn& in) {
  return SampleRow(in);
}

bool Cpu1d(const torch::Tensor& t, int64_t n, torch::ScalarType dtype) {
  return t.defined() && t.is_cpu() && t.dim() == 1 && t.size(0) == n && t.scalar_type() == dtype;
}

}  // namespace

bool SampleRowsCpu(const torch::Tensor& logits, const torch::Tensor& keys,
                   const torch::Tensor& positions, const torch::Tensor& temperature,
                   const torch::Tensor& top_k, const torch::Tensor& top_p,
                   const torch::Tensor& stop_ids, torch::Tensor* tokens, torch::Tensor* logprobs,
                   torch::Tensor* stopped) {
  if (!logits.defined() || !logits.is_cpu() || logits.dim() != 2 ||
      logits.scalar_type() != torch::kFloat32 || logits.size(1) < 1)
    return false;
  const int64_t B = logits.size(0), V = logits.size(1);
  if (!Cpu1d(keys, B, torch::kInt64) || !Cpu1d(positions, B, torch::kInt64) ||
      !Cpu1d(temperature, B, torch::kFloat64) || !Cpu1d(top_k, B, torch::kInt64) ||
      !Cpu1d(top_p, B, torch::kFloat64) || !stop_ids.defined() || !stop_ids.is_cpu() ||
      stop_ids.dim() != 2 || stop_ids.size(0) != B || stop_ids.scalar_type() != torch::kInt64)
    return false;
  const auto l = logits.contiguous();
  const auto k = keys.contiguous(), p = positions.contiguous(), t = temperature.contiguous();
  const auto kk = top_k.contiguous(), pp = top_p.contiguous(), s = stop_ids.contiguous();
  auto tok = torch::empty({B}, torch::kInt64);
  auto lp = torch::empty({B}, torch::kFloat32);
  auto st = torch::empty({B}, torch::kBool);
  const int64_t S = s.size(1);
  const bool fma = cpu::HasAvx2Fma();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const RowIn in{l.data_ptr<float>() + b * V,
                     V,
                     static_cast<uint64_t>(k.data_ptr<int64_t>()[b]),
                     static_cast<uint64_t>(p.data_ptr<int64_t>()[b]),
                     t.data_ptr<double>()[b],
                     kk.data_ptr<int64_t>()[b],
                     pp.data_ptr<double>()[b]};
      const RowOut out = fma ? SampleRowFma(in) : SampleRowPlain(in);
      tok.data_ptr<int64_t>()[b] = out.token;
      lp.data_ptr<float>()[b] = out.logprob;
      bool stop = false;
      if (!std::isnan(out.logprob)) {
        const int64_t* ids = s.data_ptr<int64_t>() + b * S;
        for (int64_t j = 0; j < S; ++j) stop = stop || ids[j] == out.token;
      }
      st.data_ptr<bool>()[b] = stop;
    }
  });
  *tokens = tok;
  *logprobs = lp;
  *stopped = st;
  return true;
}

}  // namespace lm
