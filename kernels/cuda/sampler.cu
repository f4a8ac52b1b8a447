// The keyed token draw (see sampler.cuh for the algorithm; kernels/cpu/sampler_cpu.cc is the
// same steps run serially, and the CPU reference the tests hold this to bit for bit).
#include "kernels/cuda/sampler.cuh"

#include <cmath>

#include "kernels/cpu/draw_math.h"

namespace kernels {
namespace {

constexpr int kThreads = kSampleThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 8;  // consecutive tokens per thread in a token-order scan
constexpr int kTile = kThreads * kItems;
constexpr unsigned kFullMask = 0xffffffffu;

using u64 = unsigned long long;

struct Shared {
  u64 hist[256];
  u64 count[256];
  u64 warp[kWarps];
  float warp_max[kWarps];
  int64_t warp_arg[kWarps];
  int64_t found;
  u64 greater, equal;
  uint32_t bin;
  int bad;
};

// The block's sum of v (every thread gets it). Integers: exact in any order.
__device__ u64 BlockSum(u64 v, Shared& s) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // s.warp may still be read by a previous call
  if (lane == 0) s.warp[warp] = v;
  __syncthreads();
  u64 total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.warp[w];
  return total;
}

// The exclusive prefix of v over the threads in order, and the block's total.
__device__ u64 BlockExclusiveScan(u64 v, u64* total, Shared& s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  u64 inc = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const u64 up = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += up;
  }
  __syncthreads();
  if (lane == 31) s.warp[warp] = inc;
  __syncthreads();
  u64 before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += s.warp[w];
    all += s.warp[w];
  }
  *total = all;
  return before + inc - v;
}

// The first index i < V whose inclusive prefix of value(i) (in token order) exceeds `threshold`
// (V - 1 when none does, which callers rule out). Tiles of kTile tokens, kItems consecutive
// ones per thread.
template <class Value>
__device__ int64_t FindFirst(int64_t V, u64 threshold, const Value& value, Shared& s) {
  u64 running = 0;
  __syncthreads();  // s.found may still be read by a previous call
  if (threadIdx.x == 0) s.found = V - 1;
  for (int64_t t0 = 0; t0 < V; t0 += kTile) {
    const int64_t first = t0 + static_cast<int64_t>(threadIdx.x) * kItems;
    u64 v[kItems];
    u64 mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      v[j] = first + j < V ? value(first + j) : 0;
      mine += v[j];
    }
    u64 total;
    const u64 before = BlockExclusiveScan(mine, &total, s);
    if (running + total > threshold) {  // uniform: every thread has the same running and total
      u64 acc = running + before;
      if (acc <= threshold && threshold < acc + mine) {
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          acc += v[j];
          if (acc > threshold) {
            s.found = first + j;
            break;
          }
        }
      }
      __syncthreads();
      return s.found;
    }
    running += total;
  }
  __syncthreads();
  return s.found;
}

struct RowView {
  const float* x;
  int64_t V;
  float max;
  double temperature;
  int S;
  __device__ uint32_t Key(int64_t i) const { return draw::OrderKey(x[i]); }
  __device__ uint64_t Weight(int64_t i) const {
    return draw::Weight(draw::Div(draw::Sub(x[i], max), temperature), S);
  }
};

// One radix pass: hist[digit] += weight(i) (and count[digit] += 1) over the indices whose key
// matches prefix under mask and that `in` accepts; then thread 0 walks the bins from the top and
// picks the one where `greater` + its sum reaches `need`. Returns that bin; s.greater and s.equal
// (the count in the bin) are set for every thread.
template <class In, class Amount>
__device__ uint32_t RadixPass(const RowView& r, uint32_t prefix, uint32_t mask, int shift,
                              u64 greater, u64 need, const In& in, const Amount& amount,
                              Shared& s) {
  for (int i = threadIdx.x; i < 256; i += kThreads) s.hist[i] = 0, s.count[i] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < r.V; i += kThreads) {
    const uint32_t key = r.Key(i);
    if ((key & mask) != prefix || !in(key, i)) continue;
    const uint32_t digit = (key >> shift) & 0xffu;
    atomicAdd(&s.hist[digit], static_cast<u64>(amount(i)));
    atomicAdd(&s.count[digit], 1ull);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int b = 255;
    while (b > 0 && greater + s.hist[b] < need) greater += s.hist[b--];
    s.bin = static_cast<uint32_t>(b);
    s.greater = greater;
    s.equal = s.count[b];
  }
  __syncthreads();
  return s.bin;
}

__device__ draw::Cut TopKCut(const RowView& r, u64 k, Shared& s) {
  uint32_t prefix = 0, mask = 0;
  u64 greater = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    const uint32_t bin = RadixPass(
        r, prefix, mask, shift, greater, k, [](uint32_t, int64_t) { return true; },
        [](int64_t) { return uint64_t{1}; }, s);
    prefix |= bin << shift;
    mask |= 0xffu << shift;
    greater = s.greater;
  }
  const u64 ties = k - greater, equal = s.equal;
  draw::Cut cut{prefix, r.V - 1};
  if (ties < equal) {
    cut.last_tie = FindFirst(
        r.V, ties - 1, [&](int64_t i) -> u64 { return r.Key(i) == prefix ? 1 : 0; }, s);
  }
  return cut;
}

__device__ draw::Cut TopPCut(const RowView& r, double top_p, const draw::Cut& kept, Shared& s) {
  u64 part = 0;
  for (int64_t i = threadIdx.x; i < r.V; i += kThreads)
    if (draw::Kept(kept, r.Key(i), i)) part += r.Weight(i);
  const u64 need = draw::CeilFraction(top_p, BlockSum(part, s));
  auto in_kept = [&](uint32_t key, int64_t i) { return draw::Kept(kept, key, i); };
  auto weight = [&](int64_t i) { return r.Weight(i); };
  uint32_t prefix = 0, mask = 0;
  u64 greater = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    const uint32_t bin = RadixPass(r, prefix, mask, shift, greater, need, in_kept, weight, s);
    prefix |= bin << shift;
    mask |= 0xffu << shift;
    greater = s.greater;
  }
  const u64 equal = s.equal;
  const u64 q_tau =
      draw::Weight(draw::Div(draw::Sub(draw::FromOrderKey(prefix), r.max), r.temperature), r.S);
  const u64 ties = (need - greater + q_tau - 1) / q_tau;
  draw::Cut cut{prefix, prefix == kept.tau ? kept.last_tie : r.V - 1};
  if (ties < equal) {
    cut.last_tie = FindFirst(
        r.V, ties - 1,
        [&](int64_t i) -> u64 {
          const uint32_t key = r.Key(i);
          return key == prefix && draw::Kept(kept, key, i) ? 1 : 0;
        },
        s);
  }
  return cut;
}

// The row's max and its first index, and whether it holds NaN or +inf.
__device__ void Scan(const float* x, int64_t V, float* max, int64_t* arg, bool* bad, Shared& s) {
  float m = -INFINITY;
  int64_t a = V;
  int broken = 0;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const float v = x[i];
    broken |= isnan(v) || v == INFINITY;
    if (v > m) m = v, a = i;  // increasing i: the thread's first maximum
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float om = __shfl_xor_sync(kFullMask, m, o);
    const int64_t oa = __shfl_xor_sync(kFullMask, a, o);
    if (om > m || (om == m && oa < a)) m = om, a = oa;
  }
  broken = __any_sync(kFullMask, broken);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) s.bad = 0;
  __syncthreads();
  if (lane == 0) {
    s.warp_max[warp] = m;
    s.warp_arg[warp] = a;
    if (broken) atomicOr(&s.bad, 1);
  }
  __syncthreads();
  m = s.warp_max[0];
  a = s.warp_arg[0];
  for (int w = 1; w < kWarps; ++w) {
    if (s.warp_max[w] > m || (s.warp_max[w] == m && s.warp_arg[w] < a))
      m = s.warp_max[w], a = s.warp_arg[w];
  }
  *max = m;
  *arg = a;
  *bad = s.bad != 0;
}

__global__ void __launch_bounds__(kThreads) SampleRowsKernel(SampleRowsArgs a) {
  __shared__ Shared s;
  const int64_t b = blockIdx.x;
  const int64_t V = a.vocab;
  const float* x = a.logits + b * V;
  const double temperature = a.temperature[b];
  float max;
  int64_t token = 0;
  bool bad;
  Scan(x, V, &max, &token, &bad, s);
  float logprob = NAN;
  if (bad || !(temperature >= 0) || max == -INFINITY) {
    token = 0;
  } else if (temperature == 0) {
    logprob = 0.0f;
  } else {
    const RowView r{x, V, max, temperature, draw::WeightBits(V)};
    draw::Cut cut{0, V - 1};
    const int64_t k = a.top_k[b];
    const double p = a.top_p[b];
    if (k > 0 && k < V) cut = TopKCut(r, static_cast<u64>(k), s);
    if (p > 0 && p < 1) cut = TopPCut(r, p, cut, s);
    u64 part = 0;
    for (int64_t i = threadIdx.x; i < V; i += kThreads)
      if (draw::Kept(cut, r.Key(i), i)) part += r.Weight(i);
    const u64 total = BlockSum(part, s);
    const u64 target = draw::Target(
        draw::Uniform53(static_cast<uint64_t>(a.keys[b]), static_cast<uint64_t>(a.positions[b])),
        total);
    token = FindFirst(
        V, target, [&](int64_t i) -> u64 { return draw::Kept(cut, r.Key(i), i) ? r.Weight(i) : 0; },
        s);
    const double d = draw::Div(draw::Sub(x[token], max), temperature);
    const double scale = draw::FromBits(static_cast<uint64_t>(1023 - r.S) << 52);  // 2^-S
    logprob =
        static_cast<float>(draw::Sub(d, draw::Log64(draw::Mul(static_cast<double>(total), scale))));
  }
  if (threadIdx.x == 0) {
    bool stop = false;
    if (!isnan(logprob)) {
      for (int64_t j = 0; j < a.num_stop; ++j)
        stop = stop || a.stop_ids[b * a.num_stop + j] == token;
    }
    a.tokens[b] = token;
    a.logprobs[b] = logprob;
    a.stopped[b] = stop;
  }
}

}  // namespace

cudaError_t SampleRows(const SampleRowsArgs& a, cudaStream_t stream) {
  if (a.vocab < 1 || a.batch < 0 || a.batch > 0x7fffffff || a.num_stop < 0)
    return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  SampleRowsKernel<<<static_cast<unsigned>(a.batch), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kernels
